"""Padding a sequence at its end (`opfuse.ir.seq_padding`, used by `opfuse.runtime.dynamic`), through Triton's
interpreter: a dynamic model pads a sequence whose positions interact where the padded positions are never read by
the real ones (attention under a mask an input padded with zeros masks, causal attention, a masked softmax and the
product it feeds), at odd sizes equal to eager; where they would be read (no mask, a mean over the sequence, a
constant made for one size) it runs exact sizes and says which node."""

import re

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import opfuse
from opfuse.api import capture
from opfuse.ir.graph import GraphError
from opfuse.ir.seq_padding import end_padding
from opfuse.passes.manager import prepare_graph

CONFIG = opfuse.FusionConfig(dtype="float32")
VOCAB, WIDTH, HEADS = 11, 8, 2


class MaskedAttention(torch.nn.Module):
    """Token and position embeddings, attention under a padding mask (1 attends, 0 masks a key), as transformers'
    encoders build it: a bool mask for sdpa, or (`explicit`) an additive bias of the dtype's lowest value, a softmax
    and a product. `causal` adds the causal triangle; `first` returns the first `first` positions' features too (a
    classifier's slice)."""

    def __init__(self, explicit: bool = False, causal: bool = False, first: int = 0):
        super().__init__()
        self.explicit, self.causal, self.first = explicit, causal, first
        self.tokens = torch.nn.Embedding(VOCAB, WIDTH)
        self.positions = torch.nn.Embedding(32, WIDTH)
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)
        self.out = torch.nn.Linear(WIDTH, WIDTH)

    def forward(self, ids, mask):
        b, s = ids.shape
        x = self.tokens(ids) + self.positions(torch.arange(s))
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        keep = mask.bool()[:, None, None, :]
        if self.causal:
            keep = keep & torch.ones(s, s, dtype=torch.bool).tril()
        if self.explicit:
            bias = (1.0 - keep.float()) * torch.finfo(torch.float32).min
            probs = torch.softmax(q @ k.transpose(-1, -2) / 2.0 + bias, -1)
            y = probs @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        y = self.out(y.transpose(1, 2).reshape(b, s, WIDTH))
        return (y, y[:, :self.first].sum(1)) if self.first else y


class Causal(torch.nn.Module):
    """Causal attention without a mask input: real queries never read the keys padded after them."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, WIDTH)


class MeanOverSequence(torch.nn.Module):
    def forward(self, x):
        return x - x.mean(1, keepdim=True)


class SizeScaled(torch.nn.Module):
    """Positions scaled by the length: made for one size, so no prefix of it is another size's."""

    def forward(self, x):
        return x + (torch.arange(x.shape[1]) / x.shape[1])[None, :, None]


def make(cls, *args, **kwargs):
    torch.manual_seed(0)
    return cls(*args, **kwargs).eval()


def tokens(batch, seq, masked=2):
    torch.manual_seed(seq)
    mask = torch.ones(batch, seq, dtype=torch.int64)
    mask[-1, seq - min(masked, seq - 1):] = 0       # the last row's tail masked, as a padded batch has it
    return torch.randint(0, VOCAB, (batch, seq)), mask


def check(compiled, model, *inputs):
    with torch.no_grad():
        want = model(*inputs)
    got = compiled(*inputs)
    for g, w in zip(torch.utils._pytree.tree_flatten(got)[0], torch.utils._pytree.tree_flatten(want)[0]):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def graphs(model, long, short):
    return [prepare_graph(capture(model, inputs), "float32")[0] for inputs in (long, short)]


