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
         "Identity": "identity", "Sin": "sin", "Cos": "cos", "Tan": "tan", "Sinh": "sinh", "Cosh": "cosh",
         "Asinh": "asinh", "Acosh": "acosh", "Atanh": "atanh", "Atan": "atan", "Asin": "asin", "Acos": "acos",
         "BitwiseNot": "bitwise_not"}
BINARY = {"Add": "add", "Sub": "sub", "Mul": "mul", "Div": "div", "Pow": "pow", "Max": "maximum",
          "Min": "minimum", "Sum": "add", "BitwiseAnd": "bitwise_and", "BitwiseOr": "bitwise_or",
          "BitwiseXor": "bitwise_xor"}


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


COMPARISON = {"Equal": "eq", "Less": "lt", "Greater": "gt", "LessOrEqual": "le", "GreaterOrEqual": "ge",
              "Xor": "ne"}
# on bools: And is min, Or is max; Not is x == false
LOGICAL = {"And": "minimum", "Or": "maximum"}


@converts(*COMPARISON, *LOGICAL)
def _comparison(importer: Importer, node, xs, attrs):
    return [importer.emit(COMPARISON.get(node.op_type) or LOGICAL[node.op_type], xs[:2])]


@converts("Not")
def _not(importer: Importer, node, xs, attrs):
    return [importer.emit("eq", [xs[0], importer.add_constant(torch.tensor(False), f"{node.output[0]}_false")])]


@converts("Where")
def _where(importer: Importer, node, xs, attrs):
    return [importer.emit("where", xs[:3])]


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


def _negative_part(importer: Importer, x: str, alpha: float, scale: float = 1.0) -> str:
    """x where x > 0, else alpha * (exp(x) - 1); all times `scale` (Elu, Selu)."""
    expm1 = importer.emit("sub", [importer.emit("exp", [x]), importer.scalar(1.0, x)])
    below = importer.emit("mul", [expm1, importer.scalar(alpha * scale, x)])
    above = x if scale == 1.0 else importer.emit("mul", [x, importer.scalar(scale, x)])
    positive = importer.emit("gt", [x, importer.scalar(0.0, x)])
    return importer.emit("where", [positive, above, below])


@converts("Elu", attributes=("alpha",))
def _elu(importer: Importer, node, xs, attrs):
    return [_negative_part(importer, xs[0], attrs.get("alpha", 1.0))]


@converts("Selu", attributes=("alpha", "gamma"))
def _selu(importer: Importer, node, xs, attrs):
    return [_negative_part(importer, xs[0], attrs.get("alpha", 1.67326319217681884765625),
                           attrs.get("gamma", 1.05070102214813232421875))]


@converts("Softplus")
def _softplus(importer: Importer, node, xs, attrs):
    """log(exp(x) + 1) as max(x, 0) + log(1 + exp(-|x|)): the same value, without exp overflowing for large x."""
    x = xs[0]
    tail = importer.emit("exp", [importer.emit("neg", [importer.emit("abs", [x])])])
    log1p = importer.emit("log", [importer.emit("add", [tail, importer.scalar(1.0, x)])])
    return [importer.emit("add", [importer.emit("relu", [x]), log1p])]


@converts("PRelu")
def _prelu(importer: Importer, node, xs, attrs):
    """x where x >= 0, else slope * x; the slope broadcasts to x (opset 7 on)."""
    x, slope = xs[0], xs[1]
    negative = importer.emit("lt", [x, importer.scalar(0.0, x)])
    return [importer.emit("where", [negative, importer.emit("mul", [x, slope]), x])]


@converts("Mean")
def _mean(importer: Importer, node, xs, attrs):
    inputs = [x for x in xs if x is not None]
    total = inputs[0] if len(inputs) > 1 else importer.emit("identity", inputs)
    for other in inputs[1:]:
        total = importer.emit("add", [total, other])
    return [total if len(inputs) == 1 else importer.emit("div", [total, importer.scalar(len(inputs), total)])]


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
    value = importer.constant(xs[0])
    if value is not None:   # CastLike of a constant to a run-time value's dtype: a constant too
        return [importer.add_constant(get_op("cast").run([value], {"dtype": dtype}), node.output[0])]
    return [importer.emit("cast", [xs[0]], {"dtype": dtype})]


@converts("BatchNormalization", attributes=("epsilon", "momentum", "training_mode", "spatial", "is_test"))
def _batch_norm(importer: Importer, node, xs, attrs):
    eps = attrs.get("epsilon", 1e-5)
    if attrs.get("spatial", 1) != 1:   # opsets 7-8: statistics per element (shaped as x without its batch dim)
        return [_batch_norm_per_element(importer, xs, eps)]
    if attrs.get("training_mode", 0):
        return _batch_norm_training(importer, node, xs, eps, attrs.get("momentum", 0.9))
    return [importer.emit("batch_norm", xs[:5], {"eps": eps})]


