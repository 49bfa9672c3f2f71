"""ONNX converters of the linear quantisation operators to and from the integer types the IR has (int8, uint8,
int16): QuantizeLinear, DequantizeLinear, DynamicQuantizeLinear, QLinearMatMul and QLinearConv, and the integer
MatMulInteger and ConvInteger, written in IR ops. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see
there for the converter contract).

Quantising is x / scale rounded half to even (`onnx_math.round_half_to_even`, exact), plus the zero point,
clamped to the type's range and cast; dequantising (x - zero point) * scale in float32. A scale and zero point
are a scalar, one value per slice along `axis`, or one per block of `block_size` along it (repeated to each
element). QLinearMatMul and QLinearConv multiply the zero-point-shifted integers in float64 (exact for 8-bit
operands) and requantise as ONNX's reference does; MatMulInteger and ConvInteger do the same and cast the sums to
int32.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from opfuse.frontend.onnx_converters import ONNX_DTYPES, Unsupported, converts
from opfuse.frontend.onnx_math import round_half_to_even
from opfuse.frontend.onnx_spatial import _conv

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer

RANGES = {"uint8": (0, 255), "int8": (-128, 127), "int16": (-32768, 32767)}


def _spread(importer: Importer, param: str, like: str, axis: int, block: int, name: str) -> str:
    """A scale or zero point shaped to broadcast against `like`: as it is if it is one value, along `axis` if it
    has one per slice, each value repeated `block` times along `axis` if it has one per block."""
    shape, rank = importer.type(param).shape, len(importer.type(like).shape)
    axis %= rank
    if len(shape) == 0 or shape == (1,):
        return param
    if len(shape) == 1 and not block:
        return importer.emit("reshape", [param], {"shape": (1,) * axis + shape + (1,) * (rank - axis - 1)},
                             name=f"{name}_along")
    if len(shape) != rank or not block:
        raise Unsupported(f"a scale or zero point of shape {list(shape)} for an input of rank {rank}")
    spread = shape[:axis + 1] + (1,) + shape[axis + 1:]
    wide = shape[:axis + 1] + (block,) + shape[axis + 1:]
    repeated = importer.emit("expand", [importer.emit("reshape", [param], {"shape": spread}, name=f"{name}_blocks")],
                             {"shape": wide}, name=f"{name}_repeated")
    merged = shape[:axis] + (shape[axis] * block,) + shape[axis + 1:]
    target = importer.type(like).shape[axis]
    result = importer.emit("reshape", [repeated], {"shape": merged}, name=f"{name}_per_element")
    if merged[axis] != target:   # the last block may be shorter
        result = importer.emit("slice", [result], {"dim": axis, "start": 0, "end": target, "step": 1},
                               name=f"{name}_trimmed")
    return result


def _as(importer: Importer, x: str, dtype: str, name: str) -> str:
    return x if importer.type(x).dtype == dtype else importer.emit("cast", [x], {"dtype": dtype}, name=name)


def _quantize(importer: Importer, value: str, zero_point: str | None, dtype: str, name: str) -> str:
    """round(value) + zero point, clamped to `dtype`'s range, cast to it (value a float tensor)."""
    rounded = round_half_to_even(importer, value, f"{name}_rounded")
    if zero_point is not None:
        rounded = importer.emit("add", [rounded, _as(importer, zero_point, importer.type(value).dtype,
                                                     f"{name}_zero_point")], name=f"{name}_shifted")
    low, high = RANGES[dtype]
    clamped = importer.emit("clamp", [rounded], {"min": float(low), "max": float(high)}, name=f"{name}_saturated")
    return importer.emit("cast", [clamped], {"dtype": dtype}, name=name)


@converts("QuantizeLinear", attributes=("axis", "block_size", "output_dtype", "saturate", "precision"))
def _quantize_linear(importer: Importer, node, xs, attrs):
    x, scale = xs[:2]
    zero_point = xs[2] if len(xs) > 2 else None
    out = node.output[0]
    target = importer.type(zero_point).dtype if zero_point is not None else ONNX_DTYPES.get(
        attrs.get("output_dtype", 2))
    if target not in RANGES:
        raise Unsupported(f"quantising to {target or 'a type the IR has no equivalent for'}")
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    precision = ONNX_DTYPES.get(attrs["precision"]) if "precision" in attrs else importer.type(x).dtype
    if precision is None:
        raise Unsupported("a precision the IR has no equivalent for")
    scaled = importer.emit("div", [_as(importer, x, precision, f"{out}_x"),
                                   _as(importer, _spread(importer, scale, x, axis, block, f"{out}_scale"), precision,
                                       f"{out}_scale_cast")], name=f"{out}_scaled")
    point = None if zero_point is None else _spread(importer, zero_point, x, axis, block, f"{out}_zero")
    return [_quantize(importer, scaled, point, target, out)]


