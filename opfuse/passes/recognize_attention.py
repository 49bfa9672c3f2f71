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
one-element constant, add or sub of a constant, add of one non-constant tensor (a mask computed at run time: no
other shift, and no reshape or factor after it), and reshapes of the batch dims (a bmm over merged batch dims, as
a capture may decompose a 4-D matmul; the second matmul may read the softmax through one reshape back).
Such an f is affine, f(x) = alpha * x + M: alpha is the product of the scalar factors, M = f(0) (evaluated here,
from constants alone; it is the mask, dropped when it is zero, and no larger than `MASK_BYTES`); or, as Gemma 2
caps its scores, a scaling, one tanh, then such an affine f: f(x) = c * tanh(a * x) + M with c > 0 is the sdpa's
softcap c with scale a * c (`_softcap`). The three operands
keep equal batch dims (no broadcast between them) and one float dtype, and no peeled step changes a dtype. One
difference in meaning: a row whose every key a mask sets to -inf is NaN written out and 0 as sdpa (PyTorch's and
opfuse's). The pass runs after `remove_noop_layout` (a decomposed matmul's expands to the same shape are gone) and
before `simplify_attention_masks`, which then drops, makes causal or compacts M as it does for any compile-time
mask.
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
        (q, q_steps), (key_t, k_steps), v, chain, mask, alpha, cap, softmax, merge, second = match
        scale = alpha * _factor(graph, q_steps) * _factor(graph, k_steps)
        lead = softmax.type.shape[:-2]       # the batch dims the softmax has (a bmm's are merged: reshaped back)
        q, key_t, v = (_with_lead(graph, name, lead, second) for name in (q, key_t, v))
        shape = graph[key_t].type.shape
        dims = list(range(len(shape)))
        dims[-2], dims[-1] = dims[-1], dims[-2]
        k_type = TensorType(tuple(shape[d] for d in dims), graph[key_t].type.dtype)
        keys = graph.add_node("permute", [key_t], k_type, {"dims": tuple(dims)}, name=f"{second.name}_keys",
                              source=second.source)
        inputs = [q, keys.name, v] + ([mask] if mask is not None else [])
        out_type = TensorType(lead + second.type.shape[-2:], second.type.dtype)
        attrs = {"is_causal": False, "scale": scale} | ({"softcap": cap} if cap else {})
        fused = graph.add_node("sdpa", inputs, out_type, attrs, name=f"{second.name}_sdpa", source=second.source)
        result = _with_lead(graph, fused.name, second.type.shape[:-2], second)
        graph.replace_uses(second.name, result)
        steps = [*q_steps, *k_steps, node.name, *chain, softmax.name, *([merge] if merge else []), second.name]
        for name in reversed(steps):
            remove_if_unused(graph, name)
        changes.append(f"attention {node.name} .. {second.name} is one sdpa {fused.name} (scale {scale:.4g}"
                       + (f", softcap {cap:.4g}" if cap else "") + (", masked)" if mask is not None else ")"))
        users = graph.users()
    if changes:
        graph.sort()
    return graph, changes


def _scalar_operand(graph: Graph, node: Node) -> tuple[str, float] | None:
    """(the other operand, the factor) of a mul or div of a value by a one-element constant."""
    if node.op not in SCALES or len(node.inputs) != 2:
        return None
    for position in (1, 0) if node.op == "mul" else (1,):
        value = graph.scalar_value(node.inputs[position])
        if value is not None and value != 0.0:
            return node.inputs[1 - position], value if node.op == "mul" else 1.0 / value
    return None