def _batch_norm_per_element(importer: Importer, xs, eps: float) -> str:
    """(x - mean) / sqrt(var + eps) * scale + bias, every parameter [C, D1, ...] broadcast over the batch."""
    x, scale, bias, mean, variance = xs[:5]
    std = importer.emit("sqrt", [importer.emit("add", [variance, importer.scalar(eps, variance)])])
    normalised = importer.emit("div", [importer.emit("sub", [x, mean]), std])
    return importer.emit("add", [importer.emit("mul", [normalised, scale]), bias])


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


def _log_softmax(importer: Importer, x: str, dim: int) -> str:
    """x - max - log(sum(exp(x - max))) over `dim`: exact where log(softmax(x)) would underflow to -inf."""
    largest = importer.emit("amax", [x], {"dims": [dim], "keepdim": True})
    shifted = importer.emit("sub", [x, largest])
    total = importer.emit("sum", [importer.emit("exp", [shifted])], {"dims": [dim], "keepdim": True})
    return importer.emit("sub", [shifted, importer.emit("log", [total])])


@converts("Softmax", "LogSoftmax", attributes=("axis",))
def _softmax(importer: Importer, node, xs, attrs):
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", -1 if importer.opset >= 13 else 1) % len(shape)
    normalise = ((lambda x, dim: importer.emit("softmax", [x], {"dim": dim})) if node.op_type == "Softmax"
                 else (lambda x, dim: _log_softmax(importer, x, dim)))
    if importer.opset >= 13 or axis == len(shape) - 1:
        return [normalise(xs[0], axis)]
    # before opset 13, (Log)Softmax normalises over all dims from `axis` on, as one flattened dim
    flat = importer.emit("reshape", [xs[0]], {"shape": (math.prod(shape[:axis]), math.prod(shape[axis:]))})
    return [importer.emit("reshape", [normalise(flat, 1)], {"shape": shape})]


REDUCTIONS = {"ReduceMean": "mean", "ReduceSum": "sum", "ReduceProd": "prod", "ReduceMax": "amax",
              "ReduceMin": "amin"}


# axes: an attribute before opset 13 (ReduceSum) or 18 (the others), an input after
@converts(*REDUCTIONS, attributes=("axes", "keepdims", "noop_with_empty_axes"), constant_inputs=(1,))
def _reduce(importer: Importer, node, xs, attrs):
    reduction = reduction_of(importer, node, xs, attrs)
    if reduction is None:
        return [importer.emit("identity", [xs[0]])]
    op = REDUCTIONS[node.op_type]
    shape = importer.type(xs[0]).shape
    if op in ("amax", "amin") and any(shape[d] == 0 for d in reduction["dims"]):
        return [importer.add_constant(_empty_extreme(op, shape, reduction, importer.type(xs[0]).dtype),
                                      node.output[0])]
    return [importer.emit(op, [xs[0]], reduction)]


def reduction_of(importer: Importer, node, xs, attrs) -> dict | None:
    """A Reduce* node's {"dims", "keepdim"}: its axes (an attribute before opset 18, 13 for ReduceSum, then input
    1), all dims when none are given, or None for no reduction (empty axes with noop_with_empty_axes)."""
    rank = len(importer.type(xs[0]).shape)
    axes = importer.ints(node, xs, attrs, "axes", 1)
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return None
        axes = list(range(rank))
    return {"dims": sorted(a % rank for a in axes), "keepdim": bool(attrs.get("keepdims", 1))}


def _empty_extreme(op: str, shape, reduction: dict, dtype: str) -> torch.Tensor:
    """ReduceMax (ReduceMin) over no element: the dtype's lowest (highest) value, -inf (inf) for floats."""
    kept = [1 if d in reduction["dims"] else n for d, n in enumerate(shape)
            if reduction["keepdim"] or d not in reduction["dims"]]
    torch_type = torch_dtype(dtype)
    if torch_type == torch.bool:
        value = op == "amin"
    else:
        info = torch.finfo(torch_type) if torch_type.is_floating_point else torch.iinfo(torch_type)
        value = (-math.inf if op == "amax" else math.inf) if torch_type.is_floating_point else \
            (info.min if op == "amax" else info.max)
    return torch.full(kept, value, dtype=torch_type)


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


# the other families register themselves on import (they import `converts` from here, so they come last)
from opfuse.frontend import (onnx_attention, onnx_einsum, onnx_index, onnx_layout, onnx_losses,  # noqa: E402,F401
                             onnx_math, onnx_quantize, onnx_recurrent, onnx_resize, onnx_signal, onnx_spatial)
