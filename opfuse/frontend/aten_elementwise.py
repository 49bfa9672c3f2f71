"""ATen handlers of elementwise ops (`opfuse.frontend.aten_ops`): arithmetic and comparisons, activations,
clamps and selections, and the copies, casts, dropouts and fills that compute nothing new.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from opfuse.frontend.aten_common import Handler, MultiOutput, Unmapped, first_output, registrar
from opfuse.ir.graph import WIDE_INTEGERS, dtype_name, torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")


def _binary(op: str, reverse: bool = False) -> Handler:
    """add/sub/mul/div/comparisons (Tensor and Scalar overloads): `alpha` scales `other` first; rsub swaps the
    operands. A python scalar takes the result's dtype, or for a comparison (whose result is bool) the dtype the
    comparison is made in."""
    def handle(t: Translator, a: dict) -> str:
        if a.get("rounding_mode") is not None:
            return _rounded_division(t, a["self"], a["other"], a["rounding_mode"])
        first, second = (a["other"], a["self"]) if reverse else (a["self"], a["other"])
        alpha = a.get("alpha", 1)
        if alpha is not None and alpha != 1:  # add: self + alpha·other; rsub: other - alpha·self
            second = t.emit("mul", [second, t.operand(alpha)]) if isinstance(second, fx.Node) else second * alpha
        dtype = None
        if op in COMPARISONS:
            tensor = next((v for v in (first, second) if isinstance(v, fx.Node)), None)
            if tensor is None:
                raise Unmapped("a comparison of two python scalars")
            other = second if tensor is first else first
            probe = torch.empty((), dtype=torch_dtype(t.type_of(t.value(tensor)).dtype))
            dtype = dtype_name(torch.result_type(probe, other if not isinstance(other, fx.Node) else probe))
        return t.emit(op, [t.operand(first, dtype), t.operand(second, dtype)])
    return handle


for _name in ("add", "sub", "mul", "div", "maximum", "minimum") + COMPARISONS:
    HANDLERS[_name] = _binary(_name)
HANDLERS["rsub"] = _binary("sub", reverse=True)


def _rounded_division(t: Translator, x: Any, y: Any, mode: str) -> str:
    """Integer division rounded toward minus infinity (floor) or zero (trunc), which a kernel computes exactly in
    int64; a float one has no kernel form here."""
    if t.out_type.dtype not in WIDE_INTEGERS:
        raise Unmapped(f"{mode} division of {t.out_type.dtype} values")
    return t.emit({"floor": "floor_div", "trunc": "trunc_div"}[mode], [t.operand(x), t.operand(y)])


@maps("floor_divide")
def _floor_divide(t: Translator, a: dict) -> str:
    return _rounded_division(t, a["self"], a["other"], "floor")


@maps("pow")
def _pow(t: Translator, a: dict) -> str:
    return t.emit("pow", [t.operand(a["self"]), t.operand(a["exponent"])])


_UNARY = ("relu", "sigmoid", "tanh", "silu", "hardswish", "hardsigmoid", "erf", "exp", "log", "sqrt", "rsqrt",
          "neg", "abs", "reciprocal", "square", "mish", "log_sigmoid", "sin", "cos", "log1p", "expm1", "floor", "ceil",
          "sign", "logical_not", "tan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan", "asin", "acos")
for _name in _UNARY:
    HANDLERS[_name] = (lambda op: lambda t, a: t.emit(op, [a["self"]]))(_name)


@maps("log_sigmoid_forward")
def _log_sigmoid_with_buffer(t: Translator, a: dict) -> MultiOutput:
    return first_output(t, t.emit("log_sigmoid", [a["self"]]))


@maps("glu")
def _glu(t: Translator, a: dict) -> str:
    """glu(x, dim) = a * sigmoid(b), a and b the first and second half of x along dim (slices of it: views)."""
    x = t.value(a["self"])
    rank = t.rank(x)
    dim = int(a.get("dim", -1)) % rank
    size = t.type_of(x).shape[dim]
    if size % 2:
        raise Unmapped(f"glu over a dim of odd size {size}")
    first, second = (t.emit("slice", [x], {"dim": dim, "start": start, "end": start + size // 2, "step": 1})
                     for start in (0, size // 2))
    return t.emit("mul", [first, t.emit("sigmoid", [second])])


@maps("leaky_relu")
def _leaky_relu(t: Translator, a: dict) -> str:
    return t.emit("leaky_relu", [a["self"]], {"negative_slope": float(a.get("negative_slope", 0.01))})


@maps("softplus")
def _softplus(t: Translator, a: dict) -> str:
    return t.emit("softplus", [a["self"]], {"beta": float(a.get("beta", 1)), "threshold": float(a.get("threshold", 20))})


SELU_ALPHA, SELU_SCALE = 1.6732632423543772848170429916717, 1.0507009873554804934193349852946


@maps("elu", "selu", "celu")
def _elu(t: Translator, a: dict) -> str:
    """ELU with its scales; SELU its fixed alpha and scale; CELU(alpha) is ELU(alpha) of x / alpha."""
    if t.op_name == "selu":
        alpha, scale, input_scale = SELU_ALPHA, SELU_SCALE, 1.0
    elif t.op_name == "celu":
        alpha = float(a.get("alpha", 1.0))
        if alpha == 0:
            raise Unmapped("celu with alpha 0")
        scale, input_scale = 1.0, 1.0 / alpha
    else:
        alpha, scale, input_scale = (float(a.get(k, 1)) for k in ("alpha", "scale", "input_scale"))
    return t.emit("elu", [a["self"]], {"alpha": alpha, "scale": scale, "input_scale": input_scale})


@maps("prelu", "_prelu_kernel")
def _prelu(t: Translator, a: dict) -> str:
    """x where x > 0, else weight * x, the weight [C] (or one value) along dim 1: gt, mul, where."""
    x, weight = t.value(a["self"]), t.value(a["weight"])
    rank, channels = t.rank(x), t.type_of(weight).numel
    if channels != 1 and rank >= 2:       # [C] lies along dim 1, before the dims after it
        weight = t.emit("reshape", [weight], {"shape": [channels] + [1] * (rank - 2)})
    elif channels != 1:
        raise Unmapped("prelu of a vector with several weights")
    zero = t.operand(0.0, t.type_of(x).dtype)
    return t.emit("where", [t.emit("gt", [x, zero]), x, t.emit("mul", [x, weight])])


@maps("threshold")
def _threshold(t: Translator, a: dict) -> str:
    """x where x > threshold, else value: gt and where."""
    x = t.value(a["self"])
    above = t.emit("gt", [x, t.operand(a["threshold"], t.type_of(x).dtype)])
    return t.emit("where", [above, x, t.operand(a["value"])])


@maps("gelu")
def _gelu(t: Translator, a: dict) -> str:
    return t.emit("gelu", [a["self"]], {"approximate": a.get("approximate") or "none"})


@maps("clamp", "clamp_min", "clamp_max", "hardtanh", "relu6")
def _clamp(t: Translator, a: dict) -> str:
    if t.op_name == "relu6":
        low, high = 0.0, 6.0
    elif t.op_name == "hardtanh":
        low, high = a["min_val"], a["max_val"]
    else:
        low, high = a.get("min"), a.get("max")
    if isinstance(low, fx.Node) or isinstance(high, fx.Node):   # tensor bounds: T5's fp16 overflow clamp
        x = t.value(a["self"])
        if low is not None:
            x = t.emit("maximum", [x, t.operand(low)])
        if high is not None:
            x = t.emit("minimum", [x, t.operand(high)])
        return x
    return t.emit("clamp", [a["self"]], {"min": low, "max": high})


@maps("isinf")
def _isinf(t: Translator, a: dict) -> str:
    return t.emit("isinf", [a["self"]])


@maps("where")
def _where(t: Translator, a: dict) -> str:
    """where(condition, self, other); either value may be a python scalar (of the result's dtype)."""
    if "condition" not in a or a.get("self") is None or a.get("other") is None:
        raise Unmapped("where with one argument (nonzero)")
    return t.emit("where", [a["condition"], t.operand(a["self"]), t.operand(a["other"])])


@maps("logical_and", "logical_or", "bitwise_and", "bitwise_or", "__and__", "__or__", "bitwise_xor", "__xor__")
def _boolean_logic(t: Translator, a: dict) -> str:
    """and/or of two booleans as a selection: a and b is where(a, b, a), a or b is where(a, a, b); xor as ne.
    Integers: the bitwise op, computed exactly in a kernel. Mixed dtypes stay PyTorch's."""
    conjunction = t.op_name in ("logical_and", "bitwise_and", "__and__")
    exclusive = t.op_name in ("bitwise_xor", "__xor__")
    if t.out_type.dtype != "bool":
        if t.out_type.is_float:
            raise Unmapped(f"{t.op_name} of {t.out_type.dtype} values")
        op = "bitwise_xor" if exclusive else "bitwise_and" if conjunction else "bitwise_or"
        return t.emit(op, [t.operand(a["self"]), t.operand(a["other"])])
    first, second = (t.operand(a[k], "bool") for k in ("self", "other"))
    if any(t.type_of(v).dtype != "bool" for v in (first, second)):
        raise Unmapped(f"{t.op_name} of a boolean and a number")
    if exclusive:
        return t.emit("ne", [first, second])
    return t.emit("where", [first, second, first] if conjunction else [first, first, second])


@maps("bitwise_not")
def _bitwise_not(t: Translator, a: dict) -> str:
    """The logical not of a boolean, an integer's bitwise not."""
    return t.emit("logical_not" if t.type_of(t.value(a["self"])).dtype == "bool" else "bitwise_not", [a["self"]])


@maps("masked_fill")
def _masked_fill(t: Translator, a: dict) -> str:
    """value where mask, else self: where."""
    return t.emit("where", [a["mask"], t.operand(a["value"]), a["self"]])


@maps("addcmul", "addcdiv")
def _addcmul(t: Translator, a: dict) -> str:
    """self + value * tensor1 * tensor2 (or / tensor2): mul (div), a scale where value is not 1, add."""
    product = t.emit("mul" if t.op_name == "addcmul" else "div", [a["tensor1"], a["tensor2"]])
    value = a.get("value", 1)
    if value != 1:
        product = t.emit("mul", [product, t.operand(value)])
    return t.emit("add", [a["self"], product])


@maps("_to_copy", "to", "type_as", "_cast_Float", "_cast_Half")
def _to(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    if t.type_of(x).dtype == t.out_type.dtype:
        return t.emit("identity", [x])  # a device or layout change only: the IR does not model either
    return t.emit("cast", [x], {"dtype": t.out_type.dtype})


@maps("dropout", "feature_dropout", "alpha_dropout")
def _dropout(t: Translator, a: dict) -> str:
    if a.get("train"):
        raise Unmapped("dropout in training mode")
    return t.emit("identity", [a["input"]])


@maps("native_dropout")
def _native_dropout(t: Translator, a: dict) -> MultiOutput:
    if a.get("train") or a.get("train") is None:  # None means "as in training" for this op
        raise Unmapped("dropout in training mode")
    return first_output(t, t.emit("identity", [a["input"]]))


@maps("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "lift_fresh")
def _identity(t: Translator, a: dict) -> str:
    return t.emit("identity", [a["self"]])


# new_full and full_like: fill_value; an empty tensor's contents are unspecified, and zeros are one choice of them
FILLS = {"new_zeros": 0, "zeros_like": 0, "new_ones": 1, "ones_like": 1, "empty_like": 0, "new_empty": 0}


@maps("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "empty_like", "new_empty")
def _filled(t: Translator, a: dict) -> str:
    """One value in a shape: the argument lends its shape, dtype and device only, so the result is a constant
    (Swin's window mask starts as ``x.new_zeros``; folded, all it is built from folds; MoE routing's inverse
    permutation is written over an ``empty_like``)."""
    value = FILLS.get(t.op_name, a.get("fill_value"))
    if not isinstance(value, (bool, int, float)):
        raise Unmapped(f"fill value {value!r} is not a number")
    out = t.out_type
    tensor = torch.full(out.shape, value, dtype=torch_dtype(out.dtype))
    return t.graph.add_constant(t.node.name, tensor, source=t.node.name).name


# PyTorch's aliases of the ops above (torch.multiply, torch.arccos, torch.clip, ...): export keeps them as ops of
# their own, with the schemas of the ops they alias
ALIASES = {"multiply": "mul", "subtract": "sub", "divide": "div", "true_divide": "div", "greater": "gt",
           "greater_equal": "ge", "less": "lt", "less_equal": "le", "not_equal": "ne", "absolute": "abs",
           "negative": "neg", "arccos": "acos", "arcsin": "asin", "arctan": "atan", "arccosh": "acosh",
           "arcsinh": "asinh", "arctanh": "atanh", "clip": "clamp", "special_expit": "sigmoid",
           "special_erf": "erf", "special_expm1": "expm1", "special_log1p": "log1p"}
for _alias, _op in ALIASES.items():
    HANDLERS[_alias] = HANDLERS[_op]
