"""recognize_rms_norm: x * rsqrt(mean(x^2, -1) + eps) [* w] written out becomes one rms_norm node."""

from __future__ import annotations

import pytest
import torch

import opfuse
from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import recognize_rms_norm
from tests.unit.test_passes import assert_same_numerics, const, op, rand, run_pass

F64 = torch.float64


def _written_out(square: str = "pow", weight_shape: tuple | None = (8,), scale_first: bool = False,
                 eps_value: float = 1e-6, dims=(2,), keepdim: bool = True, extra_reader: bool = False) -> Graph:
    graph = Graph("rms")
    x = graph.add_input("x", TensorType((2, 3, 8), "float64")).name
    if square == "pow":
        sq = op(graph, "sq", "pow", [x, const(graph, "two", torch.tensor(2.0, dtype=F64))])
    else:
        sq = op(graph, "sq", "mul", [x, x])
    var = op(graph, "var", "mean", [sq], dims=list(dims), keepdim=keepdim)
    shifted = op(graph, "shifted", "add", [var, const(graph, "eps", torch.tensor(eps_value, dtype=F64))])
    inv = op(graph, "inv", "rsqrt", [shifted])
    y = op(graph, "y", "mul", [inv, x] if scale_first else [x, inv])
    if weight_shape is not None:
        y = op(graph, "scaled", "mul", [const(graph, "w", rand(*weight_shape)), y])
    graph.outputs = [op(graph, "out", "tanh", [y])] + (["var"] if extra_reader else [])
    return graph


@pytest.mark.parametrize("square, weight_shape, scale_first", [("pow", (8,), False), ("mul", (1, 1, 8), True),
                                                                ("pow", None, False)])
def test_a_written_out_rms_norm_is_one_node(square, weight_shape, scale_first):
    before = _written_out(square, weight_shape, scale_first)
    after, changes = run_pass(recognize_rms_norm, before)
    (norm,) = [n for n in after if n.op == "rms_norm"]
    assert norm.attrs == {"eps": pytest.approx(1e-6)} and norm.inputs[0] == "x"
    assert len(norm.inputs) == (1 if weight_shape is None else 2)
    if weight_shape is not None:
        assert after[norm.inputs[1]].type.shape == (8,)
    assert [n.op for n in after if n.op not in ("input", "constant")] == ["rms_norm", "tanh"]
    assert len(changes) == 1
    assert_same_numerics(before, after)


@pytest.mark.parametrize("variant", [dict(dims=(1,)), dict(keepdim=False, dims=(2,)), dict(extra_reader=True),
                                     dict(weight_shape=(3, 8))])
def test_near_misses_stay_as_they_are(variant):
    if not variant.get("keepdim", True):        # mean without keepdim: the multiply would not broadcast back
        graph = Graph("rms")
        x = graph.add_input("x", TensorType((2, 3, 8), "float64")).name
        var = op(graph, "var", "mean", [op(graph, "sq", "mul", [x, x])], dims=[2], keepdim=False)
        inv = op(graph, "inv", "rsqrt", [op(graph, "shifted", "add", [var, const(graph, "eps", torch.tensor(1e-6, dtype=F64))])])
        graph.outputs = [op(graph, "y", "mul", [op(graph, "wide", "reshape", [inv], shape=(2, 3, 1)), x])]
        before = graph
    else:
        before = _written_out(**variant)
    after, changes = run_pass(recognize_rms_norm, before)
    if variant.get("weight_shape") == (3, 8):      # a weight over two dims: the norm is found, the weight stays
        assert len(changes) == 1 and after["scaled"].op == "mul"
        assert_same_numerics(before, after)
    else:
        assert changes == [] and not any(n.op == "rms_norm" for n in after)


def test_t5_layer_norms_become_rms_norm_kernels():
    pytest.importorskip("transformers")
    from opfuse.bench.zoo import build_seeded, token_inputs
    from opfuse.bench.zoo_models import build_text_model
    from tests.unit.test_zoo import TINY_TEXT_CONFIGS

    model = build_seeded(lambda: build_text_model("t5_encoder", **TINY_TEXT_CONFIGS["t5_encoder"]))
    analysis = opfuse.analyze(model, token_inputs(2, 12, model.config.vocab_size), opfuse.FusionConfig(dtype="float32"))
    norms = [n for n in analysis.prepared if n.op == "rms_norm"]
    assert len(norms) == 5                          # two blocks of two sublayers, and the final norm
    assert not any(n.op == "rsqrt" for n in analysis.prepared)
    for norm in norms:
        group = analysis.plan.group_of(norm.name)
        assert group.kind.value in ("single", "reduction") and group.name not in analysis.pytorch_groups


def test_the_rms_norm_reference_computes_in_float32():
    """x^2 of a float16 300 overflows; the models that write the norm out upcast first, and so does rms_norm."""
    from opfuse.ir.ops import get_op

    x = torch.full((2, 8), 300.0, dtype=torch.float16)
    out = get_op("rms_norm").run([x, torch.full((8,), 2.0, dtype=torch.float16)], {"eps": 1e-6})
    assert out.dtype == torch.float16 and torch.equal(out, torch.full((2, 8), 2.0, dtype=torch.float16))
