"""ONNX converters of elementwise functions, reductions and normalisations written out in the IR's own ops: Mod,
IsInf, IsNaN, Sign, Celu, ThresholdedRelu, Shrink, Softsign, Mish, Swish, SwiGLU, the norm and log reductions
(ReduceL1, ReduceL2, ReduceSumSquare, ReduceLogSum, ReduceLogSumExp), ArgMax, ArgMin, Hardmax, LpNormalization,
InstanceNormalization, GroupNormalization, MeanVarianceNormalization and BitShift; Det and BitCast as the library
calls that run alone (`opfuse.ir.ops_alone`). Registered in
`opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

Each is written so that it computes ONNX's value, not an approximation of it: an argmax is the smallest index
holding the maximum (a NaN counting as the maximum, as numpy's), a modulo of integers is exact.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import ONNX_DTYPES, Unsupported, _softplus, converts, reduction_of
from opfuse.ir.graph import DTYPE_BYTES, torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


def _constant_like(importer: Importer, value, like: str, name: str) -> str:
    return importer.add_constant(torch.tensor(value, dtype=torch_dtype(importer.type(like).dtype)), name)


# ---- elementwise --------------------------------------------------------------------------------------------

@converts("Mod", attributes=("fmod",))
def _mod(importer: Importer, node, xs, attrs):
    """a - trunc(a / b) * b, the sign of a (fmod=1, C's fmod); with fmod=0 b added where that remainder is not 0 and
    its sign is not b's (Python's %). Exact for integers; float32 and narrower are computed in float64, where the
    quotient's truncation and the product are exact while |a / b| < 2^29, and a finite a modulo an infinite b is a
    (the formula would give NaN there). float64 has no wider type to be exact in: refused."""
    a, b = xs[:2]
    out = node.output[0]
    dtype = importer.type(a).dtype
    if importer.type(a).is_float:
        if dtype == "float64":
            raise Unsupported("Mod of float64 values: no wider type to compute it exactly in (needs an fmod IR op)")
        a, b = (importer.emit("cast", [x], {"dtype": "float64"}, name=f"{out}_{n}_wide")
                for x, n in ((a, "a"), (b, "b")))
    quotient = importer.emit("trunc_div", [a, b], name=f"{out}_quotient")
    remainder = importer.emit("sub", [a, importer.emit("mul", [quotient, b], name=f"{out}_multiple")],
                              name=f"{out}_remainder")
    zero = _constant_like(importer, 0, remainder, f"{out}_zero")
    if importer.type(xs[0]).is_float:
        finite_a = importer.emit("eq", [importer.emit("sub", [a, a], name=f"{out}_a_minus_a"), zero],
                                 name=f"{out}_a_finite")
        whole = importer.emit("minimum", [importer.emit("isinf", [b], name=f"{out}_b_infinite"), finite_a],
                              name=f"{out}_a_whole")
        remainder = importer.emit("where", [whole, a, remainder], name=f"{out}_fmod")
    if attrs.get("fmod", 0):
        return [remainder if not importer.type(xs[0]).is_float
                else importer.emit("cast", [remainder], {"dtype": dtype}, name=out)]
    signs_differ = importer.emit("ne", [importer.emit("lt", [remainder, zero], name=f"{out}_negative"),
                                        importer.emit("lt", [b, zero], name=f"{out}_b_negative")],
                                 name=f"{out}_signs_differ")
    fix = importer.emit("minimum", [signs_differ, importer.emit("ne", [remainder, zero], name=f"{out}_nonzero")],
                        name=f"{out}_fix")
    result = importer.emit("where", [fix, importer.emit("add", [remainder, b], name=f"{out}_shifted"), remainder],
                           name=out if not importer.type(xs[0]).is_float else f"{out}_floored")
    return [result if not importer.type(xs[0]).is_float else importer.emit("cast", [result], {"dtype": dtype},
                                                                            name=out)]


@converts("IsInf", attributes=("detect_negative", "detect_positive"))
def _is_inf(importer: Importer, node, xs, attrs):
    positive, negative = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    if positive and negative:
        return [importer.emit("isinf", [xs[0]])]
    if not positive and not negative:
        return [importer.add_constant(torch.zeros(importer.type(xs[0]).shape, dtype=torch.bool), node.output[0])]
    return [importer.emit("eq", [xs[0], _constant_like(importer, math.inf if positive else -math.inf, xs[0],
                                                       f"{node.output[0]}_infinity")])]


@converts("IsNaN")
def _is_nan(importer: Importer, node, xs, attrs):
    return [importer.emit("ne", [xs[0], xs[0]])]


@converts("Sign")
def _sign(importer: Importer, node, xs, attrs):
    """1 above zero, -1 below, x itself otherwise (zero, or NaN as numpy's sign gives)."""
    x, out = xs[0], node.output[0]
    zero = _constant_like(importer, 0, x, f"{out}_zero")
    below = importer.emit("where", [importer.emit("lt", [x, zero], name=f"{out}_negative"),
                                    _constant_like(importer, -1, x, f"{out}_minus_one"), x], name=f"{out}_below")
    return [importer.emit("where", [importer.emit("gt", [x, zero], name=f"{out}_positive"),
                                    _constant_like(importer, 1, x, f"{out}_one"), below], name=out)]


@converts("Celu", attributes=("alpha",))
def _celu(importer: Importer, node, xs, attrs):
    """max(0, x) + min(0, alpha * (exp(x / alpha) - 1))."""
    x, alpha = xs[0], attrs.get("alpha", 1.0)
    scaled = importer.emit("div", [x, importer.scalar(alpha, x)])
    negative = importer.emit("mul", [importer.emit("sub", [importer.emit("exp", [scaled]), importer.scalar(1.0, x)]),
                                     importer.scalar(alpha, x)])
    return [importer.emit("add", [importer.emit("relu", [x]),
                                  importer.emit("minimum", [negative, importer.scalar(0.0, x)])])]


@converts("ThresholdedRelu", attributes=("alpha",))
def _thresholded_relu(importer: Importer, node, xs, attrs):
    x = xs[0]
    above = importer.emit("gt", [x, importer.scalar(attrs.get("alpha", 1.0), x)])
    return [importer.emit("where", [above, x, importer.scalar(0.0, x)])]


@converts("Shrink", attributes=("bias", "lambd"))
def _shrink(importer: Importer, node, xs, attrs):
    """x + bias below -lambd, x - bias above lambd, 0 between."""
    x, lambd, bias = xs[0], attrs.get("lambd", 0.5), attrs.get("bias", 0.0)
    low = importer.emit("lt", [x, _constant_like(importer, -lambd, x, f"{node.output[0]}_low")])
    high = importer.emit("gt", [x, _constant_like(importer, lambd, x, f"{node.output[0]}_high")])
    bias_node = _constant_like(importer, bias, x, f"{node.output[0]}_bias")
    inner = importer.emit("where", [high, importer.emit("sub", [x, bias_node]),
                                    _constant_like(importer, 0, x, f"{node.output[0]}_zero")])
    return [importer.emit("where", [low, importer.emit("add", [x, bias_node]), inner])]


@converts("Softsign")
def _softsign(importer: Importer, node, xs, attrs):
    x = xs[0]
    return [importer.emit("div", [x, importer.emit("add", [importer.emit("abs", [x]), importer.scalar(1.0, x)])])]


@converts("Mish")
def _mish(importer: Importer, node, xs, attrs):
    (softplus,) = _softplus(importer, node, xs, {})
    return [importer.emit("mul", [xs[0], importer.emit("tanh", [softplus])])]


def _swish(importer: Importer, x: str, alpha: float) -> str:
    """x * sigmoid(alpha * x): the IR's silu where alpha is 1."""
    if alpha == 1.0:
        return importer.emit("silu", [x])
    gate = importer.emit("sigmoid", [importer.emit("mul", [x, importer.scalar(alpha, x)])])
    return importer.emit("mul", [x, gate])


@converts("Swish", attributes=("alpha",))
def _swish_converter(importer: Importer, node, xs, attrs):
    return [_swish(importer, xs[0], attrs.get("alpha", 1.0))]


@converts("SwiGLU", attributes=("alpha",))
def _swiglu(importer: Importer, node, xs, attrs):
    """swish(a) * b, a and b of one shape."""
    if importer.type(xs[0]) != importer.type(xs[1]):
        raise Unsupported("SwiGLU of inputs of different types")
    return [importer.emit("mul", [_swish(importer, xs[0], attrs.get("alpha", 1.0)), xs[1]])]


# ---- reductions ---------------------------------------------------------------------------------------------

def _sum_over(importer: Importer, x: str, reduction: dict | None, name: str) -> str:
    """sum over the reduction's dims; no reduction (empty axes with noop_with_empty_axes) leaves x."""
    return x if reduction is None else importer.emit("sum", [x], reduction, name=name)


@converts("ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum",
          attributes=("axes", "keepdims", "noop_with_empty_axes"), constant_inputs=(1,))
def _reduce_norms(importer: Importer, node, xs, attrs):
    """sum(|x|), sqrt(sum(x^2)), sum(x^2), log(sum(x)) over the axes."""
    x, out = xs[0], node.output[0]
    reduction = reduction_of(importer, node, xs, attrs)
    if node.op_type == "ReduceL1":
        return [_sum_over(importer, importer.emit("abs", [x], name=f"{out}_abs"), reduction, out)]
    if node.op_type == "ReduceLogSum":
        return [importer.emit("log", [_sum_over(importer, x, reduction, f"{out}_sum")], name=out)]
    squares = _sum_over(importer, importer.emit("mul", [x, x], name=f"{out}_squares"), reduction,
                        out if node.op_type == "ReduceSumSquare" else f"{out}_sum")
    return [squares if node.op_type == "ReduceSumSquare" else importer.emit("sqrt", [squares], name=out)]


@converts("ReduceLogSumExp", attributes=("axes", "keepdims", "noop_with_empty_axes"), constant_inputs=(1,))
def _reduce_log_sum_exp(importer: Importer, node, xs, attrs):
    """log(sum(exp(x - m))) + m, m the largest element (0 where it is infinite): exp never overflows, and a slice of
    -inf gives -inf, one with +inf gives +inf, as ONNX's reference."""
    x, out = xs[0], node.output[0]
    if not importer.type(x).is_float:
        raise Unsupported("ReduceLogSumExp of integers")
    reduction = reduction_of(importer, node, xs, attrs)
    if reduction is None:
        return [importer.emit("identity", [x])]
    shape = importer.type(x).shape
    if any(shape[d] == 0 for d in reduction["dims"]):
        kept = [1 if d in reduction["dims"] else n for d, n in enumerate(shape)
                if reduction["keepdim"] or d not in reduction["dims"]]
        return [importer.add_constant(torch.full(kept, -math.inf, dtype=torch_dtype(importer.type(x).dtype)), out)]
    largest = importer.emit("amax", [x], {"dims": reduction["dims"], "keepdim": True}, name=f"{out}_largest")
    finite = importer.emit("where", [importer.emit("isinf", [largest], name=f"{out}_largest_infinite"),
                                     importer.scalar(0.0, x), largest], name=f"{out}_shift")
    shifted = importer.emit("exp", [importer.emit("sub", [x, finite], name=f"{out}_shifted")], name=f"{out}_exp")
    total = importer.emit("log", [importer.emit("sum", [shifted], {"dims": reduction["dims"], "keepdim": True},
                                                name=f"{out}_sum")], name=f"{out}_log")
    result = importer.emit("add", [total, finite], name=out if reduction["keepdim"] else f"{out}_kept")
    if not reduction["keepdim"]:
        kept = tuple(n for d, n in enumerate(shape) if d not in reduction["dims"])
        result = importer.emit("reshape", [result], {"shape": kept}, name=out)
    return [result]


def _arg_extreme(importer: Importer, x: str, axis: int, largest: bool, last: bool, name: str) -> str:
    """The index (int64, kept dim) of the largest (smallest) element along `axis`: the first one, or the last
    with `last`; a NaN counts as the extreme, as in numpy."""
    shape = importer.type(x).shape
    extreme = importer.emit("amax" if largest else "amin", [x], {"dims": [axis], "keepdim": True},
                            name=f"{name}_extreme")
    hit = importer.emit("eq", [x, extreme], name=f"{name}_hits")
    if importer.type(x).is_float:
        hit = importer.emit("maximum", [hit, importer.emit("ne", [x, x], name=f"{name}_nan")], name=f"{name}_hit")
    along = [1] * len(shape)
    along[axis] = shape[axis]
    positions = importer.add_constant(torch.arange(shape[axis]).reshape(along), f"{name}_positions")
    missing = importer.add_constant(torch.tensor(-1 if last else shape[axis]), f"{name}_none")
    candidates = importer.emit("where", [hit, positions, missing], name=f"{name}_candidates")
    return importer.emit("amax" if last else "amin", [candidates], {"dims": [axis], "keepdim": True}, name=name)


@converts("ArgMax", "ArgMin", attributes=("axis", "keepdims", "select_last_index"))
def _arg_max_min(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", 0) % len(shape)
    out = node.output[0]
    index = _arg_extreme(importer, xs[0], axis, node.op_type == "ArgMax", bool(attrs.get("select_last_index", 0)),
                         out if attrs.get("keepdims", 1) else f"{out}_kept")
    if attrs.get("keepdims", 1):
        return [index]
    return [importer.emit("reshape", [index], {"shape": shape[:axis] + shape[axis + 1:]}, name=out)]


@converts("Hardmax", attributes=("axis",))
def _hardmax(importer: Importer, node, xs, attrs):
    """1 at the first largest element along the axis (a NaN counting as the largest), 0 elsewhere, in x's dtype;
    before opset 13 along all dims from `axis` on (default 1), as one flattened dim, as (Log)Softmax."""
    x, out = xs[0], node.output[0]
    shape = importer.type(x).shape
    axis = attrs.get("axis", -1 if importer.opset >= 13 else 1) % len(shape)
    if importer.opset < 13 and axis != len(shape) - 1:
        flat = importer.emit("reshape", [x], {"shape": (math.prod(shape[:axis]), math.prod(shape[axis:]))},
                             name=f"{out}_flat")
        return [importer.emit("reshape", [_one_hot_of_largest(importer, flat, 1, f"{out}_rows")], {"shape": shape},
                              name=out)]
    return [_one_hot_of_largest(importer, x, axis, out)]


def _one_hot_of_largest(importer: Importer, x: str, axis: int, name: str) -> str:
    shape = importer.type(x).shape
    index = _arg_extreme(importer, x, axis, True, False, f"{name}_index")
    along = [1] * len(shape)
    along[axis] = shape[axis]
    positions = importer.add_constant(torch.arange(shape[axis]).reshape(along), f"{name}_positions")
    hot = importer.emit("eq", [index, positions], name=f"{name}_hot")
    return importer.emit("cast", [hot], {"dtype": importer.type(x).dtype}, name=name)


# ---- normalisations -----------------------------------------------------------------------------------------

@converts("LpNormalization", attributes=("axis", "p"))
def _lp_normalization(importer: Importer, node, xs, attrs):
    """x / ||x||_p along the axis (p 1 or 2), 0 where the norm is 0."""
    x, out = xs[0], node.output[0]
    axis = attrs.get("axis", -1) % len(importer.type(x).shape)
    p = attrs.get("p", 2)
    if p not in (1, 2):
        raise Unsupported(f"LpNormalization with p={p}")
    reduction = {"dims": [axis], "keepdim": True}
    if p == 1:
        norm = importer.emit("sum", [importer.emit("abs", [x], name=f"{out}_abs")], reduction, name=f"{out}_norm")
    else:
        norm = importer.emit("sqrt", [importer.emit("sum", [importer.emit("mul", [x, x], name=f"{out}_squares")],
                                                    reduction, name=f"{out}_sum")], name=f"{out}_norm")
    zero = importer.scalar(0.0, x)
    return [importer.emit("where", [importer.emit("eq", [norm, zero], name=f"{out}_zero_norm"), zero,
                                    importer.emit("div", [x, norm], name=f"{out}_divided")], name=out)]


def _per_channel(importer: Importer, param: str, rank: int, name: str) -> str:
    """A [C] parameter shaped to broadcast along dim 1 of a rank-`rank` tensor."""
    return importer.emit("reshape", [param], {"shape": (importer.type(param).shape[0],) + (1,) * (rank - 2)},
                         name=name)


def _grouped_layer_norm(importer: Importer, x: str, groups: int, eps: float, name: str) -> str:
    """x [N, C, ...] normalised over each of `groups` channel groups (and all spatial dims): the IR's layer_norm of
    x seen as [N, groups, the rest]."""
    shape = importer.type(x).shape
    rows = importer.emit("reshape", [x], {"shape": (shape[0], groups, math.prod(shape[1:]) // groups)},
                         name=f"{name}_groups")
    normed = importer.emit("layer_norm", [rows], {"normalized_shape": (importer.type(rows).shape[2],),
                                                  "eps": float(eps)}, name=f"{name}_normalised")
    return importer.emit("reshape", [normed], {"shape": shape}, name=f"{name}_shaped")


@converts("InstanceNormalization", attributes=("epsilon",))
def _instance_normalization(importer: Importer, node, xs, attrs):
    x, scale, bias = xs[:3]
    out = node.output[0]
    shape = importer.type(x).shape
    normed = _grouped_layer_norm(importer, x, shape[1], attrs.get("epsilon", 1e-5), out)
    scaled = importer.emit("mul", [normed, _per_channel(importer, scale, len(shape), f"{out}_scale")])
    return [importer.emit("add", [scaled, _per_channel(importer, bias, len(shape), f"{out}_bias")], name=out)]


@converts("GroupNormalization", attributes=("epsilon", "num_groups", "stash_type"))
def _group_normalization(importer: Importer, node, xs, attrs):
    """Normalised per group of channels, then scale and bias per channel (opset 21; opset 18's, per group, is
    deprecated: ONNX's checker refuses it)."""
    x, scale, bias = xs[:3]
    out = node.output[0]
    shape = importer.type(x).shape
    groups = attrs["num_groups"]
    if shape[1] % groups:
        raise Unsupported(f"{shape[1]} channels in {groups} groups")
    if attrs.get("stash_type", 1) != 1:
        raise Unsupported("stash_type other than float32")
    normed = _grouped_layer_norm(importer, x, groups, attrs.get("epsilon", 1e-5), out)
    params = [_per_channel(importer, param, len(shape), f"{out}_{what}") for param, what in ((scale, "scale"),
                                                                                             (bias, "bias"))]
    return [importer.emit("add", [importer.emit("mul", [normed, params[0]], name=f"{out}_scaled"), params[1]],
                          name=out)]


@converts("MeanVarianceNormalization", attributes=("axes",))
def _mean_variance_normalization(importer: Importer, node, xs, attrs):
    """(x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over the axes (default 0, 2, 3), as ONNX's function body."""
    x, out = xs[0], node.output[0]
    rank = len(importer.type(x).shape)
    reduction = {"dims": sorted(a % rank for a in attrs.get("axes", (0, 2, 3))), "keepdim": True}
    mean = importer.emit("mean", [x], reduction, name=f"{out}_mean")
    mean_of_squares = importer.emit("mean", [importer.emit("mul", [x, x], name=f"{out}_squares")], reduction,
                                    name=f"{out}_mean_of_squares")
    variance = importer.emit("sub", [mean_of_squares, importer.emit("mul", [mean, mean], name=f"{out}_mean_squared")],
                             name=f"{out}_variance")
    std = importer.emit("add", [importer.emit("sqrt", [variance], name=f"{out}_std"), importer.scalar(1e-9, x)],
                        name=f"{out}_std_eps")
    return [importer.emit("div", [importer.emit("sub", [x, mean], name=f"{out}_centred"), std], name=out)]


# ---- integer bit shifts -------------------------------------------------------------------------------------

@converts("BitShift", attributes=("direction",))
def _bit_shift(importer: Importer, node, xs, attrs):
    """a << b as a * 2^b (wrapping as the dtype does; 2^b read from a constant table), a >> b as a divided by 2^b
    rounded down; a shift by a negative amount or by the bit width or more gives 0 (and -1 for a negative a shifted
    right), as ONNX's reference."""
    a, b = xs[:2]
    out = node.output[0]
    dtype = torch_dtype(importer.type(a).dtype)
    if dtype.is_floating_point or dtype == torch.bool:
        raise Unsupported(f"BitShift of {importer.type(a).dtype} values")
    bits = torch.iinfo(dtype).bits
    signed = torch.iinfo(dtype).min < 0
    left = attrs.get("direction") == "LEFT"
    usable = bits if left or not signed else bits - 1      # 2^(bits-1) does not fit a signed type: see below
    zero = _constant_like(importer, 0, a, f"{out}_zero")
    in_range = importer.emit("minimum", [
        importer.emit("ge", [b, zero], name=f"{out}_b_not_negative"),
        importer.emit("lt", [b, _constant_like(importer, usable, b, f"{out}_width")], name=f"{out}_b_below_width")],
        name=f"{out}_in_range")
    amount = importer.emit("where", [in_range, b, zero], name=f"{out}_amount")
    powers = [1 << i for i in range(usable)]
    if left and signed:   # 2^(bits-1) wraps to the dtype's minimum, as a left shift into the sign bit does
        powers[-1] = torch.iinfo(dtype).min
    power = importer.emit("take", [importer.add_constant(torch.tensor(powers, dtype=dtype), f"{out}_powers"), amount],
                          {"axis": 0},
                          name=f"{out}_power")
    if left:
        shifted = importer.emit("mul", [a, power], name=f"{out}_shifted")
        outside = zero
    else:   # floor(a / 2^b): the truncated quotient, one less where a negative a left a remainder
        quotient = importer.emit("trunc_div", [a, power], name=f"{out}_quotient")
        shifted = quotient
        if signed:
            remainder = importer.emit("sub", [a, importer.emit("mul", [quotient, power], name=f"{out}_multiple")],
                                      name=f"{out}_remainder")
            shifted = importer.emit("where", [importer.emit("lt", [remainder, zero], name=f"{out}_inexact"),
                                              importer.emit("sub", [quotient, _constant_like(importer, 1, a,
                                                                                             f"{out}_one")],
                                                            name=f"{out}_floor"), quotient], name=f"{out}_shifted")
            outside = importer.emit("where", [importer.emit("lt", [a, zero], name=f"{out}_a_negative"),
                                              _constant_like(importer, -1, a, f"{out}_minus_one"), zero],
                                    name=f"{out}_sign")
        else:
            outside = zero
    return [importer.emit("where", [in_range, shifted, outside], name=out)]


# ---- rounding -----------------------------------------------------------------------------------------------

# below these magnitudes a float may have a fraction; at or above them every value is an integer already (the
# significand's bits all lie above the binary point), so a cast to int64 and back is exact where it is used
INTEGRAL_FROM = {"float64": 2.0 ** 52, "float32": 2.0 ** 23, "float16": 2.0 ** 10, "bfloat16": 2.0 ** 7}


def floor(importer: Importer, x: str, name: str) -> str:
    """floor(x), exactly: x truncated by a cast to int64 and back, one less where that is above x; x itself where
    |x| is too large to have a fraction, and for infinities and NaN (which fail the comparison)."""
    dtype = importer.type(x).dtype
    truncated = importer.emit("cast", [importer.emit("cast", [x], {"dtype": "int64"}, name=f"{name}_int")],
                              {"dtype": dtype}, name=f"{name}_truncated")
    below = importer.emit("sub", [truncated, importer.scalar(1.0, x)], name=f"{name}_one_below")
    floored = importer.emit("where", [importer.emit("lt", [x, truncated], name=f"{name}_was_negative"), below,
                                      truncated], name=f"{name}_floored")
    fractional = importer.emit("lt", [importer.emit("abs", [x], name=f"{name}_magnitude"),
                                      importer.scalar(INTEGRAL_FROM[dtype], x)], name=f"{name}_fractional")
    return importer.emit("where", [fractional, floored, x], name=name)


def round_half_to_even(importer: Importer, x: str, name: str) -> str:
    """x rounded to the nearest integer, a tie to the even one (numpy's rint, ONNX's Round): floor(x) plus 1 where
    the fraction x - floor(x) (exact) is over a half, or is a half and floor(x) is odd."""
    low = floor(importer, x, f"{name}_floor")
    fraction = importer.emit("sub", [x, low], name=f"{name}_fraction")
    half = importer.scalar(0.5, x)
    parity = importer.emit("sub", [low, importer.emit("mul", [floor(importer, importer.emit(
        "mul", [low, half], name=f"{name}_halved"), f"{name}_halved_floor"), importer.scalar(2.0, x)],
        name=f"{name}_even")], name=f"{name}_parity")                         # 1 where floor(x) is odd, else 0
    tie_up = importer.emit("minimum", [importer.emit("eq", [fraction, half], name=f"{name}_tie"),
                                       importer.emit("eq", [parity, importer.scalar(1.0, x)], name=f"{name}_odd")],
                           name=f"{name}_tie_up")
    up = importer.emit("maximum", [importer.emit("gt", [fraction, half], name=f"{name}_over_half"), tie_up],
                       name=f"{name}_up")
    return importer.emit("where", [up, importer.emit("add", [low, importer.scalar(1.0, x)], name=f"{name}_plus_one"),
                                   low], name=name)


@converts("Floor", "Ceil", "Round")
def _rounding(importer: Importer, node, xs, attrs):
    """Floor; Ceil as -floor(-x); Round half to even."""
    x, out = xs[0], node.output[0]
    if node.op_type == "Floor":
        return [floor(importer, x, out)]
    if node.op_type == "Ceil":
        negated = importer.emit("neg", [x], name=f"{out}_negated")
        return [importer.emit("neg", [floor(importer, negated, f"{out}_floor")], name=out)]
    return [round_half_to_even(importer, x, out)]


@converts("Det")
def _det(importer: Importer, node, xs, attrs):
    return [importer.emit("det", xs[:1], name=node.output[0])]


@converts("BitCast", attributes=("to",))
def _bit_cast(importer: Importer, node, xs, attrs):
    """x's bits read as `to` (a type of the same width)."""
    dtype = ONNX_DTYPES.get(attrs["to"])
    if dtype is None:
        raise Unsupported(f"to {attrs['to']}: no IR dtype")
    if DTYPE_BYTES[dtype] != DTYPE_BYTES[importer.type(xs[0]).dtype]:
        raise Unsupported(f"{importer.type(xs[0]).dtype} and {dtype} differ in width")
    return [importer.emit("bitcast", xs[:1], {"source": importer.type(xs[0]).dtype, "dtype": dtype},
                          name=node.output[0])]
