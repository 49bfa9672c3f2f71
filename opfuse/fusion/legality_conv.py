"""Conv-conv chains in one kernel (`two_anchor_rule`, switch `config.conv_conv`; the rule in
`opfuse.fusion.legality`'s docstring): several anchors share a kernel only as [expand 1x1 ->] depthwise -> pointwise
1x1, each inner stage read by the next conv alone and computed per tile from constants. Also the conv shapes the
rules, the cost model and the benchmarks recognize (`is_depthwise_conv`, `is_pointwise_conv`).
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.legality_common import Users, same_size_rule
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import along_channels, kind_of


def two_anchor_rule(graph: Graph, merged: set[str], anchors: Sequence[str], users: Users, config: FusionConfig,
                    index: Mapping[str, int]) -> Reason | None:
    """Several anchors in one kernel: only a conv-conv chain ([expand 1x1 ->] depthwise -> 1x1) is legal."""
    names = ", ".join(anchors)
    prefix = f"two anchors ({names})" if len(anchors) == 2 else f"{len(anchors)} anchors ({names})"
    if not config.conv_conv:
        return Reason(Code.DISABLED, f"{prefix}: conv-conv fusion disabled (config.conv_conv)")
    if len(anchors) > 2 and not config.conv_conv_expand:
        return Reason(Code.DISABLED, f"{prefix}: fusing the expansion conv too is disabled (config.conv_conv_expand)")
    problem = conv_chain_problem(graph, merged, list(anchors), users)
    return Reason(problem.code, f"{prefix}: {problem.text}") if problem else None


def conv_chain_problem(graph: Graph, merged: set[str], anchors: list[str], users: Users) -> Reason | None:
    """Why `anchors` (in order) with the rest of `merged` are no conv-conv kernel, or None when they are one."""
    for name in anchors:
        if graph[name].op != "conv2d":
            return Reason(Code.TWO_ANCHORS,
                          f"{name} ({graph[name].op}) is no convolution: only convolutions chain in one kernel")
    if len(anchors) > 3:
        return Reason(Code.TWO_ANCHORS, "at most three convolutions (expand, depthwise, pointwise) chain in one kernel")
    stages = conv_stages(graph, merged, anchors)
    owner = {name: i for i, stage in enumerate(stages) for name in stage}
    for i, (earlier, later) in enumerate(zip(anchors, anchors[1:])):
        if owner.get(graph[later].inputs[0]) != i:
            return Reason(Code.TWO_ANCHORS, f"{earlier} does not feed {later}: convolutions share a kernel only as "
                          "a chain, each reading the previous one's result (depthwise into 1x1)")
    if len(anchors) == 2 and is_pointwise_conv(graph, anchors[0]) and is_depthwise_conv(graph, anchors[1]):
        return Reason(Code.EXPAND_ALONE, f"the 1x1 conv {anchors[0]} joins the depthwise conv {anchors[1]} only "
                      f"together with {anchors[1]}'s pointwise conv (the whole inverted-residual block)")
    *expand, depthwise, pointwise = anchors
    if not is_depthwise_conv(graph, depthwise):
        return Reason(Code.CONV_SHAPE, f"{depthwise} is not a depthwise conv (groups == in == out channels): "
                      "conv-conv fusion takes a depthwise conv feeding a 1x1 conv")
    for name in expand + [pointwise]:
        if not is_pointwise_conv(graph, name):
            return Reason(Code.CONV_SHAPE, f"{name} is not a 1x1 conv (stride 1, no padding, groups 1)")
    for name in anchors:
        for value in graph[name].inputs[1:]:
            if not graph.is_constant(value):
                return Reason(Code.INNER_OPERAND, f"{name} reads {value} as weight or bias, not a constant")
    for name in sorted(merged - set(owner)):
        return Reason(Code.ANCHOR_PROLOGUE, f"{name} would be a prologue of {anchors[0]}: anchors take epilogues only")
    for i, stage in enumerate(stages):
        anchor = stage[0]
        for name in stage[1:]:
            if not kind_of(graph[name]).elementwise:
                return Reason(Code.NOT_ELEMENTWISE, f"{name} ({graph[name].op}) is not elementwise")
            for value in graph[name].inputs:
                if owner.get(value, i) < i:
                    return Reason(Code.INNER_READ, f"{name} reads {value} from the chain of {stages[owner[value]][0]}, "
                                  "which is never written")
        problem = same_size_rule(graph, stage[1:], graph[anchor].type.numel, f"{anchor}'s output")
        if problem:
            return problem
        if i == len(stages) - 1:
            break
        following = stages[i + 1][0]
        handed = graph[following].inputs[0]
        for name in stage:
            readers = [u.name for u in users[name] if u.name not in stage and not
                       (name == handed and u.name == following)]
            if readers or name in graph.outputs:
                who = ", ".join(dict.fromkeys(readers)) or "the graph's outputs"
                return Reason(Code.INNER_READ, f"{name} is read by {who}: the {graph[anchor].op} result of {anchor} "
                              "stays in registers in a conv-conv kernel")
        problem = constant_operands_only(graph, stage, owner)
        if problem:
            return problem
    return None


def constant_operands_only(graph: Graph, stage: Sequence[str], owner: Mapping[str, int]) -> Reason | None:
    """An inner stage is recomputed per tile from constants: scalars and per-channel vectors only."""
    for name in stage[1:]:
        node = graph[name]
        for position, value in enumerate(node.inputs):
            if value in owner:
                continue
            if not graph.is_constant(value):
                return Reason(Code.INNER_OPERAND, f"{name} reads activation {value}: an inner conv's epilogue takes "
                              "constant operands only (bias, scale, clamp bounds)")
            shape = graph[value].type.shape
            aligned = (1,) * (len(node.type.shape) - len(shape)) + tuple(shape)   # broadcasting aligns right
            per_channel = all(size == 1 for dim, size in enumerate(aligned) if dim != 1)
            if not (per_channel or along_channels(node, position)):
                return Reason(Code.INNER_OPERAND, f"{name} reads constant {value} {graph[value].type}, which varies "
                              "along more than the channels")
    return None


def conv_stages(graph: Graph, nodes: Iterable[str], anchors: Sequence[str]) -> list[list[str]]:
    """Per anchor of a conv chain, the anchor and its epilogue (the nodes of `nodes` it reaches before the next
    anchor), in topological order; nodes reached from no anchor are left out."""
    within = set(nodes)
    order = {name: i for i, name in enumerate(graph.nodes)}
    owner: dict[str, int] = {}
    for name in sorted(within, key=order.__getitem__):
        if name in anchors:
            owner[name] = anchors.index(name)
            continue
        sources = [owner[v] for v in graph[name].inputs if v in owner]
        if sources:
            owner[name] = max(sources)
    return [[n for n in sorted(owner, key=order.__getitem__) if owner[n] == i] for i in range(len(anchors))]


def conv_pairs(node: Node, attr: str, default: int) -> tuple[int, int]:
    value = node.attrs.get(attr, default)
    return (value, value) if isinstance(value, int) else tuple(value)


def is_depthwise_conv(graph: Graph, name: str) -> bool:
    """A conv2d with one filter per channel: groups == input channels == output channels."""
    node = graph[name]
    if node.op != "conv2d" or len(node.type.shape) != 4:
        return False
    channels = graph[node.inputs[0]].type.shape[1]
    return node.attrs.get("groups", 1) == channels == node.type.shape[1]


def is_pointwise_conv(graph: Graph, name: str) -> bool:
    """A 1x1 conv2d with stride 1, no padding and one group: a GEMM over pixels."""
    node = graph[name]
    if node.op != "conv2d" or len(node.type.shape) != 4:
        return False
    return (tuple(graph[node.inputs[1]].type.shape[2:]) == (1, 1) and node.attrs.get("groups", 1) == 1
            and conv_pairs(node, "stride", 1) == (1, 1) and conv_pairs(node, "padding", 0) == (0, 0))