@pytest.mark.parametrize("explicit", [False, True], ids=["sdpa", "softmax"])
def test_attention_under_a_padding_mask_pads_the_sequence_with_the_mask_zero_filled(explicit):
    model = make(MaskedAttention, explicit=explicit)
    seq = Dim("seq", max=16)
    compiled = opfuse.compile(model, tokens(2, 8), CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    for size in (5, 7, 8, 3, 1, 16, 13):
        check(compiled, model, *tokens(2, size))
    assert sorted(compiled.buckets) == [(1,), (4,), (8,), (16,)]   # 3, 5, 7 and 13 ran padded
    bucket = compiled.buckets[(8,)]
    assert bucket.zero_filled["seq"] == (1,) and not bucket.exact and "seq" not in bucket.refused
    assert "padded with zeros" in bucket.describe()


def test_a_causal_mask_and_a_padding_mask_together_pad_and_a_slice_of_the_first_positions_bounds_the_size():
    model = make(MaskedAttention, causal=True, first=6)
    seq = Dim("seq", max=8)
    compiled = opfuse.compile(model, tokens(2, 8), CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    assert compiled.buckets[(8,)].least["seq"] == 6       # the slice reads positions 0-5 at every size
    assert compiled.buckets[(8,)].zero_filled["seq"] == ()   # the causal triangle masks the padded keys alone
    check(compiled, model, *tokens(2, 7))
    assert (7,) not in compiled.buckets                    # padded on bucket 8
    check(compiled, model, *tokens(2, 5))                  # below the slice's end: exact sizes
    assert compiled.buckets[(5,)].exact


def test_causal_attention_pads_the_sequence_without_a_mask():
    model = make(Causal)
    compiled = opfuse.compile(model, (torch.randn(2, 8, WIDTH),), CONFIG,
                              dynamic_shapes=({1: Dim("seq", max=8)},))
    check(compiled, model, torch.randn(2, 5, WIDTH))
    assert (5,) not in compiled.buckets and compiled.buckets[(8,)].zero_filled["seq"] == ()


@pytest.mark.parametrize("cls, match", [(MeanOverSequence, r"mean.*reduces over the sequence"),
                                        (SizeScaled, r"differs on its first 7 positions")])
def test_a_model_whose_real_positions_read_padded_ones_runs_exact_sizes_and_names_the_node(cls, match):
    model = make(cls)
    compiled = opfuse.compile(model, (torch.randn(2, 8, 4),), CONFIG, dynamic_shapes=({1: Dim("seq", max=8)},))
    check(compiled, model, torch.randn(2, 5, 4))
    assert compiled.buckets[(5,)].exact
    assert re.search(match, compiled.buckets[(8,)].refused["seq"])


def test_an_unmasked_padding_is_refused_at_the_attention_naming_its_keys():
    model = make(MaskedAttention)
    long, short = graphs(model, tokens(2, 8), tokens(2, 7))
    names = [node.name for node in long.input_nodes]
    refused = end_padding(long, short, {name: 1 for name in names})     # the mask padded with ones: keys read
    assert refused.node.op == "sdpa" and "no mask masks them" in refused.why
    assert end_padding(long, short, {name: 1 for name in names}, [names[1]]).cuts == {long.outputs[0]: (1,)}


def test_a_reference_graph_of_other_nodes_is_refused():
    long = prepare_graph(capture(make(MaskedAttention), tokens(2, 8)), "float32")[0]
    other = prepare_graph(capture(make(MaskedAttention, explicit=True), tokens(2, 7)), "float32")[0]
    names = [node.name for node in long.input_nodes]
    refused = end_padding(long, other, {name: 1 for name in names}, [names[1]])
    assert "is not the same node" in refused.why or "not an output" in refused.why


def test_a_transformers_encoder_with_an_attention_mask_pads_its_sequence():
    transformers = pytest.importorskip("transformers")

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, vocab_size=VOCAB, max_position_embeddings=32)
            self.bert = transformers.BertModel(config)

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    model = make(Encoder)
    seq = Dim("seq", max=16)
    compiled = opfuse.compile(model, tokens(2, 8), CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    for size in (7, 3):
        check(compiled, model, *tokens(2, size))
    assert sorted(compiled.buckets) == [(4,), (8,)] and compiled.buckets[(8,)].zero_filled["seq"] == (1,)


def test_analyze_over_the_buckets_says_the_sequence_pads_under_the_mask_as_the_compile_decides():
    from opfuse.runtime.dynamic import bucket_analyses, parse_dynamic_shapes

    seq = Dim("seq", max=8)
    example = tokens(2, 8)
    records = bucket_analyses(make(MaskedAttention), example, CONFIG,
                              parse_dynamic_shapes(({1: seq}, {1: seq}), example))
    padding = {tuple(r["sizes"]): r["padding"].get("seq") for r in records}
    assert padding[(8,)] == padding[(4,)] == "pads (input 1 padded with zeros)"
    assert padding[(1,)] is None                             # nothing below size 1 to pad


def test_a_package_pads_its_sequence_under_the_mask_checked_against_the_next_smaller_size_it_holds(tmp_path):
    model = make(MaskedAttention)
    seq = Dim("seq", max=8)
    compiled = opfuse.compile(model, tokens(2, 8), CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    compiled.compile_buckets()
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "masked.opfuse"), "cpu")
    assert loaded.padding_refused_because is None
    for size in (7, 5, 3, 8):
        inputs = tokens(2, size)
        torch.testing.assert_close(loaded(*inputs), compiled(*inputs), rtol=0, atol=0)


def test_a_package_without_a_smaller_size_to_compare_with_refuses_to_pad_its_sequence(tmp_path):
    model = make(MaskedAttention)
    seq = Dim("seq", min=5, max=8)
    compiled = opfuse.compile(model, tokens(2, 8), CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "masked.opfuse"), "cpu")
    with pytest.raises(GraphError, match="never a seq padded up to one of them"):
        loaded(*tokens(2, 6))


