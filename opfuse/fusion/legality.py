"""Fusion legality: may a producer group and a consumer group become one kernel? (`can_fuse` -> None | reason).

The rules are written over fusion kinds (`opfuse.ir.ops.FusionKind`), TVM style, never over op names. A legal
group has at most one *hub*: an anchor (conv, gemm, attention) or a reduction.

- anchor + epilogue: the anchor followed by elementwise ops of its output's size. An epilogue may read other
  full-size activations from outside (the skip of a residual add: kind RESIDUAL, switch `config.residual`).
  Anchors take no prologue: their operand tiles are loaded as they are.
- reduction + prologue/epilogue: elementwise ops of the reduction's input size before it (the residual add
  before a layer norm, the scale before a softmax), elementwise ops of its output size after it.
- elementwise chain: elementwise ops that all have the same number of elements (no broadcast growth, so the
  kernel iterates over one index space and recomputes nothing).

Everything else is refused with a reason: two anchors (the conv-conv hook, `two_anchor_rule`), an anchor and a
reduction, two reductions, opaque ops, a value the consumer reads that someone outside the pair reads too
(several users), and a merge that would put a group outside the pair both after and before the fused kernel
(a cycle). Choices made here, and why:

- injective ops that copy (cat, embedding) stay single kernels: they write their output in pieces or gather
  rows, so an epilogue would need its own indexing; the traffic an epilogue would save is one elementwise pass.
- views (reshape, permute, slice, expand, identity) never join a kernel group: they cost nothing unfused, and
  the kernel templates index the anchor's output tile or one elementwise index space. A view between two
  groups therefore blocks their fusion; the passes remove no-op views (identity, reshape to the same shape)
  before planning, so only real layout changes remain in the way.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, get_op, kind_of

Users = Mapping[str, Sequence[Node]]


def can_fuse(graph: Graph, producer_nodes: Iterable[str], consumer_nodes: Iterable[str], users: Users,
             config: FusionConfig | None = None, index: Mapping[str, int] | None = None) -> str | None:
    """None when the consumer group may join the producer group in one kernel, else the reason in words.

    `users` is `graph.users()`; `index` (node name -> position in the graph) makes the cycle check cheaper.
    """
    config = config or FusionConfig()
    index = index if index is not None else node_index(graph)
    producer, consumer = set(producer_nodes), set(consumer_nodes)
    merged = producer | consumer
    for rule in (opaque_rule, injective_rule, view_rule):
        reason = rule(graph, merged)
        if reason:
            return reason
    return (several_users_rule(graph, producer, consumer, users, index)
            or structure_rule(graph, merged, users, config, index)
            or residual_rule(graph, merged, users, config, index)
            or cycle_rule(graph, producer, consumer, users, index))


def node_index(graph: Graph) -> dict[str, int]:
    """Position of each node in the graph's topological order."""
    return {name: i for i, name in enumerate(graph.nodes)}


def in_order(names: Iterable[str], index: Mapping[str, int]) -> list[str]:
    return sorted(names, key=index.__getitem__)


# ---- rules on single nodes -----------------------------------------------------------------------------

def opaque_rule(graph: Graph, nodes: Iterable[str]) -> str | None:
    """Opaque ops run through PyTorch and never share a kernel."""
    for name in sorted(nodes):
        node = graph[name]
        if kind_of(node) is FusionKind.OPAQUE:
            target = node.attrs.get("target")
            return f"opaque op {name}{f' ({target})' if target else ''} runs through PyTorch"
    return None


def injective_rule(graph: Graph, nodes: Iterable[str]) -> str | None:
    """Copying injective ops (cat, embedding) stay single kernels (see the module docstring)."""
    for name in sorted(nodes):
        node = graph[name]
        if kind_of(node) is FusionKind.INJECTIVE and not get_op(node.op).alias:
            return f"injective op {name} ({node.op}) stays its own kernel"
    return None


def view_rule(graph: Graph, nodes: Iterable[str]) -> str | None:
    """Views never join a kernel group (see the module docstring)."""
    for name in sorted(nodes):
        if is_view(graph[name]):
            return f"view {name} ({graph[name].op}) cannot join a kernel"
    return None


def is_view(node: Node) -> bool:
    return get_op(node.op).alias


# ---- rules on the pair ---------------------------------------------------------------------------------

