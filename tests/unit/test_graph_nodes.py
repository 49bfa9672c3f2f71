"""Counting a captured CUDA graph's kernels (opfuse.runtime.graph_nodes) through a driver stand-in: the walk over
nodes and child graphs, and driver errors. The real driver is exercised by tests/gpu/test_models_gpu.py."""

import pytest

from opfuse.runtime.graph_nodes import CHILD_GRAPH, KERNEL, count_kernels, kernel_nodes

MEMSET, EMPTY = 2, 5


class FakeDriver:
    """Graphs by handle, each a list of (node type, child graph handle or 0), answered as libcuda answers."""

    def __init__(self, graphs: dict[int, list[tuple[int, int]]], fail: str = ""):
        self.fail = fail
        self.nodes: dict[int, tuple[int, int]] = {}      # node handle -> (type, child graph)
        self.by_graph: dict[int, list[int]] = {}          # graph handle -> its node handles
        for handle, entries in graphs.items():
            self.by_graph[handle] = []
            for entry in entries:
                node = 1000 + len(self.nodes)
                self.nodes[node] = entry
                self.by_graph[handle].append(node)

    def cuGraphGetNodes(self, graph, nodes, count):
        found = self.by_graph[graph.value]
        if nodes is not None:
            for i, node in enumerate(found[:count._obj.value]):
                nodes[i] = node
        count._obj.value = len(found)
        return 0

    def cuGraphNodeGetType(self, node, kind):
        if self.fail == "type":
            return 400     # CUDA_ERROR_INVALID_HANDLE
        kind._obj.value = self.nodes[node.value][0]
        return 0

    def cuGraphChildGraphNodeGetGraph(self, node, child):
        child._obj.value = self.nodes[node.value][1]
        return 0


def test_kernels_counted_through_child_graphs_and_nothing_else():
    driver = FakeDriver({
        1: [(KERNEL, 0), (MEMSET, 0), (KERNEL, 0), (CHILD_GRAPH, 2), (EMPTY, 0)],
        2: [(KERNEL, 0), (CHILD_GRAPH, 3), (MEMSET, 0)],
        3: [(KERNEL, 0), (KERNEL, 0)],
    })
    assert count_kernels(driver, 1) == 5
    assert count_kernels(driver, 3) == 2


def test_an_empty_graph_has_no_kernels():
    assert count_kernels(FakeDriver({7: []}), 7) == 0


def test_a_driver_error_names_the_call():
    with pytest.raises(RuntimeError, match="cuGraphNodeGetType failed with CUDA driver error 400"):
        count_kernels(FakeDriver({1: [(KERNEL, 0)]}, fail="type"), 1)


def test_a_graph_that_kept_no_template_is_not_counted():
    class Plain:       # a CUDAGraph made without keep_graph (kept_graph on a torch without it)
        def raw_cuda_graph(self):
            raise AssertionError("a plain graph's template is gone: it must not be asked for")

    assert kernel_nodes(Plain()) is None

