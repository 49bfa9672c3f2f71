"""A model's declared state in the IR (`state` nodes, `Graph.state`, the `index_copy` op): captured from buffers a
module marks (`mark_state`) and writes, kept by dead-code elimination, checked by the verifier; any other buffer
written in forward is still refused."""

import pytest
import torch

from opfuse.frontend.torch_export import capture_torch, mark_state, state_buffers
from opfuse.ir.graph import Graph, GraphError, TensorType
from opfuse.ir.verify import verify
from opfuse.passes.eliminate_dead_code import eliminate_dead_code


class Cache(torch.nn.Module):
    """Rows written at the call's positions, then read whole: a KV cache in miniature."""

    def __init__(self, mark: bool = True):
        super().__init__()
        self.register_buffer("cache", torch.zeros(6, 4))
        self.register_buffer("count", torch.zeros(()))
        if mark:
            mark_state(self, "cache")

    def forward(self, rows, positions):
        self.cache.index_copy_(0, positions, rows)
        return self.cache.sum(0) * 2.0


def test_a_marked_buffer_written_in_forward_becomes_state_with_its_update():
    graph = capture_torch(Cache(), (torch.randn(2, 4), torch.tensor([1, 3])))
    (holder, update), = graph.state.items()
    assert graph[holder].op == "state" and holder == "cache"
    assert graph[update].op == "index_copy" and graph[update].inputs[0] == holder
    assert torch.equal(graph.constants[holder], torch.zeros(6, 4))
    assert graph[update].attrs == {"dim": 0}


def test_an_unmarked_buffer_written_in_forward_is_still_refused():
    with pytest.raises(GraphError, match="writes its buffer cache"):
        capture_torch(Cache(mark=False), (torch.randn(2, 4), torch.tensor([1, 3])))


def test_mark_state_names_what_it_marks_and_refuses_what_is_no_buffer():
    model = torch.nn.Sequential(Cache())
    assert state_buffers(model) == {"0.cache"}
    with pytest.raises(GraphError, match="has no buffer 'nothing'"):
        mark_state(model[0], "nothing")


def state_graph() -> Graph:
    graph = Graph("g")
    rows = graph.add_input("rows", TensorType((2, 4), "float32"))
    index = graph.add_input("index", TensorType((2,), "int64"))
    holder = graph.add_state("cache", torch.zeros(6, 4))
    written = graph.add_node("index_copy", [holder.name, index.name, rows.name], holder.type, {"dim": 0})
    graph.add_node("relu", [rows.name], rows.type, name="out")
    graph.outputs = ["out"]
    graph.state[holder.name] = written.name
    return graph


def test_dead_code_elimination_keeps_what_the_state_holds_after_a_call():
    graph, _ = eliminate_dead_code(state_graph())
    assert "index_copy" in graph.nodes and graph.state == {"cache": "index_copy"}
    assert graph.observed == ["out", "index_copy"]


def test_the_verifier_checks_state_updates_name_a_state_and_a_node_of_its_type():
    graph = state_graph()
    verify(graph)
    graph.state["out"] = "index_copy"
    with pytest.raises(GraphError, match="does not name a state node"):
        verify(graph)
    graph = state_graph()
    graph.state["cache"] = "out"
    with pytest.raises(GraphError, match="state cache is float32\\[6,4\\] but its update out is float32\\[2,4\\]"):
        verify(graph)


def test_replace_uses_and_copy_follow_the_state():
    graph = state_graph()
    copy = graph.copy()
    copy.replace_uses("index_copy", "out")
    assert copy.state == {"cache": "out"} and graph.state == {"cache": "index_copy"}
