"""The flash-attention kernel of sdpa groups (`opfuse.codegen.attention`) on the interpreter, against torch's sdpa in
float32: causal or not, boolean and additive masks broadcast over batch, heads and query rows, Sq != Sk, head dims
that are no power of two, q/k/v read through permuted views, float16; its forms (torch's attention first for a bare
sdpa, the Triton kernel first with an epilogue), its output layout (the head merge after it is a view) and a tiny
attention model compiled end to end. Outputs are NaN-poisoned so unwritten elements show."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.codegen.attention import AttentionKernel, lower_attention
from opfuse.codegen.base import FORM_LIBRARY, FORM_TRITON
from opfuse.codegen.forms import UNFUSED
from opfuse.codegen.lower import groups_through_pytorch, library_calls, lower_group
from opfuse.codegen.split_k import slices_of
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.reasons import Code
from opfuse.fusion.tiles import key_split_table
from opfuse.ir.graph import TensorType, torch_dtype
from opfuse.numerics import relative_error
from tests.kernels.builders import KernelGraph, rel_err


def attention_graph(shapes: tuple, causal: bool = False, mask: torch.Tensor | None = None, dtype: str = "float32",
                    scale: float | None = None, views: dict[str, torch.Tensor] | None = None, seed: int = 0):
    """(builder, sdpa node) for q, k, v of `shapes` (fed `views[name]` where given: any strides) and `mask`."""
    b = KernelGraph(dtype, seed)
    names = []
    for name, shape in zip("qkv", shapes):
        names.append(b.input(name, shape, (views or {}).get(name)))
    if mask is not None:
        mask_dtype = "bool" if mask.dtype == torch.bool else dtype
        b.feeds["mask"] = mask.to(torch_dtype(mask_dtype))
        names.append(b.graph.add_input("mask", TensorType(tuple(mask.shape), mask_dtype)).name)
    return b, b.op("sdpa", *names, is_causal=causal, scale=scale)


def reference(b: KernelGraph, node: str) -> torch.Tensor:
    """torch's sdpa of the feeds in float32 (a boolean mask kept boolean)."""
    inputs = [b.feeds[name] for name in b.graph[node].inputs]
    inputs = [x.float() if x.is_floating_point() else x for x in inputs]
    attrs = b.graph[node].attrs
    grouped = any(x.dim() >= 3 and x.shape[-3] not in (1, inputs[0].shape[-3]) for x in inputs[1:3])
    return F.scaled_dot_product_attention(*inputs[:3], attn_mask=inputs[3] if len(inputs) > 3 else None,
                                          is_causal=attrs["is_causal"], scale=attrs["scale"], enable_gqa=grouped)


def run_triton(b: KernelGraph, outputs: list[str], kind: GroupKind = GroupKind.SINGLE
               ) -> tuple[AttentionKernel, list[torch.Tensor]]:
    """The group's kernel and the results of its Triton form (its first Triton config), NaN-poisoned."""
    kernel = lower_attention(b.graph, b.group(outputs, kind), "cpu")
    kernel.epilogue.output_fill = float("nan")
    config = next(c for c in kernel.configs() if c.form == FORM_TRITON)
    results = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], config)
    for result in results:
        assert not torch.isnan(result).any(), "unwritten (NaN) elements"
    return kernel, results


def assert_matches_sdpa(b: KernelGraph, node: str, got: torch.Tensor) -> None:
    want = reference(b, node)
    assert got.shape == want.shape and got.dtype == torch_dtype(b.dtype)
    assert rel_err(got, want) < (1e-4 if b.dtype == "float32" else 1e-2), rel_err(got, want)


@pytest.mark.parametrize("batch, heads, s_q, s_k, head_dim, causal", [
    (2, 2, 5, 5, 16, False),
    (2, 2, 5, 5, 16, True),
    (2, 2, 17, 17, 24, True),      # head dim padded to 32; two query blocks, the causal loop stops early
    (1, 2, 7, 33, 64, False),      # Sq < Sk, three key blocks, the last one masked
    (2, 1, 33, 9, 24, True),       # Sq > Sk: top-left causal, later rows see every key
    (1, 3, 9, 20, 24, True),       # Sq < Sk causal: rows see only their first keys
])
def test_matches_sdpa(batch, heads, s_q, s_k, head_dim, causal):
    b, y = attention_graph(((batch, heads, s_q, head_dim), (batch, heads, s_k, head_dim),
                            (batch, heads, s_k, head_dim)), causal)
    _, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)


