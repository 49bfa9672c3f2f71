"""group_norm as the layer norm of x viewed [N, G, C/G, prod(S)] over its last two dims with the affine as its
epilogue there (`opfuse.frontend.aten_ops._group_norm`): the row reduction kernel on Triton's interpreter, reading
a channels-last input through the view, NaN-poisoned outputs against the float32 reference; and captured from
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
