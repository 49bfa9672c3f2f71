"""ONNX converters of Resize (opsets 10, 11, 13, 18, 19) and Upsample (7, 9): resampling mapped onto gathers.

Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract). The output size
and every sample position are known at import (opfuse's shapes are static), so each resized axis becomes constant
indices and weights, as ONNX's reference computes them (`onnx.reference.ops.op_resize`, separable per axis):
- nearest: one `take` of the nearest input element per output element, any dtype;
- linear and cubic (and their antialiased forms): a `take` per tap of the filter, times its weight (a constant
  along the axis), summed; floating dtypes only.
tf_crop_and_resize's extrapolated positions become a `where` with the extrapolation value. Before opset 11 (Resize
10, Upsample) the coordinates are asymmetric (x_in = x_out / scale) and nearest rounds down, as ONNX's version
converter to opset 11 has it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from opfuse.frontend.onnx_converters import Unsupported, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer

# input positions: Resize 10 (X, scales) and Upsample 9 have scales at 1; Resize 11 on has (X, roi, scales, sizes)
RESIZE_ATTRIBUTES = ("antialias", "axes", "coordinate_transformation_mode", "cubic_coeff_a", "exclude_outside",
                     "extrapolation_value", "keep_aspect_ratio_policy", "mode", "nearest_mode")


def _source_positions(mode: str, out_len: int, in_len: int, scale: float, roi) -> tuple[np.ndarray, np.ndarray | None]:
    """Each output index's position in the input (float64), and which positions are extrapolated (or None)."""
    y = np.arange(out_len, dtype=np.float64)
    out_width = scale * in_len
    if mode == "align_corners":
        return (np.zeros(out_len) if out_width == 1 else y * (in_len - 1) / (out_width - 1)), None
    if mode == "asymmetric":
        return y / scale, None
    if mode == "tf_crop_and_resize":
        if roi is None:
            raise Unsupported("tf_crop_and_resize without a constant roi")
        start, stop = roi
        x = (np.full(out_len, (stop - start) * (in_len - 1) / 2) if out_width == 1
             else y * (stop - start) * (in_len - 1) / (out_width - 1)) + start * (in_len - 1)
        return x, (x < 0) | (x > in_len - 1)
    if mode == "pytorch_half_pixel":
        return (np.full(out_len, -0.5) if out_width == 1 else (y + 0.5) / scale - 0.5), None
    if mode == "half_pixel":
        return (y + 0.5) / scale - 0.5, None
    if mode == "half_pixel_symmetric":
        offset = in_len / 2 * (1 - out_len / out_width)
        return offset + (y + 0.5) / scale - 0.5, None
    raise Unsupported(f"coordinate_transformation_mode {mode!r}")


def _filter(mode: str, nearest_mode: str, a: float, antialias: bool, scale: float):
    """The weights of the taps around a position, as a function of its fraction `ratio` in (0, 1]."""
    if mode == "nearest":
        rules = {"round_prefer_floor": lambda r: [r <= 0.5, r > 0.5], "round_prefer_ceil": lambda r: [r < 0.5, r >= 0.5],
                 "floor": lambda r: [1, 0], "ceil": lambda r: [0, 1]}
        if nearest_mode not in rules:
            raise Unsupported(f"nearest_mode {nearest_mode!r}")
        return lambda r: np.array([0, 1] if r == 1 else rules[nearest_mode](r), dtype=np.float64)
    if mode not in ("linear", "cubic"):
        raise Unsupported(f"Resize mode {mode!r}")
    if antialias:   # a filter stretched by 1 / scale when downsampling, normalised
        scale = min(scale, 1.0)
        support = 1 if mode == "linear" else 2
        start = int(np.floor(-support / scale) + 1)
        taps = np.arange(start, 2 - start)

        def weights(r):
            w = _cubic(scale * (taps - r), a) if mode == "cubic" else np.clip(1 - np.abs((taps - r) * scale), 0, 1)
            return w / w.sum()
        return weights
    if mode == "linear":
        return lambda r: np.array([1 - r, r])
    return lambda r: _cubic(np.array([r + 1, r, 1 - r, 2 - r]), a)


