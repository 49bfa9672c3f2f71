"""Sliding-window index maps of the elementwise and reduction kernels (`opfuse.codegen.operands.Region.value`):
Tensor.unfold, im2col (F.unfold) and col2im (F.fold), each evaluated at an element's coordinates through its
input's, as Triton expressions.

An unfold is a coordinate map (window i, tap j of its dim read position i * step + j). An im2col is one load of its
input, under the mask of the input's extent where it pads (0 outside). A col2im, im2col's adjoint, is the float32
sum, in kernel-position order as PyTorch adds them, of one masked load per kernel position (ki, kj): the column entry
of the block whose tap (ki, kj) lands on the element, where the element's position plus the padding less the tap's
offset is a multiple of the stride giving a block inside the grid; positions no block can reach are left out when
the code is generated.

Entry points: `unfold_coords`, `im2col_value`, `col2im_value`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from opfuse.codegen.coordinates import Coords
from opfuse.codegen.expr import int_pair
from opfuse.ir.graph import Node
from opfuse.ir.ops import sliding_windows

if TYPE_CHECKING:
    from opfuse.codegen.operands import Region


def affine(terms: Sequence[tuple[str | None, int]], constant: int = 0) -> str | None:
    """The Triton expression sum(coordinate * factor) + constant; None where that is always 0 (a coordinate None
    stands for 0)."""
    parts = [c if f == 1 else f"{c} * {f}" for c, f in terms if c is not None and f != 0]
    if not parts:
        return str(constant) if constant else None
    text = " + ".join(parts)
    if constant:
        text += f" + {constant}" if constant > 0 else f" - {-constant}"
    return f"({text})"


def unfold_coords(node: Node, in_shape: Sequence[int], coords: Coords) -> Coords:
    """Coordinates in unfold `node`'s input (of `in_shape`) of its element at `coords`: window i, tap j (the last
    coordinate) read position i * step + j of the unfolded dim."""
    dim = node.attrs["dim"] % len(in_shape)
    position = None if in_shape[dim] == 1 else affine([(coords[dim], int(node.attrs["step"])), (coords[-1], 1)])
    return coords[:dim] + (position,) + coords[dim + 1:-1]


def window(node: Node) -> tuple[tuple[int, int], ...]:
    """An im2col's or col2im's (kernel size, dilation, padding, stride), each a checked pair of ints (height,
    width): the only form pasted into a kernel's source."""
    return tuple(int_pair(node.attrs[key], node, key) for key in ("kernel_size", "dilation", "padding", "stride"))


def _zero(region: Region) -> str:
    return region.assign(f"{region.zero}.to(tl.float32)")


def _digits(region: Region, flat: str | None, sizes: Sequence[int]) -> Coords:
    """Row-major digits of coordinate `flat` (None: 0) over `sizes`, None where always 0."""
    return (None,) * len(sizes) if flat is None else region.unravel(flat, sizes)


def im2col_value(region: Region, node: Node, coords: Coords) -> str:
    """An im2col at coords [..., (c * kh + ki) * kw + kj, p * ow + q]: its input at [..., c, p * sh - ph + ki * dh,
    q * sw - pw + kj * dw], loaded under the mask of the input's extent along each padded dim, 0 outside."""
    source_name = node.inputs[0]
    in_shape = region.graph[source_name].type.shape
    lead = len(in_shape) - 3            # a batch dim, or none (one unbatched image)
    (kh, kw), dilation, padding, stride = window(node)
    sizes = in_shape[lead + 1:]
    counts = [sliding_windows(size, k, d, p, s) for size, k, d, p, s in zip(sizes, (kh, kw), dilation, padding,
                                                                           stride)]
    channel, *taps = _digits(region, coords[lead], (in_shape[lead], kh, kw))
    blocks = _digits(region, coords[lead + 1], counts)
    positions, inside = [], []
    for axis, size in enumerate(sizes):
        terms = [(blocks[axis], stride[axis]), (taps[axis], dilation[axis])]
        if all(c is None for c, _ in terms):      # one position for every element: decided here
            if padding[axis]:                     # before the image (-padding): no element reads it
                return _zero(region)
            positions.append(None)
            continue
        position = region.assign(affine(terms, -padding[axis]), "i")
        if padding[axis]:
            inside.append(f"({position} >= 0) & ({position} < {size})")
        positions.append(None if size == 1 else position)
    source = coords[:lead] + (channel, *positions)
    if not inside:
        return region.value(source_name, source)
    return region.masked(source_name, source, " & ".join(inside), "0.0")


def _block(region: Region, position: str | None, offset: int, size: int, stride: int, count: int,
           conditions: list[str]) -> str | None | bool:
    """Along one axis of a col2im: the index of the block whose tap lands on output `position` (None: 0, of an
    axis of `size`), where position + `offset` (the padding less the tap's offset) is block * stride; False where
    no position of the axis has one. The conditions under which it exists (a multiple of the stride, a block of
    the grid's `count`) go to `conditions`, those that always hold left out."""
    low, high = offset, (0 if position is None else size - 1) + offset      # the range of position + offset
    last = (count - 1) * stride
    if high < 0 or low > last or (position is None and low % stride):
        return False
    if position is None:
        return str(low // stride) if low else None
    shifted = region.assign(affine([(position, 1)], offset), "i") if offset else position
    if low < 0:
        conditions.append(f"({shifted} >= 0)")
    if stride > 1:
        conditions.append(f"({shifted} % {stride} == 0)")
    index = region.assign(f"{shifted} // {stride}", "i") if stride > 1 else shifted
    if high > last:
        conditions.append(f"({index} < {count})")
    return index


def col2im_value(region: Region, node: Node, coords: Coords) -> str:
    """A col2im at coords [..., c, y, x]: the sum over kernel positions (ki, kj) of its input at [..., (c * kh + ki)
    * kw + kj, by * ow + bx], by * sh = y + ph - ki * dh and bx * sw = x + pw - kj * dw where those are blocks of
    the grid (`_block`), each loaded under the mask of that condition (0 elsewhere)."""
    source_name = node.inputs[0]
    in_shape = region.graph[source_name].type.shape
    lead = len(in_shape) - 2
    (kh, kw), dilation, padding, stride = window(node)
    sizes = node.attrs["output_size"]
    counts = [sliding_windows(size, k, d, p, s) for size, k, d, p, s in zip(sizes, (kh, kw), dilation, padding,
                                                                           stride)]
    channel, *positions = coords[lead:]
    terms = []
    for ki in range(kh):
        for kj in range(kw):
            conditions: list[str] = []
            blocks = [_block(region, positions[axis], padding[axis] - tap * dilation[axis], sizes[axis], stride[axis],
                             counts[axis], conditions) for axis, tap in enumerate((ki, kj))]
            if any(block is False for block in blocks):
                continue
            row = None if in_shape[lead] == 1 else affine([(channel, kh * kw)], ki * kw + kj)
            column = None if in_shape[lead + 1] == 1 else affine([(blocks[0], counts[1]), (blocks[1], 1)])
            source = coords[:lead] + (row, column)
            terms.append(region.masked(source_name, source, " & ".join(conditions), "0.0") if conditions
                         else region.value(source_name, source))
    return region.assign(" + ".join(terms)) if terms else _zero(region)
