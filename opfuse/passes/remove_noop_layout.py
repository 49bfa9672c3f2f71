"""Remove layout ops that change nothing, and merge reshape-of-reshape and permute-of-permute chains.

Entry point: `remove_noop_layout(graph)`. No-ops: identity, cat of one input, a permute with identity dims, a
cast to the value's own dtype, and a reshape, expand or slice whose output type equals its input's (for a
slice with a positive step, an output as long as the input means it takes every element, in order). A gather
(`take`) whose constant indices are 0, 1, ..., n - 1 along its axis, in any shape, is a reshape (the dynamo ONNX
exporter writes a global average pool's keepdim that way), and then merges like one.
Frontends produce many of these (flatten of a flat tensor, ``x[:, :]``, ``.to(x.dtype)``); each would cost
the planner a node and, unfused, possibly a copy kernel.
"""

from __future__ import annotations

import torch

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused


def remove_noop_layout(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` without no-op layout ops, each reshape/permute chain merged into one op."""
    graph = graph.copy()
    changes = []
    for node in graph:  # in order, so a chain of three merges step by step into its last op
        if node.op == "take" and _takes_in_order(graph, node):
            index = node.inputs[1]
            node.op, node.inputs, node.attrs = "reshape", [node.inputs[0]], {"shape": list(node.type.shape)}
            remove_if_unused(graph, index)
            changes.append(f"gather {node.name} of every element in order is a reshape")
        if node.op in ("reshape", "permute") and graph[node.inputs[0]].op == node.op:
            inner = graph[node.inputs[0]]
            if node.op == "permute":
                node.attrs = {**node.attrs, "dims": _compose(inner.attrs["dims"], node.attrs["dims"])}
            node.inputs = [inner.inputs[0]]
            remove_if_unused(graph, inner.name)
            changes.append(f"merged {inner.op} {inner.name} into {node.op} {node.name}")
        if _is_noop(graph, node):
            graph.replace_uses(node.name, node.inputs[0])
            graph.remove(node.name)
            changes.append(f"removed no-op {node.op} {node.name}")
    return graph, changes


def _takes_in_order(graph: Graph, node: Node) -> bool:
    """Whether a take's indices are the constant 0 .. n - 1 of its axis (n its size), each once, in order."""
    source, indices = node.inputs
    if not graph.is_constant(indices):
        return False
    axis = node.attrs.get("axis", 0) % len(graph[source].type.shape)
    flat = graph.constants[indices].reshape(-1)
    size = graph[source].type.shape[axis]
    return flat.numel() == size and bool((flat == torch.arange(size, dtype=flat.dtype)).all())


def _is_noop(graph: Graph, node: Node) -> bool:
    if node.op in ("identity", "cat"):
        return len(node.inputs) == 1
    if node.op not in ("reshape", "permute", "expand", "slice", "cast"):
        return False
    if node.type != graph[node.inputs[0]].type:
        return False
    if node.op == "permute":  # a square tensor keeps its type under a transpose: compare the dims
        return _normalized(node.attrs["dims"]) == list(range(len(node.type.shape)))
    return True


def _normalized(dims) -> list[int]:
    return [d % len(dims) for d in dims]


def _compose(inner, outer) -> list[int]:
    """dims of the one permute equal to permute(inner) then permute(outer): out dim j is input dim inner[outer[j]]."""
    inner, outer = _normalized(inner), _normalized(outer)
    return [inner[d] for d in outer]