def _cubic(distance: np.ndarray, a: float) -> np.ndarray:
    """Keys' cubic convolution kernel with coefficient a."""
    x = np.abs(distance)
    near = ((a + 2) * x - (a + 3)) * x * x + 1
    far = ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.where(x <= 1, near, np.where(x < 2, far, 0.0))


def _axis_sampling(positions: np.ndarray, in_len: int, weights_of, exclude_outside: bool
                   ) -> tuple[np.ndarray, np.ndarray]:
    """(indices [out, taps], weights [out, taps]): the taps nearest each position (edge-clamped), as ONNX's
    reference picks them (ties to the smaller index)."""
    floor = np.floor(positions)
    ratios = np.where(positions == floor, 1.0, positions - floor)
    weights = np.stack([weights_of(float(r)) for r in ratios])
    taps = weights.shape[1]
    pad = math.ceil(taps / 2)
    shifted = positions + pad
    base = np.floor(shifted).astype(np.int64)
    fraction = shifted - base
    if taps % 2 == 0:
        offset = np.where(fraction == 0, -(taps // 2), -(taps // 2) + 1)
    else:
        offset = np.where(fraction <= 0.5, -((taps - 1) // 2), -((taps - 1) // 2) + 1)
    indices = (base + offset)[:, None] + np.arange(taps)[None, :] - pad
    if exclude_outside:
        weights = np.where((indices < 0) | (indices >= in_len), 0.0, weights)
        total = weights.sum(axis=1, keepdims=True)
        weights = weights / np.where(total == 0, 1.0, total)
    return np.clip(indices, 0, in_len - 1), weights


def _floats(importer: Importer, xs, index: int) -> list[float] | None:
    """A constant float input (None when omitted or empty, as Resize's optional roi, scales and sizes may be)."""
    if index >= len(xs) or xs[index] is None:
        return None
    value = importer.constant(xs[index])
    if value is None:
        raise Unsupported(f"input {index} is not a constant")
    return value.reshape(-1).tolist() or None


def _resize(importer: Importer, node, x: str, scales: list[float] | None, sizes: list[int] | None,
            attrs: dict, roi: list[float] | None = None) -> str:
    """x resampled to `sizes` (or by `scales`) per ONNX's Resize with these attributes."""
    shape = importer.type(x).shape
    rank = len(shape)
    axes = [a % rank for a in attrs.get("axes", range(rank))]
    scale = [1.0] * rank
    out = list(shape)
    full_roi = [0.0] * rank + [1.0] * rank
    if roi is not None:
        for i, axis in enumerate(axes):
            full_roi[axis], full_roi[rank + axis] = roi[i], roi[len(axes) + i]
    if sizes is not None:
        for axis, size in zip(axes, sizes):
            out[axis] = int(size)
        scale = [o / n for o, n in zip(out, shape)]
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
        if policy != "stretch":
            chosen = (min if policy == "not_larger" else max)(scale[a] for a in axes)
            scale = [chosen if i in axes else 1.0 for i in range(rank)]
            out = [int(chosen * shape[i] + 0.5) if i in axes else shape[i] for i in range(rank)]
    elif scales is not None:
        for axis, s in zip(axes, scales):
            scale[axis] = float(s)
        out = [int(s * n) for s, n in zip(scale, shape)]
    else:
        raise Unsupported("neither scales nor sizes given")
    mode = attrs.get("mode", "nearest")
    if mode != "nearest" and not importer.type(x).is_float:
        raise Unsupported(f"{mode} resizing of {importer.type(x).dtype} values")
    if mode == "nearest" and attrs.get("antialias", 0):
        raise Unsupported("antialias with mode nearest")
    transform = attrs.get("coordinate_transformation_mode", "half_pixel")
    dtype = torch_dtype(importer.type(x).dtype)
    result = x
    for axis in axes:
        axis_roi = (full_roi[axis], full_roi[rank + axis])
        if math.isclose(scale[axis], 1.0) and out[axis] == shape[axis] and axis_roi == (0.0, 1.0):
            continue   # as ONNX's reference: this axis is not resampled
        weights_of = _filter(mode, attrs.get("nearest_mode", "round_prefer_floor"), attrs.get("cubic_coeff_a", -0.75),
                             bool(attrs.get("antialias", 0)), scale[axis])
        positions, outside = _source_positions(transform, out[axis], shape[axis], scale[axis],
                                               axis_roi if transform == "tf_crop_and_resize" else None)
        indices, weights = _axis_sampling(positions, shape[axis], weights_of, bool(attrs.get("exclude_outside", 0)))
        name = f"{node.output[0]}_axis{axis}"
        along = (1,) * axis + (out[axis],) + (1,) * (rank - axis - 1)   # a constant varying along `axis` only
        if mode == "nearest":
            picked = indices[np.arange(len(indices)), weights.argmax(axis=1)]
            result = importer.emit("take", [result, importer.add_constant(torch.from_numpy(picked), f"{name}_index")],
                                   {"axis": axis}, name=name)
        else:
            total = None
            for tap in range(indices.shape[1]):
                if not weights[:, tap].any():
                    continue
                gathered = importer.emit("take", [result, importer.add_constant(
                    torch.from_numpy(indices[:, tap].copy()), f"{name}_tap{tap}_index")], {"axis": axis},
                    name=f"{name}_tap{tap}")
                weight = importer.add_constant(torch.from_numpy(weights[:, tap].reshape(along)).to(dtype),
                                               f"{name}_tap{tap}_weight")
                term = importer.emit("mul", [gathered, weight], name=f"{name}_tap{tap}_weighted")
                total = term if total is None else importer.emit("add", [total, term], name=f"{name}_sum{tap}")
            result = total
        if outside is not None and outside.any():
            mask = importer.add_constant(torch.from_numpy(outside.reshape(along)), f"{name}_outside")
            value = importer.add_constant(torch.tensor(attrs.get("extrapolation_value", 0.0), dtype=dtype),
                                          f"{name}_extrapolated")
            result = importer.emit("where", [mask, value, result], name=f"{name}_cropped")
    return result if result != x else importer.emit("identity", [x])


@converts("Resize", attributes=RESIZE_ATTRIBUTES, constant_inputs=(1, 2, 3))
def _resize_converter(importer: Importer, node, xs, attrs):
    if importer.opset < 11:   # Resize 10: (X, scales), asymmetric, nearest rounding down
        legacy = {"mode": attrs.get("mode", "nearest"), "coordinate_transformation_mode": "asymmetric",
                  "nearest_mode": "floor"}
        return [_resize(importer, node, xs[0], _floats(importer, xs, 1), None, legacy)]
    sizes = _floats(importer, xs, 3)
    scales = None if sizes is not None else _floats(importer, xs, 2)
    return [_resize(importer, node, xs[0], scales, None if sizes is None else [int(s) for s in sizes], attrs,
                    _floats(importer, xs, 1))]


@converts("Upsample", attributes=("mode", "scales"), constant_inputs=(1,))
def _upsample(importer: Importer, node, xs, attrs):
    """Upsample (opsets 7-9; deprecated at 10): scales as an attribute (7) or an input (9)."""
    scales = attrs.get("scales") or _floats(importer, xs, 1)
    legacy = {"mode": attrs.get("mode", "nearest"), "coordinate_transformation_mode": "asymmetric",
              "nearest_mode": "floor"}
    return [_resize(importer, node, xs[0], scales, None, legacy)]