@converts("DequantizeLinear", attributes=("axis", "block_size", "output_dtype"))
def _dequantize_linear(importer: Importer, node, xs, attrs):
    """(x - zero point) in float32, times the scale, in the scale's dtype (or output_dtype)."""
    x, scale = xs[:2]
    zero_point = xs[2] if len(xs) > 2 else None
    out = node.output[0]
    if importer.type(x).dtype not in RANGES and importer.type(x).dtype != "int32":
        raise Unsupported(f"dequantising {importer.type(x).dtype} values")
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    shifted = _as(importer, x, "float32", f"{out}_x")
    if zero_point is not None:
        shifted = importer.emit("sub", [shifted, _as(importer, _spread(importer, zero_point, x, axis, block,
                                                                       f"{out}_zero"), "float32", f"{out}_zero_f32")],
                                name=f"{out}_shifted")
    product = importer.emit("mul", [shifted, _as(importer, _spread(importer, scale, x, axis, block, f"{out}_scale"),
                                                 "float32", f"{out}_scale_f32")], name=f"{out}_scaled")
    dtype = ONNX_DTYPES.get(attrs["output_dtype"]) if "output_dtype" in attrs else importer.type(scale).dtype
    if dtype is None:
        raise Unsupported("an output dtype the IR has no equivalent for")
    return [_as(importer, product, dtype, out) if dtype != "float32" else importer.emit("identity", [product],
                                                                                        name=out)]


@converts("DynamicQuantizeLinear")
def _dynamic_quantize_linear(importer: Importer, node, xs, attrs):
    """uint8 with a scale spanning [min(x, 0), max(x, 0)] over 255 steps and the zero point that maps 0 to an
    integer: the three outputs as ONNX's reference computes them."""
    x, out = xs[0], node.output[0]
    if importer.type(x).dtype != "float32":
        raise Unsupported("DynamicQuantizeLinear of other than float32")
    every = {"dims": list(range(len(importer.type(x).shape))), "keepdim": False}
    zero = importer.scalar(0.0, x)
    largest = importer.emit("maximum", [importer.emit("amax", [x], every, name=f"{out}_max"), zero],
                            name=f"{out}_max_or_0")
    smallest = importer.emit("minimum", [importer.emit("amin", [x], every, name=f"{out}_min"), zero],
                             name=f"{out}_min_or_0")
    span = importer.emit("sub", [largest, smallest], name=f"{out}_span")
    span = importer.emit("where", [importer.emit("eq", [largest, smallest], name=f"{out}_flat"),
                                   importer.scalar(1.0, x), span], name=f"{out}_span_or_1")
    scale = importer.emit("div", [span, importer.scalar(255.0, x)], name=node.output[1] or f"{out}_scale")
    initial = importer.emit("sub", [zero, importer.emit("div", [smallest, scale], name=f"{out}_min_steps")],
                            name=f"{out}_initial_zero_point")
    point = round_half_to_even(importer, importer.emit("clamp", [initial], {"min": 0.0, "max": 255.0},
                                                       name=f"{out}_zero_clamped"), f"{out}_zero_rounded")
    y = _quantize(importer, importer.emit("div", [x, scale], name=f"{out}_steps"), point, "uint8", out)
    return [y, scale, importer.emit("cast", [point], {"dtype": "uint8"}, name=node.output[2] or f"{out}_zero_point")]


@converts("QLinearMatMul")
def _qlinear_matmul(importer: Importer, node, xs, attrs):
    """(a - a_zp) @ (b - b_zp), exact in float64, times a_scale * b_scale / y_scale (in the scales' dtype), plus
    y_zp, rounded half to even and saturated to y's type."""
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = xs[:8]
    out = node.output[0]
    target = importer.type(y_zero).dtype if y_zero is not None else importer.type(a).dtype
    if target not in RANGES:
        raise Unsupported(f"QLinearMatMul to {target}")
    for scale in (a_scale, b_scale, y_scale):
        if importer.type(scale).shape not in ((), (1,)):
            raise Unsupported("per-axis QLinearMatMul scales")

    def shifted(x, zero, what):
        wide = _as(importer, x, "float64", f"{out}_{what}_f64")
        if zero is None:
            return wide
        return importer.emit("sub", [wide, _as(importer, zero, "float64", f"{out}_{what}_zero_f64")],
                             name=f"{out}_{what}_shifted")

    product = importer.emit("matmul", [shifted(a, a_zero, "a"), shifted(b, b_zero, "b")], name=f"{out}_product")
    factor = importer.emit("div", [importer.emit("mul", [a_scale, b_scale], name=f"{out}_ab_scale"), y_scale],
                           name=f"{out}_factor")
    scaled = importer.emit("mul", [product, _as(importer, factor, "float64", f"{out}_factor_f64")],
                           name=f"{out}_scaled")
    return [_quantize(importer, scaled, y_zero, target, out)]


