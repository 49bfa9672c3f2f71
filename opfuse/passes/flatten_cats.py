"""A cat read only by a cat along the same dim is spliced into it: `flatten_cats(graph)`.

cat([a, cat([b, c], d), e], d) is cat([a, b, c, e], d). Inception's last blocks concatenate the halves of a branch,
then the branches: as one cat, each part is a slice of the one buffer its producer may store into
(`opfuse.fusion.concat_in_place`), where nested the inner cat is a copy of its own.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph


def flatten_cats(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each cat's parts that are cats along its dim, read by it once and by nothing else
    (and no graph output or state update), are replaced by their own parts."""
    graph = graph.copy()
    changes = []
    users = graph.users()
    for node in list(graph):
        if node.op != "cat":
            continue
        rank = len(node.type.shape)
        parts: list[str] = []
        for name in node.inputs:
            inner = graph[name]
            if (inner.op == "cat" and inner.attrs["dim"] % rank == node.attrs["dim"] % rank
                    and name not in graph.observed and graph.only_reader(name, users) is node):
                parts.extend(inner.inputs)
                graph.remove(name)
                changes.append(f"cat {name} spliced into cat {node.name}")
            else:
                parts.append(name)
        if len(parts) != len(node.inputs):
            node.inputs = parts
            users = graph.users()
    return graph, changes
