"""sink_reshapes: a reshape moves below the elementwise ops that read it, so they meet their producer."""

from __future__ import annotations

import torch

from opfuse.fusion.planner import plan_fusion
from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import remove_noop_layout, sink_reshapes
from tests.unit.test_passes import assert_same_numerics, const, op, rand, run_pass

TOKENS, FEATURES = 6, 4


def _gemm_then_view(*ops) -> Graph:
    """x[6,8] -> linear -> reshape [2,3,4] -> each of `ops` (name, op, other operand or None) in turn."""
    graph = Graph("gemm")
    x = graph.add_input("x", TensorType((TOKENS, 8), "float64")).name
    h = op(graph, "fc", "linear", [x, const(graph, "w", rand(FEATURES, 8))])
    h = op(graph, "view", "reshape", [h], shape=(2, 3, FEATURES))
    for name, kind, other in ops:
        h = op(graph, name, kind, [h] + ([other(graph)] if other else []))
    graph.outputs = [op(graph, "out", "layer_norm", [h], normalized_shape=(FEATURES,), eps=1e-5)]
    return graph


def _residual(graph: Graph) -> str:
    return graph.add_input("residual", TensorType((2, 3, FEATURES), "float64")).name


def test_a_reshape_sinks_through_an_elementwise_chain_to_the_next_reduction():
    before = _gemm_then_view(("act", "tanh", None),
                             ("scaled", "mul", lambda g: const(g, "two", torch.tensor(2.0, dtype=torch.float64))),
                             ("biased", "add", lambda g: const(g, "bias", rand(FEATURES))),
                             ("res", "add", _residual),
                             ("dropout", "identity", None))
    after, changes = run_pass(sink_reshapes, before)
    assert len(changes) == 5 and changes[0] == "moved reshape view below tanh act"
    for name in ("act", "scaled", "biased", "res", "dropout"):
        assert after[name].type.shape == (TOKENS, FEATURES), name
    assert after["out"].type.shape == (2, 3, FEATURES) and after[after["out"].inputs[0]].op == "reshape"
    assert after[after["res"].inputs[1]].op == "reshape"          # the residual input, brought to [6, 4]
    assert_same_numerics(before, after)
    tidy, _ = run_pass(remove_noop_layout, after)
    plan = plan_fusion(tidy)
    (gemm,) = [g for g in plan.groups if "fc" in g.nodes]
    assert {"act", "scaled", "biased"} <= set(gemm.nodes)            # now the GEMM's epilogue
    assert len(plan.group_of("res").nodes) > 1                         # the residual add fused too


def test_a_broadcast_operand_that_needs_the_reshaped_dims_stops_the_sink():
    """[1, 3, 1] broadcasts along the seq dim, which [6, 4] does not have."""
    before = _gemm_then_view(("scaled", "mul", lambda g: const(g, "per_position", rand(1, 3, 1))))
    after, changes = run_pass(sink_reshapes, before)
    assert changes == [] and after["scaled"].type.shape == (2, 3, FEATURES)


def test_leading_ones_of_a_broadcast_operand_are_dropped():
    before = _gemm_then_view(("biased", "add", lambda g: const(g, "bias", rand(1, 1, FEATURES))))
    after, changes = run_pass(sink_reshapes, before)
    assert changes == ["moved reshape view below add biased"]
    bias = after["biased"].inputs[1]
    assert after.is_constant(bias) and after[bias].type.shape == (FEATURES,)
    assert_same_numerics(before, after)


def test_a_graph_output_and_a_shared_reshape_keep_their_shapes():
    before = _gemm_then_view(("act", "tanh", None))
    before.outputs = ["act", "view"]                    # the reshape is read by an output too
    after, changes = run_pass(sink_reshapes, before)
    assert changes == [] and after["act"].type.shape == (2, 3, FEATURES)


def test_two_reshaped_operands_meet_without_going_back_up():
    graph = Graph("two")
    a = graph.add_input("a", TensorType((TOKENS, FEATURES), "float64")).name
    b = graph.add_input("b", TensorType((TOKENS, FEATURES), "float64")).name
    va = op(graph, "va", "reshape", [op(graph, "ta", "tanh", [a])], shape=(2, 3, FEATURES))
    vb = op(graph, "vb", "reshape", [op(graph, "tb", "exp", [b])], shape=(2, 3, FEATURES))
    graph.outputs = [op(graph, "norm", "layer_norm", [op(graph, "sum", "add", [va, vb])], normalized_shape=(FEATURES,),
                        eps=1e-5)]
    after, changes = run_pass(sink_reshapes, graph)
    assert changes == ["moved reshape va below add sum"]
    tidy, _ = run_pass(remove_noop_layout, after)
    assert tidy["sum"].inputs == ["ta", "tb"]                    # vb and its adapter merged away
    assert_same_numerics(graph, tidy)


def test_a_reshape_does_not_sink_where_it_would_cut_an_anchor_from_its_epilogue():
    """Swin: sum = add(reshape(earlier sum), linear(..)); sinking would put a reshape after the linear."""
    graph = Graph("swin")
    x = graph.add_input("x", TensorType((2, 3, FEATURES), "float64")).name
    tokens = graph.add_input("tokens", TensorType((2, 3, 8), "float64")).name
    earlier = op(graph, "earlier", "tanh", [x])
    flat = op(graph, "flat", "reshape", [earlier], shape=(TOKENS, FEATURES))
    projected = op(graph, "proj", "linear", [op(graph, "rows", "reshape", [tokens], shape=(TOKENS, 8)),
                                             const(graph, "w", rand(FEATURES, 8))])
    graph.outputs = [op(graph, "norm", "layer_norm", [op(graph, "sum", "add", [flat, projected])],
                        normalized_shape=(FEATURES,), eps=1e-5)]
    after, changes = run_pass(sink_reshapes, graph)
    assert changes == [] and after["sum"].inputs == ["flat", "proj"]
