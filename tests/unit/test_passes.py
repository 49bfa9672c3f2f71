"""Graph passes, TVM style: build `before` by hand, run the pass, compare with a hand-built `expected` graph
structurally, and check that `before` and the result compute the same thing (float64, rel err < 1e-10)."""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn.utils.fusion import fuse_conv_bn_weights, fuse_linear_bn_weights

from opfuse.ir.graph import Graph, GraphError, TensorType
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import infer_type
from opfuse.ir.verify import verify
from opfuse.passes import (cast_precision, default_pipeline, eliminate_dead_code, fold_batchnorm, fold_constants,
                           prepare_graph, remove_noop_layout, run_passes)
from opfuse.passes.fold_constants import GROWTH_BYTES, SMALL_BYTES

F64 = torch.float64


@pytest.fixture(autouse=True)
def seeded():
    torch.manual_seed(0)


# ---- helpers -----------------------------------------------------------------------------------------

def rand(*shape, dtype=F64, positive=False):
    t = torch.randn(shape, dtype=dtype)
    return t.abs() + 0.5 if positive else t


def op(graph: Graph, name: str, kind: str, inputs: list[str], **attrs) -> str:
    """Add a node whose type is derived from its op (so hand-built graphs are always well typed)."""
    return graph.add_node(kind, inputs, infer_type(kind, [graph[i].type for i in inputs], attrs), attrs,
                          name=name).name


def const(graph: Graph, name: str, tensor: torch.Tensor) -> str:
    return graph.add_constant(name, tensor).name


def conv(graph: Graph, name: str, x: str, w: str, b: str | None = None, groups: int = 1) -> str:
    return op(graph, name, "conv2d", [x, w] + ([b] if b else []), stride=(1, 1), padding=(1, 1),
              dilation=(1, 1), groups=groups)


def batch_norm(graph: Graph, name: str, x: str, channels: int, dtype=F64) -> tuple[str, dict]:
    params = {"weight": rand(channels, dtype=dtype), "bias": rand(channels, dtype=dtype),
              "mean": rand(channels, dtype=dtype), "var": rand(channels, dtype=dtype, positive=True)}
    names = [const(graph, f"{name}_{k}", v) for k, v in params.items()]
    return op(graph, name, "batch_norm", [x, *names], eps=1e-5), params


def _canonical_order(graph: Graph) -> list[str]:
    """Inputs in signature order, then every node reachable from the outputs in depth-first post-order."""
    order = [n.name for n in graph.input_nodes]
    seen = set(order)

    def visit(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        for i in graph[name].inputs:
            visit(i)
        order.append(name)

    for o in graph.outputs:
        visit(o)
    return order


def assert_graphs_equal(actual: Graph, expected: Graph, constant_values: bool = True) -> None:
    """Equal up to node names: ops, attrs, types, wiring, outputs, no extra (dead) nodes, constant tensors."""
    message = f"\nactual:\n{actual.format()}\nexpected:\n{expected.format()}"
    a_order, e_order = _canonical_order(actual), _canonical_order(expected)
    assert len(actual) == len(a_order), "actual graph has unreachable nodes" + message
    assert len(a_order) == len(e_order), "node counts differ" + message
    a_index = {name: i for i, name in enumerate(a_order)}
    e_index = {name: i for i, name in enumerate(e_order)}
    for a_name, e_name in zip(a_order, e_order):
        a, e = actual[a_name], expected[e_name]
        where = f" at {a_name} / {e_name}" + message
        assert a.op == e.op, "ops differ" + where
        assert a.type == e.type, "types differ" + where
        assert [a_index[i] for i in a.inputs] == [e_index[i] for i in e.inputs], "wiring differs" + where
        assert {k: v for k, v in a.attrs.items() if not callable(v)} == \
            {k: v for k, v in e.attrs.items() if not callable(v)}, "attrs differ" + where
        if a.op == "constant" and constant_values:
            a_tensor, e_tensor = actual.constants[a_name], expected.constants[e_name]
            assert a_tensor.dtype == e_tensor.dtype, "constant dtypes differ" + where
            torch.testing.assert_close(a_tensor, e_tensor, rtol=1e-10, atol=1e-12, msg=lambda m: m + where)
    assert [a_index[o] for o in actual.outputs] == [e_index[o] for o in expected.outputs], "outputs differ" + message


def random_inputs(graph: Graph) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(n.type.shape, dtype=getattr(torch, n.type.dtype)) if n.type.is_float
            else torch.randint(0, 10, n.type.shape, dtype=getattr(torch, n.type.dtype))
            for n in graph.input_nodes]


def assert_same_numerics(before: Graph, after: Graph, tolerance: float = 1e-10) -> None:
    inputs = random_inputs(before)
    for want, got in zip(interpret(before, inputs), interpret(after, inputs), strict=True):
        assert got.shape == want.shape
        error = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert error < tolerance, f"relative error {error:.3g}"


def run_pass(graph_pass, graph: Graph) -> tuple[Graph, list[str]]:
    """Run a pass, checking it left its input graph and constant tensors untouched and returned a valid graph."""
    text = graph.format()
    attrs = {n.name: repr(n.attrs) for n in graph}
    tensors = {name: (t, t.clone()) for name, t in graph.constants.items()}
    result, changes = graph_pass(graph)
    assert result is not graph
    assert graph.format() == text and {n.name: repr(n.attrs) for n in graph} == attrs
    assert graph.constants.keys() == tensors.keys()
    for name, (tensor, copy) in tensors.items():
        assert graph.constants[name] is tensor and torch.equal(tensor, copy), f"constant {name} was changed"
    verify(result)
    return result, changes


# ---- fold_batchnorm ------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("c_in, c_out, groups", [(4, 6, 1), (4, 6, 2), (4, 4, 4)],
                         ids=["dense", "grouped", "depthwise"])