@pytest.mark.parametrize("batch, heads, kv_heads, value_heads, s_q, s_k, causal", [
    (2, 4, 2, 2, 5, 5, True),       # two query heads per key/value head
    (1, 6, 2, 3, 7, 19, False),     # keys shared by 3 query heads, values by 2; Sq < Sk
    (2, 3, 1, 1, 9, 9, True),       # one key/value head for all (multi-query): a broadcast
])
def test_query_heads_read_their_shared_key_value_head(batch, heads, kv_heads, value_heads, s_q, s_k, causal):
    """Grouped-query attention: K and V with fewer heads than Q, query head h reading head h // (H / Hkv) on its
    load (no repeated copy), as torch's sdpa with enable_gqa."""
    b, y = attention_graph(((batch, heads, s_q, 24), (batch, kv_heads, s_k, 24), (batch, value_heads, s_k, 24)),
                           causal)
    kernel, (out,) = run_triton(b, [y])
    assert kernel.shared == [heads // kv_heads if kv_heads > 1 else 1, heads // value_heads if value_heads > 1 else 1]
    assert_matches_sdpa(b, y, out)
    library = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], kernel.configs()[0])[0]
    assert_matches_sdpa(b, y, library)      # the library form (torch's sdpa) takes them too


def run_config(b: KernelGraph, kernel: AttentionKernel, config) -> list[torch.Tensor]:
    """The kernel's results in form `config`, NaN-poisoned."""
    kernel.epilogue.output_fill = float("nan")
    results = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], config)
    for result in results:
        assert not torch.isnan(result).any(), "unwritten (NaN) elements"
    return results


@pytest.mark.parametrize("heads, kv_heads, keys, queries, mask, causal, slices", [
    (4, 4, 37, 1, None, False, 3),          # one query a head over an odd cache: 3 slices of one key block
    (8, 2, 61, 1, "bool", False, 2),        # 4 query heads a key/value head, the cache filled part way
    (8, 1, 45, 1, "additive", False, 3),    # 8 a key/value head (multi-query), an additive mask
    (2, 2, 50, 3, None, True, 4),           # causal: slices past a row's last key see none of it
    (2, 2, 40, 1, "none-allowed", False, 3),  # a row every key of which is masked is 0, as sdpa's
])
def test_key_slices_combine_to_sdpa(heads, kv_heads, keys, queries, mask, causal, slices):
    """The key-split form (flash-decoding) runs the slices the plan gives its tile: each stores its rows' partial
    output, max and sum; the last slice of a tile combines them in slice order. It matches sdpa in one launch, the
    tiles' counts are back at zero for the next launch (which matches again), and its unsplit twin (offered to the
    autotuner) matches too."""
    if mask == "bool":
        mask_tensor = (torch.arange(keys) < keys - 13)[None, None, None, :]
    elif mask == "additive":
        mask_tensor = torch.where(torch.arange(keys) % 5 == 0, -1e4, 0.5)[None, None, None, :]
    elif mask == "none-allowed":
        mask_tensor = (torch.arange(keys)[None, None, None, :] < 30).expand(1, heads, 1, keys).clone()
        mask_tensor[:, 1] = False
    else:
        mask_tensor = None
    b, y = attention_graph(((1, heads, queries, 16), (1, kv_heads, keys, 16), (1, kv_heads, keys, 16)), causal,
                           mask_tensor)
    group = b.group([y], GroupKind.SINGLE)
    group.split_k = {"16x16": slices}
    kernel = lower_attention(b.graph, group, "cpu")
    split = next(c for c in kernel.configs() if c.form == FORM_TRITON)
    assert slices_of(split) == slices and kernel.launches(split) == 1
    assert_matches_sdpa(b, y, run_config(b, kernel, split)[0])
    assert not kernel.counts.tensor.any()
    assert_matches_sdpa(b, y, run_config(b, kernel, split)[0])
    unsplit = kernel.alternatives(library=False)
    assert [slices_of(c) for c in unsplit] == [1] and kernel.launches(unsplit[0]) == 1
    assert_matches_sdpa(b, y, run_config(b, kernel, unsplit[0])[0])