def _peel_scales(graph: Graph, users: dict[str, list[Node]], name: str, reader: Node, scales: bool = True
                 ) -> tuple[str, list[str]]:
    """The value under scalar muls/divs (with `scales`) and reshapes of batch dims that only lead to `reader`, and
    those steps (outermost first). The value may have other batch dims than `name`: the caller reshapes it, so a
    decomposed bmm's merge (a copy where its source is permuted) is not kept."""
    steps: list[str] = []
    node = graph[name]
    while graph.only_reader(node.name, users) is reader:
        scaled = _scalar_operand(graph, node) if scales else None
        if scaled is not None:
            below = scaled[0]
        elif node.op == "reshape" and graph[node.inputs[0]].type.shape[-2:] == node.type.shape[-2:]:
            below = node.inputs[0]
        else:
            break
        if graph[below].type.dtype != node.type.dtype:   # a scale that promotes (a float64 [1] constant) stays
            break
        steps.append(node.name)
        reader, node = node, graph[below]
    return node.name, steps


def _factor(graph: Graph, steps: list[str]) -> float:
    """The product of the scalar factors among `steps` (reshapes are 1)."""
    return math.prod(scaled[1] for name in steps if (scaled := _scalar_operand(graph, graph[name])) is not None)


def _match(graph: Graph, users: dict[str, list[Node]], first: Node):
    """((q, its scale steps), (kT, its and v's peeled steps), v, the score steps, the mask or None, alpha, the softmax, the
    reshape between the softmax and the second matmul or None, the second matmul) of the attention that starts at
    matmul `first`, or None. Batched matmuls over merged batch dims (what `q @ k.transpose(-2, -1)` on 4-D tensors
    becomes when a capture decomposes it: reshapes to 3-D, bmm, a reshape back) are matched as well: the softmax may
    see the scores through reshapes of their batch dims, and the second matmul read it through one."""
    scores = first.type
    rank = len(scores.shape)
    if rank < 3 or not scores.dtype.startswith(("float", "bfloat")):
        return None
    chain: list[str] = []           # the score steps after `first`, in order; each reads the one before it
    carrier = first
    while True:
        step = graph.only_reader(carrier.name, users)
        if step is None:
            return None
        if step.op == "softmax":
            break
        if not _score_step(graph, step, carrier.name):
            return None
        chain.append(step.name)
        carrier = step
    softmax = step
    shape = softmax.type.shape
    if (softmax.attrs.get("dim") not in (len(shape) - 1, -1) or len(shape) < 3 or softmax.type.dtype != scores.dtype
            or shape[-2:] != scores.shape[-2:] or softmax.type.numel != scores.numel):
        return None
    second = graph.only_reader(softmax.name, users)
    merge = None
    if second is not None and second.op == "reshape" and second.type.shape == scores.shape:
        merge, second = second.name, graph.only_reader(second.name, users)
    probabilities = merge or softmax.name
    if (second is None or second.op != "matmul" or second.inputs[0] != probabilities
            or second.inputs[1] == probabilities):
        return None
    v = second.inputs[1]
    shapes = [graph[name].type.shape for name in (*first.inputs[:2], v)]
    if any(len(s) != rank for s in shapes) or len({s[:-2] for s in shapes + [scores.shape]}) != 1:
        return None
    if math.prod(second.type.shape[:-2]) != math.prod(scores.shape[:-2]):   # v broadcast against other batches
        return None
    if second.type.dtype != scores.dtype:
        return None
    (queries, depth), (depth_k, keys), (keys_v, _) = (s[-2:] for s in shapes)
    if depth != depth_k or keys != keys_v or scores.shape[-2:] != (queries, keys):
        return None
    if len({graph[name].type.dtype for name in (*first.inputs[:2], v)} | {scores.dtype}) != 1:
        return None
    q, q_steps = _peel_scales(graph, users, first.inputs[0], first)
    key_t, k_steps = _peel_scales(graph, users, first.inputs[1], first)
    v, v_steps = _peel_scales(graph, users, v, second, scales=False)
    capped = _softcap(graph, [first.name, *chain], scores, shape)
    if capped is None:
        return None
    alpha, cap, mask = capped
    return (q, q_steps), (key_t, k_steps + v_steps), v, chain, mask, alpha, cap, softmax, merge, second


