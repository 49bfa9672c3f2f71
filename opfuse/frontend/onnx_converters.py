"""ONNX op converters for `opfuse.frontend.onnx_import`: one function per ONNX op (or family of ops).

Each converter gets the importer, the ONNX node, the IR names of its inputs (None for an omitted optional input)
and its attributes as Python values, adds IR nodes through `importer.emit`, and returns the IR name of each ONNX
output (None for one it does not produce). It raises `Unsupported` when this use of the op has no IR
equivalent: the importer then makes the node opaque and records the reason. Entry point: `CONVERTERS`.

Each converter names the attributes it understands (`converts(..., attributes=...)`, kept in `ATTRIBUTES`). A node
carrying any other attribute (one of an older or newer opset, such as Add's `broadcast`/`axis` before opset 7) is
not converted but made opaque with the attribute named, since ignoring it could silently change the result.
It also names the inputs whose values it must know at import (`constant_inputs`, kept in `CONSTANT_INPUTS`): those
that fix a shape, such as Reshape's `shape` or Slice's `starts`; the IR's shapes are static.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto

from opfuse.ir.graph import torch_dtype
from opfuse.ir.ops import get_op

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer

ONNX_DTYPES = {
    TensorProto.FLOAT: "float32", TensorProto.DOUBLE: "float64", TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16", TensorProto.INT64: "int64", TensorProto.INT32: "int32",
    TensorProto.INT16: "int16", TensorProto.INT8: "int8", TensorProto.UINT8: "uint8", TensorProto.BOOL: "bool",
}


class Unsupported(Exception):
    """Raised by a converter: this use of a mapped op has no IR equivalent, so the node becomes opaque."""


Converter = Callable[["Importer", onnx.NodeProto, list, dict], list]
CONVERTERS: dict[str, Converter] = {}
ATTRIBUTES: dict[str, frozenset[str]] = {}   # op type -> the attributes its converter understands
CONSTANT_INPUTS: dict[str, frozenset[int]] = {}   # op type -> the input positions its converter needs constant


def converts(*op_types: str, attributes: tuple[str, ...] = (), constant_inputs: tuple[int, ...] = ()
             ) -> Callable[[Converter], Converter]:
    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
            ATTRIBUTES[op_type] = frozenset(attributes)
            CONSTANT_INPUTS[op_type] = frozenset(constant_inputs)
        return fn
    return register


def unknown_attributes(op_type: str, attrs: dict) -> list[str]:
    """The attributes of a node that its converter does not understand (sorted)."""
    return sorted(set(attrs) - ATTRIBUTES.get(op_type, frozenset()))


# ---- converters: one per ONNX op (or family), returning the IR name of each output ---------------------

UNARY = {"Relu": "relu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Exp": "exp", "Log": "log",
         "Sqrt": "sqrt", "Neg": "neg", "Abs": "abs", "Reciprocal": "reciprocal", "HardSwish": "hardswish",
         "Identity": "identity"}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Max": "maximum",
          "Min": "minimum", "Sum": "add"}


@converts(*UNARY)
def _unary(importer: Importer, node, xs, attrs):
    return [importer.emit(UNARY[node.op_type], [xs[0]])]


# `seed` and the old `ratio`/`is_test` do nothing at inference
@converts("Dropout", attributes=("seed", "ratio", "is_test"), constant_inputs=(1, 2))
def _dropout(importer: Importer, node, xs, attrs):
    """Inference Dropout: the input unchanged and a mask of ones. In training mode only a ratio of 0 (nothing
    dropped) has that meaning; any other drops at random."""
    training = importer.constant(xs[2]) if len(xs) > 2 and xs[2] is not None else False
    if training is None:
        raise Unsupported("Dropout with a training_mode computed at run time")
    if training is not False and bool(training.reshape(-1)[0]):
        ratio = importer.constant(xs[1]) if len(xs) > 1 and xs[1] is not None else 0.5
        if ratio is None or float(ratio) != 0.0:
            raise Unsupported("Dropout in training mode (random) has no inference equivalent")
    outputs = [importer.emit("identity", [xs[0]])]
    if len(node.output) > 1 and node.output[1] in importer.used:
        mask_type = importer.onnx_types.get(node.output[1])    # bool from opset 10, the input's type before
        mask = torch.ones(importer.type(xs[0]).shape, dtype=torch_dtype(mask_type.dtype if mask_type else "bool"))
        outputs.append(importer.add_constant(mask, node.output[1]))
    return outputs


@converts(*BINARY)
def _binary(importer: Importer, node, xs, attrs):
    if node.op_type == "Div" and not importer.type(xs[0]).is_float:   # integer Div truncates, torch.div does not
        return [importer.emit("trunc_div", xs[:2])]
    result = xs[0]
    for other in xs[1:]:  # Max, Min and Sum are variadic
        result = importer.emit(BINARY[node.op_type], [result, other])
    if node.op_type == "Pow" and importer.type(result).dtype != importer.type(xs[0]).dtype:
        # ONNX's Pow has its base's type (an integer base to a float power truncates); torch.pow promotes
        result = importer.emit("cast", [result], {"dtype": importer.type(xs[0]).dtype})
    return [result]


@converts("Gelu", attributes=("approximate",))
def _gelu(importer: Importer, node, xs, attrs):
    return [importer.emit("gelu", [xs[0]], {"approximate": attrs.get("approximate", "none")})]


@converts("LeakyRelu", attributes=("alpha",))
def _leaky_relu(importer: Importer, node, xs, attrs):
    alpha = attrs.get("alpha", 0.01)
    if not 0 <= alpha <= 1:
        raise Unsupported("LeakyRelu with alpha outside [0, 1]")
    # max(x, alpha * x) equals leaky relu exactly when 0 <= alpha <= 1
    return [importer.emit("maximum", [xs[0], importer.emit("mul", [xs[0], importer.scalar(alpha, xs[0])])])]


@converts("HardSigmoid", attributes=("alpha", "beta"))
def _hard_sigmoid(importer: Importer, node, xs, attrs):
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    if math.isclose(alpha, 1 / 6, rel_tol=1e-6) and math.isclose(beta, 0.5):
        return [importer.emit("hardsigmoid", [xs[0]])]
    scaled = importer.emit("mul", [xs[0], importer.scalar(alpha, xs[0])])
    scaled = importer.emit("add", [scaled, importer.scalar(beta, xs[0])])
    return [importer.emit("clamp", [scaled], {"min": 0.0, "max": 1.0})]


@converts("Clip", attributes=("min", "max"))
def _clip(importer: Importer, node, xs, attrs):
    result, bounds = xs[0], {"min": attrs.get("min"), "max": attrs.get("max")}  # attributes before opset 11
    for index, key, op in ((1, "min", "maximum"), (2, "max", "minimum")):
        if index < len(xs) and xs[index] is not None:
            value = importer.constant(xs[index])
            if value is None:  # a bound computed at run time: an elementwise max/min instead of clamp
                result = importer.emit(op, [result, xs[index]])
            else:
                bounds[key] = value.item()
    if bounds["min"] is None and bounds["max"] is None:
        return [result if result != xs[0] else importer.emit("identity", [xs[0]])]
    return [importer.emit("clamp", [result], bounds)]


# saturate and round_mode only apply to float8 targets, which are refused below
@converts("Cast", "CastLike", attributes=("to", "saturate", "round_mode"))
def _cast(importer: Importer, node, xs, attrs):
    if node.op_type == "CastLike":
        dtype = importer.type(xs[1]).dtype
    elif attrs["to"] in ONNX_DTYPES:
        dtype = ONNX_DTYPES[attrs["to"]]
    else:
        raise importer.error(f"casts to {TensorProto.DataType.Name(attrs['to'])}, which opfuse does not support")
    return [importer.emit("cast", [xs[0]], {"dtype": dtype})]


def _pads(attrs: dict, size: tuple[int, ...], kernel, strides, dilations) -> tuple[list[int], list[int]]:
    """ONNX's pads/auto_pad of a window as (the padding before each spatial dim, the padding after it)."""
    auto_pad, rank = attrs.get("auto_pad", "NOTSET"), len(size)
    if auto_pad == "VALID":
        return [0] * rank, [0] * rank
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        totals = [max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
                  for n, k, s, d in zip(size, kernel, strides, dilations)]
        small = [t // 2 for t in totals]
        large = [t - t // 2 for t in totals]
        return (small, large) if auto_pad == "SAME_UPPER" else (large, small)   # UPPER: the extra at the end
    pads = list(attrs.get("pads", [0] * 2 * rank))
    return pads[:rank], pads[rank:]


def _window(importer: Importer, xs, attrs, kernel, pad_value: float | None = None, pool: bool = False
            ) -> tuple[str, dict]:
    """(input, its stride, padding and dilation) of a 2-D conv or a 2-D or 3-D pool: ONNX's padding where PyTorch's
    symmetric one expresses it (for a pool, at most half the dilated window), else an explicit `pad` of the input
    by `pad_value` (None: unsupported) and no padding."""
    spatial = len(importer.type(xs[0]).shape) - 2
    if spatial not in ((2, 3) if pool else (2,)):
        raise Unsupported("only 2-D convolution and 1-D, 2-D or 3-D pooling are mapped")
    strides = tuple(attrs.get("strides", (1,) * spatial))
    dilations = tuple(attrs.get("dilations", (1,) * spatial))
    begin, end = _pads(attrs, importer.type(xs[0]).shape[2:], kernel, strides, dilations)
    window = {"stride": strides, "dilation": dilations}
    half = [((k - 1) * d + 1) // 2 for k, d in zip(kernel, dilations)] if pool else begin
    if begin == end and all(b <= h for b, h in zip(begin, half)):
        return xs[0], window | {"padding": tuple(begin)}
    if pad_value is None:
        raise Unsupported(f"asymmetric pads {begin + end} (before each dim, then after); opfuse needs symmetric "
                          "padding here")
    pads = tuple(v for b, e in zip(reversed(begin), reversed(end)) for v in (b, e))   # F.pad: the last dim first
    padded = importer.emit("pad", [xs[0]], {"pads": pads, "value": pad_value})
    return padded, window | {"padding": (0,) * spatial}


@converts("Conv", attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(importer: Importer, node, xs, attrs):
    x, window = _window(importer, xs, attrs, importer.type(xs[1]).shape[2:], pad_value=0.0)
    inputs = [x] + [w for w in xs[1:3] if w is not None]
    return [importer.emit("conv2d", inputs, {**window, "groups": attrs.get("group", 1)})]


# storage_order only changes the optional Indices output, which is not mapped
@converts("MaxPool", attributes=("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides",
                                 "storage_order"))
def _max_pool(importer: Importer, node, xs, attrs):
    if len(importer.type(xs[0]).shape) == 3:
        return _pool_1d_as_2d(importer, node, xs, attrs, _max_pool)
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=float("-inf"), pool=True)
    pool = {"kernel_size": tuple(attrs["kernel_shape"]), **window, "ceil_mode": bool(attrs.get("ceil_mode", 0))}
    op = {2: "max_pool2d", 3: "max_pool3d"}[len(window["stride"])]
    return [_onnx_windows(importer, importer.emit(op, [x], pool), xs, attrs)]


def _pool_1d_as_2d(importer: Importer, node, xs, attrs, pool: Converter) -> list[str]:
    """A 1-D pool of [N, C, L] as the 2-D one of [N, C, 1, L], its window 1 high."""
    n, c, length = importer.type(xs[0]).shape
    x = importer.emit("reshape", [xs[0]], {"shape": (n, c, 1, length)})
    flat = {"kernel_shape": [1, *attrs["kernel_shape"]], "strides": [1, *attrs.get("strides", [1])],
            "dilations": [1, *attrs.get("dilations", [1])]}
    if "pads" in attrs:
        flat["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
    (pooled,) = pool(importer, node, [x], {**attrs, **flat})
    return [importer.emit("reshape", [pooled], {"shape": (n, c, importer.type(pooled).shape[3])})]


def _onnx_windows(importer: Importer, pooled: str, xs, attrs) -> str:
    """`pooled` without the windows ONNX does not have: in ceil mode, from opset 22, ONNX drops a last window that
    starts past the input and its leading padding, PyTorch one that starts past its (here explicitly padded) input.
    (Before opset 22 ONNX keeps it, as PyTorch does on an explicitly padded input.)"""
    if not attrs.get("ceil_mode", 0) or importer.opset < 22:
        return pooled
    size = importer.type(xs[0]).shape[2:]
    kernel, strides = attrs["kernel_shape"], tuple(attrs.get("strides", (1,) * len(size)))
    begin = _pads(attrs, size, kernel, strides, tuple(attrs.get("dilations", (1,) * len(size))))[0]
    shape = importer.type(pooled).shape
    for dim, (n, b, stride, count) in enumerate(zip(size, begin, strides, shape[2:]), start=2):
        if (count - 1) * stride >= n + b:
            pooled = importer.emit("slice", [pooled], {"dim": dim, "start": 0, "end": count - 1, "step": 1})
    return pooled


@converts("AveragePool", attributes=("auto_pad", "ceil_mode", "count_include_pad", "dilations", "kernel_shape",
                                     "pads", "strides"))
def _average_pool(importer: Importer, node, xs, attrs):
    if len(importer.type(xs[0]).shape) == 3:
        return _pool_1d_as_2d(importer, node, xs, attrs, _average_pool)
    include_pad, ceil_mode = bool(attrs.get("count_include_pad", 0)), bool(attrs.get("ceil_mode", 0))
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=0.0, pool=True)
    if any(d != 1 for d in window.pop("dilation")):
        raise Unsupported("dilated average pooling (PyTorch has none)")
    op = {2: "avg_pool2d", 3: "avg_pool3d"}[len(window["stride"])]
    explicit = x != xs[0]
    # PyTorch averages over the part of each window inside its (explicitly padded) input, so explicit zeros count
    pool = {"kernel_size": tuple(attrs["kernel_shape"]), **window, "ceil_mode": ceil_mode,
            "count_include_pad": include_pad or explicit}
    result = importer.emit(op, [x], pool)
    if explicit and not include_pad:
        # uncounted padding: divide by each window's share inside the input, the same pool of a mask (a constant)
        dtype = torch_dtype(importer.type(xs[0]).dtype)
        mask = get_op("pad").run([torch.ones((1, 1, *importer.type(xs[0]).shape[2:]), dtype=dtype)],
                                 importer.graph[x].attrs | {"value": 0.0})
        share = get_op(op).run([mask], pool)
        result = importer.emit("div", [result, importer.add_constant(share, f"{node.output[0]}_window_share")])
    return [_onnx_windows(importer, result, xs, attrs)]


@converts("GlobalAveragePool")
def _global_average_pool(importer: Importer, node, xs, attrs):
    rank = len(importer.type(xs[0]).shape)
    if rank == 4:
        return [importer.emit("adaptive_avg_pool2d", [xs[0]], {"output_size": (1, 1)})]
    return [importer.emit("mean", [xs[0]], {"dims": list(range(2, rank)), "keepdim": True})]


@converts("BatchNormalization", attributes=("epsilon", "momentum", "training_mode", "spatial", "is_test"))
def _batch_norm(importer: Importer, node, xs, attrs):
    if attrs.get("spatial", 1) != 1:   # opset < 9: statistics per element rather than per channel
        raise Unsupported("BatchNormalization with spatial=0")
    eps = attrs.get("epsilon", 1e-5)
    if attrs.get("training_mode", 0):
        return _batch_norm_training(importer, node, xs, eps, attrs.get("momentum", 0.9))
    return [importer.emit("batch_norm", xs[:5], {"eps": eps})]


def _batch_norm_training(importer: Importer, node, xs, eps: float, momentum: float) -> list[str]:
    """Training-mode BatchNormalization (opset 14 on): Y normalised by the batch's own mean and (biased) variance
    over every dim but the channels, and the running statistics moved toward them: running * momentum + batch *
    (1 - momentum)."""
    x, scale, bias, running_mean, running_var = xs[:5]
    shape = importer.type(x).shape
    dims = {"dims": [d for d in range(len(shape)) if d != 1], "keepdim": True}
    out = node.output[0]
    mean = importer.emit("mean", [x], dims, name=f"{out}_batch_mean")
    centred = importer.emit("sub", [x, mean], name=f"{out}_centred")
    variance = importer.emit("mean", [importer.emit("mul", [centred, centred], name=f"{out}_squares")], dims,
                             name=f"{out}_batch_var")
    mean, variance = (importer.emit("reshape", [v], {"shape": (shape[1],)}, name=f"{v}_flat")
                      for v in (mean, variance))
    outputs = [importer.emit("batch_norm", [x, scale, bias, mean, variance], {"eps": eps}, name=out)]
    for running, batch, name in zip((running_mean, running_var), (mean, variance), node.output[1:3]):
        kept = importer.emit("mul", [running, importer.scalar(momentum, running)], name=f"{name}_kept")
        moved = importer.emit("mul", [batch, importer.scalar(1 - momentum, batch)], name=f"{name}_moved")
        outputs.append(importer.emit("add", [kept, moved], name=name))
    return outputs


# stash_type is the precision of the mean/variance: for Y the IR computes them in at least float32; the optional
# Mean and InvStdDev outputs are computed in it
@converts("LayerNormalization", attributes=("axis", "epsilon", "stash_type"))
def _layer_norm(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", -1) % len(shape)
    normalized, eps = shape[axis:], attrs.get("epsilon", 1e-5)
    norm = {"normalized_shape": normalized, "eps": eps}
    params = [x for x in xs[1:3] if x is not None]
    if all(importer.type(p).shape == normalized for p in params):
        result = importer.emit("layer_norm", [xs[0], *params], norm)
    else:
        result = importer.emit("layer_norm", [xs[0]], norm)  # scale/bias that only broadcast: apply them separately
        for param, op in zip(params, ("mul", "add")):
            result = importer.emit(op, [result, param])
    if not any(name in importer.used for name in node.output[1:]):
        return [result]
    return [result, *_layer_norm_statistics(importer, node, xs[0], axis, eps, attrs.get("stash_type", 1))]


def _layer_norm_statistics(importer: Importer, node, x: str, axis: int, eps: float, stash_type: int) -> list[str]:
    """LayerNormalization's Mean and InvStdDev = 1 / sqrt(variance + epsilon), over the dims from `axis` on, kept
    as size 1, in the stash type."""
    if stash_type not in ONNX_DTYPES:
        raise Unsupported(f"stash_type {TensorProto.DataType.Name(stash_type)}")
    stash = ONNX_DTYPES[stash_type]
    if importer.type(x).dtype != stash:
        x = importer.emit("cast", [x], {"dtype": stash}, name=f"{node.output[0]}_stash")
    dims = {"dims": list(range(axis, len(importer.type(x).shape))), "keepdim": True}
    names = list(node.output[1:3]) + [""] * (3 - len(node.output))
    mean = importer.emit("mean", [x], dims, name=names[0] or f"{node.output[0]}_mean")
    centred = importer.emit("sub", [x, mean], name=f"{node.output[0]}_centred")
    variance = importer.emit("mean", [importer.emit("mul", [centred, centred], name=f"{node.output[0]}_squares")],
                             dims, name=f"{node.output[0]}_variance")
    shifted = importer.emit("add", [variance, importer.scalar(eps, variance)], name=f"{node.output[0]}_shifted")
    inverse = importer.emit("reciprocal", [importer.emit("sqrt", [shifted], name=f"{node.output[0]}_std")],
                            name=names[1] or f"{node.output[0]}_inv_std_dev")
    return [mean, inverse]


@converts("LRN", attributes=("alpha", "beta", "bias", "size"))
def _lrn(importer: Importer, node, xs, attrs):
    return [importer.emit("local_response_norm", [xs[0]], {
        "size": int(attrs["size"]), "alpha": attrs.get("alpha", 1e-4), "beta": attrs.get("beta", 0.75),
        "bias": attrs.get("bias", 1.0)})]


@converts("Softmax", attributes=("axis",))
def _softmax(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", -1 if importer.opset >= 13 else 1) % len(shape)
    if importer.opset >= 13 or axis == len(shape) - 1:
        return [importer.emit("softmax", [xs[0]], {"dim": axis})]
    # before opset 13, Softmax normalises over all dims from `axis` on, as one flattened dim
    flat = importer.emit("reshape", [xs[0]], {"shape": (math.prod(shape[:axis]), math.prod(shape[axis:]))})
    return [importer.emit("reshape", [importer.emit("softmax", [flat], {"dim": 1})], {"shape": shape})]


@converts("ReduceMean", "ReduceSum", attributes=("axes", "keepdims", "noop_with_empty_axes"), constant_inputs=(1,))
def _reduce(importer: Importer, node, xs, attrs):
    rank = len(importer.type(xs[0]).shape)
    axes = importer.ints(node, xs, attrs, "axes", 1)
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return [importer.emit("identity", [xs[0]])]
        axes = list(range(rank))
    op = "mean" if node.op_type == "ReduceMean" else "sum"
    reduction = {"dims": sorted(a % rank for a in axes), "keepdim": bool(attrs.get("keepdims", 1))}
    return [importer.emit(op, [xs[0]], reduction)]


@converts("MatMul")
def _matmul(importer: Importer, node, xs, attrs):
    weight = importer.constant(xs[1])
    if weight is not None and weight.dim() == 2:
        return [importer.emit("linear", [xs[0], importer.transposed_constant(xs[1])])]
    return [importer.emit("matmul", xs[:2])]


@converts("Gemm", attributes=("alpha", "beta", "transA", "transB"))
def _gemm(importer: Importer, node, xs, attrs):
    a, b = xs[0], xs[1]
    c = xs[2] if len(xs) > 2 else None
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if importer.constant(b) is not None and not attrs.get("transA", 0) and alpha == 1.0:
        weight = b if attrs.get("transB", 0) else importer.transposed_constant(b)
        bias, features = importer.constant(c), importer.type(weight).shape[0]
        if bias is not None and beta == 1.0 and tuple(bias.shape) in ((features,), (1, features)):
            bias_name = c if bias.dim() == 1 else importer.add_constant(bias.reshape(-1), f"{c}_flat")
            return [importer.emit("linear", [a, weight, bias_name])]
        result = importer.emit("linear", [a, weight])
    else:
        if attrs.get("transA", 0):
            a = importer.emit("permute", [a], {"dims": (1, 0)})
        if attrs.get("transB", 0):
            b = importer.emit("permute", [b], {"dims": (1, 0)})
        result = importer.emit("matmul", [a, b])
        if alpha != 1.0:
            result = importer.emit("mul", [result, importer.scalar(alpha, result)])
    if c is None:
        return [result]
    if beta != 1.0:
        c = importer.emit("mul", [c, importer.scalar(beta, c)])
    return [importer.emit("add", [result, c])]


# ---- layout ------------------------------------------------------------------------------------------

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