def test_the_combining_kernel_runs_the_epilogue():
    """Split keys with an epilogue (a scale, the head merge, a residual): the last slice of each tile runs it, and
    the unfused form is still offered."""
    b, y = attention_graph(((1, 4, 1, 16), (1, 2, 53, 16), (1, 2, 53, 16)))
    scaled = b.op("mul", y, b.const("s", torch.tensor(0.5)))
    moved = b.op("permute", scaled, dims=(0, 2, 1, 3))
    out = b.op("add", moved, b.input("r", (1, 1, 4, 16)))
    group = b.group([out], GroupKind.ANCHOR_EPILOGUE)
    group.split_k = {"16x16": 3}
    kernel = lower_attention(b.graph, group, "cpu")
    assert slices_of(kernel.configs()[0]) == 3 and kernel.launches() == 1
    assert kernel.alternatives(library=True)[1:] == [UNFUSED]
    b.check([out], run_config(b, kernel, kernel.configs()[0]))


def test_keys_split_where_the_query_tiles_leave_the_gpu_idle():
    """The plan's rule (`key_split_slices`): one query a head over a cache of several key blocks splits at batch 1
    (32 heads on 132 SMs: about four programs a head fill them, each slice whole blocks, none empty), not at batch 8
    (256 heads), nor a cache of one key block, nor a prefill of 512 queries."""
    assert key_split_table(1, 384, 32, 132) == {"16x64": 3, "16x32": 4, "16x16": 5}
    assert key_split_table(1, 1280, 32, 132) == {"16x64": 5, "16x32": 5, "16x16": 5}
    assert set(key_split_table(1, 1280, 256, 132).values()) == {1}
    assert set(key_split_table(1, 16, 32, 132).values()) == {1}
    assert set(key_split_table(512, 1280, 32, 132).values()) == {1}


def test_a_given_scale_is_used():
    b, y = attention_graph(((2, 2, 9, 16),) * 3, scale=0.7)
    _, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)


@pytest.mark.parametrize("mask_shape, boolean, causal", [
    ((9, 21), True, False),             # one [Sq, Sk] mask for every batch and head: strides 0 there
    ((2, 1, 1, 21), True, False),       # a padding mask per batch, broadcast over heads and query rows
    ((2, 2, 9, 21), False, False),      # a full additive mask
    ((1, 9, 21), False, False),         # additive, broadcast over batch
    ((1, 1, 1, 21), False, False),      # one additive bias per key
])
def test_masks_broadcast_as_sdpa_allows(mask_shape, boolean, causal):
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(mask_shape, generator=generator) > 0.3 if boolean else torch.randn(mask_shape,
                                                                                         generator=generator)
    if boolean:
        mask[..., 0] = True     # every row keeps a key (fully masked rows: their own test)
    b, y = attention_graph(((2, 2, 9, 16), (2, 2, 21, 16), (2, 2, 21, 16)), causal, mask)
    _, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)


def test_a_row_with_every_key_masked_is_zero_as_in_sdpa():
    mask = torch.rand(7, 11, generator=torch.Generator().manual_seed(2)) > 0.5
    mask[3] = False
    additive = torch.zeros(7, 11)
    additive[5] = float("-inf")
    for m in (mask, additive):
        b, y = attention_graph(((1, 2, 7, 16), (1, 2, 11, 16), (1, 2, 11, 16)), mask=m)
        _, (out,) = run_triton(b, [y])
        assert_matches_sdpa(b, y, out)
        assert torch.all(out[:, :, 3 if m.dtype == torch.bool else 5] == 0)


def test_reads_q_k_v_through_permuted_views():
    """q, k, v as the head split leaves them: [B, S, H, D] memory seen as [B, H, S, D], sliced out of one packed
    projection, and a key tensor transposed twice; no copy is made (the kernel reads them through strides)."""
    generator = torch.Generator().manual_seed(3)
    packed = torch.randn(2, 11, 3, 2, 24, generator=generator).permute(2, 0, 3, 1, 4)   # [3, B, H, S, D]
    keys = torch.randn(2, 2, 24, 13, generator=generator).transpose(-1, -2)             # [B, H, S, D], D outer
    views = {"q": packed[0], "k": keys, "v": torch.randn(2, 13, 2, 24, generator=generator).permute(0, 2, 1, 3)}
    assert not any(v.is_contiguous() for v in views.values())
    b, y = attention_graph(((2, 2, 11, 24), (2, 2, 13, 24), (2, 2, 13, 24)), causal=True, views=views)
    _, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)


