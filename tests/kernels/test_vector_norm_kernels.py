"""Vector norms (linalg_vector_norm, torch.norm) as reductions with a prologue and an epilogue, addcmul / addcdiv,
and amax / amin (max and min along a dim) as row reductions, on Triton's interpreter; and ConvNeXt-V2's global
response norm and an L2 normalisation captured from PyTorch with nothing through it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.reduction import RowReductionKernel, lower_reduction_group
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.planner import plan_fusion
from opfuse.codegen.lower import groups_through_pytorch
from opfuse.ir.interpret import interpret
from opfuse.passes import prepare_graph
from tests.kernels.test_reduction_kernels import SMALL_CHUNKS, Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
@pytest.mark.parametrize("op", ["amax", "amin"])
@pytest.mark.parametrize("dims,keepdim", [([2], False), ([1, 2], True), ([0, 2], False)])
def test_amax_amin_over_dims_with_an_epilogue(op, dims, keepdim, config):
    b = Builder()
    x = b.input("x", (3, 5, 37), b.random(3, 5, 37) * 3)
    y = b.op("mul", b.op(op, b.op("abs", x), dims=dims, keepdim=keepdim), b.const("half", torch.tensor(0.5)))
    kernel, _ = run_group(b, [y], config)
    assert isinstance(kernel, RowReductionKernel)


def test_amax_is_nan_where_a_row_holds_nan_and_minus_inf_rows_stay():
    b = Builder()
    values = torch.randn(4, 19)
    values[1, 7] = float("nan")
    values[2] = float("-inf")
    x = b.input("x", (4, 19), values)
    y = b.op("amax", x, dims=[1], keepdim=False)
    kernel = lower_reduction_group(b.graph, b.group([y]), "cpu")
    kernel.output_fill = 123.0
    (got,) = kernel.run([values], KernelConfig.of(BLOCK_M=2, BLOCK_L=8, num_warps=1))
    torch.testing.assert_close(got, torch.amax(values, dim=1), equal_nan=True)


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("op", ["amax", "amin"])
def test_amax_amin_in_row_slices_keep_nan_and_infinite_rows(op, split):
    """Each slice's extreme (NaN where the slice holds one) goes to the workspace, the second launch takes the
    extreme of them, NaN if any is: a NaN in the row's last slice, a row of -inf, a row of +inf; at 4 slices of
    4-lane chunks a last slice wholly past the 19 lanes."""
    b = Builder()
    values = torch.randn(4, 19)
    values[1, 17] = float("nan")
    values[2], values[3] = float("-inf"), float("inf")
    y = b.op(op, b.input("x", (4, 19), values), dims=[1], keepdim=False)
    kernel = lower_reduction_group(b.graph, b.group([y]), "cpu")
    kernel.output_fill = 123.0
    config = KernelConfig.of(BLOCK_M=2, BLOCK_L=4, SPLIT=split, num_warps=1)
    (got,) = kernel.run([values], config)
    torch.testing.assert_close(got, getattr(torch, op)(values, dim=1), equal_nan=True)
    assert kernel.launches(config) == 2


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
def test_l2_norm_over_h_w_of_nhwc_in_float16_computed_in_float32(config):
    """ConvNeXt-V2's GRN statistic: cast -> square -> sum over (1, 2) keepdim -> sqrt -> cast; values near 300,
    whose float16 squares would overflow."""
    b = Builder("float16")
    x = b.input("x", (2, 5, 7, 6), 300 + b.random(2, 5, 7, 6))
    wide = b.op("cast", x, dtype="float32")
    norm = b.op("sqrt", b.op("sum", b.op("square", wide), dims=[1, 2], keepdim=True))
    y = b.op("cast", norm, dtype="float16")
    _, (got,) = run_group(b, [y], config)
    assert torch.isfinite(got).all()


class GlobalResponseNorm(nn.Module):
    """timm's GlobalResponseNormMlp's GRN on NHWC: norm over H, W, divided by its mean over the channels."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(channels) * 0.1)
        self.bias = nn.Parameter(torch.randn(channels) * 0.1)

    def forward(self, x):
        x_g = x.norm(p=2, dim=(1, 2), keepdim=True)
        x_n = x_g / (x_g.mean(dim=-1, keepdim=True) + 1e-6)
        return x + torch.addcmul(self.bias, self.weight, x * x_n)


class Normalised(nn.Module):
    def forward(self, x):
        ones = torch.linalg.vector_norm(x, ord=1, dim=-1, keepdim=True)
        top = torch.linalg.vector_norm(x, ord=float("inf"), dim=-1, keepdim=True)
        cube = torch.linalg.vector_norm(x, ord=3, dim=-1, keepdim=True)
        values, _ = x.max(dim=1)
        return F.normalize(x, dim=-1) * ones + torch.addcdiv(top, x, cube, value=0.5) + values.unsqueeze(1) \
            + x.amin(dim=-1, keepdim=True)


@pytest.mark.parametrize("model,shape", [(GlobalResponseNorm(6), (2, 5, 7, 6)), (Normalised(), (2, 9, 16))],
                         ids=["grn", "normalize"])
def test_captured_norms_match_eager_and_run_nothing_through_pytorch(model, shape):
    x = torch.randn(*shape)
    graph = capture_torch(model.eval(), (x,))
    assert not [n for n in graph if n.op == "opaque"]
    (got,) = interpret(graph, [x])
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    prepared, _ = prepare_graph(graph, "float32")
    plan = plan_fusion(prepared, FusionConfig(dtype="float32"))
    assert groups_through_pytorch(plan) == {}
