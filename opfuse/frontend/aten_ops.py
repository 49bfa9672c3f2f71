"""ATen op -> IR op handlers for the PyTorch frontend (`opfuse.frontend.torch_export`).

Entry point: `HANDLERS`, keyed by ATen op name ('conv2d' for aten.conv2d.default; overloads are told apart by
their arguments). A handler gets the translator and the call's arguments by schema name, emits IR nodes through
`Translator.emit` and returns the name of the node holding the result, or a `MultiOutput` for tuple-valued calls.
It raises `Unmapped` when the call has no IR equivalent (or none with these arguments): the translator then
keeps the call as an opaque node. Canonical IR attrs (pairs as int tuples, non-negative dims, concrete shapes)
are documented on each op in `opfuse.ir.ops`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

from opfuse.ir.graph import dtype_name, torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.torch_export import Translator


class Unmapped(Exception):
    """This call has no IR mapping (or none with these arguments); it becomes an opaque node."""


@dataclass
class MultiOutput:
    """A tuple-valued call; `item(i)` emits the IR for output i when a getitem reads it."""

    node: fx.Node
    item: Callable[[int], str]


def tensor_value(node: fx.Node) -> torch.Tensor | None:
    """The (fake) tensor torch recorded as `node`'s result; None for tuples and non-tensor results."""
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def op_name(target: Any) -> str:
    """'conv2d' for aten.conv2d.default: handlers are keyed by the op, overloads told apart by their args."""
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target.overloadpacket.__name__
    return ""


# ---- handlers: one per ATen op family; `a` holds the call's arguments by schema name ---------------

Handler = Callable[["Translator", dict[str, Any]], "str | MultiOutput"]
HANDLERS: dict[str, Handler] = {}