@pytest.mark.parametrize("head_dim, causal", [(16, False), (64, True)])
def test_float16(head_dim, causal):
    b, y = attention_graph(((2, 2, 9, head_dim), (2, 2, 17, head_dim), (2, 2, 17, head_dim)), causal,
                           dtype="float16")
    _, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)


def test_three_dim_inputs_and_bit_identical_reruns():
    b, y = attention_graph(((3, 10, 16), (3, 10, 16), (3, 10, 16)), causal=True)
    kernel, (out,) = run_triton(b, [y])
    assert_matches_sdpa(b, y, out)
    config = next(c for c in kernel.configs() if c.form == FORM_TRITON)
    again = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], config)[0]
    assert torch.equal(out, again)


def test_a_bare_sdpa_runs_torch_attention_first_and_offers_the_kernel():
    """Untuned, a bare sdpa runs torch's attention as before (one launch, as the plan counts); the Triton tiles
    come after it for the autotuner, and both forms give the same values."""
    b, y = attention_graph(((2, 2, 9, 16),) * 3, causal=True)
    kernel = lower_attention(b.graph, b.group([y]), "cpu")
    configs = kernel.configs()
    assert configs[0].form == FORM_LIBRARY and {c.form for c in configs[1:]} == {FORM_TRITON}
    assert kernel.alternatives(library=True) == kernel.alternatives(library=False) == []
    assert all(kernel.launches(c) == 1 for c in configs)
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    library, triton_form = (kernel.run(feeds, c)[0] for c in configs[:2])
    assert_matches_sdpa(b, y, library)
    torch.testing.assert_close(library, triton_form, rtol=1e-4, atol=1e-5)


def test_the_output_is_laid_out_so_the_head_merge_is_a_view():
    """[B, H, S, D] with the heads inside the tokens in memory, as flash attention returns it on a GPU: the
    transpose(1, 2).reshape(B, S, H*D) before the output projection needs no copy."""
    b, y = attention_graph(((2, 3, 7, 16),) * 3)
    _, (out,) = run_triton(b, [y])
    merged = out.transpose(1, 2).reshape(2, 7, 48)
    assert out.transpose(1, 2).is_contiguous() and merged.data_ptr() == out.data_ptr()
    assert merged._base is not None      # a view, not a copy


def test_an_epilogue_runs_on_the_tile():
    """sdpa, a scale and a residual after the head transpose, a GELU: one kernel (Triton first, as the plan counts
    it), its unfused form (torch's sdpa and the ops, as before) offered to the autotuner; outputs as the
    reference's, the permuted one a view of the kernel's buffer."""
    b, y = attention_graph(((2, 2, 9, 16), (2, 2, 12, 16), (2, 2, 12, 16)), causal=True)
    scaled = b.op("mul", y, b.const("s", torch.tensor(0.5)))
    moved = b.op("permute", scaled, dims=(0, 2, 1, 3))
    residual = b.input("r", (2, 9, 2, 16))
    out = b.op("gelu", b.op("add", moved, residual))
    kernel, results = run_triton(b, [out], GroupKind.ANCHOR_EPILOGUE)
    assert kernel.configs()[0].form == FORM_TRITON and kernel.launches() == 1
    assert kernel.alternatives(library=True) == [UNFUSED] and kernel.alternatives(library=False) == []
    assert kernel.launches(UNFUSED) == 4     # sdpa, mul, add, gelu
    b.check([out], results)     # (no boolean mask: the builder's float32 reference is sdpa's)
    unfused = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], UNFUSED)
    torch.testing.assert_close(unfused[0], results[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim, value_dim, causal", [
    (16, 32, False),    # LeViT's attention: values twice as wide as queries and keys
    (24, 72, True),     # both padded (32 and 128), masked
    (64, 16, False),    # values narrower
])
def test_values_of_another_head_dim_than_queries_and_keys(head_dim, value_dim, causal):
    """Q and K of head dim D, V of Dv: the scores over D, the accumulator, the output and the epilogue over Dv."""
    b, y = attention_graph(((2, 2, 9, head_dim), (2, 2, 13, head_dim), (2, 2, 13, value_dim)), causal)
    kernel, (out,) = run_triton(b, [y])
    assert out.shape == (2, 2, 9, value_dim)
    assert_matches_sdpa(b, y, out)
    b, y = attention_graph(((1, 3, 7, head_dim), (1, 3, 7, head_dim), (1, 3, 7, value_dim)), causal, dtype="float16")
    out = b.op("gelu", b.op("mul", y, b.const("s", torch.tensor(0.5))))
    _, results = run_triton(b, [out], GroupKind.ANCHOR_EPILOGUE)
    b.check([out], results)


