"""A linear whose two column halves make act(gate) * up as the two linears of a gated pair.

Entry point: `split_gated_linears(graph)`. A GLU MLP written with one projection (Phi-3's `gate_up_proj`, timm's
GluMlp and EVA-02's SwiGLU) computes both halves in one linear, slices its result in two along the features and
multiplies the activated first half by the second. The slices are views an anchor's kernel does not map, so the
linear wrote both halves and a kernel of its own read them back for the activation and the product. As two linears
(the weight's and the bias's rows split at the same place) they are the gated pair the planner fuses into one GEMM
(`opfuse.fusion.legality_anchors.gated_pair`): act(gate) * up computed in its tile, neither half written. Each
output element is the same dot product as before, so the values are unchanged.
"""

from __future__ import annotations

from opfuse.fusion.legality_anchors import gated_product
from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.passes.eliminate_dead_code import remove_if_unused


def split_gated_linears(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each linear read only by the two halves of a gated product split in two linears."""
    graph = graph.copy()
    changes: list[str] = []
    users = graph.users()
    for node in graph:
        halves = _halves(graph, node, users)
        if halves is None:
            continue
        gate, up = next(((a, b) for a, b in (halves, halves[::-1]) if gated_product(graph, a, b, users)), (None, None))
        if gate is None:
            continue
        for half in (gate, up):
            start, end = half.attrs["start"], half.attrs["end"]
            inputs = [node.inputs[0]] + [graph.add_constant(f"{half.name}_{role}", graph.constants[name][start:end]
                                                            .contiguous(), source=node.source).name
                                         for name, role in zip(node.inputs[1:], ("weight", "bias"))]
            linear = graph.add_node("linear", inputs, half.type, name=f"{node.name}_{'gate' if half is gate else 'up'}",
                                    source=node.source)
            graph.replace_uses(half.name, linear.name)
            remove_if_unused(graph, half.name)
        remove_if_unused(graph, node.name)
        graph.sort()
        users = graph.users()
        changes.append(f"linear {node.name} split in the gate and up linears of {gate.name} and {up.name}")
    return graph, changes


def _halves(graph: Graph, node: Node, users) -> tuple[Node, Node] | None:
    """The two slices of `node`'s result that read its first and second half of features, in that order, where
    `node` is a linear with constant weight (and bias) that nothing else reads; else None."""
    if node.op != "linear" or node.name not in graph.nodes or node.name in graph.observed \
            or not all(graph.is_constant(name) for name in node.inputs[1:]):
        return None
    readers = users.get(node.name, [])
    features = node.type.shape[-1]
    last = len(node.type.shape) - 1
    if len(readers) != 2 or features % 2 or any(
            r.op != "slice" or r.attrs["dim"] % len(r.type.shape) != last or r.attrs.get("step", 1) != 1
            for r in readers):
        return None
    first, second = sorted(readers, key=lambda r: r.attrs["start"])
    half = features // 2
    if (first.attrs["start"], first.attrs["end"], second.attrs["start"], second.attrs["end"]) != (0, half, half,
                                                                                                  features):
        return None
    return first, second
