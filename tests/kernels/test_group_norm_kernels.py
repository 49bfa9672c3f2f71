"""group_norm as the layer norm of x viewed [N, G, C/G, prod(S)] over its last two dims with the affine as its
epilogue there (`opfuse.frontend.aten_reductions._group_norm`): the row reduction kernel on Triton's interpreter,
reading a channels-last input through the view, NaN-poisoned outputs against the float32 reference; and captured from
PyTorch (nn.GroupNorm, F.group_norm, poolformer's one group) exactly, with nothing through PyTorch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opfuse.codegen.lower import groups_through_pytorch
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.planner import plan_fusion
from opfuse.ir.interpret import interpret
from opfuse.passes import prepare_graph
from tests.kernels.test_reduction_kernels import SMALL_CHUNKS, Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
@pytest.mark.parametrize("channels,groups", [(6, 3), (6, 1), (10, 5)])
def test_group_norm_with_its_affine_as_the_epilogue(channels, groups, config):
    b = Builder()
    x = b.input("x", (2, channels, 5, 3))                  # channels-last, 15 pixels
    grouped = b.op("reshape", x, shape=[2, groups, channels // groups, 15])
    y = b.op("layer_norm", grouped, normalized_shape=[channels // groups, 15], eps=1e-5)
    y = b.op("mul", y, b.const("weight", b.random(groups, channels // groups, 1)))
    y = b.op("add", y, b.const("bias", b.random(groups, channels // groups, 1)))
    run_group(b, [y], config)


class GroupNorms(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(4, 8)
        self.one = nn.GroupNorm(1, 8)          # poolformer's: a layer norm over C, H, W
        with torch.no_grad():
            for norm in (self.norm, self.one):
                norm.weight.normal_()
                norm.bias.normal_()

    def forward(self, x, sequence):
        return (torch.relu(self.norm(x)) + self.one(x)).sum() + F.group_norm(sequence, 2, eps=1e-3).sum()


def test_captured_group_norms_match_eager_and_run_nothing_through_pytorch():
    model, x, sequence = GroupNorms().eval(), torch.randn(2, 8, 5, 3) * 3 + 1, torch.randn(2, 6, 11)
    graph = capture_torch(model, (x, sequence))
    assert not [n for n in graph if n.op == "opaque" and "group_norm" in n.attrs["target"]]
    torch.testing.assert_close(interpret(graph, [x, sequence])[0], model(x, sequence), rtol=1e-5, atol=1e-4)
    prepared, _ = prepare_graph(graph, "float32")
    assert groups_through_pytorch(plan_fusion(prepared, FusionConfig(dtype="float32"))) == {}


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
def test_the_view_back_and_the_ops_after_it_join_the_norm_kernel(config):
    """group_norm viewed back to [N, C, H, W], then a per-channel bias, a residual and a ReLU: one kernel, the ops
    after the reshape at the coordinates the reduction's map to (row-major order)."""
    b = Builder()
    x = b.input("x", (2, 6, 5, 3))
    skip = b.input("skip", (2, 6, 5, 3))
    grouped = b.op("reshape", x, shape=[2, 3, 2, 15])
    y = b.op("layer_norm", grouped, normalized_shape=[2, 15], eps=1e-5)
    y = b.op("mul", y, b.const("weight", b.random(3, 2, 1)))
    image = b.op("reshape", y, shape=[2, 6, 5, 3])
    out = b.op("relu", b.op("add", b.op("add", image, b.const("bias", b.random(6, 1, 1))), skip))
    run_group(b, [out], config)


class NormThenActivation(nn.Module):
    """ResNetV2 (BiT) and poolformer: a group norm, then what the model computes on its [N, C, H, W] result."""

    def __init__(self):
        super().__init__()
        self.norm = nn.GroupNorm(2, 8)

    def forward(self, x):
        return torch.relu(self.norm(x) * 2.0 + 1.0)


def test_a_group_norm_and_the_activation_after_it_are_one_kernel():
    x = torch.randn(1, 8, 6, 5)
    prepared, _ = prepare_graph(capture_torch(NormThenActivation().eval(), (x,)), "float32")
    plan = plan_fusion(prepared, FusionConfig(dtype="float32"))
    assert groups_through_pytorch(plan) == {} and plan.kernel_launches == 1


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_group_norm_walks_and_writes_its_image_as_it_lies_in_memory(channels_last):
    """A group norm of a channels-last image walks each group's pixels outermost and channels innermost (ORDER: the
    input's strides), and writes its [N, C, H, W] view back channels-last, so that reads and writes move along
    memory; a row-major image keeps the row-major walk and output. Either way it equals the reference."""
    b = Builder()
    x, skip = b.input("x", (2, 6, 5, 3)), b.input("skip", (2, 6, 5, 3))
    if not channels_last:
        b.feeds["x"], b.feeds["skip"] = b.feeds["x"].contiguous(), b.feeds["skip"].contiguous()
    grouped = b.op("reshape", b.op("add", x, skip), shape=[2, 3, 2, 15])
    y = b.op("layer_norm", grouped, normalized_shape=[2, 15], eps=1e-5)
    image = b.op("reshape", b.op("mul", y, b.const("weight", b.random(3, 2, 1))), shape=[2, 6, 5, 3])
    out = b.op("relu", b.op("add", image, b.const("bias", b.random(6, 1, 1))))
    kernel, (result,) = run_group(b, [out], SMALL_CHUNKS)
    assert (kernel.order(kernel.bind([b.feeds[n] for n in kernel.runtime_inputs])) != 0) == channels_last
    assert result.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
