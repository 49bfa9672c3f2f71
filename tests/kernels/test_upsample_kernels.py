"""Upsampling as an index map of the elementwise template, on Triton's interpreter: nearest (1-D to 3-D, size or
scale factor, which decides the source index), nearest-exact, linear interpolation (its 2^dims neighbours
weighted, align_corners or not) and bicubic (4 taps a dim, 16 loads; element by element against F.interpolate),
odd sizes and size-1 dims; each against PyTorch's own upsample in float32, outputs NaN-poisoned. Then captured
models (GhostNetV2's gate, HRNet's fuse layer, CrossViT's resized image) plan with nothing through PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.codegen.lower import groups_through_pytorch
from opfuse.fusion.plan import GroupKind
from tests.kernels.test_index_map_kernels import plan_of
from tests.kernels.test_pointwise_kernels import Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def upsampled(shape: tuple, mode: str, size: list[int], scales: list | None = None, align_corners: bool = False,
              kind: GroupKind = GroupKind.POINTWISE) -> torch.Tensor:
    """x of `shape` upsampled, then scaled (the elementwise chain it starts), run and checked; the result."""
    b = Builder()
    x = b.input("x", shape, b.random(*shape))
    attrs = {"mode": mode, "size": size, "scales": scales} | ({"align_corners": align_corners}
                                                              if mode in ("linear", "cubic") else {})
    y = b.op("upsample", x, **attrs)
    out = b.op("mul", y, b.const("two", torch.tensor(2.0))) if kind is GroupKind.POINTWISE else y
    _, (result,) = run_group(b, [out], kind)
    return result


@pytest.mark.parametrize("shape, size, scales", [
    ((1, 3, 3, 3), [7, 7], None),            # GhostNetV2: a 2x2-pooled 7x7 map back to 7x7 (3 -> 7: no factor)
    ((2, 5, 4, 6), [8, 12], [2.0, 2.0]),     # HRNet: scale factor 2
    ((1, 2, 5, 5), [8, 8], [1.7, 1.7]),      # index i / 1.7, not i * 5 / 8: the factor decides (i = 5: 2, not 3)
    ((1, 3, 6, 5), [1, 9], None),            # one output row
    ((1, 3, 1, 4), [3, 4], [3.0, None]),     # one input row; W unscaled
])
def test_nearest_2d(shape, size, scales):
    upsampled(shape, "nearest", size, scales)


def test_the_scale_factor_decides_the_source_index():
    """Upsampled by 1.7 to 8, row 5 reads row 2 (5 / 1.7 = 2.9), where 5 * 5 / 8 = 3.1 would read row 3."""
    x = torch.arange(5.0).reshape(1, 1, 5, 1).expand(1, 1, 5, 2).contiguous()
    b = Builder()
    name = b.input("x", (1, 1, 5, 2), x)
    y = b.op("upsample", name, mode="nearest", size=[8, 2], scales=[1.7, None])
    _, (result,) = run_group(b, [y], GroupKind.SINGLE)
    assert result[0, 0, 5, 0] == 2.0 and result[0, 0, :, 0].tolist() == [0, 0, 1, 1, 2, 2, 3, 4]


@pytest.mark.parametrize("shape, size, mode", [
    ((2, 3, 5), [11], "nearest"),
    ((1, 2, 3, 4, 5), [6, 5, 9], "nearest"),
    ((1, 3, 5, 7), [9, 10], "nearest-exact"),
    ((1, 3, 6), [4], "nearest-exact"),       # downsampling
])
def test_nearest_1d_3d_and_exact(shape, size, mode):
    upsampled(shape, mode, size)


@pytest.mark.parametrize("shape, size, scales, align_corners", [
    ((1, 3, 5, 7), [10, 13], None, False),   # EfficientFormerV2's bilinear
    ((1, 3, 5, 7), [10, 13], None, True),
    ((2, 2, 4, 4), [8, 8], [2.0, 2.0], False),
    ((1, 2, 1, 5), [3, 9], None, False),      # one input row: one neighbour
    ((1, 2, 6, 5), [1, 3], None, True),       # one output row
    ((1, 2, 7, 9), [4, 5], None, False),      # downsampling
])
def test_bilinear(shape, size, scales, align_corners):
    upsampled(shape, "linear", size, scales, align_corners)


@pytest.mark.parametrize("shape, size, align_corners", [((2, 3, 5), [12], False), ((1, 2, 3, 4, 5), [5, 7, 6], True)])
def test_linear_1d_and_trilinear(shape, size, align_corners):
    upsampled(shape, "linear", size, None, align_corners)


def bicubic(x: torch.Tensor, size: list[int] | None, scales: tuple | None, align_corners: bool,
            kind: GroupKind = GroupKind.SINGLE) -> torch.Tensor:
    """x (as laid out) upsampled bicubic by the kernel, checked element by element against F.interpolate (its
    size, or its scale factors, which then decide the source positions) in float32; the result. POINTWISE: inside
    one kernel, a sigmoid before (computed at each of the 16 taps) and a multiply by another input after."""
    b = Builder()
    name = b.input("x", tuple(x.shape), x)
    size = size or [int(n * s) for n, s in zip(x.shape[2:], scales)]
    if kind is GroupKind.POINTWISE:
        name = b.op("sigmoid", name)
    y = b.op("upsample", name, mode="cubic", size=size, scales=None if scales is None else list(scales),
             align_corners=align_corners)
    other = torch.randn(*x.shape[:2], *size)
    if kind is GroupKind.POINTWISE:
        y = b.op("mul", y, b.input("other", tuple(other.shape), other))
    _, (result,) = run_group(b, [y], kind)
    source = torch.sigmoid(x) if kind is GroupKind.POINTWISE else x
    expected = F.interpolate(source.contiguous(), size=None if scales else size, scale_factor=scales, mode="bicubic",
                             align_corners=align_corners)
    if kind is GroupKind.POINTWISE:
        expected = expected * other
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
    return result


@pytest.mark.parametrize("shape, size, scales, align_corners", [
    ((1, 3, 5, 7), [9, 11], None, False),       # odd sizes up: the first positions lie below 0, not clamped
    ((1, 3, 5, 7), [9, 11], None, True),
    ((2, 2, 9, 11), [4, 6], None, False),       # odd sizes down
    ((2, 2, 9, 11), [4, 6], None, True),
    ((1, 3, 15, 15), [14, 14], None, False),    # CrossViT: its 240-pixel image resized to 224 (15 : 14)
    ((2, 2, 4, 5), None, (1.7, 2.3), False),    # the factors decide: i / 1.7, not i * 4 / 6
    ((1, 2, 5, 6), None, (0.6, 1.5), True),     # align_corners: the sizes decide, the factors are ignored
    ((1, 2, 1, 6), [3, 9], None, False),        # one input row: 4 taps of row 0, still weighted and summed
    ((1, 2, 6, 1), [7, 3], None, True),
    ((1, 2, 6, 5), [1, 7], None, False),        # one output row: its taps and weights are numbers
    ((1, 2, 6, 5), [1, 7], None, True),
    ((1, 2, 5, 4), [5, 7], None, False),        # H kept: weights 0, 1, 0, 0
])
def test_bicubic(shape, size, scales, align_corners):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    bicubic(x, size, scales, align_corners)


@pytest.mark.parametrize("channels_last", [False, True])
def test_bicubic_between_elementwise_ops_in_one_kernel(channels_last):
    """sigmoid -> bicubic -> multiply as one kernel: the sigmoid computed at each of the 16 taps (the planner
    would load it instead, but the template computes any member at any coordinates), read through either layout."""
    x = torch.randn(1, 3, 5, 6, generator=torch.Generator().manual_seed(1))
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    bicubic(x, [8, 9], None, False, GroupKind.POINTWISE)
    bicubic(x, None, (1.5, 0.5), False, GroupKind.POINTWISE)


def test_a_lone_upsample_is_a_kernel_of_ours():
    result = upsampled((1, 4, 3, 5), "nearest", [6, 10], [2.0, 2.0], kind=GroupKind.SINGLE)
    assert result.shape == (1, 4, 6, 10)


class Gate(nn.Module):
    """GhostNetV2's DFC attention: a gate computed at half resolution, upsampled back (nearest, to the size: 3 -> 7)
    and multiplied in; HRNet's fuse: a branch upsampled by 2 added to the other, then ReLU; a bilinear upsample."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)
        self.up = nn.Upsample(scale_factor=2.0, mode="nearest")

    def forward(self, x, low, other):
        gate = torch.sigmoid(self.conv(F.avg_pool2d(x, 2, 2)))
        gated = x * F.interpolate(gate, size=x.shape[-2:], mode="nearest")
        fused = torch.relu(other + self.up(low))
        return gated[..., :6, :6] + fused + F.interpolate(low, scale_factor=2.0, mode="bilinear")


