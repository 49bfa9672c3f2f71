"""A concatenation of two slices of one tensor that swaps their order is a roll: `recognize_roll(graph)`.

ONNX has no roll: exporters write torch.roll(x, k, d) as cat([x[n-k:], x[:n-k]], d), one such pair per rolled dim
(Swin's shifted windows roll H, then W), and code written by hand does the same. For 0 < a < n along dim d,
``cat([x[a:], x[:a]], d) == roll(x, n - a, d)``. As a roll it is an index map that the elementwise kernel reading
it computes (`opfuse.fusion.legality_views.MAPPED_COPIES`), with the views before it; as two slices and a cat it is a
copy of its own, and the views before it must be copied first. A roll whose one reader is a roll (one this pass
made or one captured) becomes one roll with the reader: the reader's shifts follow its own, as torch.roll applies a
roll's shifts one after the other.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused


def recognize_roll(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each cat of x[a:] and x[:a] along one dim is roll(x, n - a) along it, and a roll
    read only by a roll is merged into its reader."""
    graph = graph.copy()
    changes = []
    for node in list(graph):
        shift = _swapped_halves(graph, node)
        if shift is None:
            continue
        source, dim, amount = shift
        slices = list(node.inputs)
        node.op, node.inputs, node.attrs = "roll", [source], {"shifts": [amount], "dims": [dim]}
        for name in dict.fromkeys(slices):
            remove_if_unused(graph, name)
        changes.append(f"cat {node.name} of two slices of {source} is roll({source}, {amount}, dim {dim})")
    users = graph.users()      # once for the merges, each of which keeps it up to date
    for node in list(graph):
        while node.op == "roll" and graph[node.inputs[0]].op == "roll" \
                and graph.only_reader(node.inputs[0], users) is node:
            inner = graph[node.inputs[0]]
            node.inputs = list(inner.inputs)
            node.attrs = {"shifts": [*inner.attrs["shifts"], *node.attrs["shifts"]],
                          "dims": [*inner.attrs["dims"], *node.attrs["dims"]]}
            graph.remove(inner.name)
            # the merged roll reads inner's input in inner's place; nothing reads inner any more
            source = node.inputs[0]
            users[source] = [node if reader is inner else reader for reader in users[source]]
            del users[inner.name]
            changes.append(f"roll {inner.name} merged into roll {node.name}, which reads {source}")
    return graph, changes


def _swapped_halves(graph: Graph, node: Node) -> tuple[str, int, int] | None:
    """(x, dim, shift) when `node` is cat([x[a:], x[:a]], dim) with 0 < a < n, step 1; else None."""
    if node.op != "cat" or len(node.inputs) != 2:
        return None
    first, second = (graph[name] for name in node.inputs)
    if first.op != "slice" or second.op != "slice" or first.inputs[0] != second.inputs[0]:
        return None
    source = first.inputs[0]
    shape = graph[source].type.shape
    dim = node.attrs["dim"] % len(shape)
    if first.attrs["dim"] % len(shape) != dim or second.attrs["dim"] % len(shape) != dim:
        return None
    n = shape[dim]
    bounds = []
    for piece in (first, second):
        start, end, step = slice(piece.attrs["start"], piece.attrs["end"], piece.attrs.get("step", 1)).indices(n)
        if step != 1:
            return None
        bounds.append((start, end))
    (a, end), (zero, b) = bounds
    if end != n or zero != 0 or a != b or not 0 < a < n:
        return None
    return source, dim, n - a
