"""Sliding windows as index maps of a kernel's loads, on Triton's interpreter: unfold (Tensor.unfold), im2col
(F.unfold) and col2im (F.fold), each between elementwise ops in one kernel; and the captures that plan them with
nothing through PyTorch (halonet's pad and two unfolds, VOLO's outlook attention). Outputs are NaN-poisoned and
compared with the float32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opfuse
from opfuse.codegen.lower import groups_through_pytorch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.ops import sliding_windows
from tests.kernels.test_index_map_kernels import plan_of
from tests.kernels.test_pointwise_kernels import Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

TWO = torch.tensor(2.0)


def window_attrs(kernel=(1, 1), dilation=(1, 1), padding=(0, 0), stride=(1, 1)) -> dict:
    return {"kernel_size": list(kernel), "dilation": list(dilation), "padding": list(padding), "stride": list(stride)}


WINDOWS = [window_attrs((2, 3)),                                                    # overlapping, no padding
           window_attrs((3, 2), dilation=(2, 1), padding=(1, 2), stride=(2, 3)),    # every knob, odd
           window_attrs((2, 2), stride=(2, 2)),                                     # disjoint blocks
           window_attrs((3, 3), padding=(1, 1))]                                    # VOLO's


@pytest.mark.parametrize("dim,size,step", [(2, 3, 2), (-1, 2, 1), (1, 1, 2), (3, 5, 3), (2, 7, 1)])
def test_unfold_between_elementwise_ops(dim, size, step):
    """Overlapping windows, windows with gaps between them (step > size), one window of the whole dim."""
    b = Builder()
    x = b.input("x", (2, 3, 7, 5))                      # channels-last
    windows = b.op("unfold", b.op("silu", x), dim=dim, size=size, step=step)
    run_group(b, [b.op("mul", windows, b.const("two", TWO))], GroupKind.POINTWISE)


def test_two_unfolds_of_a_pad_read_the_input_once_per_window_element():
    """halonet's key/value windows: a pad, then overlapping windows along H and along W."""
    b = Builder()
    x = b.input("x", (1, 2, 6, 5), torch.randn(1, 2, 6, 5))
    padded = b.op("pad", x, pads=(1, 2, 2, 1), value=0.0)
    windows = b.op("unfold", b.op("unfold", padded, dim=2, size=4, step=3), dim=3, size=3, step=2)
    run_group(b, [b.op("neg", windows)], GroupKind.POINTWISE)


@pytest.mark.parametrize("attrs", WINDOWS)
@pytest.mark.parametrize("batched", [True, False])
def test_im2col_between_elementwise_ops(attrs, batched):
    b = Builder()
    shape = (2, 3, 7, 6) if batched else (3, 7, 6)
    x = b.input("x", shape, torch.randn(shape))
    columns = b.op("im2col", b.op("sigmoid", x), **attrs)
    run_group(b, [b.op("add", columns, b.const("two", TWO))], GroupKind.POINTWISE)


def _columns(image: tuple[int, int], channels: int, attrs: dict, lead: tuple[int, ...] = ()) -> tuple[int, ...]:
    counts = [sliding_windows(size, k, d, p, s) for size, k, d, p, s in
              zip(image, attrs["kernel_size"], attrs["dilation"], attrs["padding"], attrs["stride"])]
    return (*lead, channels * attrs["kernel_size"][0] * attrs["kernel_size"][1], counts[0] * counts[1])


@pytest.mark.parametrize("attrs", WINDOWS)
@pytest.mark.parametrize("batched", [True, False])
def test_col2im_sums_the_columns_between_elementwise_ops(attrs, batched):
    b = Builder()
    shape = _columns((7, 6), 3, attrs, (2,) if batched else ())
    x = b.input("x", shape, torch.randn(shape))
    image = b.op("col2im", b.op("relu", x), output_size=[7, 6], **attrs)
    run_group(b, [b.op("mul", image, b.const("two", TWO))], GroupKind.POINTWISE)


@pytest.mark.parametrize("image,attrs", [((1, 5), window_attrs((1, 3), padding=(0, 1))),    # a height of one
                                         ((4, 4), window_attrs((5, 5), padding=(2, 2), stride=(3, 3)))])
def test_one_channel_and_few_blocks(image, attrs):
    """Size-1 dims everywhere: one channel, a single block along a dim, a single image row."""
    b = Builder()
    columns = b.op("im2col", b.input("x", (1, 1, *image), torch.randn(1, 1, *image)), **attrs)
    shape = _columns(image, 1, attrs, (1,))
    assert list(b.graph[columns].type.shape) == list(shape)
    folded = b.op("col2im", b.op("mul", columns, b.input("y", shape, torch.randn(shape))), output_size=list(image),
                  **attrs)
    run_group(b, [b.op("neg", folded)], GroupKind.POINTWISE)


