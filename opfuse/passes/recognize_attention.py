"""Attention written out in matmuls and a softmax becomes one `sdpa` node.

Entry point: `recognize_attention(graph)`. Models that write attention by hand (torchvision's Swin, transformers'
"eager" attention) and every ONNX export (the exporter decomposes scaled_dot_product_attention) compute

    scores = (q * s_q) @ (kT * s_k)            kT: keys with their last two dims swapped, s_q, s_k scalars
    scores = f(scores)                         scalar scales, additive masks, reshapes that restore the shape
    out = softmax(scores, dim=-1) @ v

three kernels or more, with the [.., queries, keys] score matrix written to device memory and read back twice. As
one `sdpa` (scale s_q * s_k * alpha, the mask M) it is PyTorch's fused attention or opfuse's own kernel, and the
score matrix never leaves the chip.

Matched, by ops and shapes (never by names): a softmax over the last dim whose only reader is a matmul by v, and
whose input is reached from a matmul of two operands through single-reader steps `f` of the kinds mul or div by a
one-element constant, add or sub of a constant, add of one non-constant tensor (a mask computed at run time; then
no other step but scalar factors before it), and reshapes, as long as the chain ends in the score matrix's own shape.
Such an f is affine, f(x) = alpha * x + M: alpha is the product of the scalar factors, M = f(0) (evaluated here,
from constants alone; it is the mask, dropped when it is zero, and no larger than `MASK_BYTES`). The three operands keep equal batch dims (no
broadcast between them) and one float dtype. The pass runs before `simplify_attention_masks`, which then drops,
makes causal or compacts M as it does for any compile-time mask.
"""

from __future__ import annotations

import math

import torch

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.ir.ops import get_op
from opfuse.passes.eliminate_dead_code import remove_if_unused
from opfuse.passes.simplify_attention_masks import MASK_BYTES

SCALES = ("mul", "div")
SHIFTS = ("add", "sub")


