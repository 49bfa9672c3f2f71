"""Tanh-approximated GELU written out in elementwise ops becomes one `gelu` node with approximate='tanh'.

Entry point: `recognize_gelu(graph)`. GPT-2's `gelu_new` (transformers' NewGELUActivation) and its relatives write

    y = 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))

eight nodes that are `F.gelu(x, approximate='tanh')`. As one node the chain is an activation the library forms know:
cuBLASLt runs linear -> gelu(tanh) as one GEMM with its epilogue (`opfuse.codegen.library_fused`), where the
written-out chain leaves a GEMM and an epilogue kernel; a Triton epilogue computes either form alike.

Matched: ``pow(x, 3)``; ``mul`` by 0.044715; ``add`` of x; ``mul`` by sqrt(2/pi); ``tanh``; ``add`` of 1; then
either ``mul(mul(x, 0.5), that)`` or ``mul(mul(x, that), 0.5)`` (either operand order in every step). The constants
match within float16's rounding (a float16 model's scalars may be rounded); every intermediate but x is read by the
next step alone, and no step changes the dtype.
"""

from __future__ import annotations

import math

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused

_ROUNDING = 2e-3   # relative: float16's spacing near these constants is under 1e-3


def recognize_gelu(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each written-out tanh GELU replaced by one gelu node (approximate='tanh')."""
    graph = graph.copy()
    changes = []
    users = graph.users()
    for node in list(graph):
        if node.name not in graph.nodes or node.op != "tanh":
            continue
        match = _match(graph, users, node)
        if match is None:
            continue
        x, chain = match
        last = chain[-1]
        gelu = graph.add_node("gelu", [x], graph[last].type, {"approximate": "tanh"}, name=f"{last}_gelu",
                              source=graph[last].source)
        graph.replace_uses(last, gelu.name)
        for name in reversed(chain):
            remove_if_unused(graph, name)
        changes.append(f"tanh GELU {', '.join(chain)} is one gelu {gelu.name}")
        users = graph.users()
    if changes:
        graph.sort()
    return graph, changes


def _close(value: float | None, expected: float) -> bool:
    return value is not None and abs(value - expected) <= _ROUNDING * abs(expected)


def _split(graph: Graph, node: Node, op: str, constant: float) -> str | None:
    """The other operand of `node` when it is `op` of one value and a scalar constant near `constant`, else None."""
    if node.op != op or len(node.inputs) != 2 or node.attrs.get("alpha", 1) != 1:
        return None
    for i in (0, 1):
        if _close(graph.scalar_value(node.inputs[i]), constant) and graph.scalar_value(node.inputs[1 - i]) is None:
            return node.inputs[1 - i]
    return None


def _match(graph: Graph, users: dict[str, list[Node]], tanh: Node) -> tuple[str, list[str]] | None:
    """(x, the matched nodes in order) for the tanh GELU around `tanh`, or None."""
    inner = _split(graph, graph[tanh.inputs[0]], "mul", math.sqrt(2 / math.pi))
    if inner is None or graph[inner].op != "add" or len(graph[inner].inputs) != 2:
        return None
    add = graph[inner]
    for i in (0, 1):
        x, cubed = add.inputs[i], graph[add.inputs[1 - i]]
        scaled = _split(graph, cubed, "mul", 0.044715)
        if scaled is not None and graph[scaled].op == "pow" and graph[scaled].inputs[0] == x \
                and graph.scalar_value(graph[scaled].inputs[1]) == 3.0:
            break
    else:
        return None
    chain = [scaled, cubed.name, add.name, tanh.inputs[0], tanh.name]
    one = graph.only_reader(tanh.name, users)
    if one is None or _split(graph, one, "add", 1.0) != tanh.name:
        return None
    chain.append(one.name)
    product = graph.only_reader(one.name, users)
    if product is None or product.op != "mul" or len(product.inputs) != 2:
        return None
    other = graph[next(v for v in product.inputs if v != one.name)] if one.name in product.inputs else None
    if other is None:
        return None
    if _split(graph, other, "mul", 0.5) == x and graph.only_reader(other.name, users) is product:
        chain += [other.name, product.name]           # (0.5 * x) * (1 + tanh(...))
    elif other.name == x:
        half = graph.only_reader(product.name, users)  # (x * (1 + tanh(...))) * 0.5
        if half is None or _split(graph, half, "mul", 0.5) != product.name:
            return None
        chain += [product.name, half.name]
    else:
        return None
    for step, following in zip(chain[:5], chain[1:6]):   # pow ... tanh -> add 1: each read by the next alone
        if graph.only_reader(step, users) is not graph[following]:
            return None
    if len({graph[n].type.dtype for n in chain + [x]}) != 1 or graph[chain[-1]].type != graph[x].type:
        return None
    return x, chain