def test_head_dims_over_the_template_are_torch_attention_alone():
    """A bare sdpa of head dims over 128 (DaViT's channel attention) is a kernel whose one form is torch's attention
    (a library call, listed as one), no group through PyTorch; with an epilogue the template refuses it."""
    b, y = attention_graph(((1, 2, 5, 160), (1, 2, 5, 160), (1, 2, 5, 24)))
    reasons = {}
    kernel = lower_group(b.graph, b.group([y]), "cpu", reasons)
    assert kernel is not None and not reasons
    assert [c.form for c in kernel.configs()] == [FORM_LIBRARY] and kernel.alternatives() == []
    assert library_calls({"g0": kernel}) == {"g0": kernel.describe_library_form()}
    assert "head dims [160, 160, 24]" in kernel.describe_library_form()
    (out,) = kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    assert_matches_sdpa(b, y, out)
    activated = b.op("relu", y)
    assert lower_group(b.graph, b.group([activated], GroupKind.ANCHOR_EPILOGUE), "cpu", reasons) is None
    assert reasons["g0"].code is Code.OPERAND_SHAPE and "over the 128" in reasons["g0"].text
    b, y = attention_graph(((1, 2, 5, 16),) * 3)      # a tileable one: the Triton forms follow the library's
    kernel = lower_group(b.graph, b.group([y]), "cpu")
    assert library_calls({"g0": kernel}) == {} and FORM_TRITON in {c.form for c in kernel.configs()}


# ---- compiled end to end ------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    """linear -> view -> permute -> sdpa -> permute -> reshape -> linear, as the transformers write it."""

    def __init__(self, dim: int = 32, heads: int = 2, causal: bool = False):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, dim = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, self.heads, dim // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(y.permute(0, 2, 1, 3).reshape(batch, tokens, dim))


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_attention_has_a_kernel_in_both_forms(causal):
    """The sdpa group gets a kernel (no longer listed as running through PyTorch), one launch in either form; the
    model matches eager in torch's attention (untuned default) and in the Triton kernel, whose [B, S, H, D]-laid
    output the output projection reads through its views without a copy."""
    torch.manual_seed(0)
    model = SelfAttention(causal=causal).eval()
    x = torch.randn(2, 7, 32)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    plan = compiled.plan
    attention = next(g for g in plan.groups if any(plan.graph[n].op == "sdpa" for n in g.nodes))
    assert attention.name not in groups_through_pytorch(plan) and attention.name not in compiled.fallbacks
    assert {why.code for why in compiled.fallbacks.values()} <= {Code.VIEW}
    kernel = compiled.compiled.kernels[attention.name]
    assert compiled.compiled.configs[attention.name].form == FORM_LIBRARY
    assert "scaled_dot_product_attention" in compiled.compiled.library_anchors[attention.name]
    assert compiled.launches == plan.kernel_launches == compiled.analysis.fused.kernel_launches == 3
    with torch.no_grad():
        fresh = torch.randn(2, 7, 32)
        expected = model(fresh)
        assert relative_error(compiled(fresh), expected) < 1e-5
        triton_config = next(c for c in kernel.configs() if c.form == FORM_TRITON)
        compiled.compiled.set_configs({attention.name: triton_config})
        assert compiled.launches == 3
        assert relative_error(compiled(fresh), expected) < 1e-5
        projection = next(k for k in compiled.compiled.kernels.values() if getattr(k, "a_map", None) is not None)
        heads = kernel.run(_attention_inputs(compiled, fresh, kernel), triton_config)[0]
        mapped = projection.a_map.groups(heads)
        # read through its strides, not materialised; heads and head dim merge into one contiguous reduction
        assert mapped is not None and mapped[1][0][0] == 1 and mapped[1][1] == (32, 1)


