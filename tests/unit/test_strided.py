"""Views as strided index maps (`opfuse.ir.strided`): the atoms a view chain gives, checked element by element
against PyTorch running the same views (a copy where a reshape needs one)."""

from __future__ import annotations

import math

import pytest
import torch

from opfuse.ir.graph import Node, TensorType
from opfuse.ir.strided import (OPERAND_ROW_GROUPS, contiguous_strides, merged, operand_groups, through_views)


def view(op: str, shape, **attrs) -> Node:
    return Node(f"v_{op}", op, [], attrs, TensorType(tuple(shape), "float32"))


def gather(storage: torch.Tensor, dims) -> torch.Tensor:
    """The logical tensor the atoms describe, read element by element from `storage` (1-D)."""
    offsets = torch.zeros((), dtype=torch.long)
    for atoms in dims:
        # the logical index of this dim runs over the product of its atoms, outermost first
        sizes = [size for size, _ in atoms] or [1]
        strides = [stride for _, stride in atoms] or [0]
        index = torch.zeros(math.prod(sizes), dtype=torch.long)
        for position in range(math.prod(sizes)):
            rest, offset = position, 0
            for size, stride in reversed(list(zip(sizes, strides))):
                offset += (rest % size) * stride
                rest //= size
            index[position] = offset
        offsets = offsets.unsqueeze(-1) + index
    return storage[offsets]


def replay(source: torch.Tensor, chain: list[Node]) -> torch.Tensor:
    for node in chain:
        source = source.permute(node.attrs["dims"]) if node.op == "permute" else source.reshape(node.type.shape)
    return source


CASES = {
    # the head merge after attention: (B, H, S, D) -> (B, S, H, D) -> (B*S, H*D)
    "head_merge": ((2, 3, 4, 5), [view("permute", (2, 4, 3, 5), dims=(0, 2, 1, 3)), view("reshape", (8, 15))]),
    # Swin's window partition: (B, H, W, C) -> (B, nh, 2, nw, 2, C) -> (B, nh, nw, 2, 2, C) -> (B*nh*nw, 4, C)
    "windows": ((2, 4, 6, 3), [view("reshape", (2, 2, 2, 3, 2, 3)),
                               view("permute", (2, 2, 3, 2, 2, 3), dims=(0, 1, 3, 2, 4, 5)),
                               view("reshape", (12, 4, 3))]),
    # a reshape that splits a dim of a permuted tensor inside one atom, then merges across atoms
    "split_inside": ((6, 4), [view("permute", (4, 6), dims=(1, 0)), view("reshape", (2, 2, 3, 2)),
                              view("reshape", (4, 6))]),
}


@pytest.mark.parametrize("name", CASES)
def test_atoms_read_what_pytorch_computes(name):
    shape, chain = CASES[name]
    source = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    dims = through_views(shape, contiguous_strides(shape), chain)
    assert dims is not None
    assert torch.equal(gather(source.reshape(-1), dims), replay(source, chain))


def test_a_non_contiguous_source_is_followed_through_its_strides():
    """The source as PyTorch's flash attention returns it: (B, H, S, D) over (B, S, H, D) storage."""
    storage = torch.arange(2 * 4 * 3 * 5, dtype=torch.float32).reshape(2, 4, 3, 5)
    source = storage.permute(0, 2, 1, 3)
    chain = CASES["head_merge"][1]
    dims = through_views(source.shape, source.stride(), chain)
    assert torch.equal(gather(storage.reshape(-1), dims), replay(source, chain))
    rows, reduction = operand_groups(dims, 1)
    assert merged([atom for dim in dims for atom in dim]) == [(120, 1)]    # it is contiguous after all
    assert reduction == [(1, 0), (15, 1)]


def test_the_head_merge_splits_the_reduction_in_two_groups():
    shape, chain = CASES["head_merge"]
    rows, reduction = operand_groups(through_views(shape, contiguous_strides(shape), chain), 1)
    assert reduction == [(3, 20), (5, 1)]                    # heads, then head dim
    assert rows == [(1, 0)] * (OPERAND_ROW_GROUPS - 2) + [(2, 60), (4, 5)]


def test_swin_windows_need_four_row_groups():
    shape, chain = CASES["windows"]
    rows, reduction = operand_groups(through_views(shape, contiguous_strides(shape), chain), 2)
    assert len([r for r in rows if r[0] > 1]) == 4 and reduction == [(1, 0), (3, 1)]


def test_what_does_not_map_is_refused():
    shape = (4, 6)
    bad_split = [view("permute", (6, 4), dims=(1, 0)), view("reshape", (4, 6))]   # 6 = 4 * 1.5 inside an atom
    assert through_views(shape, contiguous_strides(shape), bad_split) is None
    assert through_views(shape, contiguous_strides(shape), [view("slice", (2, 6))]) is None
    five = (2, 2, 2, 2, 2, 2)       # every row dim reversed: five row groups do not fit
    dims = through_views(five, contiguous_strides(five), [view("permute", five, dims=(5, 4, 3, 2, 1, 0))])
    assert operand_groups(dims, 5) is None