# ---- planned and compiled: one kernel each, nothing through PyTorch ------------------------------------------

class Windows(nn.Module):
    """An activation, sliding windows of it that read each element at most once, and an op after them."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def forward(self, x):
        if self.op == "unfold":
            return torch.relu(x).unfold(3, 2, 3) * 2.0                               # gaps between windows
        if self.op == "im2col":
            return F.unfold(torch.sigmoid(x), (2, 3), stride=(2, 3)) + 1.0           # disjoint blocks
        return F.fold(torch.relu(x), (7, 5), (3, 2), padding=1, stride=(2, 1)) * 3.0    # overlapping sums


INPUTS = {"unfold": (2, 3, 5, 7), "im2col": (1, 2, 5, 7), "col2im": (2, 2 * 6, 4 * 6)}


@pytest.mark.parametrize("op", ["unfold", "im2col", "col2im"])
def test_the_window_and_the_ops_around_it_are_one_kernel(op):
    model, x = Windows(op).eval(), torch.randn(INPUTS[op])
    plan = plan_of(model, x)
    assert groups_through_pytorch(plan) == {}
    (group,) = [g for g in plan.groups if g.launches]
    assert op in {plan.graph[n].op for n in group.nodes} and len(group.nodes) == 3
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


class OverlappingWindows(nn.Module):
    """Overlapping windows of an activation: it would be recomputed for every window reading it."""

    def forward(self, x):
        return F.unfold(torch.tanh(x), 3, padding=1).exp()


def test_an_activation_read_by_overlapping_windows_is_computed_once_in_a_kernel_of_its_own():
    model, x = OverlappingWindows().eval(), torch.randn(1, 2, 5, 6)
    plan = plan_of(model, x)
    assert groups_through_pytorch(plan) == {}
    ops = sorted(sorted(plan.graph[n].op for n in g.nodes) for g in plan.groups if g.launches)
    assert ops == [["exp", "im2col"], ["tanh"]]
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)


class HaloWindows(nn.Module):
    """timm's HaloAttention key/values: a conv, padded by the halo, unfolded into overlapping windows along H and
    W, regrouped per block and read by a product with the queries."""

    def __init__(self, block: int = 2, halo: int = 1):
        super().__init__()
        self.block, self.halo = block, halo
        self.kv = nn.Conv2d(3, 4, 1, bias=False)

    def forward(self, x, q):
        window = self.block + 2 * self.halo
        kv = F.pad(self.kv(x), [self.halo] * 4)
        kv = kv.unfold(2, window, self.block).unfold(3, window, self.block).reshape(1, 4, 6, -1).permute(0, 2, 3, 1)
        return q @ kv.transpose(-1, -2)


def test_halo_windows_are_one_kernel_with_their_pad():
    model, x, q = HaloWindows().eval(), torch.randn(1, 3, 4, 6), torch.randn(1, 6, 4, 4)
    plan = plan_of(model, x, q)
    assert groups_through_pytorch(plan) == {}
    windows = plan.group_of(next(n.name for n in plan.graph if n.op == "unfold"))
    assert [plan.graph[n].op for n in windows.nodes if plan.graph[n].op != "reshape"] == ["pad", "unfold", "unfold"]
    compiled = opfuse.compile(model, (x, q), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, q), model(x, q), rtol=1e-5, atol=1e-5)


class Outlook(nn.Module):
    """VOLO's outlook attention, small: values unfolded into 3x3 windows (im2col), weighted per window, and
    folded back (col2im, the overlapping windows summed)."""

    def __init__(self, dim: int = 4, kernel: int = 3):
        super().__init__()
        self.kernel = kernel
        self.v = nn.Linear(dim, dim, bias=False)
        self.attn = nn.Linear(dim, kernel ** 4)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, h, w, c = x.shape
        k2 = self.kernel ** 2
        v = self.v(x).permute(0, 3, 1, 2)
        v = F.unfold(v, self.kernel, padding=1).reshape(b, 1, c, k2, h * w).permute(0, 1, 4, 3, 2)
        attn = self.attn(x).reshape(b, h * w, 1, k2, k2).permute(0, 2, 1, 3, 4).softmax(dim=-1)
        y = (attn @ v).permute(0, 1, 4, 3, 2).reshape(b, c * k2, h * w)
        y = F.fold(y, (h, w), self.kernel, padding=1)
        return self.proj(y.permute(0, 2, 3, 1))


def test_outlook_attention_runs_nothing_through_pytorch():
    model, x = Outlook().eval(), torch.randn(1, 3, 5, 4)
    plan = plan_of(model, x)
    assert groups_through_pytorch(plan) == {}
    assert {"im2col", "col2im"} <= {n.op for n in plan.graph}
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
