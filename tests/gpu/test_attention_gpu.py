"""The flash-attention kernel of sdpa groups (`opfuse.codegen.attention`) compiled by the real Triton backend, fp16 at
S=128, H=12 with head dims 64 and 128, causal or not (and a padding mask): every Triton config the H200 profile
gives must match torch's sdpa computed in float32, about as closely as torch's own fp16 attention does, write every
element, and at least one config must compile without register spills. Last, a tiny attention model compiled with
autotuning keeps whichever form it measured faster and matches eager.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_attention_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from opfuse.codegen.base import FORM_TRITON  # noqa: E402
from opfuse.fusion.plan import FusionGroup, GroupKind  # noqa: E402
from opfuse.hardware import get_hardware  # noqa: E402
from opfuse.ir.graph import Graph, TensorType  # noqa: E402
from opfuse.ir.ops import infer_type  # noqa: E402
from opfuse.numerics import relative_error, tolerance  # noqa: E402

from tests.gpu.config_checks import check_every_config  # noqa: E402

BATCH, HEADS, TOKENS = 2, 12, 128


def attention_kernel(head_dim: int, causal: bool, masked: bool):
    """The kernel of a bare fp16 sdpa group over [B, H, S, D] inputs (and a [B, 1, 1, S] boolean mask)."""
    from opfuse.codegen.attention import lower_attention

    graph = Graph("attention")
    shape = (BATCH, HEADS, TOKENS, head_dim)
    names = [graph.add_input(n, TensorType(shape, "float16")).name for n in "qkv"]
    if masked:
        names.append(graph.add_input("mask", TensorType((BATCH, 1, 1, TOKENS), "bool")).name)
    types = [graph[n].type for n in names]
    attrs = {"is_causal": causal, "scale": None}
    node = graph.add_node("sdpa", names, infer_type("sdpa", types, attrs), attrs, name="sdpa")
    graph.outputs = [node.name]
    group = FusionGroup(0, GroupKind.SINGLE, ["sdpa"], anchor="sdpa", inputs=names, outputs=["sdpa"])
    return lower_attention(graph, group, "cuda", get_hardware("h200"))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_every_config_matches_sdpa_in_fp16(head_dim, causal, masked):
    kernel = attention_kernel(head_dim, causal, masked)
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (BATCH, HEADS, TOKENS, head_dim)
    # the head split as the transformers leave it: [B, S, H, D] memory seen as [B, H, S, D]
    q, k, v = (torch.randn(BATCH, TOKENS, HEADS, head_dim, device="cuda", generator=generator,
                           dtype=torch.float16).transpose(1, 2) for _ in range(3))
    inputs = [q, k, v]
    mask = None
    if masked:    # the second sequence padded after 100 tokens
        mask = torch.ones(BATCH, 1, 1, TOKENS, dtype=torch.bool, device="cuda")
        mask[1, ..., 100:] = False
        inputs.append(mask)
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, is_causal=causal)
    torch_fp16 = relative_error(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal), reference)
    configs = [c for c in kernel.configs() if c.form == FORM_TRITON]
    assert configs, "no Triton config fits the H200"
    assert reference.shape == shape
    check_every_config(kernel, inputs, configs, reference, torch_fp16)


def test_compiled_attention_autotunes_between_torch_and_the_kernel(tmp_path):
    from opfuse import FusionConfig, compile
    from tests.kernels.test_attention_kernels import SelfAttention

    torch.manual_seed(0)
    model = SelfAttention(dim=768, heads=12).cuda().half().eval()
    x = torch.randn(4, TOKENS, 768, device="cuda", dtype=torch.float16)
    compiled = compile(model, (x,), FusionConfig(dtype="float16", cache_dir=str(tmp_path)))   # measured, not cached
    attention = next(g for g in compiled.plan.groups if any(compiled.plan.graph[n].op == "sdpa" for n in g.nodes))
    assert attention.name in compiled.compiled.kernels and attention.name not in compiled.fallbacks
    timings = compiled.compiled.tuning.timings[attention.name]
    assert {c.form for c in timings} == {"library", FORM_TRITON}     # both forms were measured
    with torch.no_grad():
        assert relative_error(compiled(x), model.float()(x.float())) < tolerance("float16")


@pytest.mark.parametrize("cache, kv_heads", [(384, 4), (1283, 8), (200, 32)])
def test_key_slices_of_a_decode_step_match_sdpa(cache, kv_heads):
    """Decoding: one query for each of 32 heads over a cache of `cache` keys (grouped-query heads), part of it
    filled (a boolean mask). Every config of the plan's key slices (`key_split_table` on the H100: 132 SMs), launched
    dependently (PDL), and its unsplit twin match torch's sdpa in float32 about as closely as its fp16 one does."""
    from opfuse.codegen.attention import lower_attention
    from opfuse.codegen.base import dependent_launches
    from opfuse.codegen.split_k import slices_of
    from opfuse.fusion.tiles import key_split_table

    graph = Graph("decode_attention")
    shapes = {"q": (1, 32, 1, 64), "k": (1, kv_heads, cache, 64), "v": (1, kv_heads, cache, 64)}
    names = [graph.add_input(n, TensorType(s, "float16")).name for n, s in shapes.items()]
    names.append(graph.add_input("mask", TensorType((1, 1, 1, cache), "bool")).name)
    attrs = {"is_causal": False, "scale": None}
    node = graph.add_node("sdpa", names, infer_type("sdpa", [graph[n].type for n in names], attrs), attrs,
                          name="sdpa")
    graph.outputs = [node.name]
    group = FusionGroup(0, GroupKind.SINGLE, ["sdpa"], anchor="sdpa", inputs=names, outputs=["sdpa"],
                        split_k=key_split_table(1, cache, 32, 132))
    with dependent_launches(True):
        kernel = lower_attention(graph, group, "cuda", get_hardware("h100"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(s, device="cuda", generator=generator, dtype=torch.float16) for s in shapes.values())
    mask = (torch.arange(cache, device="cuda") < cache - 37)[None, None, None, :]
    inputs = [q, k, v, mask]
    reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch_fp16 = relative_error(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True), reference)
    configs = [c for c in kernel.configs() if c.form == FORM_TRITON] + kernel.alternatives(library=False)
    assert any(slices_of(c) > 1 for c in configs) and any(slices_of(c) == 1 for c in configs)
    check_every_config(kernel, inputs, configs, reference, torch_fp16)
