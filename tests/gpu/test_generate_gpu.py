"""Text generation on a GPU (`opfuse.compile_generator`): a Llama of 4 layers and hidden 512 from LlamaConfig, its
greedy tokens equal to transformers' generate for 32 steps in float32, and its logits within float16's tolerance
of eager's at every step in float16 (each step replayed from its CUDA graph).

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_generate_gpu.py
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def model(dtype):
    import transformers as T

    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    llama = T.LlamaForCausalLM(config).eval().to("cuda", dtype)
    llama.generation_config.eos_token_id = None
    return llama


def test_greedy_tokens_equal_transformers_in_float32():
    import opfuse

    llama = model(torch.float32)
    prompt = torch.randint(0, 1024, (2, 37), generator=torch.Generator().manual_seed(0)).cuda()
    generator = opfuse.compile_generator(llama, 2, 128, opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        want = llama.generate(prompt, max_new_tokens=32, do_sample=False, min_new_tokens=32,
                              attention_mask=torch.ones_like(prompt))
    assert torch.equal(generator.generate(prompt, 32), want)


@pytest.mark.parametrize("switches", [{}, {"weight_prefetch": True}, {"dependent_launch": False},
                                      {"norm_prologue": True}])
def test_every_decode_step_is_within_float16_tolerance_of_eager(switches):
    """(with the GEMMs after light kernels prefetching their weights, with dependent launch off, and with the RMS norms
    deferred into the GEMMs that read them, too)"""
    import opfuse
    from opfuse.generate import KVCacheDecoder
    from opfuse.numerics import relative_error

    llama = model(torch.float16)
    generator = opfuse.compile_generator(llama, 1, 96, opfuse.FusionConfig(dtype="float16", **switches))
    eager = KVCacheDecoder(llama, 1, 96).eval()
    prompt = torch.randint(0, 1024, (1, 16), generator=torch.Generator().manual_seed(1)).cuda()
    with torch.no_grad():
        positions = torch.arange(16, device="cuda")
        got, want = generator.prefill_model(16)(prompt, positions), eager(prompt, positions)
        assert relative_error(got.float(), want.float()) < 2e-2
        token = want[:, -1].argmax(-1)
        for position in range(16, 80):
            at = torch.tensor([position], device="cuda")
            got, want = generator.step(token[:, None], at), eager(token[:, None], at)
            assert relative_error(got.float(), want.float()) < 2e-2, position
            token = want[:, -1].argmax(-1)      # both continue from eager's token
    report = generator.decode_report(position=79)
    print(report)
    assert report["measured_s"] is not None and report["share_of_bandwidth_floor"] > 0
