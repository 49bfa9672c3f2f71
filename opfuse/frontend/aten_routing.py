"""ATen handlers of a mixture of experts' routing and expert GEMMs, and of recurrent layers
(`opfuse.frontend.aten_ops`): topk and sort (their values and their indices, each an op of its own, `output`),
histc, index_put of one index tensor (an index_copy along dim 0; accumulating, a scatter summing, as index_add is),
the grouped GEMM of the experts (transformers' `grouped_mm` and torch's `_grouped_mm` with offsets), an LSTM,
scatters (scatter, scatter_add, scatter_reduce) and grid sampling. Each runs alone in a kernel of its own
(`opfuse.ir.ops_alone`).

transformers' experts (`integrations/moe.py`): topk of the router's softmax, a sort of the chosen experts' ids,
their counts (histc) summed into offsets, a take of each token's row per choice, two grouped GEMMs, and a take
through the inverse permutation (an index_put of an arange over an ``empty_like``) back to the tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from opfuse.frontend.aten_common import Handler, MultiOutput, Unmapped, registrar, reshaped, wrap_dim
from opfuse.frontend.aten_index import from_end
from opfuse.ir.graph import torch_dtype
from opfuse.ir.ops_alone import GRID_MODES, GRID_PADDINGS

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


def _along_dim(t: Translator, a: dict, op: str, **attrs) -> MultiOutput:
    """A (values, indices) call along `a`'s dim as one op per output read (`output` 0 or 1)."""
    x = t.value(a["self"])
    rank = t.rank(x)
    if rank == 0:
        raise Unmapped(f"{op} of a 0-d tensor")
    attrs = {"dim": wrap_dim(int(a["dim"]), rank), **attrs}
    return MultiOutput(t.node, lambda index: t.emit(op, [x], attrs | {"output": index}))


@maps("topk")
def _topk(t: Translator, a: dict) -> MultiOutput:
    return _along_dim(t, a, "topk", k=int(a["k"]), largest=bool(a["largest"]), sorted=bool(a["sorted"]))


@maps("sort")
def _sort(t: Translator, a: dict) -> MultiOutput:
    return _along_dim(t, a, "sort", descending=bool(a["descending"]), stable=bool(a.get("stable")))


@maps("argsort")
def _argsort(t: Translator, a: dict) -> str:
    """The indices of a sort (`output` 1)."""
    x = t.value(a["self"])
    if t.rank(x) == 0:
        raise Unmapped("argsort of a 0-d tensor")
    return t.emit("sort", [x], {"dim": wrap_dim(int(a.get("dim", -1)), t.rank(x)),
                                "descending": bool(a.get("descending", False)), "stable": bool(a.get("stable")),
                                "output": 1})


@maps("histc")
def _histc(t: Translator, a: dict) -> str:
    low, high = a["min"], a["max"]
    if not isinstance(low, (int, float)) or not isinstance(high, (int, float)) or not low < high:
        raise Unmapped("histc over a range its input's own extremes set (min >= max)")
    return t.emit("histc", [a["self"]], {"bins": int(a["bins"]), "min": float(low), "max": float(high)})


@maps("index_put")
def _index_put(t: Translator, a: dict) -> str:
    """x[index] = values (or += with `accumulate`) for one integer index tensor along dim 0: x with the rows `index`
    (negative ones from the end) replaced by (or added to by) `values` broadcast to [len(index), *x.shape[1:]]."""
    indices = a["indices"]
    if len(indices) != 1 or not isinstance(indices[0], fx.Node):
        raise Unmapped("index_put by other than one index tensor")
    x, index = t.value(a["self"]), t.value(indices[0])
    index_type, shape = t.type_of(index), t.type_of(x).shape
    if index_type.dtype not in ("int64", "int32") or len(index_type.shape) != 1 or not shape:
        raise Unmapped("index_put by other than a 1-D integer index")
    wanted = [index_type.shape[0], *shape[1:]]
    values = t.value(a["values"])
    if list(t.type_of(values).shape) != wanted:
        if len(t.type_of(values).shape) > len(wanted):
            raise Unmapped("index_put of values of more dims than the rows they write")
        values = t.emit("expand", [values], {"shape": wanted})
    if t.type_of(values).dtype != t.type_of(x).dtype:
        values = t.emit("cast", [values], {"dtype": t.type_of(x).dtype})
    index = from_end(t, index, shape[0])
    if a["accumulate"]:
        return _added_at(t, x, 0, index, values)
    return t.emit("index_copy", [x, index, values], {"dim": 0})


def _added_at(t: Translator, x: str, dim: int, index: str, values: str) -> str:
    """x with `values` added at `index` (1-D, >= 0) along `dim`: a scatter summing, its index laid along `dim` and
    expanded to the values' shape."""
    shape = t.type_of(values).shape
    laid = t.emit("reshape", [index], {"shape": [shape[d] if d == dim else 1 for d in range(len(shape))]})
    spread = t.emit("expand", [laid], {"shape": list(shape)})
    return t.emit("scatter", [x, spread, values], {"dim": dim, "reduce": "sum", "include_self": True})


@maps("index_add")
def _index_add(t: Translator, a: dict) -> str:
    """x.index_add(dim, index, source, alpha): the source (times alpha) added at the index's rows along dim."""
    x, index, source = t.value(a["self"]), t.value(a["index"]), t.value(a["source"])
    rank = t.rank(x)
    if rank == 0 or len(t.type_of(index).shape) != 1 or t.type_of(source).dtype != t.type_of(x).dtype:
        raise Unmapped("index_add into a 0-d tensor, by other than a 1-D index, or of another dtype")
    dim = wrap_dim(int(a["dim"]), rank)
    alpha = a.get("alpha", 1)
    if alpha != 1:
        source = t.emit("mul", [source, t.operand(alpha, t.type_of(x).dtype)])
    if t.type_of(index).dtype != "int64":      # (a negative index is an error, as torch's own)
        index = t.emit("cast", [index], {"dtype": "int64"})
    return _added_at(t, x, dim, index, source)


