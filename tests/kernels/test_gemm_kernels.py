"""GEMM anchor kernels (linear, matmul, batched matmul, horizontal siblings) with fused epilogues, on the interpreter.

Graph building, poisoning and the reference check are shared with the conv kernel tests.
"""

from __future__ import annotations

import pytest
import torch

from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.expr import Unsupported
from opfuse.codegen.gemm import GemmKernel, gemm_configs, lower_gemm_group
from opfuse.fusion.legality import can_fuse
from opfuse.fusion.plan import GroupKind
from tests.kernels.test_conv_kernels import Builder, run_group


def linear(b: Builder, x: str, n: int, bias: bool = True) -> str:
    k = b.graph[x].type.shape[-1]
    inputs = [x, b.const("w", b.random(n, k) * 0.3)] + ([b.const("b", b.random(n))] if bias else [])
    return b.op("linear", *inputs)


def run_gemm(b: Builder, outputs: list[str], kind: GroupKind = GroupKind.ANCHOR_EPILOGUE):
    return run_group(b, outputs, kind, lower=lower_gemm_group)


def test_linear_bias_gelu():
    b = Builder()
    x = b.input("x", (5, 20))
    kernel, _ = run_gemm(b, [b.op("gelu", linear(b, x, 7))])
    assert isinstance(kernel, GemmKernel)
    assert kernel.name.startswith("fused_linear_gelu_")


def test_linear_3d_input_with_residual_and_tanh_gelu():
    b = Builder()
    x = b.input("x", (2, 3, 18))
    r = b.input("r", (2, 3, 9))
    y = b.op("gelu", b.op("add", linear(b, x, 9), r), approximate="tanh")
    run_gemm(b, [y], GroupKind.RESIDUAL)


def test_linear_single_row_no_bias():
    b = Builder()
    x = b.input("x", (1, 33))
    run_gemm(b, [b.op("tanh", linear(b, x, 40, bias=False))])


def test_matmul_2d_with_transposed_operand():
    b = Builder()
    a = b.input("a", (9, 20))
    bt = b.random(11, 20)
    m = b.input("m", (20, 11), bt.t())             # a column-major operand, read through its strides
    run_gemm(b, [b.op("matmul", a, m)])


def test_batched_matmul_scale_and_mask():
    """bmm-like matmul, then the attention-score epilogue: scalar scale + a broadcast additive mask."""
    b = Builder()
    q = b.input("q", (3, 7, 16))
    k = b.input("k", (3, 16, 9))
    mask = b.input("mask", (1, 7, 9))
    y = b.op("add", b.op("mul", b.op("matmul", q, k), b.const("scale", torch.tensor(0.25))), mask)
    run_gemm(b, [y])


@pytest.mark.parametrize("a_shape,b_shape", [
    ((2, 3, 5, 16), (16, 6)),          # 2-D right operand broadcast over two batch dims
    ((2, 1, 5, 16), (3, 16, 6)),       # both operands broadcast
])
def test_broadcast_matmul(a_shape, b_shape):
    b = Builder()
    a = b.input("a", a_shape)
    m = b.input("m", b_shape)
    run_gemm(b, [b.op("relu", b.op("matmul", a, m))])


def test_horizontal_qkv_linears_return_views():
    b = Builder()
    x = b.input("x", (2, 3, 16))
    q, k, v = linear(b, x, 8), linear(b, x, 8), linear(b, x, 12, bias=False)
    kernel, outs = run_gemm(b, [q, k, v], GroupKind.HORIZONTAL)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1
    assert [o.shape[-1] for o in outs] == [8, 8, 12]


def test_horizontal_linears_with_epilogues_and_constants():
    b = Builder()
    x = b.input("x", (4, 16))
    ys = [b.op("relu", b.op("mul", linear(b, x, n), b.const("s", b.random(n)))) for n in (5, 9)]
    kernel, outs = run_gemm(b, ys, GroupKind.HORIZONTAL)
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()


def test_horizontal_pointwise_convs_with_relu():
    b = Builder()
    x = b.input("x", (2, 6, 4, 5))
    ys = [b.op("relu", b.conv(x, n, 1)) for n in (4, 7)]
    kernel, outs = run_group(b, ys, GroupKind.HORIZONTAL, lower=lower_conv_group)
    assert isinstance(kernel, GemmKernel)
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()
    assert all(o.is_contiguous(memory_format=torch.channels_last) or o.stride(1) == 1 for o in outs)


