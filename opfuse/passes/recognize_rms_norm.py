"""RMS normalisation written out in elementwise ops becomes one `rms_norm` node.

Entry point: `recognize_rms_norm(graph)`. T5, LLaMA and their relatives write it as

    y = x * rsqrt(mean(x ** 2, dim=-1, keepdim=True) + eps)      [then weight * y]

five or six nodes, which the planner can only cut in two kernels: the mean is a reduction whose output (one value
a row) is what it may take as an epilogue, and the final multiply is input-sized. As one `rms_norm` node (a row
reduction like `layer_norm`, whose template writes the normalised row) it is one kernel reading x once.

Matched: ``pow(x, 2)`` or ``mul(x, x)``; ``mean`` over the last dim with keepdim; ``add`` of a one-element constant
eps; ``rsqrt``; ``mul`` by x (either operand order); optionally a ``mul`` by a constant weight that varies along
the last dim only. Every intermediate is read by the next step alone, and no step changes the dtype.

A float16 model's norm upcasts to float32 before squaring (T5's ``x.to(float32).pow(2)``); `cast_precision`
makes those casts no-ops, which would leave x^2 to overflow past 256 in float16. `rms_norm` computes in float32
(its reference and its kernel), so the node restores what the model meant.
"""

from __future__ import annotations

import torch

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused


def recognize_rms_norm(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each written-out RMS norm replaced by one rms_norm node."""
    graph = graph.copy()
    changes = []
    users = graph.users()
    for node in graph:
        if node.name not in graph.nodes or node.op != "rsqrt":
            continue
        match = _match(graph, users, node)
        if match is None:
            continue
        x, eps, chain, weight = match
        last = chain[-1]
        inputs = [x] + ([weight] if weight is not None else [])
        fused = graph.add_node("rms_norm", inputs, graph[last].type, {"eps": eps}, name=f"{last}_rms_norm",
                               source=graph[last].source)
        graph.replace_uses(last, fused.name)
        for name in reversed(chain):
            remove_if_unused(graph, name)
        changes.append(f"rms norm {', '.join(chain)} is one rms_norm {fused.name}")
        users = graph.users()      # readers changed: x's, the weight's, and the norm's output
    if changes:
        graph.sort()
    return graph, changes


def _match(graph: Graph, users: dict[str, list[Node]], rsqrt: Node) -> tuple[str, float, list[str], str | None] | None:
    """(x, eps, the matched nodes in order, the weight or None) for the RMS norm around `rsqrt`, or None."""
    add = graph[rsqrt.inputs[0]]
    if add.op != "add":
        return None
    eps_position = next((i for i, v in enumerate(add.inputs) if graph.scalar_value(v) is not None), None)
    if eps_position is None:
        return None
    mean = graph[add.inputs[1 - eps_position]]
    rank = len(mean.type.shape)
    if (mean.op != "mean" or not mean.attrs.get("keepdim") or list(mean.attrs.get("dims", [])) != [rank - 1]
            or rank == 0):
        return None
    square = graph[mean.inputs[0]]
    if square.op == "pow" and graph.scalar_value(square.inputs[1]) == 2.0:
        x = square.inputs[0]
    elif square.op == "mul" and square.inputs[0] == square.inputs[1]:
        x = square.inputs[0]
    else:
        return None
    scale = graph.only_reader(rsqrt.name, users)
    if scale is None or scale.op != "mul" or sorted(scale.inputs) != sorted([x, rsqrt.name]):
        return None
    for step, following in ((square, mean), (mean, add), (add, rsqrt)):
        if graph.only_reader(step.name, users) is not following:
            return None
    chain = [square.name, mean.name, add.name, rsqrt.name, scale.name]
    if len({graph[n].type.dtype for n in chain + [x]}) != 1 or scale.type != graph[x].type:
        return None
    weight = None
    then = graph.only_reader(scale.name, users)
    if then is not None and then.op == "mul" and then.type == scale.type:
        other = next((v for v in then.inputs if v != scale.name), None)
        if other is not None and _last_dim_weight(graph, other, scale.type.shape[-1]):
            weight = _flat_weight(graph, other)
            chain.append(then.name)
    eps = graph.scalar_value(add.inputs[eps_position])
    return x, eps, chain, weight


def _last_dim_weight(graph: Graph, name: str, size: int) -> bool:
    """A constant that varies along the last dim only, of that dim's size."""
    node = graph[name]
    return graph.is_constant(name) and node.type.numel == size and node.type.shape[-1:] == (size,)


def _flat_weight(graph: Graph, name: str) -> str:
    """The weight as a [D] constant (a new one where it had leading 1s)."""
    if len(graph[name].type.shape) == 1:
        return name
    tensor: torch.Tensor = graph.constants[name].reshape(-1)
    return graph.add_constant(graph.unique_name(f"{name}_flat"), tensor, source=graph[name].source).name