def _grouped_mm(t: Translator, x: fx.Node, w: fx.Node, ends: fx.Node) -> str:
    """x[S, K] @ w[E, K, N] by the groups of rows that `ends` (cumulative) gives each expert."""
    x, w, ends = t.value(x), t.value(w), t.value(ends)
    if len(t.type_of(x).shape) != 2 or len(t.type_of(w).shape) != 3 or len(t.type_of(ends).shape) != 1 \
            or t.type_of(ends).dtype not in ("int32", "int64"):
        raise Unmapped("a grouped GEMM of other than 2-D rows, 3-D experts' weights and 1-D integer offsets")
    return t.emit("grouped_mm", [x, w, ends])


@maps("transformers.grouped_mm_fallback")
def _transformers_grouped_mm(t: Translator, a: dict) -> str:
    return _grouped_mm(t, a["input"], a["weight"], a["offs"])


@maps("_grouped_mm")
def _torch_grouped_mm(t: Translator, a: dict) -> str:
    if a.get("offs") is None or a.get("bias") is not None or a.get("out_dtype") is not None:
        raise Unmapped("torch._grouped_mm without offsets, or with a bias or an output dtype")
    return _grouped_mm(t, a["self"], a["mat2"], a["offs"])


@maps("lstm")
def _lstm(t: Translator, a: dict) -> MultiOutput:
    """torch.lstm over a padded (not packed) sequence, in inference: its output sequence, h and c, each an op."""
    if "hx" not in a or not isinstance(a.get("params"), (list, tuple)):
        raise Unmapped("an LSTM over a packed sequence")
    if a["train"] and a["dropout"]:
        raise Unmapped("an LSTM with dropout in training mode")
    inputs = [t.value(v) for v in (a["input"], *a["hx"], *a["params"])]
    attrs = {"has_biases": bool(a["has_biases"]), "num_layers": int(a["num_layers"]),
             "bidirectional": bool(a["bidirectional"]), "batch_first": bool(a["batch_first"])}
    return MultiOutput(t.node, lambda index: t.emit("lstm", inputs, attrs | {"output": index}))


SCATTER_REDUCTIONS = {None: "none", "add": "sum", "multiply": "prod", "sum": "sum", "prod": "prod", "mean": "mean",
                      "amax": "amax", "amin": "amin"}     # scatter's and scatter_reduce's words -> the IR's


@maps("scatter", "scatter_add", "scatter_reduce")
def _scatter(t: Translator, a: dict) -> str:
    """scatter (a tensor or a number as src, optionally reduced by add or multiply), scatter_add and
    scatter_reduce as one `scatter` op."""
    x, index = t.value(a["self"]), t.value(a["index"])
    rank = t.rank(x)
    if rank == 0:
        raise Unmapped("scatter into a 0-d tensor")
    data = t.type_of(x)
    reduce = "sum" if t.op_name == "scatter_add" else a.get("reduce")
    if reduce not in SCATTER_REDUCTIONS:
        raise Unmapped(f"scatter reducing by {reduce!r}")
    if isinstance(a.get("src"), fx.Node):
        src = t.value(a["src"])
    else:   # a number: its value at every index
        number = t.operand(a["value"], data.dtype)
        src = t.emit("expand", [number], {"shape": list(t.type_of(index).shape)})
    if t.type_of(src).dtype != data.dtype:
        raise Unmapped("scatter of values of another dtype than the tensor's")
    include_self = bool(a.get("include_self", True))
    return t.emit("scatter", [x, index, src], {"dim": wrap_dim(int(a["dim"]), rank),
                                               "reduce": SCATTER_REDUCTIONS[reduce], "include_self": include_self})


@maps("max_unpool2d")
def _max_unpool(t: Translator, a: dict) -> str:
    """x's values written at their max_pool2d indices (flattened over each image plane) into zeros of the output
    size: a scatter along the flattened plane."""
    x, indices = t.value(a["self"]), t.value(a["indices"])
    shape, out = t.type_of(x).shape, t.out_type
    if len(shape) != 4 or t.type_of(indices).shape != shape:
        raise Unmapped("max_unpool2d of other than a 4-D input and indices of its shape")
    planes, pixels = [shape[0], shape[1]], shape[2] * shape[3]
    zeros = t.constant("zeros", torch.zeros(*planes, out.shape[2] * out.shape[3], dtype=torch_dtype(out.dtype)))
    flat = t.emit("scatter", [zeros, reshaped(t, indices, [*planes, pixels]), reshaped(t, x, [*planes, pixels])],
                  {"dim": 2, "reduce": "none", "include_self": True})
    return t.emit("reshape", [flat], {"shape": list(out.shape)})


@maps("linalg_det", "det")
def _det(t: Translator, a: dict) -> str:
    return t.emit("det", [a.get("A", a.get("self"))], {})


@maps("grid_sampler", "grid_sampler_2d", "grid_sampler_3d")
def _grid_sample(t: Translator, a: dict) -> str:
    mode, padding = int(a["interpolation_mode"]), int(a["padding_mode"])
    if not (0 <= mode < len(GRID_MODES) and 0 <= padding < len(GRID_PADDINGS)):
        raise Unmapped(f"grid sampling of interpolation mode {mode} or padding mode {padding}")
    attrs = {"mode": GRID_MODES[mode], "padding_mode": GRID_PADDINGS[padding],
             "align_corners": bool(a["align_corners"])}
    return t.emit("grid_sample", [a["input"], a["grid"]], attrs)