def _attention_inputs(compiled, x: torch.Tensor, kernel: AttentionKernel) -> list[torch.Tensor]:
    values = compiled.compiled.collect_values(x)
    return [values[name] for name in kernel.runtime_inputs]


class AttentionThenActivation(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.relu(F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2.0).transpose(1, 2)


def test_compiled_attention_with_an_epilogue_is_one_kernel():
    """sdpa with a scale, a ReLU and the head transpose after it: one group, our kernel untuned (one launch, as the
    plan counts), matching eager."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 2, 9, 16) for _ in range(3))
    model = AttentionThenActivation()
    compiled = opfuse.compile(model, (q, k, v), opfuse.FusionConfig(dtype="float32"))
    assert not groups_through_pytorch(compiled.plan)
    (name, kernel), = compiled.compiled.kernels.items()
    assert isinstance(kernel, AttentionKernel) and compiled.compiled.configs[name].form == FORM_TRITON
    assert compiled.launches == compiled.plan.kernel_launches == 1
    with torch.no_grad():
        assert relative_error(compiled(q, k, v), model(q, k, v)) < 1e-5


def test_compiled_grouped_query_attention_matches_eager_in_both_forms():
    """K/V heads repeated for grouped-query attention (transformers' repeat_kv: expand + reshape, a copy in eager)
    are read shared by the attention kernel: no copy kernel, and the model matches eager in torch's attention and
    in the Triton kernel."""
    from tests.unit.test_share_kv_heads import GroupedQueryAttention

    torch.manual_seed(0)
    model = GroupedQueryAttention(repeat=True).eval()
    x = torch.randn(2, 7, 32)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    plan = compiled.plan
    attention = next(g for g in plan.groups if any(plan.graph[n].op == "sdpa" for n in g.nodes))
    assert {why.code for why in compiled.fallbacks.values()} <= {Code.VIEW}
    kernel = compiled.compiled.kernels[attention.name]
    assert kernel.shared == [2, 2]
    with torch.no_grad():
        fresh = torch.randn(2, 7, 32)
        expected = model(fresh)
        assert relative_error(compiled(fresh), expected) < 1e-5
        compiled.compiled.set_configs({attention.name: next(c for c in kernel.configs() if c.form == FORM_TRITON)})
        assert relative_error(compiled(fresh), expected) < 1e-5


class ClippedGroupedAttention(nn.Module):
    """Attention written out with its scores clipped (a clamp: no sdpa), key/value heads repeated for the query
    heads (expand + reshape)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, kv_heads, tokens, dim = k.shape
        rep = q.shape[1] // kv_heads
        k, v = (t[:, :, None].expand(batch, kv_heads, rep, tokens, dim).reshape(batch, -1, tokens, dim)
                for t in (k, v))
        scores = torch.clamp(q @ k.transpose(2, 3) / 8.0, -0.5, 0.5)
        return torch.softmax(scores, dim=-1) @ v


def test_compiled_matmuls_over_repeated_heads_broadcast_them():
    """The two matmuls read the unrepeated key/value heads broadcast over the query heads that share them (5-D
    batched GEMMs, a stride of 0): no copy kernel, no group through PyTorch, and eager's values."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    model = ClippedGroupedAttention().eval()
    compiled = opfuse.compile(model, (q, k, v), opfuse.FusionConfig(dtype="float32"))
    graph = compiled.plan.graph
    assert not groups_through_pytorch(compiled.plan)
    assert [graph[i].type.shape for n in graph if n.op == "matmul" for i in n.inputs] == \
        [(2, 2, 3, 5, 8), (2, 2, 1, 8, 5), (2, 2, 3, 5, 5), (2, 2, 1, 5, 8)]
    with torch.no_grad():
        assert relative_error(compiled(q, k, v), model(q, k, v)) < 1e-5