def recognize_attention(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each written-out attention replaced by one sdpa node."""
    graph = graph.copy()
    changes: list[str] = []
    users = graph.users()
    for node in list(graph):
        if node.name not in graph.nodes or node.op != "matmul":
            continue
        match = _match(graph, users, node)
        if match is None:
            continue
        (q, q_steps), (key_t, k_steps), v, chain, mask, alpha, softmax, second = match
        scale = alpha * _factor(graph, q_steps) * _factor(graph, k_steps)
        shape = graph[key_t].type.shape
        dims = list(range(len(shape)))
        dims[-2], dims[-1] = dims[-1], dims[-2]
        k_type = TensorType(tuple(shape[d] for d in dims), graph[key_t].type.dtype)
        keys = graph.add_node("permute", [key_t], k_type, {"dims": tuple(dims)}, name=f"{second.name}_keys",
                              source=second.source)
        inputs = [q, keys.name, v] + ([mask] if mask is not None else [])
        fused = graph.add_node("sdpa", inputs, second.type, {"is_causal": False, "scale": scale},
                               name=f"{second.name}_sdpa", source=second.source)
        graph.replace_uses(second.name, fused.name)
        for name in reversed([*q_steps, *k_steps, node.name, *chain, softmax.name, second.name]):
            remove_if_unused(graph, name)
        changes.append(f"attention {node.name} .. {second.name} is one sdpa {fused.name} (scale {scale:.4g}"
                       + (", masked)" if mask is not None else ")"))
        users = graph.users()
    if changes:
        graph.sort()
    return graph, changes


def _only_user(graph: Graph, users: dict[str, list[Node]], name: str) -> Node | None:
    readers = users[name]
    if len(readers) != 1 or name in graph.outputs:
        return None
    return readers[0]


def _scalar(graph: Graph, name: str) -> float | None:
    if not graph.is_constant(name) or graph[name].type.numel != 1:
        return None
    return float(graph.constants[name].reshape(()).item())


def _scalar_operand(graph: Graph, node: Node) -> tuple[str, float] | None:
    """(the other operand, the factor) of a mul or div of a value by a one-element constant."""
    if node.op not in SCALES or len(node.inputs) != 2:
        return None
    for position in (1, 0) if node.op == "mul" else (1,):
        value = _scalar(graph, node.inputs[position])
        if value is not None and value != 0.0:
            return node.inputs[1 - position], value if node.op == "mul" else 1.0 / value
    return None


def _peel_scales(graph: Graph, users: dict[str, list[Node]], name: str, reader: Node) -> tuple[str, list[str]]:
    """The value under scalar muls/divs that only lead to `reader`, and those steps (outermost first)."""
    steps = []
    node = graph[name]
    while (scaled := _scalar_operand(graph, node)) is not None and _only_user(graph, users, node.name) is reader:
        steps.append(node.name)
        reader, node = node, graph[scaled[0]]
    return node.name, steps


def _factor(graph: Graph, steps: list[str]) -> float:
    return math.prod(_scalar_operand(graph, graph[name])[1] for name in steps)


def _match(graph: Graph, users: dict[str, list[Node]], first: Node):
    """((q, its scale steps), (kT, its scale steps), v, the score steps, the mask or None, alpha, the softmax, the
    second matmul) of the attention that starts at matmul `first`, or None."""
    scores = first.type
    rank = len(scores.shape)
    if rank < 3 or not scores.dtype.startswith(("float", "bfloat")):
        return None
    chain: list[str] = []           # the score steps after `first`, in order; each reads the one before it
    carrier = first
    while True:
        step = _only_user(graph, users, carrier.name)
        if step is None:
            return None
        if step.op == "softmax":
            break
        if not _score_step(graph, step, carrier.name):
            return None
        chain.append(step.name)
        carrier = step
    softmax = step
    if softmax.attrs.get("dim") not in (rank - 1, -1) or softmax.type != scores:
        return None
    second = _only_user(graph, users, softmax.name)
    if second is None or second.op != "matmul" or second.inputs[0] != softmax.name or second.inputs[1] == softmax.name:
        return None
    q, q_steps = _peel_scales(graph, users, first.inputs[0], first)
    key_t, k_steps = _peel_scales(graph, users, first.inputs[1], first)
    v = second.inputs[1]
    shapes = [graph[name].type.shape for name in (q, key_t, v)]
    if any(len(s) != rank for s in shapes) or len({s[:-2] for s in shapes + [scores.shape]}) != 1:
        return None
    (queries, depth), (depth_k, keys), (keys_v, _) = (s[-2:] for s in shapes)
    if depth != depth_k or keys != keys_v or scores.shape[-2:] != (queries, keys):
        return None
    if len({graph[name].type.dtype for name in (q, key_t, v)} | {scores.dtype}) != 1:
        return None
    affine = _affine(graph, [first.name, *chain], scores)
    if affine is None:
        return None
    alpha, mask = affine
    return (q, q_steps), (key_t, k_steps), v, chain, mask, alpha, softmax, second


def _score_step(graph: Graph, node: Node, carrier: str) -> bool:
    """Whether `node` is a step of the affine chain on the scores `carrier`."""
    if node.op == "reshape":
        return True
    scaled = _scalar_operand(graph, node)
    if scaled is not None:
        return scaled[0] == carrier
    return (node.op in SHIFTS and len(node.inputs) == 2 and node.inputs.count(carrier) == 1
            and (node.op == "add" or node.inputs[0] == carrier) and node.type == graph[carrier].type)


def _affine(graph: Graph, chain: list[str], scores: TensorType) -> tuple[float, str | None] | None:
    """(alpha, the mask: a new constant, a run-time tensor, or None) of the chain f(x) = alpha * x + M that follows
    the matmul `chain[0]`."""
    alpha = 1.0
    runtime_mask = None
    shifted = False
    for carrier, name in zip(chain, chain[1:]):
        node = graph[name]
        scaled = _scalar_operand(graph, node)
        if scaled is not None:
            alpha *= scaled[1]
            if shifted and runtime_mask is not None:    # a factor after a run-time mask would scale it
                return None
            continue
        if node.op == "reshape":
            if runtime_mask is not None:
                return None
            continue
        shift = next(i for i in node.inputs if i != carrier)
        if not graph.is_constant(shift):
            if (node.op != "add" or shifted or graph[shift].type.dtype != scores.dtype
                    or any(graph[n].op == "reshape" for n in chain)):
                return None
            runtime_mask = shift
        shifted = True
    if runtime_mask is not None:
        return alpha, runtime_mask
    if not shifted:
        return alpha, None
    if scores.nbytes > MASK_BYTES:
        return None
    exact = torch.float64 if scores.dtype == "float64" else torch.float32
    current = torch.zeros(scores.shape, dtype=exact)     # M = f(0)
    for carrier, name in zip(chain, chain[1:]):
        node = graph[name]
        args = [current if i == carrier else graph.constants[i].to(exact) for i in node.inputs]
        current = get_op(node.op).run(args, node.attrs)
    if tuple(current.shape) != scores.shape:
        return None
    if not torch.any(current != 0):
        return alpha, None
    dtype = getattr(torch, scores.dtype)
    mask = graph.add_constant(graph.unique_name(f"{chain[-1]}_mask"), current.to(dtype).contiguous(),
                              source=graph[chain[-1]].source)
    return alpha, mask.name
