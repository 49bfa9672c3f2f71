"""Rewrite a chain of reshapes and permutes that PyTorch would copy as split -> permute -> merge views.

Entry point: `fold_view_chains(graph)`. A reshape that merges dims whose strides do not nest is no view, and PyTorch
copies it (a kernel, and the planner keeps it out of every kernel); yet the chain it starts may end in a layout that
is a plain view of its source. nn.MultiheadAttention splits its heads that way: q [T, N, E] -> reshape
[T, N * H, D] (a copy at N > 1) -> transpose -> reshape [N, H, T, D], whose every element is
q[t, n, h * D + d], a strided view of q.

The pass follows each dim of the chain's end as a list of factors of the source's dims ("atoms": a source dim split
into consecutive factors, outer first; a reshape regroups the factors, splitting one where a new dim needs part of
it; a permute reorders the dims). Where every dim of the end is one run of consecutive factors of one source dim,
in order (size-1 factors aside), the end equals: the source reshaped to those factors (a split: a view of any
strided tensor), permuted into the end's order, reshaped to the end's shape (each merge joins consecutive factors
of one source dim: a view). The chain's end then reads that instead, and the old chain goes where nothing else reads
it; unless a reshape reading the end would then copy (from the strided views, once per such reader, where the
chain copied once). Chains are taken from a reshape that would copy, through readers that are its only reader, as
long as they are reshapes or permutes.
"""

from __future__ import annotations

import math

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.ir.ops import view_copies
from opfuse.passes.eliminate_dead_code import remove_if_unused

Atom = tuple[int, tuple[int, ...], int]     # (source dim, position among its factors, outer first; size)


def fold_view_chains(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each copying view chain that is a view of its source reads it as one."""
    graph = graph.copy()
    changes = []
    users = graph.users()
    for node in list(graph):
        if node.name not in graph.nodes or node.op != "reshape" or not view_copies(graph, node):
            continue
        chain = [node]
        while (reader := graph.only_reader(chain[-1].name, users)) is not None and reader.op in ("reshape", "permute"):
            chain.append(reader)
        source = graph[node.inputs[0]]
        dims = _follow(source.type.shape, chain) if len(chain) > 1 else None
        if dims is None:
            continue
        end = chain[-1]
        views = _as_views(graph, source, dims, end)
        if views is None:
            continue
        graph.replace_uses(end.name, views.name)
        graph.sort()
        readers = [r for r in users[end.name] if r.op == "reshape"]
        if any(view_copies(graph, r) for r in readers):   # each would copy from the strided views instead
            graph.replace_uses(views.name, end.name)
            for dead in (views.name, views.inputs[0], graph[views.inputs[0]].inputs[0]):
                graph.remove(dead)
            continue
        for dead in reversed(chain):
            remove_if_unused(graph, dead.name)
        users = graph.users()
        changes.append(f"{' -> '.join(n.op for n in chain)} {node.name}..{end.name} of {source.name} copied: "
                       f"read as split, permute, merge views ({views.name})")
    return graph, changes


def _follow(shape: tuple[int, ...], chain: list[Node]) -> list[list[Atom]] | None:
    """Each dim of the chain's end as the source factors it holds, or None where a reshape cannot regroup them."""
    dims: list[list[Atom]] = [[(d, (), size)] if size != 1 else [] for d, size in enumerate(shape)]
    for step in chain:
        if step.op == "permute":
            dims = [dims[d] for d in step.attrs["dims"]]
            continue
        atoms = [atom for dim in dims for atom in dim]
        dims = []
        for size in step.type.shape:
            taken, product = [], 1
            while product < size:
                if not atoms:
                    return None
                dim, position, atom_size = atoms.pop(0)
                if size % (product * atom_size) == 0:
                    taken.append((dim, position, atom_size))
                    product *= atom_size
                    continue
                outer = size // product
                if size % product or atom_size % outer:
                    return None
                taken.append((dim, position + (0,), outer))
                atoms.insert(0, (dim, position + (1,), atom_size // outer))
                product = size
            dims.append(taken)
        if atoms:
            return None
    return dims


def _as_views(graph: Graph, source: Node, dims: list[list[Atom]], end: Node) -> Node | None:
    """The split, permute and merge nodes reading `source` that compute `end` (the last one), or None where some
    dim of `end` is not one in-order run of one source dim's factors."""
    leaves = sorted({atom for dim in dims for atom in dim})        # by source dim, then outer to inner
    for dim in dims:
        if not dim:
            continue
        first = leaves.index(dim[0])
        if leaves[first:first + len(dim)] != dim or len({atom[0] for atom in dim}) != 1:
            return None
    split_shape = [size for _, _, size in leaves]
    if math.prod(split_shape) != math.prod(source.type.shape):
        return None
    dtype = source.type.dtype
    split = graph.add_node("reshape", [source.name], TensorType(tuple(split_shape), dtype),
                           {"shape": split_shape}, name=f"{end.name}_split")
    order = [leaves.index(atom) for dim in dims for atom in dim]
    permuted = graph.add_node("permute", [split.name], TensorType(tuple(split_shape[i] for i in order), dtype),
                              {"dims": order}, name=f"{end.name}_permute")
    return graph.add_node("reshape", [permuted.name], end.type, {"shape": list(end.type.shape)},
                          name=f"{end.name}_merge")
