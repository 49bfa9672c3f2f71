"""Give a view PyTorch would copy its own chain of views back to what it is a view of.

Entry point: `unshare_views(graph)`. A reshape of a permuted tensor is no view (PyTorch copies it), but the kernel
that reads it maps it as an index map of its load, with every view on the way back to the value it is a view of
(`opfuse.fusion.planner`). A view belongs to one group, though, and one that another node reads too (TinyViT's
permute to [N, H, W, C], read by the window partition and by the residual add) keeps the whole chain out of the
reader's kernel: the copy runs through PyTorch. Views cost nothing, so each such chain gets views of its own from
the first shared one down: the reader's kernel may then map all of them, the other readers keep the original.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph
from opfuse.ir.ops import get_op, view_copies
from opfuse.passes.simplify_attention_masks import remove_dead_cone


def unshare_views(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each copying reshape reads a chain of views no other node reads."""
    graph = graph.copy()
    changes: list[str] = []
    for node in list(graph):
        if node.op != "reshape" or not view_copies(graph, node):
            continue
        users = graph.users()
        chain, value = [], node.inputs[0]
        while _is_view(graph, value):
            chain.append(value)
            value = graph[value].inputs[0]
        shared = [i for i, name in enumerate(chain) if len(users[name]) > 1 or name in graph.outputs]
        if not shared:
            continue
        top = chain[max(shared)]
        others = [u.name for u in users[top] if u.name not in chain and u is not node] or ["the outputs"]
        reader = node
        for name in chain[:max(shared) + 1]:     # from the copy's side: each reader takes a fresh view
            view = graph[name]
            clone = graph.add_node(view.op, list(view.inputs), view.type, dict(view.attrs), name=f"{name}_own",
                                   source=view.source)
            reader.inputs = [clone.name if i == name else i for i in reader.inputs]
            reader = clone
        remove_dead_cone(graph, chain[0])        # the original views this copy alone read
        changes.append(f"{node.name} reads views of its own from {top}, which {', '.join(others)} read too")
    if changes:
        graph.sort()
    return graph, changes


def _is_view(graph: Graph, name: str) -> bool:
    node = graph[name]
    return get_op(node.op).alias and node.op not in ("input", "constant") and bool(node.inputs)
