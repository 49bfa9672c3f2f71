"""Coordinates of the elementwise and reduction kernels (`opfuse.codegen.operands`), as Triton expressions: a
value's coordinates broadcast to an operand (`broadcast_coords`), a flat index unravelled into row-major digits
(`unravel_expressions`), an upsample's source indices (`upsample_source`; bicubic's 4 taps a dim: `cubic_taps`), and
the layouts a flat index addresses directly (`is_dense_in_order`, `is_channels_last`).
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from opfuse.codegen.expr import Unsupported, literal
from opfuse.ir.graph import Node

Coords = tuple  # tuple[str | None, ...]: a Triton expression per dimension, None meaning 0


def broadcast_coords(coords: Coords, out_shape: Sequence[int], in_shape: Sequence[int]) -> Coords:
    """Coordinates in an operand of `in_shape` broadcast (numpy rules) to `out_shape`."""
    lead = len(out_shape) - len(in_shape)
    if lead < 0:
        raise Unsupported(f"operand {list(in_shape)} has more dimensions than its result {list(out_shape)}")
    result = []
    for d, size in enumerate(in_shape):
        if size == 1:
            result.append(None)
        elif size == out_shape[lead + d]:
            result.append(coords[lead + d])
        else:
            raise Unsupported(f"operand {list(in_shape)} does not broadcast to {list(out_shape)}")
    return tuple(result)


def dense_strides(shape: Sequence[int], order: Sequence[int]) -> list[int]:
    """Strides of a dense tensor whose dimensions are laid out in `order` (outermost first)."""
    strides = [0] * len(shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return strides


def layout_order(rank: int, channels_last: bool) -> list[int]:
    return [0, 2, 3, 1] if channels_last and rank == 4 else list(range(rank))


def is_channels_last(tensor: torch.Tensor) -> bool:
    """A 4-D tensor whose channels are adjacent in memory (dense NHWC, or a channel slice of one)."""
    return tensor.dim() == 4 and tensor.shape[1] > 1 and tensor.stride(1) == 1


def is_dense_in_order(tensor: torch.Tensor, order: Sequence[int]) -> bool:
    """Whether element offsets equal the flat index enumerating the shape in `order` (size-1 strides ignored)."""
    expected = dense_strides(tensor.shape, order)
    return all(size == 1 or stride == want
               for size, stride, want in zip(tensor.shape, tensor.stride(), expected))


def unravel_expressions(flat: str, sizes: Sequence[int]) -> list[str]:
    """Row-major digits of `flat` over `sizes`; the outermost takes no modulo (flat is in range where unmasked)."""
    expressions = []
    inner = 1
    for position in range(len(sizes) - 1, -1, -1):
        e = flat if inner == 1 else f"({flat} // {inner})"
        if position > 0:
            e = f"{e} % {sizes[position]}"
        expressions.append(e)
        inner *= sizes[position]
    return expressions[::-1]


def upsample_scale(node: Node, dim: int, in_size: int) -> float:
    """The float32 step from output to source index of upsample `node` along its spatial dim `dim`, as PyTorch
    computes it: (in - 1) / (out - 1) with align_corners (linear, cubic), 1 / the scale factor given, else in / out."""
    out_size = node.attrs["size"][dim]
    scales = node.attrs.get("scales") or [None] * len(node.attrs["size"])
    if node.attrs["mode"] in ("linear", "cubic") and node.attrs.get("align_corners"):
        return float(np.float32(in_size - 1) / np.float32(out_size - 1)) if out_size > 1 else 0.0
    if scales[dim] is not None and scales[dim] > 0:
        return float(np.float32(1.0 / scales[dim]))
    return float(np.float32(in_size) / np.float32(out_size))


def upsample_source(node: Node, dim: int, in_size: int, coord: str | None, assign: Callable[..., str]
                    ) -> tuple[str | None, str | None, str | None]:
    """(source index, its upper neighbour, the upper neighbour's weight) of the output coordinate `coord` (None: 0)
    of upsample `node` along spatial dim `dim` of input size `in_size`, in PyTorch's float32 arithmetic: nearest
    floor(i * scale), nearest-exact floor((i + 0.5) * scale), both at most in - 1 (no neighbour); linear the source
    position scale * i (align_corners) or max(scale * (i + 0.5) - 0.5, 0), its floor and the next index (at most
    in - 1), weighted by the fraction. Indices are None where always 0 (a size-1 input), and computed here where the
    coordinate is (a size-1 output)."""
    if in_size == 1:
        return None, None, None
    scale = upsample_scale(node, dim, in_size)
    mode, align = node.attrs["mode"], node.attrs.get("align_corners")
    if coord is None:           # one output index, 0: its sources are numbers
        f32 = np.float32
        if mode != "linear":
            index = min(int(f32(0.0 if mode == "nearest" else 0.5) * f32(scale)), in_size - 1)
            return (str(index) if index else None), None, None
        real = f32(0.0) if align else max(f32(0.5) * f32(scale) - f32(0.5), f32(0.0))
        low = int(real)
        return (str(low) if low else None), str(min(low + 1, in_size - 1)), literal(min(max(real - low, 0.0), 1.0))
    position = f"({coord}).to(tl.float32)"
    if mode != "linear":
        shifted = position if mode == "nearest" else f"({position} + 0.5)"
        return assign(f"tl.minimum(({shifted} * {literal(scale)}).to(tl.int32), {in_size - 1})", "i"), None, None
    real = assign(f"{position} * {literal(scale)}" if align else
                  f"tl.maximum(({position} + 0.5) * {literal(scale)} - 0.5, 0.0)", "r")
    low = assign(f"{real}.to(tl.int32)", "i")
    high = assign(f"tl.minimum({low} + 1, {in_size - 1})", "i")
    weight = assign(f"tl.minimum(tl.maximum({real} - {low}.to(tl.float32), 0.0), 1.0)", "w")
    return low, high, weight


# Keys' cubic convolution with A = -0.75 as PyTorch's UpSample.h writes it (cubic_convolution1 for |x| <= 1,
# cubic_convolution2 for 1 < |x| < 2), its constants folded: A + 2, A + 3, 5A, 8A and 4A are exact in float32, and
# subtracting a negative constant is adding its magnitude, bit for bit. Not bit for bit with every PyTorch build:
# its compiler may fuse some of these multiply-adds (torch 2.14's x86 CPU wheel fuses the far weight's `+ 8A`), as
# Triton's may on a GPU; the weights then differ by an ulp of the terms (~2e-7), the outputs by ~1e-6 relative
CUBIC_NEAR = "((1.25 * {x} - 2.25) * {x}) * {x} + 1.0"
CUBIC_FAR = "((-0.75 * {x} + 3.75) * {x} - 6.0) * {x} + 3.0"


def _cubic_weights_f32(t: np.float32) -> list[np.float32]:
    """`CUBIC_NEAR` and `CUBIC_FAR` at distances t + 1, t, 1 - t, 2 - t, in numpy float32 (a size-1 output dim)."""
    f32 = np.float32

    def near(x):
        return ((f32(1.25) * x - f32(2.25)) * x) * x + f32(1.0)

    def far(x):
        return ((f32(-0.75) * x + f32(3.75)) * x - f32(6.0)) * x + f32(3.0)
    u = f32(1.0) - t
    return [far(t + f32(1.0)), near(t), near(u), far(u + f32(1.0))]


def cubic_taps(node: Node, dim: int, in_size: int, coord: str | None, assign: Callable[..., str]
               ) -> list[tuple[str | None, str]]:
    """The 4 (source index, weight) taps of the output coordinate `coord` (None: 0) of bicubic upsample `node` along
    spatial dim `dim` of input size `in_size`, in PyTorch's float32 arithmetic (upsample_bicubic2d): the source
    position scale * i (align_corners) or scale * (i + 0.5) - 0.5, not clamped at 0 (unlike linear); its floor f, at
    most in - 1, and the fraction t = position - f (clamped to [0, 1], as PyTorch guards it); indices f - 1 .. f + 2
    clamped to [0, in - 1], weighted by Keys' kernel at distances t + 1, t, 1 - t, 2 - t. Indices are None where
    always 0 (a size-1 input, whose 4 taps PyTorch still weights and sums); all are numbers where the coordinate is
    (a size-1 output)."""
    scale = upsample_scale(node, dim, in_size)
    align = node.attrs.get("align_corners")
    last = in_size - 1
    if coord is None:           # one output index, 0: its taps are numbers
        f32 = np.float32
        real = f32(0.0) if align else f32(0.5) * f32(scale) - f32(0.5)
        low = min(int(np.floor(real)), last)
        t = min(max(real - f32(low), f32(0.0)), f32(1.0))
        indices = [min(max(low + k, 0), last) for k in (-1, 0, 1, 2)]
        return [(str(i) if i else None, literal(w)) for i, w in zip(indices, _cubic_weights_f32(t))]
    position = f"({coord}).to(tl.float32)"
    real = assign(f"{position} * {literal(scale)}" if align else f"({position} + 0.5) * {literal(scale)} - 0.5", "r")
    low = assign(f"tl.minimum(tl.floor({real}).to(tl.int32), {last})", "i")
    t = assign(f"tl.minimum(tl.maximum({real} - {low}.to(tl.float32), 0.0), 1.0)", "t")
    u = assign(f"1.0 - {t}", "t")
    distances = [assign(f"{t} + 1.0", "t"), t, u, assign(f"{u} + 1.0", "t")]
    weights = [assign((CUBIC_FAR if k in (0, 3) else CUBIC_NEAR).format(x=x), "w") for k, x in enumerate(distances)]
    if in_size == 1:
        return [(None, w) for w in weights]
    indices = [assign(f"tl.minimum(tl.maximum({low}{offset}, 0), {last})", "i")
               for offset in (" - 1", "", " + 1", " + 2")]
    return list(zip(indices, weights))
