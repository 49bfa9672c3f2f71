"""Conv-conv kernels ([expand 1x1 ->] depthwise -> pointwise 1x1 in one kernel) on Triton's interpreter.

Each test builds a tiny inverted-residual chain by hand, lowers it as one CONV_CONV group, runs the kernel on
NaN-poisoned output buffers and compares with the IR reference interpreter in float32 (rel err < 1e-4; 1e-2 in
float16). The interpreter config is 16x16x16, so channel counts of 20 or 18 leave partial mid and output tiles.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.codegen import lower
from opfuse.codegen.base import KernelConfig
from opfuse.codegen.conv_conv import ConvConvKernel, lower_conv_conv_group
from opfuse.codegen.expr import Unsupported
from opfuse.fusion.plan import GroupKind
from opfuse.numerics import relative_error

from tests.kernels.builders import with_random_batch_norms
from test_conv_kernels import Builder, run_group


def inverted_residual(b: Builder, x: str, c_mid: int, c_out: int, stride: int = 1, kernel: int = 3,
                      expand: bool = False, skip: str | None = None) -> str:
    """[1x1 expand + relu6 ->] depthwise kernel x kernel + relu6 -> 1x1 (+ skip); returns the last value."""
    y = x
    if expand:
        y = b.op("clamp", b.conv(x, c_mid, 1), min=0.0, max=6.0)
    y = b.op("clamp", b.conv(y, c_mid, kernel, stride=stride, padding=kernel // 2, groups=c_mid), min=0.0, max=6.0)
    y = b.conv(y, c_out, 1)
    return b.op("add", y, skip) if skip is not None else y


def run_conv_conv(b: Builder, outputs: list[str]) -> ConvConvKernel:
    kernel, _ = run_group(b, outputs, GroupKind.CONV_CONV, lower=lower_conv_conv_group)
    assert isinstance(kernel, ConvConvKernel)
    return kernel


@pytest.mark.parametrize("batch,c_mid,c_out,hw,stride,residual", [
    (2, 20, 18, (7, 6), 1, True),     # mid and output channels not multiples of 16, non-square image, residual
    (1, 20, 18, (7, 6), 2, False),    # stride 2, batch 1
    (2, 16, 16, (4, 4), 1, False),    # exact tiles
    (1, 33, 5, (5, 5), 2, True),      # three mid-channel chunks, fewer output channels than one tile
])
def test_depthwise_pointwise(batch, c_mid, c_out, hw, stride, residual):
    b = Builder()
    x = b.input("x", (batch, c_mid, *hw))
    out_hw = tuple((s - 1) // stride + 1 for s in hw)
    skip = b.input("skip", (batch, c_out, *out_hw)) if residual else None
    y = inverted_residual(b, x, c_mid, c_out, stride, skip=skip)
    kernel = run_conv_conv(b, [y])
    assert kernel.expansion is None and kernel.name.startswith("fused_dw_conv_clamp_pw_conv")
    assert kernel.group.kind is GroupKind.CONV_CONV


@pytest.mark.parametrize("stride,residual", [(1, True), (2, False)])
def test_whole_inverted_residual_with_expansion(stride, residual):
    """The expansion is recomputed per tap; taps in the padding must read zeros, not relu6(bias)."""
    b = Builder()
    x = b.input("x", (2, 6, 7, 5))
    y = inverted_residual(b, x, 20, 6 if residual else 9, stride, expand=True, skip=x if residual else None)
    kernel = run_conv_conv(b, [y])
    assert kernel.expansion is not None and kernel.block_cin == 16
    assert kernel.name.startswith("fused_expand_conv_clamp_dw_conv_pw_conv")


@pytest.mark.parametrize("expand,slices", [(False, 2), (False, 3), (True, 2)])
def test_mid_channel_slices_summed_in_the_same_launch(expand, slices):
    """SPLIT_K slices of the 40 mid channels (three 16-channel chunks: uneven slices with 2): each slice stores its
    partial tile, the last of a tile to arrive sums them and alone runs the epilogue, then resets the tile's count.
    Run twice: the second launch must find the counts back at zero, the results right both times."""
    b = Builder()
    x = b.input("x", (2, 6 if expand else 40, 5, 4))
    skip = x if expand else b.input("skip", (2, 6, 5, 4))
    y = inverted_residual(b, x, 40, 6, expand=expand, skip=skip)
    kernel = lower_conv_conv_group(b.graph, b.group([y], GroupKind.CONV_CONV), "cpu")
    kernel.epilogue.output_fill = float("nan")
    config = KernelConfig.of(4, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=slices)
    counts = None
    for _ in range(2):
        b.check([y], kernel.run([b.feeds[name] for name in kernel.runtime_inputs], config))
        assert int(kernel.counts.tensor.abs().sum()) == 0
        assert counts is None or kernel.counts.tensor is counts     # one buffer: a captured CUDA graph keeps pointing at it
        counts = kernel.counts.tensor
    assert kernel.launches(config) == 1


def test_only_the_last_slice_to_arrive_runs_the_epilogue():
    """Launch every tile but one slice short: no tile's count reaches SPLIT_K, so no program may sum or store, and
    each count is left at the slices that arrived. (The interpreter runs programs one after another, so the full
    launch above cannot tell "the last to arrive" from "the last in launch order"; this can.)"""
    b = Builder()
    x = b.input("x", (2, 40, 5, 4))
    y = inverted_residual(b, x, 40, 6, skip=b.input("skip", (2, 6, 5, 4)))
    kernel = lower_conv_conv_group(b.graph, b.group([y], GroupKind.CONV_CONV), "cpu")
    kernel.epilogue.output_fill = float("nan")
    launch = kernel.kernel

    class OneSliceShort:
        def __getitem__(self, grid):
            return launch[(grid[0], grid[1] - 1)]

    kernel.kernel = OneSliceShort()
    config = KernelConfig.of(4, 1, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=3)
    (out,) = kernel.run([b.feeds[name] for name in kernel.runtime_inputs], config)
    tiles = -(-2 * 5 * 4 // 16)                                          # 40 pixels x 6 channels: 3 tiles of 16 x 16
    assert torch.isnan(out).all()
    assert kernel.counts.tensor[:tiles].tolist() == [2] * tiles and int(kernel.counts.tensor[tiles:].abs().sum()) == 0


def test_five_by_five_depthwise_and_an_nchw_input():
    b = Builder()
    x = b.input("x", (1, 12, 6, 7), b.random(1, 12, 6, 7))           # contiguous NCHW: read through its strides
    y = inverted_residual(b, x, 12, 10, stride=2, kernel=5)
    run_conv_conv(b, [y])


def test_dilated_depthwise():
    b = Builder()
    x = b.input("x", (2, 17, 7, 7))
    d = b.op("clamp", b.conv(x, 17, 3, padding=2, dilation=2, groups=17), min=0.0, max=6.0)
    run_conv_conv(b, [b.conv(d, 9, 1)])


def test_channel_slice_view_input():
    b = Builder()
    wide = b.random(2, 30, 5, 5).to(memory_format=torch.channels_last)
    x = b.input("x", (2, 20, 5, 5), wide[:, 4:24])                     # a strided view, not a copy
    y = inverted_residual(b, x, 20, 7)
    run_conv_conv(b, [y])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # the 0/0 lanes, on purpose
def test_unfolded_batch_norm_and_hardswish_in_both_epilogues():
    """Per-channel vectors of the depthwise epilogue live in their helper; the pointwise epilogue is the shared one.
    The division makes 0/0 = NaN in the mid channels past 18 (their vectors load as 0): they must not reach the dot."""
    b = Builder()
    x = b.input("x", (1, 18, 5, 6))
    d = b.conv(x, 18, 3, padding=1, groups=18, bias=False)
    params = [b.const("bn_w", b.random(18)), b.const("bn_b", b.random(18)), b.const("bn_m", b.random(18)),
              b.const("bn_v", b.random(18).abs() + 0.5)]
    d = b.op("hardswish", b.op("batch_norm", d, *params, eps=1e-5))
    d = b.op("div", d, b.const("divisor", b.random(1, 18, 1, 1).abs() + 0.5))
    y = b.op("mul", b.conv(d, 17, 1), b.const("scale", b.random(1, 17, 1, 1)))
    y = b.op("relu", b.op("add", y, b.input("skip", (1, 17, 5, 6))))
    kernel = run_conv_conv(b, [y])
    assert len(kernel.stage_vectors) == 5 and "def depthwise_epilogue(" in kernel.source


def test_float16():
    b = Builder("float16")
    x = b.input("x", (2, 6, 6, 5))
    y = inverted_residual(b, x, 20, 6, expand=True, skip=x)
    _, (out,) = run_group(b, [y], GroupKind.CONV_CONV, lower=lower_conv_conv_group)
    assert out.dtype == torch.float16


def test_a_depthwise_result_read_elsewhere_is_refused():
    b = Builder()
    x = b.input("x", (1, 16, 5, 5))
    d = b.op("clamp", b.conv(x, 16, 3, padding=1, groups=16), min=0.0, max=6.0)
    y = b.conv(d, 8, 1)
    group = b.group([y, d], GroupKind.CONV_CONV)
    with pytest.raises(Unsupported, match="stays in registers"):
        lower_conv_conv_group(b.graph, group, "cpu")


def test_dispatch_sends_conv_conv_groups_to_the_fused_kernel():
    b = Builder()
    x = b.input("x", (1, 16, 5, 5))
    group = b.group([inverted_residual(b, x, 16, 8)], GroupKind.CONV_CONV)
    assert lower.choose_lowering(b.graph, group) == "conv-conv"
    reasons: dict[str, str] = {}
    assert isinstance(lower.lower_group(b.graph, group, "cpu", reasons), ConvConvKernel) and not reasons


# ---- opfuse.compile of a small MobileNet ----------------------------------------------------------------

def tiny_mobilenet() -> nn.Module:
    """A stem and two torchvision inverted-residual blocks, pooled and classified: the first without expansion (as
    MobileNetV2's first block) and with its residual add, the second expanded 3x and strided."""
    from torchvision.models.mobilenetv2 import InvertedResidual

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(),
        InvertedResidual(8, 8, stride=1, expand_ratio=1),
        InvertedResidual(8, 12, stride=2, expand_ratio=3),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    return with_random_batch_norms(model).eval()


def test_compile_small_mobilenet_uses_the_conv_conv_kernels(monkeypatch):
    from opfuse import hardware

    # without the H200's conv-conv measurements (loop floor, efficiency), which keep such tiny blocks apart
    monkeypatch.setitem(hardware.PROFILES, "h200ideal", hardware.PROFILES["h200"].with_ideal_conv_conv())
    model = tiny_mobilenet()
    x = torch.randn(2, 3, 8, 8)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", hardware="h200ideal"))
    groups = [g for g in compiled.plan.groups if g.kind is GroupKind.CONV_CONV]
    assert len(groups) == 2                                             # one per block
    graph = compiled.plan.graph
    depthwise = [n.name for n in graph if n.op == "conv2d" and n.attrs["groups"] > 1]
    assert all(any(d in g.nodes for g in groups) for d in depthwise)
    for group in groups:   # a real fused kernel, checked on its own, no fallback to PyTorch
        assert isinstance(compiled.compiled.kernels[group.name], ConvConvKernel)
        assert group.name not in compiled.fallbacks
    assert any(graph[n].op == "add" for n in groups[0].nodes)            # the first block's residual is fused
    # at this size the launch saved outweighs the halo recompute: the second block is fused whole
    assert compiled.compiled.kernels[groups[1].name].expansion is not None
    checked = {c.group: c for c in compiled.checks}
    assert all(checked[g.name].passed for g in groups)
    assert compiled.launches == compiled.plan.kernel_launches
    with torch.no_grad():
        fresh = torch.randn(2, 3, 8, 8)
        assert relative_error(compiled(fresh), model(fresh)) < 1e-4