def _softcap(graph: Graph, chain: list[str], scores: TensorType, shape: tuple[int, ...]
             ) -> tuple[float, float | None, str | None] | None:
    """(the scale, the softcap or None, the mask) of the score chain after the matmul `chain[0]`: affine
    (`_affine`), or, with one tanh in it (Gemma 2's softcapping), a scaling before the tanh and an affine
    c·t + M after it, c > 0: c·tanh(S / c) + M with S the scores scaled by c times the factors before the tanh."""
    tanhs = [i for i, name in enumerate(chain) if graph[name].op == "tanh"]
    if not tanhs:
        affine = _affine(graph, chain, scores, shape)
        return None if affine is None else (affine[0], None, affine[1])
    if len(tanhs) > 1:
        return None
    before = _affine(graph, chain[:tanhs[0] + 1], scores, shape)      # the tanh's own step: a reshape-like 1
    after = _affine(graph, chain[tanhs[0]:], scores, shape)
    if before is None or after is None or before[1] is not None or after[0] <= 0:
        return None
    return before[0] * after[0], after[0], after[1]


def _with_lead(graph: Graph, name: str, lead: tuple[int, ...], near: Node) -> str:
    """`name` with batch dims `lead` (a reshape of its batch dims, or itself when it has them)."""
    node = graph[name]
    if node.type.shape[:-2] == lead:
        return name
    shape = lead + node.type.shape[-2:]
    return graph.add_node("reshape", [name], TensorType(shape, node.type.dtype), {"shape": shape},
                          name=f"{name}_batched", source=near.source).name


def _score_step(graph: Graph, node: Node, carrier: str) -> bool:
    """Whether `node` is a step of the chain on the scores `carrier`: affine, or a tanh (`_softcap`)."""
    if node.op == "reshape" or node.op == "tanh" and node.inputs == [carrier]:
        return True
    scaled = _scalar_operand(graph, node)
    if scaled is not None:
        return scaled[0] == carrier
    return (node.op in SHIFTS and len(node.inputs) == 2 and node.inputs.count(carrier) == 1
            and (node.op == "add" or node.inputs[0] == carrier) and node.type == graph[carrier].type)


def _affine(graph: Graph, chain: list[str], scores: TensorType, shape: tuple[int, ...]
            ) -> tuple[float, str | None] | None:
    """(alpha, the mask at the softmax's `shape`: a new constant, a run-time tensor, or None) of the chain
    f(x) = alpha * x + M that follows the matmul `chain[0]`."""
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
        if node.op in ("reshape", "tanh"):      # (a tanh ends the chain `_softcap` scales before it)
            if runtime_mask is not None:     # the mask must broadcast to the softmax's shape, as it was added
                return None
            continue
        shift = next(i for i in node.inputs if i != carrier)
        if runtime_mask is not None:     # a run-time mask is the one shift: M = f(0) would leave it out
            return None
        if not graph.is_constant(shift):
            if node.op != "add" or shifted or graph[shift].type.dtype != scores.dtype:
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
    # where the model's constants are (a model compiled on the GPU is captured with its weights there, while
    # constants made at capture, such as a folded shift mask or a scalar, may be on the CPU: each is moved there)
    devices = {graph.constants[i].device for n in chain[1:] for i in graph[n].inputs if graph.is_constant(i)}
    device = min(devices, key=lambda d: d.type == "cpu")
    current = torch.zeros(scores.shape, dtype=exact, device=device)     # M = f(0)
    for carrier, name in zip(chain, chain[1:]):
        node = graph[name]
        args = [current if i == carrier else graph.constants[i].to(device=device, dtype=exact) for i in node.inputs]
        current = get_op(node.op).run(args, node.attrs)
    if tuple(current.shape) != shape:
        return None
    if not torch.any(current != 0):
        return alpha, None
    dtype = getattr(torch, scores.dtype)
    mask = graph.add_constant(graph.unique_name(f"{chain[-1]}_mask"), current.to(dtype).contiguous(),
                              source=graph[chain[-1]].source)
    return alpha, mask.name
