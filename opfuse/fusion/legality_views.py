"""Views and copying index maps in fusion legality (the rules in `opfuse.fusion.legality`'s docstring): which views
and copies a kernel maps on its loads instead of copying (`maps_on_load`), which of them read each input element once
(`reads_each_once`) or compute nothing (`loaded_view`), the chain of views a linear reads its operand through
(`operand_chain`), and the orders in which an epilogue reads its hub's values (`epilogue_spaces`, `mixed_orders`).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from opfuse.fusion.legality_common import Users
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, get_op, kind_of
from opfuse.ir.strided import MAPPED_VIEWS, contiguous_strides, operand_groups, through_views

ELEMENT_KEEPING_VIEWS = frozenset({"reshape", "permute", "identity"})
REPEATING_VIEWS = frozenset({"expand"})     # views a kernel without an anchor maps on a load of their input (a repeat)
EPILOGUE_VIEWS = frozenset({"permute"})      # views an anchor's epilogue maps: values stay at the tile's coordinates
# copying ops an elementwise kernel computes as index maps
MAPPED_COPIES = frozenset({"cat", "roll", "embedding", "take", "gather", "pad", "upsample", "unfold", "im2col",
                           "col2im"})


def is_view(node: Node) -> bool:
    return get_op(node.op).alias


def joins_as_map(node: Node) -> bool:
    """A node an elementwise or reduction kernel evaluates through coordinates: a view keeping every element, a
    cat or a roll."""
    return node.op in ELEMENT_KEEPING_VIEWS or node.op in MAPPED_COPIES


def reads_each_once(node: Node) -> bool:
    """A copying index map that reads each element of its inputs at most once, so what computes them before it in
    its kernel computes each once: a cat, a pad, a col2im (each column entry lands on one image position, or none),
    and an unfold or im2col whose windows do not overlap (step >= size; each dim's dilated kernel span at most its
    stride)."""
    if node.op in ("cat", "pad", "col2im"):
        return True
    if node.op == "unfold":
        return node.attrs["step"] >= node.attrs["size"]
    if node.op == "im2col":
        return all(dilation * (kernel - 1) < stride for kernel, dilation, stride
                   in zip(node.attrs["kernel_size"], node.attrs["dilation"], node.attrs["stride"]))
    return False


def loads_only(node: Node) -> bool:
    """A view, or a copying index map each of whose elements is one load of an input element (or a constant): no
    arithmetic (an upsample's linear blend and a col2im's sum compute), no index computed from data (an
    embedding's)."""
    if is_view(node):
        return True
    if node.op == "upsample":
        return node.attrs["mode"] != "linear"
    return node.op in ("cat", "roll", "pad", "unfold", "im2col")


def loaded_view(graph: Graph, name: str, within: set[str]) -> bool:
    """Whether no element of `name` is computed in a kernel of `within`, only loaded: it is outside `within`, or
    reached from values outside through views and copying maps of `within` that only load (`loads_only`: the views
    before a repeat's expand, however small; a pad before the unfolds of overlapping windows, read several times)."""
    pending = [name]
    while pending:
        name = pending.pop()
        if name not in within:
            continue
        if not loads_only(graph[name]) or not graph[name].inputs:
            return False
        pending += graph[name].inputs
    return True


def maps_on_load(node: Node) -> bool:
    """A node an elementwise or reduction kernel evaluates through coordinates (`joins_as_map`), or an expand of a
    value it loads (REPEATING_VIEWS: what reads a repeat)."""
    return joins_as_map(node) or node.op in REPEATING_VIEWS


def operand_chain(graph: Graph, anchor: str, within: Iterable[str], users: Users) -> list[str]:
    """The views of `within` through which linear `anchor` reads its input, source side first: a chain of
    MAPPED_VIEWS, each read by the next alone (the last by the anchor alone), that replayed on the contiguous
    source is a strided map of the operand load (`opfuse.ir.strided.operand_groups`); empty when there is none."""
    node = graph[anchor]
    within = set(within)
    if node.op != "linear":
        return []
    chain: list[str] = []
    value, reader = node.inputs[0], anchor
    while value in within and graph[value].op in MAPPED_VIEWS and [u.name for u in users[value]] == [reader] \
            and value not in graph.outputs:
        chain.append(value)
        value, reader = graph[value].inputs[0], value
    chain.reverse()
    if not chain:
        return []
    source = graph[value].type.shape
    dims = through_views(source, contiguous_strides(source), [graph[v] for v in chain])
    if dims is None or operand_groups(dims, len(node.type.shape) - 1) is None:
        return []
    return chain


def operand_views(graph: Graph, nodes: Iterable[str], users: Users) -> set[str]:
    """The views of `nodes` that are operand maps of a linear anchor among them (`operand_chain`)."""
    nodes = list(nodes)
    return {view for name in nodes if kind_of(graph[name]) is FusionKind.ANCHOR
            for view in operand_chain(graph, name, nodes, users)}


def epilogue_spaces(graph: Graph, anchor: str, epilogue: Sequence[str]) -> dict[str, tuple[int, ...]] | Reason:
    """Per value of the anchor's epilogue (`epilogue` in topological order), the anchor dims its dims are: an
    EPILOGUE_VIEWS permute reorders them, any other node has its inputs'. A Reason names a node that reads the
    anchor's values in two orders (its template would need two coordinates per element)."""
    spaces = {anchor: tuple(range(len(graph[anchor].type.shape)))}
    for name in epilogue:
        node = graph[name]
        seen = {spaces[v] for v in node.inputs if v in spaces}
        if len(seen) != 1:
            return Reason(Code.VIEW_IN_ANCHOR,
                          f"{name} ({node.op}) reads {anchor}'s values in two orders of their dims")
        space = seen.pop()
        spaces[name] = tuple(space[d] for d in node.attrs["dims"]) if node.op in EPILOGUE_VIEWS else space
    return spaces


def mixed_orders(graph: Graph, hub: str, epilogue: Sequence[str]) -> Reason | None:
    """Why a reduction's epilogue (`epilogue` in topological order) cannot be computed once per element at mapped
    coordinates, or None: a node reads the hub's values through two different views (two coordinates each)."""
    orders: dict[str, object] = {hub: hub}
    for name in epilogue:
        node = graph[name]
        seen = {orders[v] for v in node.inputs if v in orders}
        if len(seen) != 1:
            return Reason(Code.VIEW_AFTER_REDUCTION, f"{name} ({node.op}) reads {hub}'s values through two views")
        order = seen.pop()
        orders[name] = name if node.op in ("reshape", "permute") else order
    return None
