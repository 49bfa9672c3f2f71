"""A linear between reshapes that flatten its rows and restore them reads and writes the rows unflattened.

Entry point: `fold_linear_reshapes(graph)`. GPT-2's Conv1D (and any `x.view(-1, K) @ W` written by hand) computes
``reshape(linear(reshape(x, [T, K])), [1, T, N])``; a linear takes [..., K] inputs and keeps the row order, so
``linear(reshape(x, [1, T, K]))`` of shape [1, T, N] is the same values in the same order, and the input reshape
is gone where it was only the flattening. Without the reshape of its result, what reads the linear (GPT-2's residual
add) joins its epilogue, and without the one before, the layer norm before it joins its prologue: an anchor's kernel
maps no reshape of its output. Only rows restored to two dims are taken: the GEMM template indexes few row groups of
a tensor it reads through strides, and Swin's window partition keeps its reshapes.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, TensorType
from opfuse.passes.eliminate_dead_code import remove_if_unused


def fold_linear_reshapes(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each reshape -> linear -> reshape whose last reshape keeps the linear's output
    features gives the linear its rows in that shape."""
    graph = graph.copy()
    users = graph.users()
    changes = []
    for node in list(graph):
        if node.op != "linear" or graph[node.inputs[0]].op != "reshape" or node.name in graph.outputs:
            continue
        flat, readers = graph[node.inputs[0]], users[node.name]
        if len(readers) != 1 or readers[0].op != "reshape" or [u.name for u in users[flat.name]] != [node.name] \
                or flat.name in graph.outputs:
            continue
        restore = readers[0]
        features = node.type.shape[-1]
        if not restore.type.shape or restore.type.shape[-1] != features or not 2 < len(restore.type.shape) <= 3:
            continue    # (more row dims than the GEMM template's row groups: Swin's windows stay as they are)
        rows = tuple(restore.type.shape[:-1])
        shape = rows + (flat.type.shape[-1],)
        flat.attrs = {**flat.attrs, "shape": list(shape)}
        flat.type = TensorType(shape, flat.type.dtype)
        node.type = TensorType(rows + (features,), node.type.dtype)
        graph.replace_uses(restore.name, node.name)
        graph.remove(restore.name)
        words = f"linear {node.name} writes {list(node.type.shape)} directly (no reshape {restore.name})"
        if graph[flat.inputs[0]].type == flat.type:    # the reshape before only flattened: the linear reads its source
            node.inputs = [flat.inputs[0]] + list(node.inputs[1:])
            remove_if_unused(graph, flat.name)
            words += f" and reads {flat.inputs[0]} (no reshape {flat.name})"
        users = graph.users()
        changes.append(words)
    return graph, changes
