"""Compute the elementwise ops after an anchor before the unit reshapes and slices between them.

Entry point: `elementwise_before_unit_reshapes(graph)`. A 1-D convolution is the 2-D one of [N, C, 1, L] viewed
back as [N, C, L] (`opfuse.frontend.aten_anchors`), and a causal one is then cut to its first L positions (Mamba's
conv, WaveNet's): the view stood between the conv and the activation, batch norm, scale or residual after it, and
an anchor's epilogue maps no reshape or slice, so none of them joined the conv's kernel (whisper's and wav2vec2's
convs ran alone, their GELUs in kernels of their own). An elementwise op reading such a view at the view's shape
computes the same values before it, and the view moves after it: y = f(V(x), c) -> V(f(x, V^-1(c))).
- A unit reshape (it only inserts or drops size-1 dims): the other operands are viewed alike (a constant reshaped
  in place, anything else through a reshape node; a scalar as it is).
- A slice: only where no other operand varies along the sliced dim (f computes the positions the slice drops as
  well, which cost their arithmetic alone and are never read).
The views are followed back from the op to an anchor's output (or a value moved here: a chain moves op by op), and
`fold_batchnorm` (after this pass) folds a batch norm into the conv. A batch norm moves only where its channel dim
stays dim 1 and whole. Nothing else changes: views after anything but an anchor stay where they are.
"""

from __future__ import annotations

from collections import deque

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.ir.ops import FusionKind, kind_of
from opfuse.passes.eliminate_dead_code import remove_if_unused


def elementwise_before_unit_reshapes(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each elementwise op after a unit reshape or slice of an anchor's output computed
    before it."""
    graph = graph.copy()
    changes: list[str] = []
    moved: set[str] = set()       # values this pass computes before a view: chains go on from them
    made: set[str] = set()        # the views of other operands it adds: never moved through (they would go back)
    pending = deque(graph.nodes)
    while pending:
        node = graph.nodes.get(pending.popleft())
        if node is None or not kind_of(node).elementwise:
            continue
        view = next((graph[i] for i in node.inputs if i not in made and _movable(graph, graph[i], node, moved)), None)
        if view is None:
            continue
        source = view.inputs[0]
        inner = tuple(graph[source].type.shape)
        if node.op == "batch_norm":       # its statistics are per channel, dim 1 on both sides
            inputs = [source] + node.inputs[1:]
        else:
            inputs = [source if i == view.name else _viewed(graph, i, view, inner) for i in node.inputs]
            made.update(i for i in inputs if i not in node.inputs and i != source)
        before = graph.add_node(node.op, inputs, TensorType(inner, node.type.dtype), node.attrs,
                                name=f"{node.name}_before_view", source=node.source)
        attrs = {"shape": list(node.type.shape)} if view.op == "reshape" else dict(view.attrs)
        after = graph.add_node(view.op, [before.name], node.type, attrs, name=f"{node.name}_view",
                               source=node.source)
        graph.replace_uses(node.name, after.name)
        graph.remove(node.name)
        remove_if_unused(graph, view.name)      # so that a batch norm's conv has no other reader left
        graph.sort()
        moved.add(before.name)
        pending.extendleft(user.name for user in graph.users().get(after.name, []))
        pending.appendleft(before.name)         # it may move before the view its source is read through
        changes.append(f"{node.op} {node.name} computed before {view.op} {view.name} of {source} "
                       f"(as {before.name})")
    return graph, changes


def unit_reshape(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether a reshape from `before` to `after` only inserts or drops size-1 dims."""
    return before != after and [s for s in before if s != 1] == [s for s in after if s != 1]


def _from_anchor(graph: Graph, name: str, moved: set[str]) -> bool:
    """Whether `name` is an anchor's output, a value moved here, or a unit reshape or slice of one."""
    node = graph[name]
    while node.op in ("reshape", "slice") and kind_of(node) is not FusionKind.ANCHOR:
        node = graph[node.inputs[0]]
    return kind_of(node) is FusionKind.ANCHOR or node.name in moved


def _movable(graph: Graph, view: Node, reader: Node, moved: set[str]) -> bool:
    """Whether `reader` may be computed before `view`: a unit reshape or a slice of a value from an anchor
    (`_from_anchor`), read at the reader's own shape, every other operand viewable (`_viewed`); a batch norm only
    where dims 0 and 1 are the same on both sides."""
    if view.op not in ("reshape", "slice") or tuple(view.type.shape) != tuple(reader.type.shape):
        return False
    before, after = tuple(graph[view.inputs[0]].type.shape), tuple(view.type.shape)
    if view.op == "reshape" and not unit_reshape(before, after):
        return False
    if not _from_anchor(graph, view.inputs[0], moved):
        return False
    if reader.op == "batch_norm":
        return reader.inputs[0] == view.name and len(before) > 1 and before[:2] == after[:2]
    if view.op == "slice":      # every other operand the same along the sliced dim
        dim = view.attrs["dim"] % len(after)
        for name in reader.inputs:
            shape = tuple(graph[name].type.shape)
            if name != view.name and len(shape) >= len(after) - dim and shape[dim - len(after)] != 1:
                return False
    return True


def _viewed(graph: Graph, name: str, view: Node, inner: tuple[int, ...]) -> str:
    """Operand `name` of an op reading `view`, for the same op at the view's input shape `inner`. Through a slice
    it is as it is (`_movable`: size 1 along the sliced dim). Through a unit reshape each dim of more than one
    element keeps its size and every other is 1: a constant reshaped, anything else through a reshape node (a
    view), a scalar as it is."""
    shape = tuple(graph[name].type.shape)
    outer = tuple(view.type.shape)
    if not shape or view.op == "slice":
        return name
    aligned = (1,) * (len(outer) - len(shape)) + shape
    sizes = iter(size for size, full in zip(aligned, outer) if full != 1)
    target = tuple(next(sizes) if full != 1 else 1 for full in inner)
    if target == shape:
        return name
    if graph.is_constant(name) and name in graph.constants:
        return graph.add_constant(f"{name}_viewed", graph.constants[name].reshape(target),
                                  source=graph[name].source).name
    return graph.add_node("reshape", [name], TensorType(target, graph[name].type.dtype), {"shape": list(target)},
                          name=f"{name}_viewed", source=graph[name].source).name