def test_fold_conv_batchnorm(with_bias, c_in, c_out, groups):
    w, b = rand(c_out, c_in // groups, 3, 3), (rand(c_out) if with_bias else None)
    before = Graph("before")
    x = before.add_input("x", TensorType((2, c_in, 5, 5), "float64")).name
    y = conv(before, "conv1", x, const(before, "w", w), const(before, "b", b) if with_bias else None, groups)
    y, bn = batch_norm(before, "bn1", y, c_out)
    before.outputs = [op(before, "relu", "relu", [y])]

    after, changes = run_pass(fold_batchnorm, before)

    w_folded, b_folded = fuse_conv_bn_weights(w, b, bn["mean"], bn["var"], 1e-5, bn["weight"], bn["bias"])
    expected = Graph("expected")
    x = expected.add_input("x", TensorType((2, c_in, 5, 5), "float64")).name
    y = conv(expected, "conv1", x, const(expected, "w", w_folded.detach()), const(expected, "b", b_folded.detach()),
             groups)
    expected.outputs = [op(expected, "relu", "relu", [y])]
    assert_graphs_equal(after, expected)
    assert changes == ["folded batch_norm bn1 into conv2d conv1"]
    assert_same_numerics(before, after)


def test_fold_linear_batchnorm1d():
    w, b = rand(6, 8), rand(6)
    before = Graph("before")
    x = before.add_input("x", TensorType((5, 8), "float64")).name
    y = op(before, "fc", "linear", [x, const(before, "w", w), const(before, "b", b)])
    y, bn = batch_norm(before, "bn", y, 6)
    before.outputs = [y]

    after, changes = run_pass(fold_batchnorm, before)

    w_folded, b_folded = fuse_linear_bn_weights(w, b, bn["mean"], bn["var"], 1e-5, bn["weight"], bn["bias"])
    expected = Graph("expected")
    x = expected.add_input("x", TensorType((5, 8), "float64")).name
    expected.outputs = [op(expected, "fc", "linear", [x, const(expected, "w", w_folded.detach()),
                                                      const(expected, "b", b_folded.detach())])]
    assert_graphs_equal(after, expected)
    assert changes == ["folded batch_norm bn into linear fc"]
    assert_same_numerics(before, after)


def test_fold_conv_batchnorm_mul_add_chain():
    w = rand(6, 4, 3, 3)
    m, a = rand(6, 1, 1), rand(1, 6, 1, 1)
    before = Graph("before")
    x = before.add_input("x", TensorType((2, 4, 5, 5), "float64")).name
    y = conv(before, "conv", x, const(before, "w", w))
    y, bn = batch_norm(before, "bn", y, 6)
    y = op(before, "scale", "mul", [y, const(before, "m", m)])
    y = op(before, "shift", "add", [const(before, "a", a), y])  # constant first: add commutes
    before.outputs = [op(before, "act", "silu", [y])]

    after, changes = run_pass(fold_batchnorm, before)

    w_bn, b_bn = fuse_conv_bn_weights(w, None, bn["mean"], bn["var"], 1e-5, bn["weight"], bn["bias"])
    w_folded = w_bn.detach() * m.reshape(6, 1, 1, 1)
    b_folded = b_bn.detach() * m.reshape(6) + a.reshape(6)
    expected = Graph("expected")
    x = expected.add_input("x", TensorType((2, 4, 5, 5), "float64")).name
    y = conv(expected, "conv", x, const(expected, "w", w_folded), const(expected, "b", b_folded))
    expected.outputs = [op(expected, "act", "silu", [y])]
    assert_graphs_equal(after, expected)
    assert changes == ["folded batch_norm bn into conv2d conv", "folded mul scale into conv2d conv",
                       "folded add shift into conv2d conv"]
    assert_same_numerics(before, after)


@pytest.mark.parametrize("anchor, kind, shape, constant_first", [
    ("conv2d", "mul", (6, 1, 1), True), ("conv2d", "add", (), False), ("conv2d", "sub", (1, 6, 1, 1), False),
    ("conv2d", "div", (6, 1, 1), False), ("conv2d", "mul", (1,), False),
    ("linear", "mul", (6,), False), ("linear", "add", (1, 1, 6), True), ("linear", "div", (), False),
])
def test_fold_per_channel_scale_shift(anchor, kind, shape, constant_first):
    x_type = TensorType((2, 4, 5, 5) if anchor == "conv2d" else (2, 3, 4), "float64")
    w = rand(6, 4, 3, 3) if anchor == "conv2d" else rand(6, 4)
    c = rand(*shape, positive=True)

    def build(fold: bool) -> Graph:
        graph = Graph()
        x = graph.add_input("x", x_type).name
        weights = [const(graph, "w", w), const(graph, "b", rand(6))]
        y = conv(graph, "anchor", x, *weights) if anchor == "conv2d" else op(graph, "anchor", "linear", [x, *weights])
        if not fold:
            operands = [const(graph, "c", c), y] if constant_first else [y, const(graph, "c", c)]
            y = op(graph, "follower", kind, operands)
        graph.outputs = [op(graph, "out", "relu", [y])]
        return graph

    before = build(fold=False)
    after, changes = run_pass(fold_batchnorm, before)
    assert_graphs_equal(after, build(fold=True), constant_values=False)  # values: checked by the numerics
    assert changes == [f"folded {kind} follower into {anchor} anchor"]
    assert_same_numerics(before, after)


def _conv_then(follow) -> Graph:
    """x -> conv -> follow(graph, conv) ...; `follow` adds the rest and sets the outputs."""
    graph = Graph("before")
    x = graph.add_input("x", TensorType((2, 4, 5, 5), "float64")).name
    y = conv(graph, "conv", x, const(graph, "w", rand(6, 4, 3, 3)))
    follow(graph, y)
    return graph


def _two_users(g, y):
    bn, _ = batch_norm(g, "bn", y, 6)
    g.outputs = [op(g, "sum", "add", [bn, op(g, "relu", "relu", [y])])]


def _conv_is_output(g, y):
    g.outputs = [batch_norm(g, "bn", y, 6)[0], y]


def _stats_not_constant(g, y):
    mean = g.add_input("mean", TensorType((6,), "float64")).name
    params = [const(g, n, rand(6, positive=True)) for n in ("gamma", "beta", "var")]
    g.outputs = [op(g, "bn", "batch_norm", [y, params[0], params[1], mean, params[2]], eps=1e-5)]


def _spatial_constant(g, y):
    g.outputs = [op(g, "mul", "mul", [y, const(g, "c", rand(1, 1, 5, 5))])]


def _constant_minus_conv(g, y):
    g.outputs = [op(g, "sub", "sub", [const(g, "c", rand(6, 1, 1)), y])]


def _divide_by_zero(g, y):
    c = rand(6, 1, 1)
    c[2] = 0
    g.outputs = [op(g, "div", "div", [y, const(g, "c", c)])]


def _per_sample_constant(g, y):  # same output shape, but one value per (sample, channel)
    g.outputs = [op(g, "mul", "mul", [y, const(g, "c", rand(2, 6, 1, 1))])]


@pytest.mark.parametrize("follow", [_two_users, _conv_is_output, _stats_not_constant, _spatial_constant,
                                    _constant_minus_conv, _divide_by_zero, _per_sample_constant])
def test_fold_refuses(follow):
    before = _conv_then(follow)
    after, changes = run_pass(fold_batchnorm, before)
    assert changes == []
    assert_graphs_equal(after, before)


def test_fold_refuses_batchnorm_over_a_3d_linear():
    # bn1d on [B, C, L] normalises dim 1, but a linear's output channels are the last dim
    before = Graph("before")
    x = before.add_input("x", TensorType((2, 6, 4), "float64")).name
    y = op(before, "fc", "linear", [x, const(before, "w", rand(6, 4))])
    before.outputs = [batch_norm(before, "bn", y, 6)[0]]
    after, changes = run_pass(fold_batchnorm, before)
    assert changes == []
    assert_graphs_equal(after, before)


def test_fold_with_shared_weight_gives_the_folded_conv_its_own():
    w = rand(4, 4, 3, 3)
    before = Graph("before")
    x = before.add_input("x", TensorType((1, 4, 5, 5), "float64")).name
    shared = const(before, "w", w)
    plain = conv(before, "plain", x, shared)
    folded, _ = batch_norm(before, "bn", conv(before, "folded", plain, shared), 4)
    before.outputs = [folded]

    after, changes = run_pass(fold_batchnorm, before)
    assert changes == ["folded batch_norm bn into conv2d folded"]
    assert after["plain"].inputs[1] == "w" and after.constants["w"] is before.constants["w"]
    assert after["folded"].inputs[1] != "w"
    assert_same_numerics(before, after)


def test_fold_refuses_a_constant_that_widens_the_dtype():
    before = Graph("before")
    x = before.add_input("x", TensorType((2, 4, 5, 5), "float32")).name
    y = conv(before, "conv", x, const(before, "w", rand(6, 4, 3, 3, dtype=torch.float32)))
    before.outputs = [op(before, "mul", "mul", [y, const(before, "c", rand(6, 1, 1))])]  # float64: output widens
    after, changes = run_pass(fold_batchnorm, before)
    assert changes == []
    assert_graphs_equal(after, before)


def test_fold_keeps_float32_weight_dtype():
    before = Graph("before")
    x = before.add_input("x", TensorType((2, 4, 5, 5), "float32")).name
    y = conv(before, "conv", x, const(before, "w", rand(6, 4, 3, 3, dtype=torch.float32)))
    before.outputs = [batch_norm(before, "bn", y, 6, dtype=torch.float32)[0]]
    after, _ = run_pass(fold_batchnorm, before)
    weight, bias = (after.constants[i] for i in after["conv"].inputs[1:])
    assert weight.dtype == bias.dtype == torch.float32
    assert_same_numerics(before, after, tolerance=1e-5)



@pytest.mark.parametrize("follower", ["div_scalar", "batch_norm", "batch_norm_biased_conv"])
def test_fold_keeps_the_weights_device_when_other_constants_are_on_the_cpu(follower):
    """A model on the GPU has its weights there while the frontend's scalar constants (and a batch norm's
    missing affine) are made on the CPU: folding must compute on the weight's device (the H200 property run
    found `x / 2` after a linear crashing analyze). "meta" stands in for the GPU here."""
    graph = Graph("devices")
    x = graph.add_input("x", TensorType((2, 4, 5, 5), "float32")).name
    weight = const(graph, "w", rand(6, 4, 3, 3, dtype=torch.float32).to("meta"))
    bias = const(graph, "b", rand(6, dtype=torch.float32).to("meta")) if follower.endswith("biased_conv") else None
    y = conv(graph, "conv", x, weight, bias)
    if follower == "div_scalar":
        graph.outputs = [op(graph, "div", "div", [y, const(graph, "two", torch.tensor(2.0))])]
    else:
        params = [const(graph, "gamma", torch.ones(6)), const(graph, "beta", torch.zeros(6)),
                  const(graph, "mean", rand(6, dtype=torch.float32).to("meta")),
                  const(graph, "var", rand(6, dtype=torch.float32, positive=True).to("meta"))]
        graph.outputs = [op(graph, "bn", "batch_norm", [y, *params], eps=1e-5)]
    after, changes = fold_batchnorm(graph)     # not run_pass: torch.equal has no meta kernel
    assert len(changes) == 1
    assert [after.constants[i].device.type for i in after["conv"].inputs[1:]] == ["meta", "meta"]

# ---- eliminate_dead_code -------------------------------------------------------------------------------

def test_dce_removes_unused_branch_and_its_constants():
    before = Graph("before")
    x = before.add_input("x", TensorType((3, 4), "float64")).name
    unused_input = before.add_input("unused", TensorType((2,), "float64")).name
    kept = op(before, "relu", "relu", [x])
    dead = op(before, "dead_add", "add", [x, const(before, "dead_c", rand(3, 4))])
    op(before, "dead_sigmoid", "sigmoid", [dead])
    before.outputs = [kept, op(before, "scaled", "mul", [kept, const(before, "c", rand(4))])]

    after, changes = run_pass(eliminate_dead_code, before)

    expected = Graph("expected")
    x = expected.add_input("x", TensorType((3, 4), "float64")).name
    expected.add_input("unused", TensorType((2,), "float64"))
    kept = op(expected, "relu", "relu", [x])
    expected.outputs = [kept, op(expected, "scaled", "mul", [kept, const(expected, "c", before.constants["c"])])]
    assert_graphs_equal(after, expected)
    assert sorted(changes) == ["removed dead add dead_add", "removed dead constant dead_c",
                               "removed dead sigmoid dead_sigmoid"]
    assert "dead_c" not in after.constants and unused_input in after.nodes
    assert_same_numerics(before, after)


# ---- remove_noop_layout --------------------------------------------------------------------------------

# each case: (ops applied between relu(x) and sigmoid, ops expected to remain); x is float64[2,3,4]
NOOP_CASES = {
    "identity": ([("identity", {})], []),
    "reshape same shape": ([("reshape", {"shape": (2, 3, -1)})], []),
    "permute identity": ([("permute", {"dims": (0, 1, 2)})], []),
    "permute identity negative dims": ([("permute", {"dims": (-3, -2, -1)})], []),
    "expand same shape": ([("expand", {"shape": (2, -1, 4)})], []),
    "slice whole dim": ([("slice", {"dim": 1, "start": 0, "end": 100, "step": 1})], []),
    "cast same dtype": ([("cast", {"dtype": "float64"})], []),
    "cat one input": ([("cat", {"dim": 0})], []),
    "reshape of reshape": ([("reshape", {"shape": (6, 4)}), ("reshape", {"shape": (4, 6)})],
                           [("reshape", {"shape": (4, 6)})]),
    "three reshapes back to start": ([("reshape", {"shape": (6, 4)}), ("reshape", {"shape": (24,)}),
                                      ("reshape", {"shape": (2, 3, 4)})], []),
    "permute of permute": ([("permute", {"dims": (1, 2, 0)}), ("permute", {"dims": (0, 2, 1)})],
                           [("permute", {"dims": [1, 0, 2]})]),
    "permute of permute is identity": ([("permute", {"dims": (1, 2, 0)}), ("permute", {"dims": (2, 0, 1)})], []),
}
KEPT_CASES = {
    "reshape": [("reshape", {"shape": (6, 4)})],
    "permute": [("permute", {"dims": (0, 2, 1)})],
    "expand": [("reshape", {"shape": (2, 1, 3, 4)}), ("expand", {"shape": (2, 5, 3, 4)})],
    "slice part": [("slice", {"dim": 2, "start": 1, "end": 4, "step": 1})],
    "slice step": [("slice", {"dim": 2, "start": 0, "end": 4, "step": 2})],
    "cast": [("cast", {"dtype": "float32"}), ("cast", {"dtype": "float64"})],
}


def _layout_chain(ops: list[tuple[str, dict]], x_shape=(2, 3, 4)) -> Graph:
    graph = Graph()
    y = op(graph, "relu", "relu", [graph.add_input("x", TensorType(x_shape, "float64")).name])
    for i, (kind, attrs) in enumerate(ops):
        y = op(graph, f"{kind}{i}", kind, [y], **attrs)
    graph.outputs = [op(graph, "sigmoid", "sigmoid", [y])]
    return graph


@pytest.mark.parametrize("case", NOOP_CASES)
def test_remove_noop_layout(case):
    ops, remaining = NOOP_CASES[case]
    before = _layout_chain(ops)
    after, changes = run_pass(remove_noop_layout, before)
    assert_graphs_equal(after, _layout_chain(remaining))
    assert changes and all(c.startswith(("removed no-op ", "merged ")) for c in changes)
    assert_same_numerics(before, after)


@pytest.mark.parametrize("case", KEPT_CASES)
def test_remove_noop_layout_keeps_real_layout_ops(case):
    before = _layout_chain(KEPT_CASES[case])
    after, changes = run_pass(remove_noop_layout, before)
    assert changes == []
    assert_graphs_equal(after, before)


def test_transpose_of_square_tensor_is_kept():
    before = _layout_chain([("permute", {"dims": (1, 0)})], x_shape=(3, 3))  # same type, different values
    after, changes = run_pass(remove_noop_layout, before)
    assert changes == []
    assert_graphs_equal(after, before)


@pytest.mark.parametrize("indices, kept", [(torch.arange(3).reshape(1, 3, 1), False),   # in order: a reshape
                                             (torch.tensor([0, 2, 1]), True),            # a real gather
                                             (torch.tensor([0, 1]), True)])              # a part of the axis
def test_a_take_of_every_element_in_order_is_a_reshape(indices, kept):
    """The dynamo ONNX exporter's keepdim of a global average pool: flatten, then Gather(arange(C)) into
    (1, C, 1, 1); with the flatten before it, the chain is a no-op."""
    before = Graph()
    x = op(before, "relu", "relu", [before.add_input("x", TensorType((2, 3, 4), "float64")).name])
    index = before.add_constant("index", indices).name
    before.outputs = [op(before, "out", "sigmoid", [op(before, "gather", "take", [x, index], axis=1)])]
    after, changes = run_pass(remove_noop_layout, before)
    assert (after["gather"].op == "take") is kept and ("index" in after.nodes) is kept
    assert bool(changes) is not kept
    assert_same_numerics(before, after)


def test_reshape_of_shared_reshape_keeps_the_shared_one():
    before = Graph()
    x = before.add_input("x", TensorType((2, 3, 4), "float64")).name
    inner = op(before, "inner", "reshape", [x], shape=(6, 4))
    outer = op(before, "outer", "reshape", [inner], shape=(4, 6))
    before.outputs = [op(before, "a", "relu", [inner]), op(before, "b", "relu", [outer])]
    after, changes = run_pass(remove_noop_layout, before)
    assert changes == ["merged reshape inner into reshape outer"]
    assert after["outer"].inputs == ["x"] and "inner" in after.nodes
    assert_same_numerics(before, after)


# ---- fold_constants ------------------------------------------------------------------------------------

def _conv1d(weight_ops: list[tuple[str, dict]], weight: torch.Tensor, bias: torch.Tensor | None = None) -> Graph:
    """x[4,8] -> linear(x, ops(W), b): GPT-2's Conv1D as captured, W stored [K, N] and permuted to [N, K]."""
    graph = Graph("conv1d")
    x = graph.add_input("x", TensorType((4, 8), "float64")).name
    w = const(graph, "w", weight)
    for i, (kind, attrs) in enumerate(weight_ops):
        w = op(graph, f"{kind}{i}", kind, [w], **attrs)
    graph.outputs = [op(graph, "fc", "linear", [x, w, const(graph, "b", rand(6) if bias is None else bias)])]
    return graph


def test_fold_constants_gives_a_linear_its_transposed_weight_as_a_constant():
    before = _conv1d([("permute", {"dims": (1, 0)})], rand(8, 6))
    after, changes = run_pass(fold_constants, before)

    expected = _conv1d([], before.constants["w"].t(), before.constants["b"])
    assert_graphs_equal(after, expected)
    assert changes == ["folded permute permute0 of constants into constant w_permute"]
    weight = after.constants[after["fc"].inputs[1]]
    assert after["fc"].inputs[1] == "w_permute" and after["w_permute"].source == "permute0"
    assert weight.is_contiguous() and weight.shape == (6, 8)
    assert "w" not in after.nodes and "w" not in after.constants   # the original is dropped, not kept twice
    assert_same_numerics(before, after)


def test_fold_constants_folds_a_chain_step_by_step():
    before = _conv1d([("cast", {"dtype": "float32"}), ("reshape", {"shape": (48,)}),
                      ("reshape", {"shape": (8, 6)}), ("permute", {"dims": (1, 0)}), ("cast", {"dtype": "float64"})],
                     rand(8, 6))
    after, changes = run_pass(fold_constants, before)
    assert len(changes) == 5
    assert [n.op for n in after] == ["input", "constant", "constant", "linear"]
    name = after["fc"].inputs[1]
    assert name == "w_cast_reshape_reshape_permute_cast"
    assert torch.equal(after.constants[name], before.constants["w"].float().double().t())
    assert set(after.constants) == {name, "b"}
    again, _ = run_pass(fold_constants, before)   # names depend on the graph only
    assert again.format() == after.format()
    assert_same_numerics(before, after, tolerance=1e-6)


def test_fold_constants_leaves_a_graph_output_computed():
    """A folded output would be a constant: the compiled model would return its own tensor to every caller."""
    before = _conv1d([], rand(6, 8))
    before.outputs = [before["fc"].name, op(before, "doubled", "mul", ["b", const(before, "two", torch.tensor(2.0))])]
    after, changes = run_pass(fold_constants, before)
    assert changes == [] and after["doubled"].op == "mul" and after.outputs == before.outputs


def test_fold_constants_keeps_a_constant_that_another_node_reads():
    before = _conv1d([("permute", {"dims": (1, 0)})], rand(8, 8), rand(8))
    fc = before["fc"].name
    before.outputs = [fc, op(before, "tied", "matmul", [fc, "w"])]   # the unpermuted W, read as it is
    after, _ = run_pass(fold_constants, before)
    assert after["tied"].inputs == [fc, "w"] and torch.equal(after.constants["w"], before.constants["w"])
    assert torch.equal(after.constants[after["fc"].inputs[1]], before.constants["w"].t())
    assert "permute" not in {n.op for n in after}
    assert_same_numerics(before, after)


def test_fold_constants_gives_a_slice_its_own_storage():
    before = Graph()
    x = before.add_input("x", TensorType((2, 4), "float64")).name
    half = op(before, "half", "slice", [const(before, "table", rand(1000, 4))], dim=0, start=0, end=2, step=1)
    before.outputs = [op(before, "add", "add", [x, half])]
    after, _ = run_pass(fold_constants, before)
    sliced = after.constants[after["add"].inputs[1]]
    assert "table" not in after.constants
    assert sliced.untyped_storage().nbytes() == 2 * 4 * 8     # not the whole table kept alive behind a view
    assert_same_numerics(before, after)


def _expand_bias(rows: int) -> Graph:
    graph = Graph()
    x = graph.add_input("x", TensorType((rows, 16), "float64")).name
    bias = op(graph, "wide", "expand", [const(graph, "bias", rand(1, 16))], shape=(rows, 16))
    graph.outputs = [op(graph, "add", "add", [x, bias])]
    return graph


def _opaque_of_constant() -> Graph:
    graph = Graph()
    x = graph.add_input("x", TensorType((3,), "float64")).name
    c = const(graph, "c", rand(3))
    twice = graph.add_node("opaque", [c], graph[c].type, {"target": "double", "fn": lambda xs: xs[0] * 2},
                           name="twice").name
    graph.outputs = [op(graph, "add", "add", [x, twice])]
    return graph


def test_fold_constants_leaves_opaque_calls_and_growth_past_the_limit():
    for before in (_opaque_of_constant(), _expand_bias(SMALL_BYTES // (16 * 8) + 1)):
        after, changes = run_pass(fold_constants, before)
        assert changes == []
        assert_graphs_equal(after, before)
    small = _expand_bias(4)          # a small broadcast is folded: it saves a node and costs little
    after, changes = run_pass(fold_constants, small)
    assert changes == ["folded expand wide of constants into constant bias_expand"]
    assert_same_numerics(small, after)


def test_a_broadcast_that_only_folding_nodes_read_folds_past_the_limit():
    """Swin's window mask: a.unsqueeze(1) - a.unsqueeze(2) grows, but what reads it folds too; only the finished
    mask is read at run time, and it is materialised either way."""
    n = 100
    graph = Graph()
    x = graph.add_input("x", TensorType((n, n), "float64")).name
    table = const(graph, "table", rand(n))
    rows, cols = op(graph, "rows", "reshape", [table], shape=(n, 1)), op(graph, "cols", "reshape", [table], shape=(1, n))
    grid = op(graph, "grid", "sub", [rows, cols])
    assert graph[grid].type.nbytes > SMALL_BYTES
    scaled = op(graph, "scaled", "mul", [grid, const(graph, "two", torch.tensor(2.0, dtype=F64))])
    graph.outputs = [op(graph, "add", "add", [x, scaled])]
    after, changes = run_pass(fold_constants, graph)
    assert [n.op for n in after] == ["input", "constant", "add"] and len(changes) == 4
    assert_same_numerics(graph, after)


def test_a_folded_broadcast_is_stored_at_its_smallest_shape():
    """x + b.expand(8, 32, 64) * 2: the folded product is b * 2 broadcast, kept as [1, 1, 64] and expanded by a
    view, not 128 KiB of repeats read at every call."""
    graph = Graph()
    x = graph.add_input("x", TensorType((8, 32, 64), "float64")).name
    wide = op(graph, "wide", "expand", [const(graph, "b", rand(64))], shape=(8, 32, 64))
    doubled = op(graph, "doubled", "mul", [wide, const(graph, "two", torch.tensor(2.0, dtype=F64))])
    graph.outputs = [op(graph, "add", "add", [x, doubled])]
    assert graph["doubled"].type.nbytes > SMALL_BYTES
    after, _ = run_pass(fold_constants, graph)
    assert max(t.numel() for t in after.constants.values()) == 64
    (view,) = [n for n in after if n.op == "expand"]
    assert after.constants[view.inputs[0]].shape == (1, 1, 64) and after["add"].inputs[1] == view.name
    assert_same_numerics(graph, after)


def test_fold_constants_leaves_nodes_that_read_an_input():
    before = _conv1d([], rand(6, 8))
    after, changes = run_pass(fold_constants, before)
    assert changes == []
    assert_graphs_equal(after, before)


def _opaque(graph: Graph, name: str, inputs: list[str], fn, type: TensorType, pure: bool) -> str:
    return graph.add_node("opaque", inputs, type, {"target": name, "fn": fn, "pure": pure}, name=name).name


def test_pure_opaque_calls_of_constants_fold_and_impure_ones_stay():
    graph = Graph()
    x = graph.add_input("x", TensorType((4,), "float64")).name
    ids = const(graph, "ids", torch.arange(4))
    ge = _opaque(graph, "ge", [ids], lambda xs: xs[0] >= 2, TensorType((4,), "bool"), pure=True)
    rand = _opaque(graph, "noise", [ids], lambda xs: torch.rand(4, dtype=torch.float64), TensorType((4,), "float64"),
                   pure=False)
    picked = _opaque(graph, "where", [ge, x, rand], lambda xs: torch.where(*xs), TensorType((4,), "float64"), pure=True)
    graph.outputs = [picked]
    after, changes = run_pass(fold_constants, graph)
    assert changes == ["folded opaque ge of constants into constant ids_opaque"]
    assert torch.equal(after.constants["ids_opaque"], torch.tensor([False, False, True, True]))
    assert after["noise"].op == "opaque" and after["where"].op == "opaque"


def test_a_gather_of_constants_folds_past_the_broadcast_limit():
    """An embedding of constant ids writes its result at every call anyway; an expand is free in a kernel."""
    rows = SMALL_BYTES // (16 * 8) + 1
    graph = Graph()
    x = graph.add_input("x", TensorType((rows, 16), "float64")).name
    table = const(graph, "table", torch.randn(3, 16, dtype=torch.float64))
    gathered = op(graph, "gathered", "embedding", [table, const(graph, "ids", torch.arange(rows) % 3)])
    assert graph[gathered].type.nbytes > SMALL_BYTES and graph[gathered].type.nbytes < GROWTH_BYTES
    graph.outputs = [op(graph, "add", "add", [x, gathered])]
    after, changes = run_pass(fold_constants, graph)
    assert changes == ["folded embedding gathered of constants into constant ids_embedding"]
    assert_same_numerics(graph, after)


class _Conv1D(torch.nn.Module):
    """transformers' GPT-2 Conv1D: addmm(b, x, W) with W stored [in, out]."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_in, n_out) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], -1)


class _MatmulTransposed(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(n_out, n_in) * 0.2)
        self.bias = torch.nn.Parameter(torch.randn(n_out) * 0.1)

    def forward(self, x):
        return x @ self.weight.t() + self.bias


@pytest.mark.parametrize("module", [_Conv1D, _MatmulTransposed])
def test_a_transposed_parameter_reaches_the_gemm_template_as_a_constant(module):
    import opfuse

    model = module(8, 6).eval()
    weight = model.weight.detach().clone()
    analysis = opfuse.analyze(model, (torch.randn(2, 3, 8),), opfuse.FusionConfig(dtype="float32"))
    prepared = analysis.prepared
    assert "permute" not in {n.op for n in prepared}
    (anchor,) = [n for n in prepared if n.op in ("linear", "matmul")]
    assert prepared.is_constant(anchor.inputs[1])
    assert analysis.pytorch_groups == {}                            # the GEMM group gets its kernel
    assert analysis.fused.kernel_launches == 1
    assert torch.equal(model.weight, weight)                        # the user's parameter is untouched


# ---- cast_precision ------------------------------------------------------------------------------------

def _mixed_model() -> Graph:
    graph = Graph("mixed")
    tokens = graph.add_input("tokens", TensorType((2, 3), "int64")).name
    x = graph.add_input("x", TensorType((2, 3, 4), "float32")).name
    h = op(graph, "embed", "embedding", [const(graph, "table", torch.randn(10, 4)), tokens])
    h = op(graph, "add", "add", [h, x])
    h = op(graph, "norm", "layer_norm", [h, const(graph, "ln_w", torch.randn(4)), const(graph, "ln_b", torch.randn(4))],
           normalized_shape=(4,), eps=1e-5)
    h = op(graph, "fc", "linear", [h, const(graph, "fc_w", torch.randn(5, 4)), const(graph, "fc_b", torch.randn(5))])
    h = graph.add_node("opaque", [h], graph[h].type, {"target": "double", "fn": lambda xs: xs[0] * 2},
                       name="twice").name
    h = op(graph, "rows", "reshape", [op(graph, "to_f32", "cast", [h], dtype="float32")], shape=(6, 5))
    h = op(graph, "pick", "embedding", [h, const(graph, "positions", torch.arange(3))])
    graph.outputs = [h]
    return graph


def test_cast_precision_to_float16():
    before = _mixed_model()
    after, changes = run_pass(functools.partial(cast_precision, dtype="fp16"), before)

    for name in ("table", "ln_w", "ln_b", "fc_w", "fc_b"):
        assert after.constants[name].dtype == torch.float16 and after[name].type.dtype == "float16"
        assert before.constants[name].dtype == torch.float32
        torch.testing.assert_close(after.constants[name].float(), before.constants[name], rtol=1e-3, atol=1e-3)
    assert after.constants["positions"] is before.constants["positions"]  # int constants untouched
    assert after["tokens"].type == TensorType((2, 3), "int64")
    assert after["x"].type == TensorType((2, 3, 4), "float16")
    for name in ("embed", "add", "norm", "fc", "twice", "to_f32", "rows", "pick"):
        assert after[name].type == before[name].type.with_dtype("float16"), name
    assert after["to_f32"].attrs["dtype"] == "float16"
    assert "cast input x from float32 to float16" in changes
    assert "cast constant table from float32 to float16" in changes
    assert not any("positions" in c or "tokens" in c for c in changes)

    inputs = random_inputs(before)
    want = interpret(before, inputs)[0]
    got = interpret(after, [inputs[0], inputs[1].half()])[0]
    assert got.dtype == torch.float16
    assert ((got.float() - want).norm() / want.norm()).item() < 1e-2


def _router(width: str) -> Graph:
    """A mixture of experts' router: logits (in `width`), widened to float32 where `width` is narrow, a softmax and
    its top two; a float32 scale in between."""
    graph = Graph("router")
    x = graph.add_input("x", TensorType((6, 16), width)).name
    logits = op(graph, "logits", "linear", [x, const(graph, "w", torch.randn(8, 16).to(getattr(torch, width)))])
    if width != "float32":
        logits = op(graph, "wide", "cast", [logits], dtype="float32")
    scaled = op(graph, "scaled", "mul", [logits, const(graph, "scale", torch.tensor(0.5))])
    probs = op(graph, "probs", "softmax", [scaled], dim=-1)
    top = op(graph, "top", "topk", [probs], k=2, dim=-1, largest=True, sorted=True, output=0)
    graph.outputs = [op(graph, "back", "cast", [top], dtype=width)]
    return graph


def test_a_cast_widening_what_a_choice_ranks_keeps_its_dtype():
    """A narrow model's float32 router softmax stays float32 up to its topk (narrowed, near-equal probabilities
    round to ties that pick other experts); a model wide throughout is narrowed as asked."""
    after, changes = run_pass(functools.partial(cast_precision, dtype="float16"), _router("float16"))
    assert [after[n].type.dtype for n in ("logits", "wide", "scaled", "probs", "top", "back")] == \
        ["float16", "float32", "float32", "float32", "float32", "float16"]
    assert any("wide still casts to float32" in change for change in changes)
    after, _ = run_pass(functools.partial(cast_precision, dtype="float16"), _router("float32"))
    assert {after[n].type.dtype for n in ("logits", "scaled", "probs", "top", "back")} == {"float16"}
    after, _ = run_pass(functools.partial(cast_precision, dtype="bfloat16"), _router("float16"))
    assert after["probs"].type.dtype == "float32"


def test_cast_precision_rejects_integer_dtype():
    with pytest.raises(ValueError, match="floating"):
        cast_precision(_mixed_model(), "int32")


# ---- the pass manager ----------------------------------------------------------------------------------

def _conv_bn_model(dtype="float64") -> Graph:
    graph = Graph("model")
    x = graph.add_input("x", TensorType((1, 3, 6, 6), dtype)).name
    y = conv(graph, "conv", x, const(graph, "w", rand(4, 3, 3, 3, dtype=getattr(torch, dtype))))
    y = op(graph, "dropout", "identity", [y])
    y, _ = batch_norm(graph, "bn", y, 4, dtype=getattr(torch, dtype))
    op(graph, "unused", "tanh", [y])
    graph.outputs = [op(graph, "relu", "relu", [y])]
    return graph


def _break_types(graph: Graph) -> tuple[Graph, list[str]]:
    graph = graph.copy()
    relu = graph["relu"]
    relu.type = TensorType((7,), relu.type.dtype)
    return graph, ["broke relu"]


def _returns_its_input(graph: Graph) -> tuple[Graph, list[str]]:
    return graph, []


def test_run_passes_names_the_pass_that_broke_the_graph(tmp_path):
    with pytest.raises(GraphError, match=r"pass _break_types produced an invalid graph: node relu"):
        run_passes(_conv_bn_model(), [remove_noop_layout, _break_types, eliminate_dead_code], debug_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00_input.txt", "01_remove_noop_layout.txt",
                                                         "02__break_types.txt"]
    with pytest.raises(GraphError, match="pass _returns_its_input returned its input graph"):
        run_passes(_conv_bn_model(), [_returns_its_input])


def test_run_passes_records_and_debug_files(tmp_path):
    before = _conv_bn_model()
    after, records = run_passes(before, default_pipeline(), debug_dir=tmp_path)
    assert [r.name for r in records] == ["fold_constants", "remove_noop_layout", "recognize_roll", "flatten_cats",
                                         "recognize_attention", "share_kv_heads", "simplify_attention_masks",
                                         "fold_linear_reshapes", "fold_view_chains", "unshare_views",
                                         "recognize_rms_norm", "recognize_gelu", "matrix_vector_as_reduction",
                                         "split_gated_linears", "elementwise_before_unit_reshapes",
                                         "views_before_prologues", "fold_batchnorm", "eliminate_dead_code"]
    assert all(records[i].changes == [] for i in (0, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15))
    assert records[1].changes == ["removed no-op identity dropout"]
    assert records[16].changes == ["folded batch_norm bn into conv2d conv"]
    assert records[17].changes == ["removed dead tanh unused"]
    assert all(r.seconds >= 0 for r in records)
    assert [n.op for n in after if n.op not in ("input", "constant")] == ["conv2d", "relu"]
    assert (tmp_path / "18_eliminate_dead_code.txt").read_text() == after.format() + "\n"
    assert (tmp_path / "00_input.txt").read_text() == before.format() + "\n"
    assert_same_numerics(before, after)


def test_prepare_graph_casts_then_runs_the_pipeline(tmp_path):
    before = _conv_bn_model("float32")
    after, records = prepare_graph(before, "float16", debug_dir=tmp_path)
    assert [r.name for r in records] == ["cast_precision", "fold_constants", "remove_noop_layout", "recognize_roll",
                                         "flatten_cats", "recognize_attention", "share_kv_heads",
                                         "simplify_attention_masks", "fold_linear_reshapes", "fold_view_chains", "unshare_views",
                                         "recognize_rms_norm", "recognize_gelu", "matrix_vector_as_reduction",
                                         "split_gated_linears", "elementwise_before_unit_reshapes",
                                         "views_before_prologues", "fold_batchnorm", "eliminate_dead_code"]
    assert (tmp_path / "01_cast_precision.txt").exists()
    assert [n.op for n in after if n.op not in ("input", "constant")] == ["conv2d", "relu"]
    assert all(t.dtype == torch.float16 for t in after.constants.values())
    assert all(n.type.dtype == "float16" for n in after)
    assert before["x"].type.dtype == "float32"


def test_a_linear_between_row_reshapes_reads_and_writes_its_rows_unflattened():
    """GPT-2's Conv1D: view(-1, K), addmm, view(1, T, N) is one linear over [1, T, K]; a reshape that is more than
    the flattening (a head merge [1, T, H, D] -> [T, H*D]) stays, reshaping to [1, T, H*D]."""
    from opfuse.passes import fold_linear_reshapes

    graph = Graph("conv1d")
    x = graph.add_input("x", TensorType((1, 6, 8), "float32")).name
    heads = graph.add_input("heads", TensorType((1, 6, 2, 4), "float32")).name
    w = const(graph, "w", torch.randn(5, 8))
    flat = op(graph, "flat", "reshape", [x], shape=[6, 8])
    out = op(graph, "out", "reshape", [op(graph, "fc", "linear", [flat, w]), ], shape=[1, 6, 5])
    merged = op(graph, "merge", "reshape", [heads], shape=[6, 8])
    proj = op(graph, "proj_out", "reshape", [op(graph, "proj", "linear", [merged, w])], shape=[1, 6, 5])
    graph.outputs = [op(graph, "sum", "add", [out, proj])]
    feeds = [torch.randn(1, 6, 8), torch.randn(1, 6, 2, 4)]
    after, changes = run_pass(fold_linear_reshapes, graph)     # the input graph left as it was
    assert len(changes) == 2
    assert [n.name for n in after if n.op == "reshape"] == ["merge"] and after["merge"].attrs["shape"] == [1, 6, 8]
    assert after["fc"].inputs[0] == "x" and after["fc"].type.shape == (1, 6, 5) == after["proj"].type.shape
    torch.testing.assert_close(interpret(after, feeds)[0], interpret(graph, feeds)[0])


def test_infer_type_keeps_answers_by_op_types_and_attrs_of_their_type(monkeypatch):
    """The verifier re-infers every node's type after every pass: answers are kept per (op, input types, attrs),
    attrs compared with their types (1, 1.0 and True are different keys), and an attr that is not a
    plain value (a callable) is inferred afresh each time."""
    from opfuse.ir import ops
    from opfuse.ir.graph import TensorType

    calls = []
    original = ops._infer_type
    monkeypatch.setattr(ops, "_infer_type", lambda *args: calls.append(args[0]) or original(*args))
    monkeypatch.setattr(ops, "_INFERRED", {})
    x = TensorType((1, 2, 5, 5), "float32")
    w = TensorType((3, 2, 3, 3), "float32")
    conv = dict(stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1)
    first = infer_type("conv2d", [x, w], conv)
    assert first == TensorType((1, 3, 5, 5), "float32") and infer_type("conv2d", [x, w], dict(conv)) == first
    assert calls == ["conv2d"]                                   # the second answer was the kept one
    assert infer_type("conv2d", [x, w], conv | {"padding": (0, 0)}) == TensorType((1, 3, 3, 3), "float32")
    assert infer_type("clamp", [x], {"min": 0, "max": 6}) == infer_type("clamp", [x], {"min": 0.0, "max": 6.0})
    assert calls == ["conv2d", "conv2d", "clamp", "clamp"]       # 0 and 0.0: two keys
    opaque = {"fn": lambda xs: xs[0] * 2}
    assert infer_type("opaque", [x], opaque) == x and infer_type("opaque", [x], opaque) == x
    assert calls[-2:] == ["opaque", "opaque"]                    # never kept: the callable is not a plain value


class _PositionalEncoding(torch.nn.Module):
    """EdgeNeXt's: a cumsum of a mask of ones (float32 whatever the model's dtype), normalised, sin and cos
    interleaved by a stack: computed from the input's shape alone."""

    def forward(self, x):
        mask = torch.zeros(x.shape[0], x.shape[2], x.shape[3], dtype=torch.bool)
        rows = (~mask).cumsum(1, dtype=torch.float32)
        rows = rows / (rows[:, -1:, :] + 1e-6) * 6.28
        encoding = torch.stack((rows.sin(), rows.cos()), dim=3).flatten(3).permute(0, 3, 1, 2)
        return x + encoding.to(x.dtype)


def test_a_value_of_shapes_alone_folds_in_a_graph_cast_to_float16():
    """The cumsum (computing in float32, its dtype= argument) retyped float16 by cast_precision still folds, with
    what it feeds: the prepared graph adds one constant, and it equals eager's encoding in float16."""
    from opfuse.frontend.torch_export import capture_torch
    from opfuse.passes import prepare_graph

    model, x = _PositionalEncoding().eval(), torch.randn(1, 2, 5, 4)
    graph = capture_torch(model, (x,))
    assert [n.attrs for n in graph if n.op == "cumsum"] == [{"dim": 1, "dtype": "float32"}]
    prepared, _ = prepare_graph(graph, "float16")
    assert [n.op for n in prepared if n.op not in ("input", "constant")] == ["add"]
    with torch.no_grad():
        expected = model(x.half().float()).half()
    torch.testing.assert_close(interpret(prepared, [x.half()])[0], expected, rtol=2e-3, atol=2e-3)


def test_fold_constants_replaces_a_where_by_a_constant_condition_by_the_operand_it_selects():
    """transformers' padding mask: where(a mask function true everywhere, the [B, 1, 1, S] mask, true)."""
    graph = Graph("mask")
    mask = graph.add_input("mask", TensorType((2, 1, 1, 5), "float64")).name
    everywhere = const(graph, "everywhere", torch.ones(1, 1, 5, 1, dtype=torch.bool))
    keep = op(graph, "keep", "where", [everywhere, mask, const(graph, "low", rand())])
    graph.outputs = [op(graph, "scores", "add", [keep, const(graph, "zero", rand(2, 1, 5, 5))])]
    after, changes = run_pass(fold_constants, graph)
    assert "where" not in {n.op for n in after} and {"everywhere", "low"}.isdisjoint(after.nodes)
    assert after[after["scores"].inputs[0]].op == "expand" and changes[0].startswith("replaced keep by")
    assert_same_numerics(graph, after)


def test_fold_constants_keeps_a_where_whose_constant_condition_varies():
    graph = Graph("mask")
    mask = graph.add_input("mask", TensorType((2, 1, 1, 5), "float64")).name
    triangle = const(graph, "triangle", torch.ones(5, 5, dtype=torch.bool).tril())
    graph.outputs = [op(graph, "keep", "where", [triangle, mask, const(graph, "low", rand())])]
    after, _ = run_pass(fold_constants, graph)
    assert after["keep"].op == "where"


def test_a_cat_read_only_by_a_cat_along_its_dim_is_spliced_into_it():
    """Inception's last blocks: cat([a, cat([b, c]), cat([d, e]), f]) is one cat of six; an inner cat along another
    dim, or read elsewhere too, stays."""
    from opfuse.passes.flatten_cats import flatten_cats

    g = Graph("nested")
    xs = [g.add_input(f"x{i}", TensorType((2, i + 1, 3, 3), "float64")).name for i in range(6)]
    inner = op(g, "inner", "cat", xs[1:3], dim=1)
    other = op(g, "other", "cat", xs[3:5], dim=-3)
    outer = op(g, "outer", "cat", [xs[0], inner, other, xs[5]], dim=1)
    tall = op(g, "tall", "cat", [xs[0], xs[0]], dim=2)
    kept = op(g, "kept", "cat", [tall, g.add_input("x6", TensorType((2, 1, 6, 3), "float64")).name], dim=1)
    shared = op(g, "shared", "cat", [xs[0], xs[1]], dim=1)
    also = op(g, "also", "cat", [shared, xs[2]], dim=1)
    g.outputs = [outer, kept, also, shared]
    after, changes = flatten_cats(g)
    assert changes == ["cat inner spliced into cat outer", "cat other spliced into cat outer"]
    assert after["outer"].inputs == xs and "inner" not in after.nodes and "other" not in after.nodes
    assert after["kept"].inputs == ["tall", "x6"] and after["also"].inputs == ["shared", "x2"]
    assert_same_numerics(g, after)
