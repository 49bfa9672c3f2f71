"""Views as strided index maps: what a chain of reshapes and permutes makes of a strided tensor, copy or not.

A strided tensor maps each logical dim to memory through one (size, stride) pair. A view chain can always be
described the same way if a logical dim may consist of several such pairs ("atoms", outermost first): a reshape
that PyTorch must copy (a reshape merging dims of a permuted tensor: the head merge after attention) merges dims
whose atoms do not fuse, and is still an index map on the original storage. `through_views(shape, strides,
views)` replays reshapes, permutes and identities on atoms; `merged(atoms)` fuses the atoms that follow each
other in memory; `operand_groups` splits the result into the row and reduction groups an anchor kernel indexes
its operand with (`opfuse.codegen.gemm`: at most OPERAND_ROW_GROUPS row groups and OPERAND_K_GROUPS reduction
groups).
"""

from __future__ import annotations

import math
from typing import Sequence

from opfuse.ir.graph import Node

Atom = tuple[int, int]          # (size, stride)
OPERAND_ROW_GROUPS = 4          # row groups an anchor kernel's operand load decomposes its row index into
OPERAND_K_GROUPS = 2            # reduction groups of that load (the head merge: heads, then head dim)
MAPPED_VIEWS = frozenset({"reshape", "permute", "identity"})


def dims_of(shape: Sequence[int], strides: Sequence[int]) -> list[list[Atom]]:
    """One atom per dim of a strided tensor (size-1 dims: none)."""
    return [[(size, stride)] if size != 1 else [] for size, stride in zip(shape, strides)]


def _reshape(dims: list[list[Atom]], shape: Sequence[int]) -> list[list[Atom]] | None:
    """The atoms of each dim of `shape`, taken in row-major order from `dims`' atoms; an atom is split where a new
    dim ends inside it and its size allows, else None (not an index map of this form)."""
    atoms = [atom for dim in dims for atom in dim]
    atoms.reverse()                      # a stack: the outermost atom on top
    result: list[list[Atom]] = []
    for size in shape:
        taken: list[Atom] = []
        left = size
        while left > 1:
            if not atoms:
                return None
            atom_size, stride = atoms.pop()
            if atom_size <= left:
                if left % atom_size:
                    return None
                taken.append((atom_size, stride))
                left //= atom_size
            else:                        # the dim ends inside this atom: its outer part goes here
                if atom_size % left:
                    return None
                inner = atom_size // left
                taken.append((left, stride * inner))
                atoms.append((inner, stride))
                left = 1
        result.append(taken)
    return result if not atoms else None


def through_views(shape: Sequence[int], strides: Sequence[int], views: Sequence[Node]) -> list[list[Atom]] | None:
    """The atoms of each dim of the last view's value, for a source of `shape` and `strides` (None where a view
    is not one of MAPPED_VIEWS or a reshape does not map)."""
    dims = dims_of(shape, strides)
    for view in views:
        if view.op == "permute":
            dims = [dims[d] for d in view.attrs["dims"]]
        elif view.op == "reshape":
            dims = _reshape(dims, view.type.shape)
            if dims is None:
                return None
        elif view.op != "identity":
            return None
    return dims


def merged(atoms: Sequence[Atom]) -> list[Atom]:
    """`atoms` (outermost first) with neighbours that follow each other in memory fused into one."""
    result: list[Atom] = []
    for size, stride in atoms:
        if size == 1:
            continue
        if result and result[-1][1] == stride * size:
            outer, _ = result.pop()
            result.append((outer * size, stride))
        else:
            result.append((size, stride))
    return result


def operand_groups(dims: Sequence[Sequence[Atom]], row_dims: int) -> tuple[list[Atom], list[Atom]] | None:
    """(row groups, reduction groups) of an operand whose first `row_dims` dims are its rows and the rest its
    reduction, each padded in front with (1, 0) to OPERAND_ROW_GROUPS and OPERAND_K_GROUPS; None when more groups
    are needed."""
    rows = merged([atom for dim in dims[:row_dims] for atom in dim])
    reduction = merged([atom for dim in dims[row_dims:] for atom in dim])
    if len(rows) > OPERAND_ROW_GROUPS or len(reduction) > OPERAND_K_GROUPS:
        return None
    return ([(1, 0)] * (OPERAND_ROW_GROUPS - len(rows)) + rows,
            [(1, 0)] * (OPERAND_K_GROUPS - len(reduction)) + reduction)


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides of `shape`."""
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]