def _shifted(importer: Importer, x: str, zero: str | None, like_axis: int | None, out: str, what: str) -> str:
    """x - its zero point, in float64 (exact for 8-bit integers and their products' sums); a zero point of one value
    per slice lies along `like_axis` of x (a weight's output channels, a matrix's columns)."""
    wide = _as(importer, x, "float64", f"{out}_{what}_f64")
    if zero is None:
        return wide
    if like_axis is not None and importer.type(zero).shape not in ((), (1,)):
        zero = _spread(importer, zero, x, like_axis, 0, f"{out}_{what}_zero")
    return importer.emit("sub", [wide, _as(importer, zero, "float64", f"{out}_{what}_zero_f64")],
                         name=f"{out}_{what}_shifted")


@converts("MatMulInteger")
def _matmul_integer(importer: Importer, node, xs, attrs):
    """(a - a_zp) @ (b - b_zp) as int32: multiplied in float64 (exact for 8-bit operands), then cast. a's zero point
    is one value (or one per row), b's one value or one per column."""
    a, b = xs[:2]
    a_zero = xs[2] if len(xs) > 2 else None
    b_zero = xs[3] if len(xs) > 3 else None
    out = node.output[0]
    if a_zero is not None and importer.type(a_zero).shape not in ((), (1,)):
        raise Unsupported("a zero point per row of a")
    product = importer.emit("matmul", [_shifted(importer, a, a_zero, None, out, "a"),
                                       _shifted(importer, b, b_zero, -1, out, "b")], name=f"{out}_product")
    return [importer.emit("cast", [product], {"dtype": "int32"}, name=out)]


def _integer_conv(importer: Importer, node, xs, attrs, x_zero: str | None, w_zero: str | None, out: str) -> str:
    """The conv (as ONNX's Conv: `onnx_spatial._conv`) of the zero-point-shifted integers, in float64."""
    x = _shifted(importer, xs[0], x_zero, None, out, "x")
    w = _shifted(importer, xs[1], w_zero, 0, out, "w")
    (summed,) = _conv(importer, node, [x, w], attrs)
    return summed


@converts("ConvInteger", attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv_integer(importer: Importer, node, xs, attrs):
    """Conv of (x - x_zp) and (w - w_zp) as int32, summed in float64 (exact for 8-bit operands); the padding is
    x's zero point, i.e. 0 once shifted."""
    x_zero = xs[2] if len(xs) > 2 else None
    w_zero = xs[3] if len(xs) > 3 else None
    out = node.output[0]
    summed = _integer_conv(importer, node, xs[:2], attrs, x_zero, w_zero, out)
    return [importer.emit("cast", [summed], {"dtype": "int32"}, name=out)]


@converts("QLinearConv", attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _qlinear_conv(importer: Importer, node, xs, attrs):
    """Conv of (x - x_zp) and (w - w_zp) in float64 plus the int32 bias, times x_scale * w_scale / y_scale (one w
    scale per output channel, or one), plus y_zp, rounded half to even and saturated to y's type, as ONNX's
    reference does."""
    x, x_scale, x_zero, w, w_scale, w_zero, y_scale, y_zero = xs[:8]
    bias = xs[8] if len(xs) > 8 else None
    out = node.output[0]
    target = importer.type(y_zero).dtype if y_zero is not None else importer.type(x).dtype
    if target not in RANGES:
        raise Unsupported(f"QLinearConv to {target}")
    if any(importer.type(s).shape not in ((), (1,)) for s in (x_scale, y_scale)):
        raise Unsupported("per-axis QLinearConv input or output scales")
    summed = _integer_conv(importer, node, [x, w], attrs, x_zero, w_zero, out)
    rank = len(importer.type(summed).shape)
    if bias is not None:
        along = importer.emit("reshape", [_as(importer, bias, "float64", f"{out}_bias_f64")],
                              {"shape": (1, -1) + (1,) * (rank - 2)}, name=f"{out}_bias_along")
        summed = importer.emit("add", [summed, along], name=f"{out}_biased")
    w_scale = _spread(importer, w_scale, summed, 1, 0, f"{out}_w_scale")
    factor = importer.emit("div", [importer.emit("mul", [x_scale, w_scale], name=f"{out}_xw_scale"), y_scale],
                           name=f"{out}_factor")
    scaled = importer.emit("mul", [summed, _as(importer, factor, "float64", f"{out}_factor_f64")],
                           name=f"{out}_scaled")
    return [_quantize(importer, scaled, y_zero, target, out)]
