"""Move a permute that an anchor reads before the elementwise ops that compute its input.

Entry point: `views_before_prologues(graph)`. ResMLP's and MLP-Mixer's token mixing is a linear over the patch dim:
an affine (or any elementwise op) over [N, T, C], then a transpose to [N, C, T] that the linear reads. The permute
stood between the elementwise ops and the linear, and an anchor's kernel maps no view between it and its prologue,
so the affine was a kernel of its own before every token-mixing GEMM. An elementwise op whose one reader is such a
permute computes the same values after it: P(f(x, c)) = f(P(x), P(c)), its other operands permuted alike (a
constant in place, anything else through a permute node; aligned to its rank first, a scalar as it is). The
permute then reads the op's input, the op reads the permute and the anchor reads the op, so the op can be the
anchor's prologue; an op so moved moves again past the permute before it. The values are the same: an elementwise
op is computed where each element lands.
"""

from __future__ import annotations

from collections import deque

from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.ops import FusionKind, kind_of
from opfuse.passes.eliminate_dead_code import remove_if_unused


def views_before_prologues(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each permute that only anchors read moved before the elementwise ops only it reads."""
    graph = graph.copy()
    changes: list[str] = []
    users = graph.users()     # read again only after a change
    pending = deque(node.name for node in graph if node.op == "permute" and users.get(node.name)
                    and all(kind_of(reader) is FusionKind.ANCHOR for reader in users[node.name]))
    while pending:
        view = graph.nodes.get(pending.popleft())
        if view is None:
            continue
        op = graph[view.inputs[0]]
        if (not kind_of(op).elementwise or op.op == "batch_norm" or op.name in graph.observed
                or [u.name for u in users.get(op.name, [])] != [view.name]):
            continue
        dims = list(view.attrs["dims"])
        rank = len(op.type.shape)
        inputs = [permuted_operand(graph, i, dims, rank) for i in op.inputs]
        moved = graph.add_node(op.op, inputs, TensorType(tuple(view.type.shape), op.type.dtype), op.attrs,
                               name=f"{op.name}_after_view", source=op.source)
        graph.replace_uses(view.name, moved.name)
        remove_if_unused(graph, view.name)
        remove_if_unused(graph, op.name)
        graph.sort()
        users = graph.users()
        changes.append(f"permute {view.name} moved before {op.op} {op.name} (now {moved.name})")
        pending.extend(i for i in moved.inputs if graph[i].op == "permute" and i not in pending)
    return graph, changes


def permuted_operand(graph: Graph, name: str, dims: list[int], rank: int) -> str:
    """Operand `name` of an elementwise op of `rank` dims, aligned to that rank and permuted by `dims`: a constant
    in place, anything else through a reshape (where it aligns) and a permute node; a scalar as it is."""
    shape = tuple(graph[name].type.shape)
    if not shape:
        return name
    aligned = (1,) * (rank - len(shape)) + shape
    target = tuple(aligned[d] for d in dims)
    source, dtype = graph[name].source, graph[name].type.dtype
    if graph.is_constant(name) and name in graph.constants:
        return graph.add_constant(f"{name}_permuted", graph.constants[name].reshape(aligned).permute(dims).contiguous(),
                                  source=source).name
    if aligned != shape:
        name = graph.add_node("reshape", [name], TensorType(aligned, dtype), {"shape": list(aligned)},
                              name=f"{name}_aligned", source=source).name
    return graph.add_node("permute", [name], TensorType(target, dtype), {"dims": dims}, name=f"{name}_permuted",
                          source=source).name
