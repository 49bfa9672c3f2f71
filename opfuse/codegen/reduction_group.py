"""A group of one reduction, as the row-reduction and pooling templates take it: its reduction node
(`reduction_node`), the outputs it writes before and after the reduction (`split_outputs`), and their stores
(`store_outputs`, `store_epilogue`).
"""

from __future__ import annotations

from typing import Sequence

from opfuse.codegen.coordinates import Coords
from opfuse.codegen.expr import SUPPORTED_OPS, Unsupported
from opfuse.codegen.operands import VIEW_OPS, Region
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, kind_of


def reduction_node(graph: Graph, group: FusionGroup) -> Node:
    """The group's one reduction; every other node must be elementwise or a view."""
    reductions = [graph[n] for n in group.nodes if kind_of(graph[n]) is FusionKind.REDUCTION]
    if len(reductions) != 1:
        raise Unsupported(f"group {group.name} holds {len(reductions)} reductions; the template takes one",
                          Code.EPILOGUE_FORM)
    for name in group.nodes:
        node = graph[name]
        if node is not reductions[0] and node.op not in SUPPORTED_OPS and node.op not in VIEW_OPS:
            raise Unsupported(f"node {node.describe()} in group {group.name} is neither elementwise nor a view",
                              Code.EPILOGUE_FORM)
    return reductions[0]


def split_outputs(graph: Graph, group: FusionGroup, node: Node) -> tuple[list[str], list[str]]:
    """Group outputs computed before the reduction (prologue) and from it (epilogue), with their sizes checked."""
    after = {node.name}
    for name in group.nodes:
        if any(i in after for i in graph[name].inputs):
            after.add(name)
    x_numel = graph[node.inputs[0]].type.numel
    prologue = [o for o in group.outputs if o not in after]
    epilogue = [o for o in group.outputs if o in after]
    for o in prologue:
        if graph[o].type.numel != x_numel:
            raise Unsupported(f"prologue output {graph[o].describe()} is not the size of the reduction input",
                              Code.EPILOGUE_FORM)
    for o in epilogue:
        if graph[o].type.numel != node.type.numel:
            raise Unsupported(f"epilogue output {graph[o].describe()} is not the size of {node.describe()}",
                              Code.EPILOGUE_FORM)
    return prologue, epilogue


def store_outputs(region: Region, outputs: Sequence[str], coords: Coords, shape: Sequence[int]) -> None:
    """Store each output at `coords` of `shape`, mapped through row-major order when its own shape differs."""
    for o in outputs:
        own = region.graph[o].type.shape
        region.store(o, coords if tuple(own) == tuple(shape) else region.reshape_coords(coords, shape, own))


def store_epilogue(region: Region, group: FusionGroup, node: Node, coords: Coords, outputs: Sequence[str]) -> None:
    """Store the epilogue `outputs` of reduction `node`, bound at `coords`. A view after the reduction (group norm's
    reshape back to [N, C, H, W], the permutes and reshapes of a copy the kernel writes directly) maps the
    coordinates forward: its value at the mapped coordinates is its input's at the input's (bound so, no round trip
    through div/mod back to `coords`), and an op after it is computed at the coordinates of the value it reads from
    the reduction. An output found at no mapped coordinates (another shape) is stored through row-major order."""
    graph = region.graph
    at: dict[str, Coords] = {node.name: tuple(coords)}
    for name in group.nodes:
        current = graph[name]
        if name in at or not any(i in at for i in current.inputs):
            continue
        source = current.inputs[0]
        if current.op in ("reshape", "identity", "permute") and source in at:
            inner = at[source]
            if current.op == "permute":
                own = tuple(inner[d % len(inner)] for d in current.attrs["dims"])
            elif current.op == "identity":
                own = inner
            else:
                own = region.reshape_coords(inner, graph[source].type.shape, current.type.shape)
            region.bind(name, own, region.held(source, inner))
            at[name] = own
        else:       # elementwise: at the coordinates of the value of its shape it reads from the reduction
            same = [at[i] for i in current.inputs if i in at and graph[i].type.shape == current.type.shape]
            if same:
                at[name] = same[0]
    shape = tuple(node.type.shape)
    for o in outputs:
        own = graph[o].type.shape
        mapped = at.get(o) if len(at.get(o, ())) == len(own) else None
        region.store(o, mapped if mapped is not None else region.reshape_coords(coords, shape, own))
