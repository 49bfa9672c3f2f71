"""recognize_roll: cat([x[a:], x[:a]], d), as ONNX exporters write torch.roll, becomes roll(x, n - a, d)."""

from __future__ import annotations

import pytest
import torch

from opfuse.api import analyze
from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import prepare_graph, recognize_roll
from tests.unit.test_passes import assert_same_numerics, op, run_pass

INT64_MAX = 2**63 - 1
SHAPE = (2, 6, 5, 3)


def _rolled(dims=((1, 2),), exporter_bounds: bool = False, reader: str = "tanh") -> Graph:
    """x [2, 6, 5, 3] rolled along each (dim, shift) of `dims` as cat of two slices, then read by `reader`."""
    graph = Graph("rolled")
    value = graph.add_input("x", TensorType(SHAPE, "float64")).name
    for i, (dim, shift) in enumerate(dims):
        n = SHAPE[dim]
        cut = n - shift
        if exporter_bounds:     # the dynamo exporter's form: a negative start and an end past the dim
            tail = op(graph, f"tail{i}", "slice", [value], dim=dim, start=-shift, end=INT64_MAX, step=1)
        else:
            tail = op(graph, f"tail{i}", "slice", [value], dim=dim, start=cut, end=n, step=1)
        head = op(graph, f"head{i}", "slice", [value], dim=dim, start=0, end=cut, step=1)
        value = op(graph, f"cat{i}", "cat", [tail, head], dim=dim)
    graph.outputs = [op(graph, "out", reader, [value])]
    return graph


@pytest.mark.parametrize("exporter_bounds", [False, True])
def test_two_swapped_slices_are_a_roll(exporter_bounds):
    before = _rolled(exporter_bounds=exporter_bounds)
    after, changes = run_pass(recognize_roll, before)
    (roll,) = [n for n in after if n.op == "roll"]
    assert roll.inputs == ["x"] and roll.attrs == {"shifts": [2], "dims": [1]}
    assert not any(n.op in ("slice", "cat") for n in after)
    assert changes == ["cat cat0 of two slices of x is roll(x, 2, dim 1)"]
    assert_same_numerics(before, after)
    assert torch.equal(torch.roll(torch.arange(6), 2), torch.cat([torch.arange(6)[4:], torch.arange(6)[:4]]))


def test_rolls_along_two_dims_are_one_roll():
    """Swin's shifted windows from ONNX: H rolled, then W."""
    before = _rolled(dims=((1, 3), (2, 2)))
    after, changes = run_pass(recognize_roll, before)
    (roll,) = [n for n in after if n.op == "roll"]
    assert roll.inputs == ["x"] and roll.attrs == {"shifts": [3, 2], "dims": [1, 2]}
    assert changes[-1] == "roll cat0 merged into roll cat1, which reads x"
    assert_same_numerics(before, after)


def test_a_roll_read_elsewhere_too_is_not_merged():
    before = _rolled(dims=((1, 3), (2, 2)))
    before.outputs.append("cat0")
    after, _ = run_pass(recognize_roll, before)
    assert sorted(len(n.attrs["dims"]) for n in after if n.op == "roll") == [1, 1]
    assert_same_numerics(before, after)


def test_slices_read_elsewhere_stay():
    before = _rolled()
    before.outputs.append("head0")
    after, _ = run_pass(recognize_roll, before)
    assert [n.op for n in after if n.op in ("slice", "roll")] == ["slice", "roll"]
    assert_same_numerics(before, after)


def _cat(graph: Graph, pieces: list[tuple[str, int, int, int, int]], dim: int = 1) -> Graph:
    """cat of slices (source, dim, start, end, step) of the graph's inputs."""
    names = [op(graph, f"s{i}", "slice", [source], dim=d, start=start, end=end, step=step)
             for i, (source, d, start, end, step) in enumerate(pieces)]
    graph.outputs = [op(graph, "cat", "cat", names, dim=dim)]
    return graph


def _inputs(*names: str) -> Graph:
    graph = Graph("near")
    for name in names:
        graph.add_input(name, TensorType(SHAPE, "float64"))
    return graph


