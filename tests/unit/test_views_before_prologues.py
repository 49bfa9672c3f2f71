"""`views_before_prologues`: a transpose a linear reads moves before the elementwise ops that compute its input, so
they become the linear's prologue (ResMLP's token mixing); values unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.interpret import interpret
from opfuse.passes.views_before_prologues import views_before_prologues


class TokenMixing(nn.Module):
    """ResMLP's first half-block: an affine over the channels, a linear over the tokens, a layer scale, a residual."""

    def __init__(self, tokens: int = 6, channels: int = 4):
        super().__init__()
        self.alpha = nn.Parameter(torch.rand(1, 1, channels) + 0.5)
        self.beta = nn.Parameter(torch.randn(1, 1, channels))
        self.mix = nn.Linear(tokens, tokens)
        self.scale = nn.Parameter(torch.rand(channels) + 0.5)

    def forward(self, x):
        y = torch.addcmul(self.beta, self.alpha, x)
        return x + self.scale * self.mix(y.transpose(1, 2)).transpose(1, 2)


def test_the_transpose_moves_before_the_affine_and_values_are_unchanged():
    torch.manual_seed(0)
    model, x = TokenMixing().double().eval(), torch.randn(2, 6, 4, dtype=torch.float64)
    graph = capture_torch(model, (x,))
    moved, changes = views_before_prologues(graph)
    assert len(changes) == 2             # before the add, then before the mul
    linear = next(node for node in moved if node.op == "linear")
    assert moved[linear.inputs[0]].op == "add"
    (got,), want = interpret(moved, [x]), model(x).detach()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


def test_the_affine_is_the_token_linears_prologue_and_matches_eager():
    """Before the pass: the affine in a kernel of its own, then the linear with its residual."""
    torch.manual_seed(0)
    model, x = TokenMixing().eval(), torch.randn(2, 6, 4)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    kernels = [group for group in analysis.plan.groups if group.kind is not GroupKind.VIEW]
    assert len(kernels) == 1 and "linear" in [analysis.prepared[n].op for n in kernels[0].nodes]
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 6, 4)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


class SharedInput(nn.Module):
    def forward(self, x, w):
        y = torch.relu(x)
        return y.transpose(0, 1) @ w, y.sum()


def test_an_op_read_by_anything_but_the_permute_stays_where_it_is():
    graph = capture_torch(SharedInput(), (torch.randn(3, 4), torch.randn(3, 5)))
    moved, changes = views_before_prologues(graph)
    assert changes == [] and [node.op for node in moved] == [node.op for node in graph]
