"""What the fusion rules share (`opfuse.fusion.legality` and its rule modules, and the planner beside them): the
users map the rules read, the graph's topological order, walks along the edges of a group, and the check that a
kernel's nodes have one size (no broadcast growth).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import Graph, Node

Users = Mapping[str, Sequence[Node]]


def node_index(graph: Graph) -> dict[str, int]:
    """Position of each node in the graph's topological order."""
    return {name: i for i, name in enumerate(graph.nodes)}


def in_order(names: Iterable[str], index: Mapping[str, int]) -> list[str]:
    return sorted(names, key=index.__getitem__)


def same_size_rule(graph: Graph, names: Sequence[str], numel: int, what: str) -> Reason | None:
    """Every node has `numel` elements: no broadcast growth inside a kernel."""
    for name in names:
        if graph[name].type.numel != numel:
            return Reason(Code.BROADCAST_GROWTH, f"broadcast growth: {name} has {graph[name].type.numel} elements, "
                          f"{what} {numel} ({graph[name].type})")
    return None


# ---- graph walks ---------------------------------------------------------------------------------------

def reachable(graph: Graph, start: str, within: set[str], users: Users) -> set[str]:
    """Nodes of `within` reachable from `start` along edges inside `within` (start included)."""
    seen, stack = {start}, [start]
    while stack:
        for user in users[stack.pop()]:
            if user.name in within and user.name not in seen:
                seen.add(user.name)
                stack.append(user.name)
    return seen


def reachable_backwards(graph: Graph, start: str, within: set[str]) -> set[str]:
    """Nodes of `within` that reach `start` along edges inside `within` (start included)."""
    seen, stack = {start}, [start]
    while stack:
        for value in graph[stack.pop()].inputs:
            if value in within and value not in seen:
                seen.add(value)
                stack.append(value)
    return seen


def path_outside(graph: Graph, sources: set[str], targets: set[str], exclude: set[str], users: Users,
                 index: Mapping[str, int]) -> str | None:
    """The first node outside `exclude` on a path from `sources` to `targets`, or None when there is none.

    Only nodes placed before the last target can lie on such a path (the graph is in topological order),
    which keeps the walk short: usually it ends at once.
    """
    if not targets:
        return None
    last = max(index[t] for t in targets)
    origin: dict[str, str] = {}
    stack: list[str] = []
    for name in sources:
        for user in users[name]:
            if user.name not in exclude and user.name not in origin and index[user.name] < last:
                origin[user.name] = user.name
                stack.append(user.name)
    while stack:
        name = stack.pop()
        for user in users[name]:
            if user.name in targets:
                return origin[name]
            if user.name not in exclude and user.name not in origin and index[user.name] < last:
                origin[user.name] = origin[name]
                stack.append(user.name)
    return None
