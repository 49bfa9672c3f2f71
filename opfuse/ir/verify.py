"""Graph verifier, run between passes: structure, registered ops, attributes as each op declares them
(`opfuse.ir.attrs`), and types re-derived from each op."""

from __future__ import annotations

from opfuse.ir.attrs import check_attrs
from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.ops import REGISTRY, infer_type


def verify(graph: Graph, check_types: bool = True) -> None:
    """Raise GraphError naming the first offending node; returns None on a well-formed graph."""
    seen: set[str] = set()
    for name, node in graph.nodes.items():
        if name != node.name:
            raise GraphError(f"node stored under {name!r} is named {node.name!r}")
        if node.op not in REGISTRY:
            raise GraphError(f"node {node.describe()} has unknown op {node.op!r}")
        check_attrs(node, REGISTRY[node.op].attrs)
        for i in node.inputs:
            if i not in seen:
                raise GraphError(f"node {node.describe()} reads {i!r}, which is not defined before it")
        if node.op in ("constant", "state"):
            if name not in graph.constants:
                raise GraphError(f"{node.op} node {node.describe()} has no tensor")
            tensor = graph.constants[name]
            if tuple(tensor.shape) != node.type.shape:
                raise GraphError(f"{node.op} node {node.describe()} is typed {node.type} but holds "
                                 f"{tuple(tensor.shape)}")
        elif check_types and node.op not in ("input", "opaque"):
            expected = infer_type(node.op, graph.input_types(node), node.attrs)
            if expected != node.type:
                raise GraphError(f"node {node.describe()} is typed {node.type} but its op gives {expected}")
        seen.add(name)
    if not graph.outputs:
        raise GraphError(f"graph {graph.name} has no outputs")
    for o in graph.outputs:
        if o not in graph.nodes:
            raise GraphError(f"graph output {o!r} is not a node")
    for holder, update in graph.state.items():
        if graph.nodes.get(holder) is None or graph.nodes[holder].op != "state" or update not in graph.nodes:
            raise GraphError(f"state update {holder!r} <- {update!r} does not name a state node and a node")
        if graph.nodes[update].type != graph.nodes[holder].type:
            raise GraphError(f"state {holder} is {graph.nodes[holder].type} but its update {update} is "
                             f"{graph.nodes[update].type}")
