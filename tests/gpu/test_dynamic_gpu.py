"""Shapes that vary on a real GPU: a transformers encoder given an attention mask, and a causal decoder, compiled
once with the sequence dynamic, equal eager in float32 at odd sizes padded within their buckets.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_dynamic_gpu.py
"""

import pytest
import torch
from torch.export import Dim

import opfuse
from opfuse.numerics import relative_error

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

transformers = pytest.importorskip("transformers")


class Encoder(torch.nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        if kind == "bert":
            config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                             intermediate_size=128, vocab_size=100, max_position_embeddings=128)
            self.model = transformers.BertModel(config)
        else:
            config = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=128,
                                             use_cache=False)
            self.model = transformers.GPT2Model(config)

    def forward(self, ids, mask):
        return self.model(input_ids=ids, attention_mask=mask).last_hidden_state


def tokens(batch: int, seq: int):
    generator = torch.Generator().manual_seed(seq)
    ids = torch.randint(0, 100, (batch, seq), generator=generator)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[0, max(1, seq - 3):] = 0
    return ids.cuda(), mask.cuda()


@pytest.mark.parametrize("kind", ["bert", "gpt2"])
def test_a_masked_transformer_serves_odd_sequence_lengths_padded_within_its_buckets(kind):
    torch.manual_seed(0)
    model = Encoder(kind).eval().cuda()
    seq = Dim("seq", max=128)
    compiled = opfuse.compile(model, tokens(2, 64), opfuse.FusionConfig(dtype="float32"),
                              dynamic_shapes=({1: seq}, {1: seq}))
    for size in (1, 7, 33, 64, 100, 128):
        inputs = tokens(2, size)
        with torch.no_grad():
            want = model(*inputs)
        got = compiled(*inputs)
        assert got.shape == want.shape
        assert relative_error(got.float(), want.float()) < 1e-4, size
    padded = [key for key, bucket in compiled.buckets.items() if "seq" in bucket.cuts]
    assert (64,) in padded and (128,) in padded and (33,) not in compiled.buckets