def test_captured_upsamples_join_the_kernels_that_read_them():
    """Each upsample is an index map of the kernel of what reads it (the multiply, the add and ReLU, the sum):
    nothing runs through PyTorch, and the upsample reads its input from memory (it is not recomputed per output)."""
    plan = plan_of(Gate(), torch.randn(1, 4, 7, 7), torch.randn(1, 4, 3, 3), torch.randn(1, 4, 6, 6))
    assert groups_through_pytorch(plan) == {}
    graph = plan.graph
    upsamples = [n for n in graph if n.op == "upsample"]
    assert len(upsamples) == 3
    for node in upsamples:
        group = plan.group_of(node.name)
        readers = {u.op for u in graph.users()[node.name]}
        assert readers <= {graph[n].op for n in group.nodes}           # its reader computes it
        assert graph[node.inputs[0]].name not in group.nodes            # its input is loaded


class ResizedBranch(nn.Module):
    """CrossViT's second branch: its image resized bicubic (240 -> 224 there: 15 -> 14 here) before its patch
    embedding; a small map upsampled bicubic (align_corners) and added to a feature map, then GELU; both
    concatenated. (A parameter's upsample, a position table's, is folded into a constant before planning.)"""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 4, 2, stride=2)

    def forward(self, image, small, features):
        tokens = self.embed(F.interpolate(image, size=(14, 14), mode="bicubic", align_corners=False))
        table = F.interpolate(small, size=features.shape[-2:], mode="bicubic", align_corners=True)
        return torch.cat([tokens, F.gelu(features + table)], dim=1)


def test_captured_bicubic_upsamples_compile_to_kernels_of_ours():
    """Both resizes are kernels of ours (the small map's joins the add and GELU that read it): nothing runs
    through PyTorch, and the compiled model matches eager in float32."""
    model = ResizedBranch().eval()
    inputs = (torch.randn(1, 3, 15, 15), torch.randn(1, 4, 3, 3), torch.randn(1, 4, 7, 7))
    plan = plan_of(model, *inputs)
    assert groups_through_pytorch(plan) == {}
    upsamples = {n.attrs["align_corners"]: n.name for n in plan.graph if n.op == "upsample"}
    assert len(upsamples) == 2
    assert "gelu" in {plan.graph[n].op for n in plan.group_of(upsamples[True]).nodes}
    compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(*inputs), model(*inputs), rtol=1e-5, atol=1e-5)