def test_the_backend_with_dynamic_shapes_pads_the_sequence_under_the_mask(monkeypatch):
    from opfuse.runtime import dynamic

    built = []
    original = dynamic.DynamicModel.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(dynamic.DynamicModel, "__init__", record)
    torch._dynamo.reset()
    model = make(MaskedAttention)
    compiled = torch.compile(model, backend="opfuse", dynamic=True)
    with torch.no_grad():
        for size in (8, 7, 5):
            check(compiled, model, *tokens(2, size))
    torch._dynamo.reset()
    (dynamic_model,) = built
    assert sorted(dynamic_model.buckets) == [(2, 8)]              # 7 and 5 ran padded on it
    assert list(dynamic_model.buckets[(2, 8)].zero_filled.values()) == [(1,)]


def test_an_op_whose_attrs_follow_the_size_is_refused_even_off_the_sequence():
    class RolledByLength(torch.nn.Module):
        def forward(self, x):
            return x + torch.roll(x, x.shape[1], 2)      # a roll along the features by the length

    model = make(RolledByLength)
    long, short = graphs(model, (torch.randn(2, 8, 5),), (torch.randn(2, 7, 5),))
    refused = end_padding(long, short, {long.input_nodes[0].name: 1})
    assert "computes otherwise at another size" in refused.why


class DividedByMask(torch.nn.Module):
    """Values divided by the mask (finite while every real token attends): padded with zeros, the padded values are
    infinite, and a probability of 0 times them is NaN, so the sequence may not pad."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x, mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        v = v / mask[:, None, :, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :])


def test_padded_values_that_may_be_infinite_keep_the_sequence_from_padding():
    model = make(DividedByMask)
    seq = Dim("seq", max=8)
    example = (torch.randn(2, 8, WIDTH), torch.ones(2, 8))
    compiled = opfuse.compile(model, example, CONFIG, dynamic_shapes=({1: seq}, {1: seq}))
    check(compiled, model, torch.randn(2, 5, WIDTH), torch.ones(2, 5))
    assert compiled.buckets[(5,)].exact                      # padded, its real outputs would be NaN
    long, short = graphs(model, example, (torch.randn(2, 7, WIDTH), torch.ones(2, 7)))
    names = [node.name for node in long.input_nodes]
    refused = end_padding(long, short, {name: 1 for name in names}, [names[1]])
    assert refused.node.op == "sdpa" and "may not be finite" in refused.why


class NormalisedByMask(torch.nn.Module):
    """Features zeroed at masked positions, then scaled by their own sum: at a position padded with a zero mask that
    is 0 / 0, NaN, which a probability of 0 does not cancel."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(WIDTH, 3 * WIDTH)

    def forward(self, x, mask):
        b, s, _ = x.shape
        x = x * mask[:, :, None]
        x = x / x.abs().sum(-1, keepdim=True)
        q, k, v = self.qkv(x).view(b, s, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.bool()[:, None, None, :])


class RowAndKeyMask(torch.nn.Module):
    """A [queries, keys] mask of -inf from the padding mask on both sides: a padded query row is -inf throughout, its
    softmax NaN, and the next layer reads it as a value."""

    def forward(self, x, mask):
        keep = mask.bool()
        bias = torch.where(keep[:, :, None] & keep[:, None, :], 0.0, float("-inf"))
        for _ in range(2):
            x = torch.softmax(x @ x.transpose(1, 2) + bias, -1) @ x
        return x


@pytest.mark.parametrize("cls", [NormalisedByMask, RowAndKeyMask])
def test_padded_positions_made_nan_by_the_zero_mask_keep_the_sequence_from_padding(cls):
    model = make(cls)
    long, short = graphs(model, (torch.randn(2, 8, WIDTH), torch.ones(2, 8)),
                         (torch.randn(2, 7, WIDTH), torch.ones(2, 7)))
    names = [node.name for node in long.input_nodes]
    refused = end_padding(long, short, {name: 1 for name in names}, [names[1]])
    assert not hasattr(refused, "cuts") and "may not be finite" in refused.why


def test_a_package_whose_next_smaller_size_is_far_below_does_not_pad_on_its_constants(tmp_path):
    model = make(SizeScaled)
    compiled = opfuse.compile(model, (torch.randn(2, 8, 4),), CONFIG, dynamic_shapes=({1: Dim("seq", max=8)},))
    compiled(torch.randn(2, 1, 4))                        # the package holds sizes 1 and 8
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "scaled.opfuse"), "cpu")
    with pytest.raises(GraphError, match="never a seq padded"):
        loaded(torch.randn(2, 5, 4))                       # compared on 1 position, arange(8) / 8 would pass
