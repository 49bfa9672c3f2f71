"""1-D convolutions (whisper's and wav2vec2's feature encoders, mamba's causal conv) as 2-D convolutions of
[N, C, 1, L] through the conv templates, on Triton's interpreter; and captured from PyTorch with nothing through
it. Outputs are NaN-poisoned and compared with the float32 reference."""

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
from tests.kernels.test_conv_kernels import Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


@pytest.mark.parametrize("cin,cout,kernel,stride,padding,dilation,groups", [
    (3, 5, 3, 1, 1, 1, 1), (4, 6, 5, 2, 0, 1, 2), (6, 6, 4, 1, 3, 1, 6), (2, 3, 3, 1, 2, 2, 1)])
def test_a_1d_convolution_as_a_2d_one_with_its_gelu(cin, cout, kernel, stride, padding, dilation, groups):
    b = Builder()
    x = b.input("x", (2, cin, 1, 23), b.random(2, cin, 1, 23))
    w = b.const("w", b.random(cout, cin // groups, 1, kernel) * 0.4)
    y = b.op("conv2d", x, w, b.const("bias", b.random(cout)), stride=(1, stride), padding=(0, padding),
             dilation=(1, dilation), groups=groups)
    run_group(b, [b.op("gelu", y, approximate="none")])


class Conv1dStack(nn.Module):
    """A feature encoder's strided conv + GELU, a 'same' depthwise conv, and mamba's causal conv (padded both
    sides, then its first L outputs kept)."""

    def __init__(self):
        super().__init__()
        self.strided = nn.Conv1d(3, 8, 5, stride=2)
        self.same = nn.Conv1d(8, 8, 3, padding="same", groups=8, bias=False)
        self.causal = nn.Conv1d(8, 8, 4, padding=3, groups=8)

    def forward(self, x):
        y = F.gelu(self.strided(x))
        y = self.same(y) + y
        return F.silu(self.causal(y)[..., :y.shape[-1]])


def test_captured_1d_convolutions_match_eager_and_run_nothing_through_pytorch():
    model, x = Conv1dStack().eval(), torch.randn(2, 3, 41)
    graph = capture_torch(model, (x,))
    assert not [n for n in graph if n.op == "opaque"]
    assert sum(n.op == "conv2d" for n in graph) == 3
    torch.testing.assert_close(interpret(graph, [x])[0], model(x), rtol=1e-5, atol=1e-5)
    prepared, _ = prepare_graph(graph, "float32")
    assert all(prepared.is_constant(n.inputs[1]) for n in prepared if n.op == "conv2d")   # weights folded
    assert groups_through_pytorch(plan_fusion(prepared, FusionConfig(dtype="float32"))) == {}