def maps(*names: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for name in names:
            HANDLERS[name] = handler
        return handler
    return register


def _pair(value: Any) -> tuple[int, int]:
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return int(values[0]), int(values[-1])  # a single value stands for both


def _dim(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


def _first_output(t: Translator, name: str) -> MultiOutput:
    """A tuple-valued call whose output 0 is `name`; the others (statistics, indices, masks) stay opaque."""
    def item(index: int) -> str:
        if index != 0:
            raise Unmapped(f"output {index} has no IR mapping")
        return name
    name = t.take_name(name)
    return MultiOutput(t.node, item)


def _split_like(t: Translator, a: dict[str, Any], squeeze: bool = False) -> MultiOutput:
    """split / chunk / unbind: each output read becomes a slice (plus a reshape that drops the dim for unbind)."""
    pieces = t.node.meta["val"]
    x = a["self"]
    dim = _dim(a.get("dim") or 0, t.rank(x))
    sizes = [1 if squeeze else piece.shape[dim] for piece in pieces]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def item(index: int) -> str:
        part = t.emit("slice", [x], {"dim": dim, "start": starts[index], "end": starts[index] + sizes[index],
                                     "step": 1})
        return t.emit("reshape", [part], {"shape": list(t.out_type.shape)}) if squeeze else part
    return MultiOutput(t.node, item)


# anchors

@maps("conv1d")
def _conv1d(t: Translator, a: dict) -> str:
    """A 1-D convolution of [N, C, L] as the 2-D one of [N, C, 1, L] with a [Co, Ci/g, 1, K] weight (reshapes, no
    copy; the weight's folds into a constant): the conv templates take it, the same arithmetic."""
    x, weight = t.value(a["input"]), t.value(a["weight"])
    if t.rank(x) != 3:
        raise Unmapped("an unbatched 1-D convolution")
    n, c, length = t.type_of(x).shape
    w_shape = list(t.type_of(weight).shape)
    single = lambda v: int(list(v)[0]) if isinstance(v, (list, tuple)) else int(v)   # noqa: E731
    padding = a["padding"]
    if padding == "same":
        total = single(a["dilation"]) * (w_shape[2] - 1)
        if total % 2:
            raise Unmapped("'same' padding that is not symmetric")
        padding = total // 2
    elif padding == "valid":
        padding = 0
    image = t.emit("reshape", [x], {"shape": [n, c, 1, length]})
    kernel = t.emit("reshape", [weight], {"shape": w_shape[:2] + [1, w_shape[2]]})
    inputs = [image, kernel] + ([a["bias"]] if a["bias"] is not None else [])
    y = t.emit("conv2d", inputs, {"stride": (1, single(a["stride"])), "padding": (0, single(padding)),
                                  "dilation": (1, single(a["dilation"])), "groups": int(a["groups"])})
    return t.emit("reshape", [y], {"shape": list(t.out_type.shape)})


@maps("conv2d", "convolution", "_convolution")
def _conv2d(t: Translator, a: dict) -> str:
    if a.get("transposed"):
        raise Unmapped("transposed convolution")
    if t.rank(a["input"]) == 3 and t.op_name != "conv2d" and len(list(a["stride"])) == 1:
        return _conv1d(t, a)
    if t.rank(a["input"]) != 4:
        raise Unmapped("only 1-D and 2-D convolutions of batched inputs map to conv2d")
    stride, dilation, padding = _pair(a["stride"]), _pair(a["dilation"]), a["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        kernel = t.type_of(t.value(a["weight"])).shape[2:]
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if any(p % 2 for p in total):
            raise Unmapped("'same' padding that is not symmetric")
        padding = [p // 2 for p in total]
    inputs = [a["input"], a["weight"]] + ([a["bias"]] if a["bias"] is not None else [])
    return t.emit("conv2d", inputs, {"stride": stride, "padding": _pair(padding), "dilation": dilation,
                                     "groups": int(a["groups"])})


@maps("linear")
def _linear(t: Translator, a: dict) -> str:
    return t.emit("linear", [a["input"], a["weight"]] + ([a["bias"]] if a["bias"] is not None else []))


@maps("addmm")
def _addmm(t: Translator, a: dict) -> str:
    if a["beta"] != 1 or a["alpha"] != 1:
        raise Unmapped("addmm with beta or alpha other than 1")
    bias = t.value(a["self"])
    if len(t.type_of(bias).shape) != 1:
        return t.emit("add", [t.emit("matmul", [a["mat1"], a["mat2"]]), bias])
    weight = t.value(a["mat2"])
    source = t.graph[weight]
    if source.op == "permute" and list(source.attrs["dims"]) == [1, 0]:
        weight = source.inputs[0]  # mat2 is W.t(): take W itself (linear wants [N, K])
    else:
        weight = t.emit("permute", [weight], {"dims": [1, 0]})
    return t.emit("linear", [a["mat1"], weight, bias])


@maps("mm", "bmm", "matmul")
def _matmul(t: Translator, a: dict) -> str:
    """x @ W with W a 2-D weight (a parameter, maybe transposed: Falcon's and GPT-J's ``x @ self.weight.T``) is a
    linear of W^T, whose kernel reads its input through views and takes a prologue; anything else a matmul."""
    x, other = t.value(a["self"]), t.value(a.get("mat2", a.get("other")))
    if t.rank(x) >= 2 and t.rank(other) == 2:
        source = t.graph[other]
        if source.op == "permute" and list(source.attrs["dims"]) == [1, 0] and t.graph.is_constant(source.inputs[0]):
            return t.emit("linear", [x, source.inputs[0]])
        if t.graph.is_constant(other):
            return t.emit("linear", [x, t.emit("permute", [other], {"dims": [1, 0]})])
    return t.emit("matmul", [x, other])


@maps("baddbmm", "addbmm")
def _baddbmm(t: Translator, a: dict) -> str:
    """beta * self + alpha * (batch1 @ batch2): a matmul whose scale and add are its epilogue (beta 0 ignores self,
    NaN included, as PyTorch does); addbmm also sums the products over the batch."""
    if t.op_name == "addbmm":
        raise Unmapped("addbmm sums over the batch")
    product = t.emit("matmul", [a["batch1"], a["batch2"]])
    alpha, beta = a.get("alpha", 1), a.get("beta", 1)
    if alpha != 1:
        product = t.emit("mul", [product, t.operand(alpha)])
    if beta == 0:
        return product
    base = a["self"] if beta == 1 else t.emit("mul", [a["self"], t.operand(beta)])
    return t.emit("add", [base, product])


def _permuted(t: Translator, value: str, order: list[int]) -> str:
    return value if order == list(range(len(order))) else t.emit("permute", [value], {"dims": order})


def _reshaped(t: Translator, value: str, shape: list[int]) -> str:
    return value if list(t.type_of(value).shape) == shape else t.emit("reshape", [value], {"shape": shape})


@maps("einsum")
def _einsum(t: Translator, a: dict) -> str:
    """One or two operands with an explicit output and no repeated letter within an operand: letters only one
    operand has and the output lacks are summed away first; then the two operands, permuted and reshaped to
    [batch, rows, K] and [batch, K, columns], are one batched matmul (a broadcast mul where nothing is contracted),
    reshaped and permuted to the output's letters (the batch letters kept as batch dims of the matmul)."""
    equation = a["equation"].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Unmapped("einsum with an ellipsis or an implicit output")
    inputs, output = equation.split("->")
    specs = inputs.split(",")
    if len(specs) != len(a["tensors"]) or len(specs) > 2 or any(len(set(s)) != len(s) for s in specs + [output]):
        raise Unmapped("einsum of more than two operands, or with a diagonal")
    values = [t.value(x) for x in a["tensors"]]
    sizes: dict[str, int] = {}
    for spec, value in zip(specs, values):
        for letter, size in zip(spec, t.type_of(value).shape):
            if sizes.setdefault(letter, size) != size:
                raise Unmapped("einsum with broadcast letters")
    for i, spec in enumerate(specs):       # letters of this operand alone that the output lacks: summed away
        others = "".join(specs[:i] + specs[i + 1:]) + output
        alone = [d for d, letter in enumerate(spec) if letter not in others]
        if alone:
            values[i] = t.emit("sum", [values[i]], {"dims": alone, "keepdim": False})
            specs[i] = "".join(letter for letter in spec if letter in others)
    if len(specs) == 1:
        return _permuted(t, values[0], [specs[0].index(letter) for letter in output])
    (sa, sb), (va, vb) = specs, values
    batch = [c for c in output if c in sa and c in sb]
    rows = [c for c in output if c in sa and c not in sb]
    columns = [c for c in output if c in sb and c not in sa]
    contracted = [c for c in sa if c in sb and c not in output]
    size = lambda letters: [sizes[c] for c in letters]      # noqa: E731
    count = lambda letters: math.prod(size(letters))        # noqa: E731
    va = _permuted(t, va, [sa.index(c) for c in batch + rows + contracted])
    vb = _permuted(t, vb, [sb.index(c) for c in batch + contracted + columns])
    if contracted:      # (the batch letters stay apart: merging them after a permute would copy)
        va = _reshaped(t, va, size(batch) + [count(rows), count(contracted)])
        vb = _reshaped(t, vb, size(batch) + [count(contracted), count(columns)])
        product = t.emit("matmul", [va, vb])
    else:       # an outer product per batch: broadcast
        va = _reshaped(t, va, size(batch) + size(rows) + [1] * len(columns))
        vb = _reshaped(t, vb, size(batch) + [1] * len(rows) + size(columns))
        product = t.emit("mul", [va, vb])
    letters = batch + rows + columns
    product = _reshaped(t, product, size(letters))
    return _permuted(t, product, [letters.index(c) for c in output])


@maps("masked_fill")
def _masked_fill(t: Translator, a: dict) -> str:
    """value where mask, else self: where."""
    return t.emit("where", [a["mask"], t.operand(a["value"]), a["self"]])


@maps("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
      "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")
def _sdpa(t: Translator, a: dict) -> str | MultiOutput:
    """Fewer key/value heads than query heads (enable_gqa) are the IR's grouped-query sdpa (`kv_heads_shared`)."""
    if a.get("dropout_p") or a.get("dropout_mask") is not None:
        raise Unmapped("attention with dropout")
    mask = a.get("attn_mask", a.get("attn_bias"))
    inputs = [a["query"], a["key"], a["value"]] + ([mask] if mask is not None else [])
    name = t.emit("sdpa", inputs, {"is_causal": bool(a.get("is_causal")), "scale": a.get("scale")})
    return name if tensor_value(t.node) is not None else _first_output(t, name)


# normalisation

def _batch_norm(t: Translator, a: dict) -> str:
    if a.get("training"):
        raise Unmapped("batch norm in training mode")
    if a.get("running_mean") is None or a.get("running_var") is None:
        raise Unmapped("batch norm without running statistics")
    x, mean, var = t.value(a["input"]), t.value(a["running_mean"]), t.value(a["running_var"])
    channels, dtype = t.type_of(x).shape[1], torch_dtype(t.type_of(mean).dtype)
    weight = a["weight"] if a["weight"] is not None else t.constant("weight", torch.ones(channels, dtype=dtype))
    bias = a["bias"] if a["bias"] is not None else t.constant("bias", torch.zeros(channels, dtype=dtype))
    return t.emit("batch_norm", [x, weight, bias, mean, var], {"eps": float(a["eps"])})


maps("batch_norm")(_batch_norm)


@maps("_native_batch_norm_legit_no_training", "_native_batch_norm_legit", "native_batch_norm")
def _batch_norm_with_statistics(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, _batch_norm(t, a))


def _layer_norm(t: Translator, a: dict) -> str:
    x, weight, bias = t.value(a["input"]), a["weight"], a["bias"]
    shape = [int(d) for d in a["normalized_shape"]]
    if weight is None and bias is not None:  # the IR's inputs are positional: weight must come first
        weight = t.constant("weight", torch.ones(shape, dtype=torch_dtype(t.type_of(t.value(bias)).dtype)))
    inputs = [x] + [w for w in (weight, bias) if w is not None]
    return t.emit("layer_norm", inputs, {"normalized_shape": shape, "eps": float(a["eps"])})


maps("layer_norm")(_layer_norm)


@maps("native_layer_norm")
def _layer_norm_with_statistics(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, _layer_norm(t, a))


def _group_norm(t: Translator, a: dict) -> str:
    """group_norm(x[N, C, *S], G) as the layer norm of x viewed [N, G, C/G, prod(S)] over its last two dims, the
    weight and bias [C] applied there as [G, C/G, 1] (the norm's epilogue, in its kernel's float32), then viewed
    back: reshapes, no copy."""
    x = t.value(a["input"])
    shape = list(t.type_of(x).shape)
    groups = int(a.get("num_groups", a.get("group")))
    if len(shape) < 2 or shape[1] % groups:
        raise Unmapped("group norm of an unbatched input, or channels not divisible by the groups")
    n, c = shape[:2]
    grouped = [n, groups, c // groups, math.prod(shape[2:])]
    y = t.emit("layer_norm", [t.emit("reshape", [x], {"shape": grouped})],
               {"normalized_shape": grouped[2:], "eps": float(a["eps"])})
    for key, op in (("weight", "mul"), ("bias", "add")):
        if a.get(key) is not None:
            y = t.emit(op, [y, t.emit("reshape", [a[key]], {"shape": [groups, c // groups, 1]})])
    return t.emit("reshape", [y], {"shape": shape})


maps("group_norm")(_group_norm)


@maps("native_group_norm")
def _group_norm_with_statistics(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, _group_norm(t, a))


def _rms_norm(t: Translator, a: dict) -> str:
    """x * rsqrt(mean(x^2 over the last dim) + eps) [* weight] in float32 (nn.RMSNorm); eps None is float32's
    epsilon (float64's for float64 inputs), as PyTorch takes it."""
    x = t.value(a["input"])
    x_type = t.type_of(x)
    if [int(d) for d in a["normalized_shape"]] != list(x_type.shape[-1:]):
        raise Unmapped("RMS norm over more than the last dim")
    eps = a.get("eps")
    if eps is None:
        eps = torch.finfo(torch.float64 if x_type.dtype == "float64" else torch.float32).eps
    inputs = [x] + ([a["weight"]] if a.get("weight") is not None else [])
    return t.emit("rms_norm", inputs, {"eps": float(eps)})


maps("rms_norm")(_rms_norm)


@maps("_fused_rms_norm")
def _rms_norm_with_statistics(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, _rms_norm(t, a))


# elementwise

COMPARISONS = ("lt", "le", "gt", "ge", "eq", "ne")


def _binary(op: str, reverse: bool = False) -> Handler:
    """add/sub/mul/div/comparisons (Tensor and Scalar overloads): `alpha` scales `other` first; rsub swaps the
    operands. A python scalar takes the result's dtype, or for a comparison (whose result is bool) the dtype the
    comparison is made in."""
    def handle(t: Translator, a: dict) -> str:
        if a.get("rounding_mode") is not None:
            raise Unmapped("division with a rounding mode")
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


@maps("pow")
def _pow(t: Translator, a: dict) -> str:
    return t.emit("pow", [t.operand(a["self"]), t.operand(a["exponent"])])


_UNARY = ("relu", "sigmoid", "tanh", "silu", "hardswish", "hardsigmoid", "erf", "exp", "log", "sqrt", "rsqrt",
          "neg", "abs", "reciprocal", "square", "mish", "log_sigmoid", "sin", "cos", "log1p", "expm1", "floor", "ceil",
          "sign", "logical_not")
for _name in _UNARY:
    HANDLERS[_name] = (lambda op: lambda t, a: t.emit(op, [a["self"]]))(_name)


@maps("log_sigmoid_forward")
def _log_sigmoid_with_buffer(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, t.emit("log_sigmoid", [a["self"]]))


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


@maps("any")
def _any(t: Translator, a: dict) -> str:
    """any over some dims (all when none are given). Over more dims than the last, it runs in two steps, the last
    dim first: rows in parallel, then the few values left (a full reduction in one program would be serial)."""
    x = t.value(a["self"])
    rank = t.rank(x)
    dims = a.get("dim")
    dims = list(range(rank)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    dims = sorted({_dim(d, rank) for d in dims})
    keepdim = bool(a.get("keepdim"))
    if len(dims) > 1 and dims[-1] == rank - 1:
        x = t.emit("any", [x], {"dims": [rank - 1], "keepdim": True})
    return t.emit("any", [x], {"dims": dims, "keepdim": keepdim})


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
    return _first_output(t, t.emit("identity", [a["input"]]))


@maps("clone", "contiguous", "alias", "detach", "lift_fresh_copy", "lift_fresh")
def _identity(t: Translator, a: dict) -> str:
    return t.emit("identity", [a["self"]])


FILLS = {"new_zeros": 0, "zeros_like": 0, "new_ones": 1, "ones_like": 1}   # new_full and full_like: fill_value


@maps("new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like")
def _filled(t: Translator, a: dict) -> str:
    """One value in a shape: the argument lends its shape, dtype and device only, so the result is a constant
    (Swin's window mask starts as ``x.new_zeros``; folded, all it is built from folds)."""
    value = FILLS.get(t.op_name, a.get("fill_value"))
    if not isinstance(value, (bool, int, float)):
        raise Unmapped(f"fill value {value!r} is not a number")
    out = t.out_type
    tensor = torch.full(out.shape, value, dtype=torch_dtype(out.dtype))
    return t.graph.add_constant(t.node.name, tensor, source=t.node.name).name


# reductions

@maps("softmax", "_softmax")
def _softmax(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    if a.get("half_to_float") or (a.get("dtype") is not None and dtype_name(a["dtype"]) != t.type_of(x).dtype):
        x = t.emit("cast", [x], {"dtype": t.out_type.dtype})
    return t.emit("softmax", [x], {"dim": _dim(a["dim"], t.rank(x))})


def _reduce(op: str) -> Handler:
    """mean / sum over `dim` (all dims when absent), after a cast when a dtype is asked for."""
    def handle(t: Translator, a: dict) -> str:
        x = t.value(a["self"])
        rank = t.rank(x)
        if a.get("dtype") is not None and dtype_name(a["dtype"]) != t.type_of(x).dtype:
            x = t.emit("cast", [x], {"dtype": dtype_name(a["dtype"])})
        dims = a.get("dim")
        dims = list(range(rank)) if not dims else [dims] if isinstance(dims, int) else list(dims)
        return t.emit(op, [x], {"dims": sorted(_dim(d, rank) for d in dims), "keepdim": bool(a.get("keepdim"))})
    return handle


HANDLERS["mean"] = _reduce("mean")
HANDLERS["sum"] = _reduce("sum")


def _reduced_dims(dims: Any, rank: int) -> list[int]:
    """A reduction's dims (an int, a list, or None / [] for all), non-negative and sorted."""
    dims = list(range(rank)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    return sorted({_dim(d, rank) for d in dims})


@maps("amax", "amin")
def _extreme(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    return t.emit(t.op_name, [x], {"dims": _reduced_dims(a.get("dim"), t.rank(x)), "keepdim": bool(a.get("keepdim"))})


@maps("max", "min")
def _max(t: Translator, a: dict) -> str | MultiOutput:
    """max / min of all elements (amax / amin), or along one dim: its values (amax / amin), not its indices; the
    binary overloads (max(x, y)) are maximum / minimum."""
    op = "amax" if t.op_name == "max" else "amin"
    x = t.value(a["self"])
    if a.get("other") is not None:
        return t.emit("maximum" if op == "amax" else "minimum", [x, a["other"]])
    if a.get("dim") is None:
        return t.emit(op, [x], {"dims": list(range(t.rank(x))), "keepdim": False})
    if not isinstance(a["dim"], int):
        raise Unmapped("max over a named dim")
    return _first_output(t, t.emit(op, [x], {"dims": [_dim(a["dim"], t.rank(x))], "keepdim": bool(a.get("keepdim"))}))


@maps("linalg_vector_norm", "norm")
def _vector_norm(t: Translator, a: dict) -> str:
    """The p-norm over dims as reductions with a prologue and an epilogue, computed in float32 at least as PyTorch
    does (a float16 square overflows past 256): |x| (amax, amin) for p = +-inf, sum |x| for 1, sqrt(sum x^2) for 2,
    sum(|x|^p)^(1/p) for any other p but 0."""
    x = t.value(a.get("self", a.get("input")))
    order = a.get("ord", a.get("p", 2))
    order = 2.0 if order is None else float(order)
    if order == 0 or a.get("dtype") is not None:
        raise Unmapped("the 0-norm (a count), or a norm in another dtype")
    rank, dtype = t.rank(x), t.type_of(x).dtype
    attrs = {"dims": _reduced_dims(a.get("dim"), rank), "keepdim": bool(a.get("keepdim"))}
    wide = dtype if dtype in ("float32", "float64") else "float32"
    if wide != dtype:
        x = t.emit("cast", [x], {"dtype": wide})
    if order == 2:
        y = t.emit("sqrt", [t.emit("sum", [t.emit("square", [x])], attrs)])
    elif order == 1:
        y = t.emit("sum", [t.emit("abs", [x])], attrs)
    elif order in (float("inf"), float("-inf")):
        y = t.emit("amax" if order > 0 else "amin", [t.emit("abs", [x])], attrs)
    else:
        powered = t.emit("pow", [t.emit("abs", [x]), t.operand(order, wide)])
        y = t.emit("pow", [t.emit("sum", [powered], attrs), t.operand(1.0 / order, wide)])
    return t.emit("cast", [y], {"dtype": t.out_type.dtype}) if t.out_type.dtype != wide else y


@maps("addcmul", "addcdiv")
def _addcmul(t: Translator, a: dict) -> str:
    """self + value * tensor1 * tensor2 (or / tensor2): mul (div), a scale where value is not 1, add."""
    product = t.emit("mul" if t.op_name == "addcmul" else "div", [a["tensor1"], a["tensor2"]])
    value = a.get("value", 1)
    if value != 1:
        product = t.emit("mul", [product, t.operand(value)])
    return t.emit("add", [a["self"], product])


def _max_pool(t: Translator, a: dict) -> str:
    kernel = _pair(a["kernel_size"])
    stride = _pair(a["stride"]) if a["stride"] else kernel  # empty stride means "the kernel size"
    return t.emit("max_pool2d", [a["self"]], {"kernel_size": kernel, "stride": stride,
                                              "padding": _pair(a["padding"]), "dilation": _pair(a["dilation"]),
                                              "ceil_mode": bool(a["ceil_mode"])})


maps("max_pool2d")(_max_pool)


@maps("max_pool2d_with_indices")
def _max_pool_with_indices(t: Translator, a: dict) -> MultiOutput:
    return _first_output(t, _max_pool(t, a))


@maps("avg_pool2d")
def _avg_pool(t: Translator, a: dict) -> str:
    if a.get("divisor_override") is not None:
        raise Unmapped("avg_pool2d with divisor_override")
    kernel = _pair(a["kernel_size"])
    stride = _pair(a["stride"]) if a["stride"] else kernel
    return t.emit("avg_pool2d", [a["self"]], {"kernel_size": kernel, "stride": stride,
                                              "padding": _pair(a["padding"]), "ceil_mode": bool(a["ceil_mode"]),
                                              "count_include_pad": bool(a["count_include_pad"])})


@maps("adaptive_avg_pool2d", "_adaptive_avg_pool2d")
def _adaptive_avg_pool(t: Translator, a: dict) -> str:
    return t.emit("adaptive_avg_pool2d", [a["self"]], {"output_size": _pair(a["output_size"])})


# layout

@maps("view", "_unsafe_view", "reshape", "view_copy", "_reshape_alias", "flatten", "unflatten", "squeeze",
      "unsqueeze", "view_as", "reshape_as")
def _reshape(t: Translator, a: dict) -> str:
    return t.emit("reshape", [a["self"]], {"shape": list(t.out_type.shape)})


@maps("permute", "transpose", "t", "swapaxes", "numpy_T")
def _permute(t: Translator, a: dict) -> str:
    rank, name = t.rank(a["self"]), t.op_name
    if name == "permute":
        dims = [_dim(d, rank) for d in a["dims"]]
    elif name == "numpy_T":
        dims = list(reversed(range(rank)))
    else:  # transpose / swapaxes swap two dims; t() swaps the two of a matrix and leaves a vector alone
        first, second = {"transpose": ("dim0", "dim1"), "swapaxes": ("axis0", "axis1")}.get(name, (None, None))
        first, second = (a[first], a[second]) if first else (0, max(rank - 1, 0))
        dims = list(range(rank))
        if rank:
            first, second = _dim(first, rank), _dim(second, rank)
            dims[first], dims[second] = dims[second], dims[first]
    return t.emit("permute", [a["self"]], {"dims": dims})


@maps("expand", "expand_as", "expand_copy")
def _expand(t: Translator, a: dict) -> str:
    return t.emit("expand", [a["self"]], {"shape": list(t.out_type.shape)})


@maps("repeat", "tile")
def _repeat(t: Translator, a: dict) -> str:
    """x tiled `repeats` times along each dim (leading new dims for extra repeats): a dim of size 1 is expanded (a
    view), any other split [.., 1, s, ..], expanded to [.., r, s, ..] and merged back, whose reader maps the merge
    (an index map of its load: copy or not, no kernel of its own)."""
    x = t.value(a["self"])
    repeats = [int(r) for r in a.get("repeats", a.get("dims"))]
    shape = list(t.type_of(x).shape)
    if t.op_name == "tile" and len(repeats) < len(shape):      # tile pads the repeats, repeat refuses fewer
        repeats = [1] * (len(shape) - len(repeats)) + repeats
    shape = [1] * (len(repeats) - len(shape)) + shape
    x = _reshaped(t, x, shape)
    split, grown = [], []
    for size, times in zip(shape, repeats):
        if size == 1 or times == 1:
            split.append(size)
            grown.append(size * times)
        else:
            split += [1, size]
            grown += [times, size]
    x = _reshaped(t, x, split)
    if grown != split:
        x = t.emit("expand", [x], {"shape": grown})
    return _reshaped(t, x, list(t.out_type.shape))


@maps("repeat_interleave")
def _repeat_interleave(t: Translator, a: dict) -> str:
    """Each element repeated `repeats` times along dim (of the flattened tensor without one): [.., s, ..] split
    [.., s, 1, ..], expanded to [.., s, r, ..] and merged (a size-1 dim is just expanded); tensor repeats are not
    mapped."""
    if "self" not in a or isinstance(a.get("repeats"), fx.Node):
        raise Unmapped("repeat_interleave by a tensor of repeats")
    x, times = t.value(a["self"]), int(a["repeats"])
    if a.get("dim") is None:
        x = _reshaped(t, x, [t.type_of(x).numel])
    shape = list(t.type_of(x).shape)
    dim = _dim(a.get("dim") or 0, len(shape))
    split = shape[:dim + 1] + ([1] if shape[dim] != 1 else []) + shape[dim + 1:]
    grown = list(split)
    grown[dim + (shape[dim] != 1)] = times
    x = t.emit("expand", [_reshaped(t, x, split)], {"shape": grown}) if times != 1 else x
    return _reshaped(t, x, list(t.out_type.shape))


@maps("cat", "concat", "concatenate")
def _cat(t: Translator, a: dict) -> str:
    return t.emit("cat", list(a["tensors"]), {"dim": _dim(a["dim"], len(t.out_type.shape))})


@maps("stack")
def _stack(t: Translator, a: dict) -> str:
    """stack(tensors, dim): each tensor with a size-1 dim inserted at dim (a reshape, no copy), then their cat (an
    index map of the kernel that reads it)."""
    out = list(t.out_type.shape)
    dim = _dim(a.get("dim") or 0, len(out))
    pieces = [t.emit("reshape", [x], {"shape": out[:dim] + [1] + out[dim + 1:]}) for x in a["tensors"]]
    return t.emit("cat", pieces, {"dim": dim}) if len(pieces) > 1 else pieces[0]


@maps("slice", "narrow", "select")
def _slice(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    shape = t.type_of(x).shape
    dim = _dim(a.get("dim") or 0, len(shape))
    size = shape[dim]
    name = t.op_name
    if name == "select":
        start = _dim(a["index"], size)
        end, step = start + 1, 1
    elif name == "narrow":
        start = _dim(a["start"], size)
        end, step = start + a["length"], 1
    else:
        start = 0 if a["start"] is None else a["start"]
        end = size if a["end"] is None else a["end"]
        step = a["step"] or 1
    start, end = (min(max(_dim(v, size), 0), size) for v in (start, end))  # Python's slice clamping
    part = t.emit("slice", [x], {"dim": dim, "start": start, "end": max(start, end), "step": int(step)})
    return t.emit("reshape", [part], {"shape": list(t.out_type.shape)}) if name == "select" else part


@maps("split", "split_with_sizes", "chunk", "unsafe_split", "unsafe_split_with_sizes", "unsafe_chunk",
      "tensor_split")
def _split(t: Translator, a: dict) -> MultiOutput:
    return _split_like(t, a)


@maps("unbind")
def _unbind(t: Translator, a: dict) -> MultiOutput:
    return _split_like(t, a, squeeze=True)


@maps("roll")
def _roll(t: Translator, a: dict) -> str:
    """A cyclic shift along given dims (Swin's shifted windows); without dims torch flattens first: not mapped."""
    shifts, dims = a["shifts"], a.get("dims")
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [] if dims is None else [dims] if isinstance(dims, int) else list(dims)
    if not dims or len(dims) != len(shifts) or not all(isinstance(v, int) for v in shifts):
        raise Unmapped("roll of the flattened tensor, or with symbolic shifts")
    rank = t.rank(a["self"])
    return t.emit("roll", [a["self"]], {"shifts": shifts, "dims": [_dim(d, rank) for d in dims]})


@maps("pad", "constant_pad_nd")
def _pad(t: Translator, a: dict) -> str:
    """Constant padding (F.pad's order); padding by nothing (Swin pads its windows up to a multiple of their size,
    often by zero) is no op at all."""
    if a.get("mode", "constant") != "constant":
        raise Unmapped(f"{a['mode']} padding")
    pads = tuple(int(p) for p in a["pad"])
    if not any(pads):
        return t.emit("identity", [a["self"]])
    value = a.get("value")
    return t.emit("pad", [a["self"]], {"pads": pads, "value": 0.0 if value is None else float(value)})


UPSAMPLE_MODES = {f"upsample_nearest{d}d": "nearest" for d in (1, 2, 3)} \
    | {f"_upsample_nearest_exact{d}d": "nearest-exact" for d in (1, 2, 3)} \
    | {"upsample_linear1d": "linear", "upsample_bilinear2d": "linear", "upsample_trilinear3d": "linear"}


@maps(*UPSAMPLE_MODES)
def _upsample(t: Translator, a: dict) -> str:
    """Nearest, nearest-exact and (bi/tri)linear upsampling of the last 1 to 3 dims, to the output's size; the scale
    factors it was given, which decide the source index (1 / factor instead of size in / size out), are kept."""
    mode = UPSAMPLE_MODES[t.op_name]
    size = list(t.out_type.shape[2:])
    if "scale_factors" in a:        # the .vec overloads
        scales = a.get("scale_factors")
    else:
        scales = [a.get(key) for key in ("scales_d", "scales_h", "scales_w", "scales") if key in a]
    scales = None if scales is None or all(v is None for v in scales) else [None if v is None else float(v)
                                                                            for v in scales]
    attrs = {"mode": mode, "size": size, "scales": scales}
    if mode == "linear":
        attrs["align_corners"] = bool(a["align_corners"])
    return t.emit("upsample", [a.get("input", a.get("self"))], attrs)


@maps("embedding")
def _embedding(t: Translator, a: dict) -> str:
    return t.emit("embedding", [a["weight"], a["indices"]])


@maps("index_copy")
def _index_copy(t: Translator, a: dict) -> str:
    """A KV cache written at the call's positions (`index_copy_` made functional, or as written)."""
    return t.emit("index_copy", [a["self"], a["index"], a["source"]], {"dim": _dim(a["dim"], t.rank(a["self"]))})