@pytest.mark.parametrize("pieces, dim", [
    ([("x", 1, 0, 2, 1), ("x", 1, 2, 6, 1)], 1),            # in order: the identity, not a roll
    ([("x", 1, 2, 6, 1), ("y", 1, 0, 2, 1)], 1),            # two sources
    ([("x", 1, 3, 6, 1), ("x", 1, 0, 2, 1)], 1),            # a gap: not the whole dim
    ([("x", 1, 2, 6, 2), ("x", 1, 0, 2, 1)], 1),            # a strided slice
    ([("x", 1, 3, 6, 1), ("x", 1, 0, 3, 1)], 2),            # sliced along another dim than the cat's
    ([("x", 1, 0, 6, 1), ("x", 1, 0, 0, 1)], 1),            # a = 0
])
def test_near_misses_stay_as_they_are(pieces, dim):
    before = _cat(_inputs("x", "y"), pieces, dim)
    after, changes = run_pass(recognize_roll, before)
    assert changes == [] and not any(n.op == "roll" for n in after)


def test_an_exported_roll_plans_like_a_captured_one(tmp_path):
    """torch.roll exported to ONNX comes back a roll, and joins the kernel that reads it as the captured one does."""
    class Shifted(torch.nn.Module):
        def forward(self, x):
            return torch.roll(x, shifts=(3, 2), dims=(1, 2)) + x

    model, x = Shifted().eval(), torch.randn(*SHAPE)
    path = tmp_path / "roll.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=True)
    captured, exported = analyze(model, (x,)), analyze(str(path))
    assert [n.op for n in exported.prepared if n.op not in ("input", "constant")] == ["roll", "add"]
    assert exported.plan.kernel_launches == captured.plan.kernel_launches == 1
    prepared, _ = prepare_graph(exported.captured, "float32")
    assert any(n.op == "roll" for n in prepared)


@pytest.mark.parametrize("inner_dims, outer_dims", [([1], [2]), ([-1], [3]), ([1, 2], [1])])
def test_a_roll_read_only_by_a_roll_is_merged_into_it(inner_dims, outer_dims):
    """Captured rolls too, along other dims or the same one (its shifts add up: the kernel's index map adds them,
    tests/kernels/test_pointwise_kernels.py), a negative dim included."""
    graph = Graph("rolls")
    x = graph.add_input("x", TensorType(SHAPE, "float64")).name
    inner = op(graph, "inner", "roll", [x], shifts=[1] * len(inner_dims), dims=inner_dims)
    outer = op(graph, "outer", "roll", [inner], shifts=[2] * len(outer_dims), dims=outer_dims)
    graph.outputs = [op(graph, "out", "tanh", [outer])]
    after, changes = run_pass(recognize_roll, graph)
    (roll,) = [n for n in after if n.op == "roll"]
    assert roll.inputs == ["x"] and roll.attrs["dims"] == inner_dims + outer_dims
    assert changes == ["roll inner merged into roll outer, which reads x"]
    assert_same_numerics(graph, after)


def test_a_chain_of_rolls_is_merged_with_one_look_at_the_readers(monkeypatch):
    """Four rolls in a row become one (each merge leaves the merged roll the only reader of the next one in): the
    pass finds every value's readers once, not again after each merge. A roll read by two rolls stays apart."""
    graph = Graph("chain")
    value = graph.add_input("x", TensorType(SHAPE, "float64")).name
    for i, dim in enumerate((1, 2, 3, 1)):
        value = op(graph, f"roll{i}", "roll", [value], shifts=[i + 1], dims=[dim])
    forked = [op(graph, f"fork{i}", "roll", [value], shifts=[1], dims=[2]) for i in range(2)]
    graph.outputs = [op(graph, "out", "add", forked)]
    calls = []
    users = Graph.users
    monkeypatch.setattr(Graph, "users", lambda self: calls.append(1) or users(self))
    after, changes = run_pass(recognize_roll, graph)
    assert len(calls) == 1
    rolls = {n.name: n for n in after if n.op == "roll"}
    assert sorted(rolls) == ["fork0", "fork1", "roll3"]
    assert rolls["roll3"].inputs == ["x"] and rolls["roll3"].attrs == {"shifts": [1, 2, 3, 4], "dims": [1, 2, 3, 1]}
    assert changes == [f"roll roll{i} merged into roll roll{i + 1}, which reads x" for i in range(3)]
    monkeypatch.undo()
    assert_same_numerics(graph, after)
