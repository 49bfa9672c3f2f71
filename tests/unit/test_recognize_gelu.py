"""recognize_gelu: 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))) written out becomes one tanh gelu."""

from __future__ import annotations

import math

import pytest
import torch

import opfuse
from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import recognize_gelu
from tests.unit.test_passes import assert_same_numerics, const, op, run_pass

F64 = torch.float64


def _written_out(half_last: bool = False, swap: bool = False, cube: float = 0.044715, exponent: float = 3.0,
                 extra_reader: bool = False) -> Graph:
    """GPT-2's gelu_new over x, in float64; `half_last` multiplies by 0.5 at the end, `swap` puts every constant
    first."""
    graph = Graph("gelu")
    x = graph.add_input("x", TensorType((2, 3, 8), "float64")).name

    def times(name, value, constant):
        c = const(graph, f"{name}_c", torch.tensor(constant, dtype=F64))
        return op(graph, name, "mul", [c, value] if swap else [value, c])

    cubed = op(graph, "cubed", "pow", [x, const(graph, "three", torch.tensor(exponent, dtype=F64))])
    inner = op(graph, "inner", "add", [x, times("scaled", cubed, cube)])
    t = op(graph, "t", "tanh", [times("arg", inner, math.sqrt(2 / math.pi))])
    one = const(graph, "one", torch.tensor(1.0, dtype=F64))
    onep = op(graph, "onep", "add", [one, t] if swap else [t, one])
    if half_last:
        y = times("y", op(graph, "xy", "mul", [x, onep]), 0.5)
    else:
        y = op(graph, "y", "mul", [times("half", x, 0.5), onep])
    graph.outputs = [op(graph, "out", "relu", [y])] + (["t"] if extra_reader else [])
    return graph


@pytest.mark.parametrize("half_last, swap", [(False, False), (True, False), (False, True), (True, True)])
def test_a_written_out_tanh_gelu_is_one_node(half_last, swap):
    before = _written_out(half_last, swap)
    after, changes = run_pass(recognize_gelu, before)
    assert [(n.op, n.inputs, n.attrs) for n in after if n.op not in ("input", "constant", "relu")] == \
        [("gelu", ["x"], {"approximate": "tanh"})]
    assert len(changes) == 1 and "tanh GELU" in changes[0]
    assert_same_numerics(before, after)


@pytest.mark.parametrize("variant", [dict(cube=0.05), dict(exponent=2.0), dict(extra_reader=True)])
def test_near_misses_stay_as_they_are(variant):
    before = _written_out(**variant)
    after, changes = run_pass(recognize_gelu, before)
    assert changes == [] and not any(n.op == "gelu" for n in after)


def test_gpt2_mlp_gelu_becomes_a_linear_epilogue():
    """Each of GPT-2's two blocks: its c_fc linear followed by one tanh gelu, planned as that linear's epilogue."""
    pytest.importorskip("transformers")
    from opfuse.bench.zoo import build_seeded, token_inputs
    from opfuse.bench.zoo_models import build_text_model
    from tests.unit.test_zoo import TINY_TEXT_CONFIGS

    model = build_seeded(lambda: build_text_model("gpt2", **TINY_TEXT_CONFIGS["gpt2"]))
    analysis = opfuse.analyze(model, token_inputs(2, 12, model.config.vocab_size), opfuse.FusionConfig(dtype="float32"))
    gelus = [n for n in analysis.prepared if n.op == "gelu"]
    assert len(gelus) == 2 and all(n.attrs["approximate"] == "tanh" for n in gelus)
    assert not any(n.op in ("tanh", "pow") for n in analysis.prepared)
    for gelu in gelus:
        (source,) = gelu.inputs
        assert analysis.prepared[source].op == "linear"
        group = analysis.plan.group_of(gelu.name)
        assert source in group.nodes and group.name not in analysis.pytorch_groups