def test_float16_linear():
    b = Builder("float16")
    x = b.input("x", (6, 24))
    _, (out,) = run_gemm(b, [b.op("silu", linear(b, x, 10))])
    assert out.dtype == torch.float16


def test_unsupported_cases():
    b = Builder()
    x = b.input("x", (4, 8))
    w = b.input("w", (6, 8))
    with pytest.raises(Unsupported, match="weight is not a constant"):
        lower_gemm_group(b.graph, b.group([b.op("linear", x, w)]), "cpu")

    b = Builder()
    x = b.input("x", (4, 8))
    y = linear(b, x, 6)
    z = b.op("softmax", y, dim=1)
    with pytest.raises(Unsupported, match="not elementwise"):
        lower_gemm_group(b.graph, b.group([z]), "cpu")

    b = Builder()       # a horizontal residual: per-sibling runtime tensors cannot be concatenated
    x = b.input("x", (4, 8))
    r = b.input("r", (4, 6))
    ys = [b.op("add", linear(b, x, 6), r) for _ in range(2)]
    with pytest.raises(Unsupported, match="full tensor"):
        lower_gemm_group(b.graph, b.group(ys, GroupKind.HORIZONTAL), "cpu")


def test_configs_pick_small_tiles_for_batch_one(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert gemm_configs(1, 4096, 4096)[0]["BLOCK_M"] <= 32
    big = gemm_configs(8192, 8192, 8192)[0]
    assert (big["BLOCK_M"], big["BLOCK_N"], big.num_warps) == (128, 128, 8)
    assert gemm_configs(100352, 64, 576)[0]["BLOCK_N"] == 64        # few output channels: no idle columns
    for m, n, k in [(1, 4096, 4096), (8192, 8192, 8192), (100352, 64, 576), (512, 512, 64)]:
        configs = gemm_configs(m, n, k)
        assert len(set(configs)) == len(configs)
        assert all(min(c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) >= 16 for c in configs)
    for c in gemm_configs(8192, 8192, 8192, itemsize=4):      # float32 tiles: every pipeline fits in 227 KiB
        assert (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 4 * c.num_stages <= 227 * 1024


def head_merge(b: Builder, x: str) -> str:
    """(B, H, S, D) -> (B, S, H, D) -> (B*S, H*D): the reshape PyTorch copies after attention."""
    batch, heads, tokens, dim = b.graph[x].type.shape
    moved = b.op("permute", x, dims=(0, 2, 1, 3))
    return b.op("reshape", moved, shape=(batch * tokens, heads * dim))


def test_linear_reads_the_head_merge_through_its_views():
    """Heads and head dim are the two reduction groups of the operand load (6 per head: the 16-deep K blocks of
    the interpreter's tile straddle heads); no copy, the source is the kernel's input."""
    b = Builder()
    attention = b.input("attention", (2, 3, 5, 6), b.random(2, 3, 5, 6))     # contiguous, as the planner assumes
    r = b.input("r", (10, 7))
    y = b.op("add", linear(b, head_merge(b, attention), 7), r)
    kernel, _ = run_gemm(b, [y], GroupKind.RESIDUAL)
    assert kernel.runtime_inputs == ["attention", "r"]
    assert kernel.a_map is not None and kernel.a_map.groups(b.feeds["attention"])[1] == [(3, 30), (6, 1)]


def test_linear_reads_swin_windows_through_four_row_groups():
    b = Builder()
    x = b.input("x", (2, 4, 6, 5), b.random(2, 4, 6, 5))         # (B, H, W, C), windows of 2 x 2
    split = b.op("reshape", x, shape=(2, 2, 2, 3, 2, 5))
    moved = b.op("permute", split, dims=(0, 1, 3, 2, 4, 5))
    windows = b.op("reshape", moved, shape=(12, 4, 5))
    kernel, _ = run_gemm(b, [b.op("gelu", linear(b, windows, 9))])
    rows, _ = kernel.a_map.groups(b.feeds["x"])
    assert len([size for size, _ in rows if size > 1]) == 4


def test_a_source_whose_strides_do_not_map_is_copied_first():
    """Fed a source of other strides than planned (every dim reversed in memory), the reshape's reduction needs
    three groups, one more than the load has: the operand is materialised by PyTorch, and the result is right."""
    b = Builder()
    source = b.input("source", (2, 3, 4, 5), b.random(5, 4, 3, 2).permute(3, 2, 1, 0))
    y = linear(b, b.op("reshape", source, shape=(2, 60)), 4)
    kernel, _ = run_gemm(b, [b.op("relu", y)])
    assert kernel.a_map is not None and kernel.a_map.groups(b.feeds["source"]) is None


def test_the_epilogue_permutes_back_to_nchw_for_a_layer_scale_and_residual():
    """ConvNeXt's block tail: linear over (N, H, W, C), permute to (N, C, H, W), a (C, 1, 1) layer scale, the
    residual (channels-last, as the block's input is). The permuted output is a view of the tile-ordered buffer."""
    b = Builder()
    x = b.input("x", (2, 3, 5, 6))
    skip = b.input("skip", (2, 7, 3, 5))                         # channels-last by default
    nchw = b.op("permute", linear(b, x, 7), dims=(0, 3, 1, 2))
    scaled = b.op("mul", nchw, b.const("gamma", b.random(7, 1, 1)))
    _, (out,) = run_gemm(b, [b.op("add", scaled, skip)], GroupKind.RESIDUAL)
    assert out.shape == (2, 7, 3, 5) and out.is_contiguous(memory_format=torch.channels_last)


def test_a_value_read_in_two_orders_is_refused():
    """An epilogue node reading the anchor's values through a permute and directly: no kernel, and the planner
    never makes one (the same rule, `legality_views.epilogue_spaces`)."""
    b = Builder()
    x = b.input("x", (4, 4))
    y = linear(b, x, 4)
    both = b.op("add", y, b.op("permute", y, dims=(1, 0)))
    with pytest.raises(Unsupported, match="two orders"):
        lower_gemm_group(b.graph, b.group([both]), "cpu")
    group = b.group([both])
    reason = can_fuse(b.graph, [y], [n for n in group.nodes if n != y], b.graph.users())
    assert reason is not None and "two orders" in reason.text


def squeeze_excite_scale(b: Builder, x: str) -> str:
    """x * s: the per-image, per-channel scale (N, C, 1, 1) squeeze-and-excitation computes."""
    n, c = b.graph[x].type.shape[:2]
    return b.op("mul", x, b.input("s", (n, c, 1, 1)))


def test_a_1x1_conv_scales_its_input_tiles_as_it_loads_them():
    """The SE scale before the project conv: a prologue on the A tiles (5 channels: the 16-deep K blocks of the
    interpreter's tile are partial), batch 2 so the scale differs per image."""
    b = Builder()
    x = b.input("x", (2, 5, 3, 4))
    kernel, _ = run_group(b, [b.op("relu", b.conv(squeeze_excite_scale(b, x), 7, 1))], lower=lower_conv_group)
    assert isinstance(kernel, GemmKernel) and kernel.prologue is not None
    assert sorted(kernel.runtime_inputs) == ["s", "x"]


def test_a_linear_takes_a_prologue_with_a_constant_and_a_broadcast():
    b = Builder()
    x = b.input("x", (2, 3, 18))
    shift = b.input("shift", (2, 1, 18))
    scaled = b.op("add", b.op("mul", x, b.const("gamma", b.random(18))), shift)
    kernel, _ = run_gemm(b, [b.op("gelu", linear(b, scaled, 5))])
    assert [b.graph[n].op for n in kernel.prologue.nodes] == ["mul", "add"]


def test_a_batch_norm_after_the_epilogue_permute_reads_its_channels_where_they_are():
    """BatchNorm1d over (N, C, L) after a linear over (N, L, C): its [C] parameters lie along the tile's channels;
    after a conv's permute to (N, H, C, W) they lie along no tile axis and are read as a broadcast tensor."""
    b = Builder()
    x = b.input("x", (2, 5, 6))
    params = [b.const(n, b.random(7) if n != "var" else b.random(7).abs() + 0.5) for n in ("w", "b", "mean", "var")]
    y = b.op("batch_norm", b.op("permute", linear(b, x, 7), dims=(0, 2, 1)), *params, eps=1e-5)
    run_gemm(b, [b.op("relu", y)])
    b = Builder()
    x = b.input("x", (1, 3, 4, 5))
    params = [b.const(n, b.random(4) if n != "var" else b.random(4).abs() + 0.5) for n in ("w", "b", "mean", "var")]
    y = b.op("batch_norm", b.op("permute", b.conv(x, 6, 1), dims=(0, 2, 1, 3)), *params, eps=1e-5)
    run_group(b, [y], lower=lower_conv_group)


def test_a_batch_norm_prologue_reads_its_parameters_along_the_channels():
    """DenseNet's batch norm + ReLU before the 1x1 conv (no conv before it to fold the norm into), and a
    BatchNorm1d before a linear: the [C] parameters lie along dim 1, not broadcast from the right. Read as the
    latter, densenet121 failed to compile (a [C] vector expanded along W); W != C here, and K (10 channels) spans
    partial K blocks."""
    def norm(b: Builder, x: str, channels: int) -> str:
        params = [b.const(f"{n}{x}", b.random(channels) if n != "var" else b.random(channels).abs() + 0.5)
                  for n in ("w", "b", "mean", "var")]
        return b.op("relu", b.op("batch_norm", x, *params, eps=1e-5))

    b = Builder()
    x = b.input("x", (2, 10, 3, 4))
    kernel, _ = run_group(b, [b.op("relu", b.conv(norm(b, x, 10), 7, 1))], lower=lower_conv_group)
    assert [b.graph[n].op for n in kernel.prologue.nodes] == ["batch_norm", "relu"]
    b = Builder()
    x = b.input("x", (3, 10))
    kernel, _ = run_gemm(b, [linear(b, norm(b, x, 10), 5)])
    assert [b.graph[n].op for n in kernel.prologue.nodes] == ["batch_norm", "relu"]


def test_tiles_follow_the_gpu_profile(monkeypatch):
    """The SM count picks the default tile and the shared memory bounds the pipelines: an RTX 4090's 99 KiB per
    block leaves out float32 tiles an H200 takes; a grid that fills an Orin's 16 SMs keeps the big tile."""
    from opfuse.fusion.tiles import fits
    from opfuse.hardware import get_hardware

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    h200, rtx, orin = get_hardware("h200"), get_hardware("rtx4090"), get_hardware("orin")
    big = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}
    assert fits(big, 4, h200) and not fits(big, 4, rtx)        # 192 KiB of operand stages
    assert all(fits(c.as_dict(), 4, rtx) for c in gemm_configs(8192, 8192, 8192, itemsize=4, hw=rtx))
    assert len(gemm_configs(8192, 8192, 8192, itemsize=4, hw=rtx)) < len(gemm_configs(8192, 8192, 8192, itemsize=4,
                                                                                       hw=h200))
    # 1024 x 1024: 64 tiles of 128 x 128, under 2 x 132 SMs (a 64 x 64 default) but over 2 x 16
    assert gemm_configs(1024, 1024, 1024, hw=h200)[0]["BLOCK_M"] == 64
    assert gemm_configs(1024, 1024, 1024, hw=orin)[0]["BLOCK_M"] == 128


def test_a_prologue_undefined_at_zero_leaves_the_tiles_padding_zero():
    """K = 5 in 16-deep blocks: x / s at the masked columns is 0 / 0; the tile is zeroed again past K."""
    b = Builder()
    x, s = b.input("x", (4, 5)), b.input("s", (1, 5), b.random(1, 5).abs() + 0.5)
    kernel, _ = run_gemm(b, [b.op("relu", linear(b, b.op("div", x, s), 3))])
    assert kernel.prologue is not None


def test_an_anchor_lowering_finds_the_graphs_users_once(monkeypatch):
    """siblings_and_chains, the operand views, the prologue: one `graph.users()` for a group's whole lowering."""
    from opfuse.ir.graph import Graph

    calls = []
    users = Graph.users
    monkeypatch.setattr(Graph, "users", lambda graph: calls.append(1) or users(graph))
    linear_graph = Builder()
    attention = linear_graph.input("attention", (2, 3, 5, 6), linear_graph.random(2, 3, 5, 6))
    viewed = linear(linear_graph, head_merge(linear_graph, attention), 7)
    conv_graph = Builder()
    scaled = conv_graph.op("mul", conv_graph.input("x", (2, 6, 3, 4)), conv_graph.input("s", (2, 6, 1, 1)))
    conv = conv_graph.op("relu", conv_graph.conv(scaled, 5, 1))
    for b, output, lower in ((linear_graph, viewed, lower_gemm_group), (conv_graph, conv, lower_conv_group)):
        group = b.group([output])
        calls.clear()
        kernel = lower(b.graph, group, "cpu")
        assert len(calls) == 1 and kernel.operand_nodes, (group.nodes, len(calls))


def test_an_anchor_group_past_int32_offsets_runs_through_pytorch_and_says_why():
    """A linear over 2^25 rows of 64 (2^31 elements): the anchor templates' offsets are int32, so the group gets no
    kernel and its reason names the tensor; one element fewer lowers (graph types only: nothing is allocated)."""
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.plan import FusionGroup
    from opfuse.fusion.reasons import Code
    from opfuse.ir.graph import Graph, TensorType
    from opfuse.ir.ops import infer_type

    for rows, fits in ((2 ** 25, False), (2 ** 25 - 1, True)):
        graph = Graph("huge")
        x = graph.add_input("x", TensorType((rows, 64), "float16")).name
        w = graph.add_constant("w", torch.randn(16, 64).half()).name
        y = graph.add_node("linear", [x, w], infer_type("linear", [graph[x].type, graph[w].type], {}), {}).name
        graph.outputs = [y]
        group = FusionGroup(0, GroupKind.SINGLE, [y], anchor=y, inputs=[x, w], outputs=[y])
        reasons = {}
        kernel = lower_group(graph, group, "cpu", reasons)
        assert (kernel is not None) == fits
        if not fits:
            assert reasons[group.name].code is Code.UNSUPPORTED and "int32" in reasons[group.name].text
            assert "x" in reasons[group.name].text


def test_a_horizontal_group_whose_shared_output_passes_int32_runs_through_pytorch():
    """Two sibling linears of 2^30 output elements each write one [rows, 32] buffer of 2^31 elements: refused,
    though each sibling's own output is within int32."""
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.plan import FusionGroup
    from opfuse.ir.graph import Graph, TensorType
    from opfuse.ir.ops import infer_type

    graph = Graph("huge")
    x = graph.add_input("x", TensorType((2 ** 26, 8), "float16")).name
    ys = []
    for i in range(2):
        w = graph.add_constant(f"w{i}", torch.randn(16, 8).half()).name
        ys.append(graph.add_node("linear", [x, w], infer_type("linear", [graph[x].type, graph[w].type], {}),
                                 {}).name)
    graph.outputs = ys
    group = FusionGroup(0, GroupKind.HORIZONTAL, ys, anchor=ys[0], inputs=[x, "w0", "w1"], outputs=ys)
    reasons = {}
    assert lower_group(graph, group, "cpu", reasons) is None
    assert "share one buffer" in reasons[group.name].text and "int32" in reasons[group.name].text


def test_a_split_whose_workspace_passes_int32_runs_through_pytorch():
    """A linear of 2^28 outputs planned in 16 K slices: its fp32 partial tiles need 2^32 workspace elements."""
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.plan import FusionGroup
    from opfuse.ir.graph import Graph, TensorType
    from opfuse.ir.ops import infer_type

    for slices, fits in ((16, False), (4, True)):
        graph = Graph("split")
        x = graph.add_input("x", TensorType((2 ** 24, 64), "float16")).name
        w = graph.add_constant("w", torch.randn(16, 64).half()).name
        y = graph.add_node("linear", [x, w], infer_type("linear", [graph[x].type, graph[w].type], {}), {}).name
        graph.outputs = [y]
        group = FusionGroup(0, GroupKind.SINGLE, [y], anchor=y, inputs=[x, w], outputs=[y],
                            split_k={"any-tile": slices})
        reasons = {}
        if fits:       # within int32: the guard lets it through (whatever the template then makes of the table)
            from opfuse.codegen.lower import _within_int32
            assert _within_int32(graph, group) is None
        else:
            assert lower_group(graph, group, "cpu", reasons) is None and "workspace" in reasons[group.name].text


class GatedMLP(torch.nn.Module):
    """A SwiGLU (or GeGLU) MLP as Llama and T5 v1.1 write it: act(gate(x)) * up(x), then down."""

    def __init__(self, width: int = 24, hidden: int = 40, act=torch.nn.functional.silu, up_first: bool = False):
        super().__init__()
        self.gate = torch.nn.Linear(width, hidden, bias=False)
        self.up = torch.nn.Linear(width, hidden, bias=False)
        self.down = torch.nn.Linear(hidden, width, bias=False)
        self.act, self.up_first = act, up_first

    def forward(self, x):
        gated = self.up(x) * self.act(self.gate(x)) if self.up_first else self.act(self.gate(x)) * self.up(x)
        return self.down(gated)


@pytest.mark.parametrize("act, up_first, rows", [
    (torch.nn.functional.silu, False, 7),
    (torch.nn.functional.gelu, True, 33),
    (torch.nn.functional.silu, False, 1),
])
def test_a_gated_pair_runs_as_one_gemm_over_interleaved_weights_and_matches_eager(act, up_first, rows):
    """The gate and up projections, the activation and the product: one kernel (GatedGemmKernel), at odd row counts
    and widths, with the product on either side, equal to eager in float32."""
    import opfuse
    from opfuse.codegen.gemm import GatedGemmKernel

    torch.manual_seed(2)
    model = GatedMLP(act=act, up_first=up_first).eval()
    x = torch.randn(rows, 24)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    gated = [k for k in compiled.compiled.kernels.values() if isinstance(k, GatedGemmKernel)]
    assert len(gated) == 1 and compiled.plan.kernel_launches == 2
    fresh = torch.randn(rows, 24)
    with torch.no_grad():
        got, want = compiled(fresh), model(fresh)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


class NormedGatedMLP(GatedMLP):
    """Llama's MLP: an RMS norm, then the gated pair and the down projection."""

    def forward(self, x):
        x32 = x.float()
        return super().forward((x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype))


@pytest.mark.parametrize("rows", [1, 7])
def test_a_gated_pair_normalizes_its_input_tiles_and_matches_eager(rows):
    """With `norm_prologue` the RMS norm is the gated GEMM's prologue (its row statistics computed in the kernel):
    one kernel for norm, gate, up, SiLU and the product, equal to eager in float32."""
    import opfuse
    from opfuse.codegen.gemm import GatedGemmKernel

    torch.manual_seed(4)
    model = NormedGatedMLP(act=torch.nn.functional.silu, up_first=False).eval()
    x = torch.randn(rows, 24) * 3 + 1
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", norm_prologue=True))
    gated = [k for k in compiled.compiled.kernels.values() if isinstance(k, GatedGemmKernel)]
    assert len(gated) == 1 and gated[0].prologue is not None and compiled.plan.kernel_launches == 2
    fresh = torch.randn(rows, 24) * 3 + 1
    with torch.no_grad():
        got, want = compiled(fresh), model(fresh)
    assert (got - want).abs().max() / want.abs().max() < 1e-5


class WeightedNormGatedMLP(GatedMLP):
    """Llama's MLP with its RMS norm's weight: weight * (x * rstd) in float32, as transformers writes it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(24) + 0.5)

    def forward(self, x):
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return super().forward(self.weight * normed)


def test_a_gated_pair_folds_its_rms_norms_weight_into_its_own():
    """With `rms_norm_prologue` the gated kernel folds the norm's weight into its weight's rows (`fold_weight`):
    its A tiles go to the dot as loaded, and the result is eager's in float32. Where the folded weight would leave
    float16's range (a norm weight of 1000 on a channel whose gate weights are 100) the kernel keeps the weight on
    its tiles instead (`opfuse.codegen.prologue`: x * w / max|w|, tested in float16 in test_compile)."""
    import opfuse
    from opfuse.codegen.gemm import GatedGemmKernel
    from opfuse.codegen.lower import lower_plan

    torch.manual_seed(5)
    model = WeightedNormGatedMLP().eval()
    x = torch.randn(3, 24) * 2 + 1
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", rms_norm_prologue=True))
    (gated,) = [k for k in compiled.compiled.kernels.values() if isinstance(k, GatedGemmKernel)]
    assert gated.prologue.folded and compiled.plan.kernel_launches == 2
    fresh = torch.randn(3, 24) * 2 + 1
    with torch.no_grad():
        got, want = compiled(fresh), model(fresh)
    assert (got - want).abs().max() / want.abs().max() < 1e-5

    with torch.no_grad():
        model.weight[0], model.gate.weight[:, 0] = 1000.0, 100.0
    plan = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float16", rms_norm_prologue=True)).plan
    (gated,) = [k for k in lower_plan(plan, "cpu")[0].values() if isinstance(k, GatedGemmKernel)]
    assert gated.prologue.deferred and not gated.prologue.folded
