"""Attention masks known at compile time, in their simplest form.

Entry point: `simplify_attention_masks(graph)`. Models build their attention masks from shapes alone when no mask
is passed in (transformers' BERT and T5 an all-ones padding mask, GPT-2 its causal triangle, T5 adds its
relative-position bias); once `fold_constants` ran, such a mask is a constant, or a broadcast of one. Each
``sdpa`` whose mask is computable from constants alone (`CompileTimeValues`) is rewritten:

- a mask that masks nothing (bool all True, additive all zero) is dropped;
- a mask that is exactly the causal triangle over (queries, keys), top-left aligned as `is_causal` means it (bool
  ``tril``; additive 0 on and below the diagonal, -inf or the dtype's lowest value above it) becomes
  ``is_causal`` without a mask (PyTorch takes a mask or ``is_causal``, never both);
- any other mask is stored at its smallest broadcast shape (a dim along which it does not change keeps size 1:
  T5's bias at batch 64 is one [1, heads, L, S] constant, not 64 copies computed at every call).

Why: PyTorch's fused attention takes its fastest kernels (flash) only without a mask, or with ``is_causal``; a
materialised mask costs its kernels and its traffic at every call and sends the call to a slower backend. The
results are the same up to rounding: an additive mask's lowest value gives a zero probability as -inf does.
"""

from __future__ import annotations

from typing import Iterable

import torch

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused
from opfuse.passes.fold_constants import GROWTH_BYTES, is_pure, node_value, smallest_broadcast

MASK_BYTES = 16 * GROWTH_BYTES  # a mask larger than this is not evaluated at compile time


def simplify_attention_masks(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each sdpa's compile-time mask dropped, made `is_causal`, or compacted."""
    graph = graph.copy()
    changes: list[str] = []
    values = CompileTimeValues(graph)
    compacted: dict[str, str | None] = {}    # a mask -> the constant that replaces it (None: it stays)
    for node in list(graph):
        if node.op != "sdpa" or len(node.inputs) < 4:
            continue
        mask_name = node.inputs[3]
        mask = values.value(mask_name)
        if mask is None:
            continue
        queries, keys = graph[node.inputs[0]].type.shape[-2], graph[node.inputs[1]].type.shape[-2]
        if _masks_nothing(mask):
            node.inputs = node.inputs[:3]
            changes.append(f"dropped {node.name}'s mask {mask_name}: it masks nothing")
        elif _is_causal(mask, queries, keys):
            node.inputs = node.inputs[:3]
            node.attrs["is_causal"] = True
            changes.append(f"made {node.name} causal: its mask {mask_name} is the causal triangle")
        else:
            if mask_name not in compacted:
                compacted[mask_name] = _compact(graph, mask_name, mask, compacted.values(), changes)
            if compacted[mask_name] is None:
                continue
            node.inputs[3] = compacted[mask_name]
        remove_dead_cone(graph, mask_name)
    if changes:
        graph.sort()
    return graph, changes


class CompileTimeValues:
    """Values of the nodes that depend on constants alone through pure nodes, none larger than `MASK_BYTES`: the
    set of them is found in one pass over the graph, so a mask computed from activations costs no walk; values are
    computed on demand, in the graph's order, and kept."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.cone: set[str] = set()
        for node in graph:
            if graph.is_constant(node.name) or (node.op != "input" and is_pure(node) and node.inputs
                                                and node.type.nbytes <= MASK_BYTES
                                                and all(i in self.cone for i in node.inputs)):
                self.cone.add(node.name)
        self.values: dict[str, torch.Tensor | None] = {}

    def value(self, name: str) -> torch.Tensor | None:
        """The value of node `name`, or None when it is not computable at compile time (or its reference fails)."""
        if name not in self.cone:
            return None
        pending = [name]
        while pending:                      # depth-first over the cone, inputs before the node that reads them
            current = pending[-1]
            if current in self.values:
                pending.pop()
                continue
            node = self.graph[current]
            if self.graph.is_constant(current):
                self.values[current] = self.graph.constants[current]
                continue
            missing = [i for i in node.inputs if i not in self.values]
            if missing:
                pending.extend(missing)
                continue
            inputs = [self.values[i] for i in node.inputs]
            self.values[current] = node_value(node, inputs) if all(t is not None for t in inputs) else None
        return self.values[name]


def _compact(graph: Graph, mask_name: str, mask: torch.Tensor, made: Iterable[str | None], changes: list[str]
             ) -> str | None:
    """The name of a constant holding `mask` at its smallest broadcast shape: one of those `made` before for other
    masks if equal (T5's layers each copy one bias), else a new one; None where that changes nothing (a constant
    already as small) or would hold more than `GROWTH_BYTES` that were not held before."""
    compact = smallest_broadcast(mask)
    held = graph.is_constant(mask_name)
    if held and compact.shape == mask.shape:
        return None
    if not held and compact.numel() * compact.element_size() > GROWTH_BYTES:
        return None
    for name in made:
        if name is not None and _same(graph.constants[name], compact):
            changes.append(f"mask {mask_name} {list(mask.shape)} is constant {name}, as another mask")
            return name
    name = graph.unique_name(f"{mask_name}_compact")
    graph.add_constant(name, compact, source=graph[mask_name].source)
    changes.append(f"mask {mask_name} {list(mask.shape)} is now constant {name} {list(compact.shape)}"
                   + ("" if held else ", not computed at every call"))
    return name


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def remove_dead_cone(graph: Graph, name: str) -> None:
    """Remove `name` and, in turn, each input it leaves unread."""
    pending = [name]
    while pending:
        current = pending.pop()
        node: Node | None = graph.nodes.get(current)
        if node is not None and remove_if_unused(graph, current):
            pending.extend(node.inputs)


def _masks_nothing(mask: torch.Tensor) -> bool:
    return bool(mask.all()) if mask.dtype == torch.bool else bool((mask == 0).all())


def _is_causal(mask: torch.Tensor, queries: int, keys: int) -> bool:
    try:
        mask = mask.expand(torch.broadcast_shapes(mask.shape, (queries, keys)))
    except RuntimeError:
        return False
    triangle = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril()
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        blocked = (mask == float("-inf")) | (mask <= torch.finfo(mask.dtype).min)
        if not bool((allowed | blocked).all()):
            return False
    return bool((allowed == triangle).all())
