"""ONNX converters of the layout operators: Reshape, Flatten, (Un)Squeeze, Transpose, Expand, Tile, Concat, Split,
Slice, Gather, Pad and the constant makers (Shape, Size, Constant, ConstantOfShape). Registered in
`opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from opfuse.frontend.onnx_converters import Unsupported, converts

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


@converts("Flatten", attributes=("axis",))
def _flatten(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    return [importer.emit("reshape", [xs[0]], {"shape": (math.prod(shape[:axis]), math.prod(shape[axis:]))})]


@converts("Reshape", attributes=("shape", "allowzero"), constant_inputs=(1,))
def _reshape(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    target = importer.ints(node, xs, attrs, "shape", 1)
    if target is None:
        raise Unsupported("no shape")
    # 0 copies the input's dim (unless allowzero); -1 takes what is left
    target = [shape[i] if d == 0 and not attrs.get("allowzero", 0) else d for i, d in enumerate(target)]
    if -1 in target:
        known = math.prod(d for d in target if d != -1)
        target[target.index(-1)] = math.prod(shape) // known if known else 0
    return [importer.emit("reshape", [xs[0]], {"shape": tuple(target)})]


@converts("Unsqueeze", attributes=("axes",), constant_inputs=(1,))
def _unsqueeze(importer: Importer, node, xs, attrs):
    shape = list(importer.type(xs[0]).shape)
    axes = importer.ints(node, xs, attrs, "axes", 1)
    rank = len(shape) + len(axes)
    for axis in sorted(a % rank for a in axes):
        shape.insert(axis, 1)
    return [importer.emit("reshape", [xs[0]], {"shape": tuple(shape)})]


@converts("Squeeze", attributes=("axes",), constant_inputs=(1,))
def _squeeze(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axes = importer.ints(node, xs, attrs, "axes", 1)
    drop = {a % len(shape) for a in axes} if axes else {i for i, d in enumerate(shape) if d == 1}
    return [importer.emit("reshape", [xs[0]], {"shape": tuple(d for i, d in enumerate(shape) if i not in drop)})]


@converts("Transpose", attributes=("perm",))
def _transpose(importer: Importer, node, xs, attrs):
    rank = len(importer.type(xs[0]).shape)
    return [importer.emit("permute", [xs[0]], {"dims": tuple(attrs.get("perm", range(rank - 1, -1, -1)))})]


@converts("Expand", constant_inputs=(1,))
def _expand(importer: Importer, node, xs, attrs):
    target = importer.ints(node, xs, attrs, "shape", 1)
    shape = tuple(np.broadcast_shapes(importer.type(xs[0]).shape, tuple(target)))  # ONNX broadcasts both ways
    return [importer.emit("expand", [xs[0]], {"shape": shape})]


@converts("Tile", constant_inputs=(1,))
def _tile(importer: Importer, node, xs, attrs):
    """x repeated r times along each dim: a size-1 dim before each one, expanded to r, merged with it."""
    shape = importer.type(xs[0]).shape
    repeats = importer.ints(node, xs, attrs, "repeats", 1)
    spread = importer.emit("reshape", [xs[0]], {"shape": tuple(v for d in shape for v in (1, d))})
    spread = importer.emit("expand", [spread], {"shape": tuple(v for r, d in zip(repeats, shape) for v in (r, d))})
    return [importer.emit("reshape", [spread], {"shape": tuple(r * d for r, d in zip(repeats, shape))})]


@converts("Pad", attributes=("mode", "pads", "value"), constant_inputs=(1, 2, 3))
def _pad(importer: Importer, node, xs, attrs):
    """Pads as an attribute (before opset 11) or an input, with `axes` from opset 18; a negative pad crops. Mode
    constant is the IR's pad; edge, reflect and wrap gather each padded dim's elements by a constant index."""
    shape = importer.type(xs[0]).shape
    rank = len(shape)
    pads = importer.ints(node, xs, attrs, "pads", 1)
    axes = [a % rank for a in (importer.ints(node, xs, attrs, "axes", 3) or range(rank))]
    begin, end = [0] * rank, [0] * rank
    for i, axis in enumerate(axes):
        begin[axis], end[axis] = pads[i], pads[len(axes) + i]
    mode = attrs.get("mode", "constant")
    if mode == "constant":
        value = attrs.get("value", 0.0)
        if len(xs) > 2 and xs[2] is not None:
            given = importer.constant(xs[2])
            if given is None:
                raise Unsupported("input 2 (constant_value) is not a constant")
            value = given.item()
        if not any(begin + end):
            return [importer.emit("identity", [xs[0]])]
        flat = tuple(v for b, e in zip(reversed(begin), reversed(end)) for v in (b, e))   # F.pad: last dim first
        return [importer.emit("pad", [xs[0]], {"pads": flat, "value": value})]
    numpy_mode = {"edge": "edge", "reflect": "reflect", "wrap": "wrap"}.get(mode)
    if numpy_mode is None:
        raise Unsupported(f"Pad mode {mode!r}")
    result = xs[0]
    for axis, (b, e) in enumerate(zip(begin, end)):
        if b == 0 and e == 0:
            continue
        kept = np.arange(max(-b, 0), shape[axis] - max(-e, 0))      # a negative pad crops first
        if numpy_mode == "reflect" and len(kept) < 2 and max(b, e) > 0:
            raise Unsupported("reflect padding of a dim of size 1")
        picked = np.pad(kept, (max(b, 0), max(e, 0)), mode=numpy_mode)
        indices = importer.add_constant(torch.from_numpy(picked.astype(np.int64)), f"{node.output[0]}_axis{axis}")
        result = importer.emit("take", [result, indices], {"axis": axis})
    return [result]


@converts("Concat", attributes=("axis",))
def _concat(importer: Importer, node, xs, attrs):
    inputs = [x for x in xs if x is not None]
    return [importer.emit("cat", inputs, {"dim": attrs["axis"] % len(importer.type(inputs[0]).shape)})]


@converts("Split", attributes=("axis", "split", "num_outputs"), constant_inputs=(1,))
def _split(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", 0) % len(shape)
    sizes = importer.ints(node, xs, attrs, "split", 1)
    if sizes is None:  # equal parts; the last one smaller if the dim does not divide (opset 18)
        parts = attrs.get("num_outputs", len(node.output))
        step = math.ceil(shape[axis] / parts)
        sizes = [min(step, shape[axis] - i * step) for i in range(parts)]
    outputs, start = [], 0
    for name, size in zip(node.output, sizes):
        part = {"dim": axis, "start": start, "end": start + size, "step": 1}
        outputs.append(importer.emit("slice", [xs[0]], part, name=name) if name in importer.used else None)
        start += size
    return outputs


@converts("Slice", attributes=("starts", "ends", "axes"), constant_inputs=(1, 2, 3, 4))
def _slice(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    starts = importer.ints(node, xs, attrs, "starts", 1)
    ends = importer.ints(node, xs, attrs, "ends", 2)
    axes = importer.ints(node, xs, attrs, "axes", 3) or list(range(len(starts)))
    steps = importer.ints(node, xs, attrs, "steps", 4) or [1] * len(starts)
    result = xs[0]
    for start, end, axis, step in zip(starts, ends, axes, steps):
        if step == 0:
            raise Unsupported("Slice with a step of 0")
        axis, size = axis % len(shape), shape[axis % len(shape)]
        start, end = (v + size if v < 0 else v for v in (start, end))
        if step > 0:
            start, end = (min(max(v, 0), size) for v in (start, end))  # ONNX clamps to [0, size]
            result = importer.emit("slice", [result], {"dim": axis, "start": start, "end": end, "step": step})
        else:  # backwards, clamped to [0, size - 1] and [-1, size - 1]; PyTorch slices only forwards: a take
            picked = torch.arange(min(max(start, 0), size - 1), min(max(end, -1), size - 1), step)
            result = importer.emit("take", [result, importer.add_constant(picked, f"{node.output[0]}_indices")],
                                   {"axis": axis})
    return [result if result != xs[0] else importer.emit("identity", [xs[0]])]


@converts("Gather", attributes=("axis",))
def _gather(importer: Importer, node, xs, attrs):
    table, indices = importer.constant(xs[0]), importer.constant(xs[1])
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", 0) % len(shape)
    if table is not None and table.dim() == 2 and axis == 0 and importer.type(xs[1]).dtype in ("int64", "int32"):
        return [importer.emit("embedding", [xs[0], xs[1]])]
    if indices is not None and indices.dim() == 0:  # x.select(axis, i): a slice, then drop the axis
        i = int(indices) % shape[axis]
        picked = importer.emit("slice", [xs[0]], {"dim": axis, "start": i, "end": i + 1, "step": 1})
        return [importer.emit("reshape", [picked], {"shape": shape[:axis] + shape[axis + 1:]})]
    return [importer.emit("take", [xs[0], xs[1]], {"axis": axis})]


# ---- constants: the importer evaluates these at import (`Importer.fold`); a converter is reached only when it
# could not, so it says why

@converts("Shape", attributes=("start", "end"))
def _shape(importer: Importer, node, xs, attrs):
    """The input's static shape, or the part [start:end] of it (opset 15 on), as an int64 constant."""
    shape = importer.type(xs[0]).shape
    part = shape[attrs.get("start", 0):attrs.get("end", len(shape))]
    return [importer.add_constant(torch.tensor(part, dtype=torch.int64), node.output[0])]


@converts("Size")
def _size(importer: Importer, node, xs, attrs):
    return [importer.add_constant(torch.tensor(math.prod(importer.type(xs[0]).shape)), node.output[0])]


@converts("Constant", attributes=("value", "value_float", "value_floats", "value_int", "value_ints", "value_string",
                                  "value_strings", "sparse_value"))
def _constant(importer: Importer, node, xs, attrs):
    raise Unsupported("a Constant of a kind opfuse has no tensor for (a string, a sparse tensor, or an unsupported "
                      "dtype)")


@converts("ConstantOfShape", attributes=("value",), constant_inputs=(0,))
def _constant_of_shape(importer: Importer, node, xs, attrs):
    if importer.constant(xs[0]) is None:
        raise Unsupported("input 0 (shape) is not a constant")
    raise Unsupported("its value has a dtype opfuse does not support")
