"""Dead-code elimination: drop every node (and its constant tensor) that no output and no state update depends on.

Entry point: `eliminate_dead_code(graph)`. Input nodes always stay, even unread: they are the compiled
model's signature. `remove_if_unused` is the one-node version other passes use to clean up what they orphan.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph


def eliminate_dead_code(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` without the nodes no output reads, directly or indirectly."""
    graph = graph.copy()
    live: set[str] = set()
    pending = graph.observed
    while pending:
        name = pending.pop()
        if name not in live:
            live.add(name)
            pending.extend(graph[name].inputs)
    changes = []
    for node in graph:
        if node.name not in live and node.op != "input":
            graph.remove(node.name)
            changes.append(f"removed dead {node.op} {node.name}")
    return graph, changes


def remove_if_unused(graph: Graph, name: str) -> bool:
    """Remove node `name` (never an input) if no node and no output reads it; says whether it did."""
    node = graph.nodes.get(name)
    if node is None or node.op == "input" or name in graph.observed:
        return False
    if any(name in other.inputs for other in graph.nodes.values()):
        return False
    graph.remove(name)
    return True
