"""ATen handlers of normalisations, reductions and pooling (`opfuse.frontend.aten_ops`): batch, layer, group and
RMS norms, softmax, sums, means, extremes, vector norms, any, and max / average pooling.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch

from opfuse.frontend.aten_common import (Handler, MultiOutput, Unmapped, first_output, pair, registrar, single,
                                         wrap_dim)
from opfuse.ir.graph import dtype_name, torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


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
    return first_output(t, _batch_norm(t, a))


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
    return first_output(t, _layer_norm(t, a))


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
    return first_output(t, _group_norm(t, a))


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
    return first_output(t, _rms_norm(t, a))


# reductions

@maps("softmax", "_softmax")
def _softmax(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    if a.get("half_to_float") or (a.get("dtype") is not None and dtype_name(a["dtype"]) != t.type_of(x).dtype):
        x = t.emit("cast", [x], {"dtype": t.out_type.dtype})
    return t.emit("softmax", [x], {"dim": wrap_dim(a["dim"], t.rank(x))})


def _reduce(op: str) -> Handler:
    """mean / sum / prod over `dim` (all dims when absent), after a cast when a dtype is asked for."""
    def handle(t: Translator, a: dict) -> str:
        x = t.value(a["self"])
        rank = t.rank(x)
        if a.get("dtype") is not None and dtype_name(a["dtype"]) != t.type_of(x).dtype:
            x = t.emit("cast", [x], {"dtype": dtype_name(a["dtype"])})
        dims = a.get("dim")
        dims = list(range(rank)) if not dims else [dims] if isinstance(dims, int) else list(dims)
        return t.emit(op, [x], {"dims": sorted(wrap_dim(d, rank) for d in dims), "keepdim": bool(a.get("keepdim"))})
    return handle


HANDLERS["mean"] = _reduce("mean")
HANDLERS["sum"] = _reduce("sum")
HANDLERS["prod"] = _reduce("prod")


@maps("cumsum", "cumprod")
def _scan(t: Translator, a: dict) -> str:
    """The inclusive scan (cumsum, cumprod) along `dim`; `dtype` (the input cast to it first) kept as the op's attr
    where it changes the result's dtype: another dtype than the input's, or any for an integer or bool input (whose
    scan is int64 without it: transformers' MoE routing scans int32 counts with dtype=torch.int32). A 0-d tensor has
    no row to scan (it stays opaque)."""
    x = t.value(a["self"])
    rank = t.rank(x)
    if rank == 0:
        raise Unmapped(f"{t.op_name} of a 0-d tensor")
    attrs: dict[str, Any] = {"dim": wrap_dim(int(a["dim"]), rank)}
    if a.get("dtype") is not None and (dtype_name(a["dtype"]) != t.type_of(x).dtype or not t.type_of(x).is_float):
        attrs["dtype"] = dtype_name(a["dtype"])
    return t.emit(t.op_name, [x], attrs)


def reduced_dims(dims: Any, rank: int) -> list[int]:
    """A reduction's dims (an int, a list, or None / [] for all), non-negative and sorted."""
    dims = list(range(rank)) if dims is None or dims == [] else [dims] if isinstance(dims, int) else list(dims)
    return sorted({wrap_dim(d, rank) for d in dims})


@maps("amax", "amin")
def _extreme(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    return t.emit(t.op_name, [x], {"dims": reduced_dims(a.get("dim"), t.rank(x)), "keepdim": bool(a.get("keepdim"))})


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
    return first_output(t, t.emit(op, [x], {"dims": [wrap_dim(a["dim"], t.rank(x))], "keepdim": bool(a.get("keepdim"))}))


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
    attrs = {"dims": reduced_dims(a.get("dim"), rank), "keepdim": bool(a.get("keepdim"))}
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


@maps("any")
def _any(t: Translator, a: dict) -> str:
    """any over some dims (all when none are given). Over more dims than the last, it runs in two steps, the last
    dim first: rows in parallel, then the few values left (a full reduction in one program would be serial)."""
    x = t.value(a["self"])
    rank = t.rank(x)
    dims = reduced_dims(a.get("dim"), rank)
    keepdim = bool(a.get("keepdim"))
    if len(dims) > 1 and dims[-1] == rank - 1:
        x = t.emit("any", [x], {"dims": [rank - 1], "keepdim": True})
    return t.emit("any", [x], {"dims": dims, "keepdim": keepdim})


# pooling

def _max_pool_attrs(a: dict) -> dict:
    kernel = pair(a["kernel_size"])
    stride = pair(a["stride"]) if a["stride"] else kernel  # empty stride means "the kernel size"
    return {"kernel_size": kernel, "stride": stride, "padding": pair(a["padding"]), "dilation": pair(a["dilation"]),
            "ceil_mode": bool(a["ceil_mode"])}


def _max_pool(t: Translator, a: dict) -> str:
    return t.emit("max_pool2d", [a["self"]], _max_pool_attrs(a))


maps("max_pool2d")(_max_pool)


@maps("max_pool2d_with_indices")
def _max_pool_with_indices(t: Translator, a: dict) -> MultiOutput:
    """The pooled values by the pooling template; the indices (each window's largest, flattened over its image
    plane) by PyTorch's own pool, a library call alone (`max_pool2d_indices`), where something reads them."""
    def item(index: int) -> str:
        if index == 0:
            return _max_pool(t, a)
        return t.emit("max_pool2d_indices", [a["self"]], _max_pool_attrs(a))
    return MultiOutput(t.node, item)


@maps("avg_pool2d")
def _avg_pool(t: Translator, a: dict) -> str:
    if a.get("divisor_override") is not None:
        raise Unmapped("avg_pool2d with divisor_override")
    kernel = pair(a["kernel_size"])
    stride = pair(a["stride"]) if a["stride"] else kernel
    return t.emit("avg_pool2d", [a["self"]], {"kernel_size": kernel, "stride": stride,
                                              "padding": pair(a["padding"]), "ceil_mode": bool(a["ceil_mode"]),
                                              "count_include_pad": bool(a["count_include_pad"])})


@maps("adaptive_max_pool2d")
def _adaptive_max_pool(t: Translator, a: dict) -> MultiOutput:
    """An adaptive max pool whose windows divide the image evenly is the max pool of that window (its values by the
    pooling template; its indices, where read, as `max_pool2d_with_indices` gives them); uneven windows stay
    opaque."""
    x = t.value(a["self"])
    if t.rank(x) != 4:
        raise Unmapped("an adaptive max pool of other than a batched image")
    height, width = t.type_of(x).shape[2:]
    out_h, out_w = pair(a["output_size"])
    if height % out_h or width % out_w:
        raise Unmapped(f"adaptive max pooling of {height}x{width} to {out_h}x{out_w} has uneven windows")
    window = (height // out_h, width // out_w)
    attrs = {"kernel_size": window, "stride": window, "padding": (0, 0), "dilation": (1, 1), "ceil_mode": False}
    return MultiOutput(t.node, lambda index: t.emit("max_pool2d" if index == 0 else "max_pool2d_indices", [x], attrs))


@maps("avg_pool1d")
def _avg_pool1d(t: Translator, a: dict) -> str:
    """The 2-D pool of [N, C, 1, L] (a reshape, no copy; an unbatched [C, L] as N = 1), its window 1 high."""
    x = t.value(a["self"])
    shape = list(t.type_of(x).shape)
    kernel = single(a["kernel_size"])
    stride = single(a["stride"]) if a["stride"] else kernel
    image = t.emit("reshape", [x], {"shape": [math.prod(shape[:-2]), shape[-2], 1, shape[-1]]})
    pooled = t.emit("avg_pool2d", [image], {"kernel_size": (1, kernel), "stride": (1, stride),
                                            "padding": (0, single(a["padding"])), "ceil_mode": bool(a["ceil_mode"]),
                                            "count_include_pad": bool(a["count_include_pad"])})
    return t.emit("reshape", [pooled], {"shape": list(t.out_type.shape)})


@maps("adaptive_avg_pool2d", "_adaptive_avg_pool2d")
def _adaptive_avg_pool(t: Translator, a: dict) -> str:
    return t.emit("adaptive_avg_pool2d", [a["self"]], {"output_size": pair(a["output_size"])})
