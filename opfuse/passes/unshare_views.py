"""Give each reader of a view chain PyTorch would copy views of its own.

Entry point: `unshare_views(graph)`. A reshape of a permuted tensor is no view (PyTorch copies it), but the kernel
that reads it, or a view of it, maps it as an index map of its load, with every view on the way back to the value
it is a view of (`opfuse.fusion.planner`). A view belongs to one group, though, and one that another node reads too
keeps the whole chain out of the reader's kernel, so the copy runs through PyTorch: TinyViT's permute to [N, H, W,
C], read by its window partition and by the residual add; MobileViT's unfolded patches, read by a layer norm and
by the residual add after the attention. Views cost nothing, so each reader whose kernel maps views (an elementwise
op or a reduction) of a chain of views it maps (no slice) holding such a copy, a view of which another node reads
too, gets the whole chain of its own; the other readers keep the originals (ShuffleNet's shuffle, read through two
slices by convs, stays one copy its producer writes).
"""

from __future__ import annotations

from opfuse.ir.graph import Graph
from opfuse.ir.ops import FusionKind, get_op, view_chain, view_copies
from opfuse.passes.simplify_attention_masks import remove_dead_cone


def unshare_views(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each reader of a copying view chain reads a chain no other node reads."""
    graph = graph.copy()
    changes: list[str] = []
    for reader in list(graph):
        if get_op(reader.op).kind not in MAPPING_READERS:
            continue
        for value in dict.fromkeys(reader.inputs):
            chain = view_chain(graph, value)
            if not any(view_copies(graph, graph[name]) for name in chain) \
                    or any(graph[name].op not in MAPPED for name in chain):
                continue
            readers = {name: {u.name for u in users} for name, users in graph.users().items()}
            shared = [i for i, name in enumerate(chain) if len(readers[name]) > 1 or name in graph.outputs]
            if not shared:
                continue
            top = chain[max(shared)]
            others = sorted(readers[top] - set(chain) - {reader.name}) or ["the outputs"]
            below = reader
            for name in chain:      # from the reader's side, the whole chain (no view of it left shared above)
                view = graph[name]
                clone = graph.add_node(view.op, list(view.inputs), view.type, dict(view.attrs),
                                       name=f"{name}_own", source=view.source)
                below.inputs = [clone.name if i == name else i for i in below.inputs]
                below = clone
            remove_dead_cone(graph, chain[0])        # what only this reader read
            changes.append(f"{reader.name} reads views of its own from {top}, which {', '.join(others)} read too")
    if changes:
        graph.sort()
    return graph, changes


# readers whose kernels map views on their loads (`opfuse.fusion.legality_views.maps_on_load`), and the views they map:
# an anchor's kernel maps none (a copy it reads is written by its producer's kernel, once for all readers)
MAPPING_READERS = (FusionKind.POINTWISE, FusionKind.BROADCAST, FusionKind.REDUCTION)
MAPPED = ("reshape", "permute", "identity", "expand")


