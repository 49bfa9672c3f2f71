"""Templates say what they take (`supports`, `opfuse.codegen.lower.template_refusal`): a reason of its own code,
nothing generated, asked by the planner before each merge."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.codegen import base, epilogue, lower
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.reasons import Code
from opfuse.numerics import relative_error


class ConvOfInput(nn.Module):
    """A convolution whose weight is an input (ONNX's Conv with its weight as an input looks so)."""

    def forward(self, x, w):
        return torch.relu(F.conv2d(x, w, padding=1)) * 2


class IntegerMax(nn.Module):
    def forward(self, x):
        return torch.amax(x, -1) * 3 + 1


def _analysis(model, inputs):
    return opfuse.analyze(model, inputs, config=FusionConfig(dtype="float32"))


@pytest.mark.parametrize("model, inputs, code", [
    (ConvOfInput().eval(), (torch.randn(1, 4, 6, 6), torch.randn(8, 4, 3, 3)), Code.NOT_CONSTANT),
    (IntegerMax().eval(), (torch.randint(0, 100, (4, 16)),), Code.OPERAND_DTYPE)])
def test_a_merge_the_template_refuses_is_refused_and_the_rest_gets_a_kernel(model, inputs, code):
    """The anchor or reduction the template cannot compute runs through PyTorch under the template's own code; the
    elementwise ops after it, which a merged group would have taken through PyTorch with it, are a kernel."""
    analysis = _analysis(model, inputs)
    refused, after = analysis.plan.groups
    assert len(refused.nodes) == 1 and refused.code is code and after.kind is GroupKind.POINTWISE
    assert set(analysis.pytorch_groups) == {refused.name}
    assert analysis.pytorch_groups[refused.name].code is code
    merges = [d for d in analysis.plan.decisions if d.producer == refused.nodes]
    assert merges and all(d.code is code for d in merges)
    compiled = opfuse.compile(model, inputs, FusionConfig(dtype="float32"))
    with torch.no_grad():
        assert relative_error(compiled(*inputs).double(), model(*inputs).double()) < 1e-6


def test_supports_generates_no_source(monkeypatch):
    """Asking every group of a plan (a conv, a linear with its epilogue, attention, a layer norm, elementwise ops)
    writes and loads no kernel module."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm, self.linear = nn.Conv2d(3, 8, 3, padding=1), nn.LayerNorm(8), nn.Linear(8, 8)

        def forward(self, x):
            t = self.conv(x).flatten(2).transpose(1, 2)               # [1, 16, 8]
            q = self.linear(self.norm(t)).unflatten(-1, (2, 4)).transpose(1, 2)
            return torch.sigmoid(F.scaled_dot_product_attention(q, q, q)) + 1

    torch.manual_seed(0)
    plan = _analysis(Block().eval(), (torch.randn(1, 3, 4, 4),)).plan
    chosen = {lower.choose_lowering(plan.graph, g) for g in plan.groups}
    assert {"conv", "gemm", "attention", "reduction"} <= chosen

    def generating(*args, **kwargs):
        raise AssertionError("supports generated source")

    monkeypatch.setattr(base, "load_source", generating)
    monkeypatch.setattr(epilogue, "generate_kernel", generating)
    users = plan.graph.users()
    assert all(lower.template_refusal(plan.graph, g, users) is None for g in plan.groups)


def test_each_template_refuses_with_a_code_of_its_own():
    """A group handed to a template that cannot take it: the horizontal conv template, two convs of different
    inputs; the attention template, an sdpa whose q and k head dims differ; the reduction template, two reductions."""
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 4, 1), nn.Conv2d(3, 4, 1)

        def forward(self, x, y):
            return self.a(x) + self.b(y)

    graph = _analysis(Pair().eval(), (torch.randn(1, 3, 4, 4), torch.randn(1, 3, 4, 4))).plan.graph
    convs = [n.name for n in graph if n.op == "conv2d"]
    pair = FusionGroup(0, GroupKind.HORIZONTAL, convs, outputs=convs)
    assert lower.TEMPLATES["conv"].supports(graph, pair).code is Code.SEVERAL_ANCHORS

    class Norms(nn.Module):
        def forward(self, x):
            return torch.softmax(x, -1).sum(-1)

    graph = _analysis(Norms(), (torch.randn(2, 8),)).plan.graph
    nodes = [n.name for n in graph if n.op in ("softmax", "sum")]
    two = FusionGroup(0, GroupKind.REDUCTION, nodes, outputs=nodes[-1:])
    reason = lower.TEMPLATES["reduction"].supports(graph, two)
    assert reason.code is Code.EPILOGUE_FORM and "2 reductions" in reason.text
