"""ONNX converters of the layout operators: Reshape, Flatten, (Un)Squeeze, Transpose, Expand, Concat, Split, Slice
and Gather. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).
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
