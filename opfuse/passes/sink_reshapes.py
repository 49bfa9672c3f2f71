"""Move reshapes below the elementwise ops that read them, so that the ops meet their producer.

Entry point: `sink_reshapes(graph)`. Views never join a kernel, so ``gemm -> reshape -> gelu`` is two kernels
where ``gemm -> gelu -> reshape`` is one: GPT-2's Conv1D computes ``addmm`` on [tokens, features] and reshapes to
[batch, seq, features] before its bias-free GELU and its residual add. An elementwise op reading ``reshape(x)``
computes the same elements in x's shape: each element keeps its row-major position under a reshape. So an
elementwise op E whose output has the reshape's shape is rewritten to work in x's shape and the reshape moves to
E's output, when each other operand of E can be brought to x's shape for free:

- an operand of the reshape's full shape: reshaped to x's shape (a view; a reshape of it merges);
- a broadcast operand whose dims past its leading 1s lie within trailing dims that x's shape and the reshape's
  share (a bias [N] across [tokens, N] and [batch, seq, N]; a scalar): the leading 1s are dropped.

except where such a reshaped operand is an anchor's output (through identities and reshapes): its reshape would
then stand between that anchor and E, which could be the anchor's epilogue (Swin's residual add reads a
reshaped earlier sum and a linear's output).

An ``identity`` (an eval-mode dropout, which `remove_noop_layout` drops later) is passed the same way.
Repeated until nothing moves, so a reshape sinks through a chain; it stops at a graph output and at any other
op (a reduction, an anchor), where `remove_noop_layout` then merges it with the reshape the anchor reads.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.ir.ops import FusionKind, get_op
from opfuse.passes.eliminate_dead_code import remove_if_unused


def sink_reshapes(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each reshape moved below the elementwise ops that read it, where it can be."""
    graph = graph.copy()
    changes: list[str] = []
    adapters: set[str] = set()   # reshapes made to bring an operand to a shape: never sunk (they would go back up)
    moved = True
    while moved:
        moved = False
        for node in graph:
            if node.name in graph.nodes and _sink_into(graph, node, adapters, changes):
                moved = True
    if changes:
        graph.sort()
    return graph, changes


def _sink_into(graph: Graph, node: Node, adapters: set[str], changes: list[str]) -> bool:
    """Rewrite elementwise `node` to read below the first reshape among its inputs it can; says whether it did."""
    if not (get_op(node.op).kind.elementwise or node.op == "identity") or node.name in graph.outputs:
        return False
    for reshape_name in dict.fromkeys(node.inputs):
        reshape = graph[reshape_name]
        if reshape.op != "reshape" or reshape.name in adapters or reshape.type.shape != node.type.shape:
            continue
        source_shape = graph[reshape.inputs[0]].type.shape
        operands = [_operand(graph, i, reshape, source_shape, adapters) for i in node.inputs]
        if any(o is None for o in operands):
            continue
        if any(i != reshape_name and not graph.is_constant(i) and graph[i].type.shape == reshape.type.shape
               and _from_anchor(graph, i) for i in node.inputs):
            continue   # its adapter would stand between that anchor and this op, which could be its epilogue
        view = graph.add_node("reshape", [node.name], node.type, {"shape": list(node.type.shape)},
                              name=f"{node.name}_view", source=node.source)
        graph.replace_uses(node.name, view.name)
        view.inputs = [node.name]
        node.inputs = [o() for o in operands]
        node.type = TensorType(source_shape, node.type.dtype)
        remove_if_unused(graph, reshape_name)
        changes.append(f"moved reshape {reshape_name} below {node.op} {node.name}")
        return True
    return False


def _operand(graph: Graph, name: str, reshape: Node, source_shape: tuple[int, ...], adapters: set[str]):
    """A function making operand `name` in `source_shape`'s terms (adding a reshape where needed), or None."""
    if name == reshape.name:
        return lambda: reshape.inputs[0]
    shape, target = graph[name].type.shape, reshape.type.shape
    if shape == target:
        return lambda: _reshaped(graph, name, source_shape, adapters)
    kept = list(shape)
    while kept and kept[0] == 1:
        kept.pop(0)
    k = len(kept)
    if k > len(source_shape) or tuple(source_shape[len(source_shape) - k:]) != tuple(target[len(target) - k:]):
        return None
    return lambda: name if len(kept) == len(shape) else _reshaped(graph, name, tuple(kept), adapters)


def _from_anchor(graph: Graph, name: str) -> bool:
    node = graph[name]
    while node.op in ("identity", "reshape"):
        node = graph[node.inputs[0]]
    return get_op(node.op).kind is FusionKind.ANCHOR


def _reshaped(graph: Graph, name: str, shape: tuple[int, ...], adapters: set[str]) -> str:
    """`name` in `shape`: a constant of that shape (sharing the tensor), else a reshape node, an adapter."""
    if graph.is_constant(name):
        return graph.add_constant(f"{name}_view", graph.constants[name].reshape(shape), source=graph[name].source).name
    type = TensorType(shape, graph[name].type.dtype)
    adapter = graph.add_node("reshape", [name], type, {"shape": list(shape)}, name=f"{name}_view",
                             source=graph[name].source).name
    adapters.add(adapter)
    return adapter