def several_users_rule(graph: Graph, producer: set[str], consumer: set[str], users: Users,
                       index: Mapping[str, int]) -> str | None:
    """Each value passed from producer to consumer must be read by the consumer group only."""
    merged = producer | consumer
    shares = False
    for name in in_order(producer, index):
        readers = [u.name for u in users[name]]
        if not any(r in consumer for r in readers):
            continue
        shares = True
        if any(r not in merged for r in readers):
            return f"{name} has several users: {', '.join(dict.fromkeys(readers))}"
    if not shares:
        return "the consumer reads no value of the producer"
    return None


def two_anchor_rule(graph: Graph, first: str, second: str, config: FusionConfig) -> str:
    """Hook for conv-conv fusion (depthwise + pointwise in one kernel), which a later issue enables."""
    return f"two anchors ({first}, {second}): conv-conv fusion not enabled"


def structure_rule(graph: Graph, merged: set[str], users: Users, config: FusionConfig,
                   index: Mapping[str, int]) -> str | None:
    """The merged group must be one hub with elementwise prologue/epilogue, or an elementwise chain."""
    order = in_order(merged, index)
    anchors = [n for n in order if kind_of(graph[n]) is FusionKind.ANCHOR]
    reductions = [n for n in order if kind_of(graph[n]) is FusionKind.REDUCTION]
    if len(anchors) > 1:
        return two_anchor_rule(graph, anchors[0], anchors[1], config)
    if anchors and reductions:
        return (f"reduction {reductions[0]} and anchor {anchors[0]} in one kernel: anchors take elementwise "
                "epilogues only")
    if len(reductions) > 1:
        return f"two reductions ({reductions[0]}, {reductions[1]}) in one kernel"
    for name in order:
        if not kind_of(graph[name]).elementwise and name not in anchors + reductions:
            return f"{name} ({graph[name].op}) is not elementwise"
    if not anchors and not reductions:
        return same_size_rule(graph, order, graph[order[0]].type.numel, "the chain")
    hub = (anchors + reductions)[0]
    after = reachable(graph, hub, merged, users) - {hub}
    before = reachable_backwards(graph, hub, merged) - {hub}
    epilogue = [n for n in order if n in after]
    prologue = [n for n in order if n in before]
    for name in order:
        if name == hub or name in after or name in before:
            continue
        return f"{name} reaches {hub}'s epilogue from a side branch (neither before nor after {hub})"
    if prologue and anchors:
        return f"{prologue[0]} would be a prologue of anchor {hub}: anchors take epilogues only"
    hub_input = graph[graph[hub].inputs[0]].type.numel
    return (same_size_rule(graph, epilogue, graph[hub].type.numel, f"{hub}'s output")
            or same_size_rule(graph, prologue, hub_input, f"{hub}'s input"))


def same_size_rule(graph: Graph, names: Sequence[str], numel: int, what: str) -> str | None:
    """Every node has `numel` elements: no broadcast growth inside a kernel."""
    for name in names:
        if graph[name].type.numel != numel:
            return (f"broadcast growth: {name} has {graph[name].type.numel} elements, {what} {numel} "
                    f"({graph[name].type})")
    return None


def skip_operands(graph: Graph, nodes: Iterable[str], anchor: str, users: Users,
                  index: Mapping[str, int]) -> list[str]:
    """Full-size activations from outside that the anchor's epilogue reads (the skip of a residual add)."""
    node_set = set(nodes)
    size = graph[anchor].type.numel
    skips: list[str] = []
    for name in in_order(reachable(graph, anchor, node_set, users) - {anchor}, index):
        for value in graph[name].inputs:
            if (value not in node_set and value not in skips and not graph.is_constant(value)
                    and graph[value].type.numel == size):
                skips.append(value)
    return skips


def residual_rule(graph: Graph, merged: set[str], users: Users, config: FusionConfig,
                  index: Mapping[str, int]) -> str | None:
    """An epilogue that reads a skip activation is a residual fusion: allowed only with config.residual."""
    if config.residual:
        return None
    for name in in_order(merged, index):
        if kind_of(graph[name]) is FusionKind.ANCHOR:
            skips = skip_operands(graph, merged, name, users, index)
            if skips:
                return f"residual fusion disabled (epilogue of {name} reads {skips[0]})"
    return None


def cycle_rule(graph: Graph, producer: set[str], consumer: set[str], users: Users,
               index: Mapping[str, int]) -> str | None:
    """Merging must not put a node outside the pair both after and before the fused kernel."""
    merged = producer | consumer
    via = path_outside(graph, producer, consumer, merged, users, index) or \
        path_outside(graph, consumer, producer, merged, users, index)
    if via:
        return f"cycle through {via}: it reads one side of the pair and feeds the other"
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
