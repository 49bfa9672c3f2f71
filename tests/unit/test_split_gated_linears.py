"""`split_gated_linears`: a linear whose two halves make act(gate) * up (Phi-3's gate_up_proj, EVA-02's SwiGLU) is
split in the two linears of a gated pair, which one GEMM computes with the product in its tile, biases included;
values unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.interpret import interpret
from opfuse.passes.split_gated_linears import split_gated_linears


class GluMlp(nn.Module):
    """One projection to both halves, SiLU on the first, times the second, then the down projection."""

    def __init__(self, features: int = 8, hidden: int = 6, bias: bool = True):
        super().__init__()
        self.up = nn.Linear(features, 2 * hidden, bias=bias)
        self.down = nn.Linear(hidden, features)

    def forward(self, x):
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def test_the_linear_becomes_two_and_values_are_unchanged():
    model, x = GluMlp().double().eval(), torch.randn(2, 3, 8, dtype=torch.float64)
    graph = capture_torch(model, (x,))
    split, changes = split_gated_linears(graph)
    assert len(changes) == 1
    linears = [node for node in split if node.op == "linear"]
    assert len(linears) == 3 and not [node for node in split if node.op == "slice"]
    assert all(split[node.inputs[1]].type.shape == (6, 8) for node in linears[:2])
    (got,), want = interpret(split, [x]), model(x).detach()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


class HalvesElsewhere(nn.Module):
    """The halves multiplied, but the linear's whole result also read: nothing to split."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)

    def forward(self, x):
        y = self.up(x)
        gate, up = y.chunk(2, dim=-1)
        return torch.relu(gate) * up, y.sum()


def test_a_linear_read_by_more_than_its_halves_stays_whole():
    graph = capture_torch(HalvesElsewhere().eval(), (torch.randn(2, 4),))
    split, changes = split_gated_linears(graph)
    assert changes == [] and [node.op for node in split] == [node.op for node in graph]


@pytest.mark.parametrize("bias", [True, False])
def test_the_glu_is_one_gated_gemm_and_matches_eager(bias):
    """Before the pass: the projection, then SiLU and the product in a kernel of their own."""
    torch.manual_seed(0)
    model, x = GluMlp(bias=bias).eval(), torch.randn(2, 3, 8)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    kernels = [group for group in analysis.plan.groups if group.kind is not GroupKind.VIEW]
    ops = [[analysis.prepared[n].op for n in group.nodes] for group in kernels]
    assert ["linear", "silu", "linear", "mul"] in ops and len(kernels) == 2
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 3, 8)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


class Siblings(nn.Module):
    """A gated pair written as two linears, a bias on the gate alone."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = nn.Linear(8, 6), nn.Linear(8, 6, bias=False)

    def forward(self, x):
        return nn.functional.gelu(self.gate(x)) * self.up(x)


def test_a_bias_on_one_half_is_added_to_that_half_alone():
    torch.manual_seed(0)
    model, x = Siblings().eval(), torch.randn(5, 8)
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    assert [group.kind for group in compiled.plan.groups if group.kind is not GroupKind.VIEW] == [GroupKind.HORIZONTAL]
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
