"""ATen handlers of indexed reads and writes (`opfuse.frontend.aten_ops`), as index maps of the IR: gather, advanced
indexing (`x[i, j]`), the functional writes of a slice or a select back into a tensor (slice_scatter,
select_scatter, which torch.export makes of `x[:, 1:] = y` on a fresh tensor: BART's shift of its decoder tokens),
and the fills and copies such writes carry.

Advanced indexing by k index tensors in adjacent dims reads x seen with those dims merged into one, at the flat
index sum(wrap(i_j) * stride_j) (a take): a flat index known at compile time that counts 0, 1, 2, ... is no gather
but a view of x (transformers' padding masks, `mask[batch_arange, key_arange]`), a reshape and expand.

A scatter is the written value padded to the base's shape, picked over the base where a constant mask of the
written positions is true: `where(mask, pad(src), base)`, all three index maps an elementwise kernel computes on
its loads (`opfuse.codegen.operands`), exactly for integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

import math

from opfuse.frontend.aten_common import Handler, Unmapped, registrar, wrap_dim
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


@maps("gather")
def _gather(t: Translator, a: dict) -> str:
    """torch.gather(x, dim, index): x at index's value along dim, at each position of index elsewhere."""
    if a.get("sparse_grad"):
        raise Unmapped("gather with sparse gradients")
    x, index = t.value(a["self"]), t.value(a["index"])
    return t.emit("gather", [x, index], {"dim": wrap_dim(a["dim"], t.rank(x))})


@maps("index_select")
def _index_select(t: Translator, a: dict) -> str:
    """torch.index_select(x, dim, index): the rows of x along dim that the 1-D index names, as `take` (M2M100's
    sinusoidal positions)."""
    x = t.value(a["self"])
    return t.emit("take", [x, t.value(a["index"])], {"axis": wrap_dim(a["dim"], t.rank(x))})


@maps("index")
def _index(t: Translator, a: dict) -> str:
    """x[i_0, ..., i_k-1] (aten.index.Tensor): integer index tensors in adjacent dims, None for a dim taken whole
    (module docstring); boolean masks (a data-dependent shape) and indices apart from each other stay PyTorch's."""
    from opfuse.passes.simplify_attention_masks import CompileTimeValues

    x = t.value(a["self"])
    shape = t.type_of(x).shape
    indices = list(a["indices"])
    placed = [d for d, index in enumerate(indices) if index is not None]
    if not placed or placed != list(range(placed[0], placed[-1] + 1)):
        raise Unmapped("indices in dims apart from each other")
    names = [t.value(indices[d]) for d in placed]
    if any(not t.type_of(n).dtype.startswith(("int", "uint")) for n in names):
        raise Unmapped("a boolean mask as an index")
    first, indexed = placed[0], [shape[d] for d in placed]
    rest = list(shape[placed[-1] + 1:])
    merged = t.emit("reshape", [x], {"shape": [*shape[:first], math.prod(indexed), *rest]})
    strides = [math.prod(indexed[j + 1:]) for j in range(len(indexed))]
    values = CompileTimeValues(t.graph)
    known = [values.value(n) for n in names]
    out_shape = t.out_type.shape
    if all(k is not None for k in known):
        flat = sum(torch.where(k < 0, k + size, k).long() * stride for k, size, stride in zip(known, indexed, strides))
        view = _counting(flat, math.prod(indexed))
        if view is not None:      # the index reads x in order: a view
            shaped = t.emit("reshape", [merged], {"shape": [*shape[:first], *view, *rest]})
            return t.emit("expand", [shaped], {"shape": list(out_shape)}) if tuple(view) != tuple(
                out_shape[first:first + len(view)]) else shaped
        index = t.constant("flat_index", flat)
    else:
        index = None
        for name, size, stride in zip(names, indexed, strides):
            wrapped = from_end(t, name, size)
            term = wrapped if stride == 1 else t.emit("mul", [wrapped, t.operand(stride, "int64")])
            index = term if index is None else t.emit("add", [index, term])
    return t.emit("take", [merged, index], {"axis": first})


def from_end(t: Translator, index: str, size: int) -> str:
    """Integer `index` into a dim of `size`, a negative one counted from its end, as int64."""
    dtype = t.type_of(index).dtype
    negative = t.emit("lt", [index, t.operand(0, dtype)])
    wrapped = t.emit("where", [negative, t.emit("add", [index, t.operand(size, dtype)]), index])
    return wrapped if dtype == "int64" else t.emit("cast", [wrapped], {"dtype": "int64"})


def _counting(flat: torch.Tensor, count: int) -> list[int] | None:
    """The shape `flat` (a broadcast flat index) has at its smallest broadcast where it counts 0 .. count-1 in
    order, else None."""
    from opfuse.passes.fold_constants import smallest_broadcast

    compact = smallest_broadcast(flat)
    if compact.numel() != count or not torch.equal(compact.reshape(-1).cpu(), torch.arange(count)):
        return None
    return list(compact.shape)


def _spread(t: Translator, x: str) -> str:
    """Value `x` broadcast to the call's output shape in its dtype (what a fill or copy writes)."""
    out = t.out_type
    if t.type_of(x).dtype != out.dtype:
        x = t.emit("cast", [x], {"dtype": out.dtype})
    shape = t.type_of(x).shape
    if tuple(shape) == tuple(out.shape):
        return t.emit("identity", [x])
    if len(shape) < len(out.shape):
        x = t.emit("reshape", [x], {"shape": [1] * (len(out.shape) - len(shape)) + list(shape)})
    return t.emit("expand", [x], {"shape": list(out.shape)})


@maps("fill")
def _fill(t: Translator, a: dict) -> str:
    """fill(self, value): `value` (a number or a 0-d tensor) in self's shape and dtype, which are all self lends."""
    value = a["value"]
    if isinstance(value, (bool, int, float)):
        out = t.out_type
        tensor = torch.full(out.shape, value, dtype=torch_dtype(out.dtype))
        return t.graph.add_constant(t.node.name, tensor, source=t.node.name).name
    return _spread(t, t.value(value))


@maps("copy")
def _copy(t: Translator, a: dict) -> str:
    """copy(self, src): src broadcast to self's shape, in self's dtype (the functional twin of copy_)."""
    return _spread(t, t.value(a["src"]))


def _written(t: Translator, base: str, src: str, dim: int, start: int, end: int) -> str:
    """`base` with positions [start, end) along `dim` replaced by `src` (of that extent there)."""
    shape = t.type_of(base).shape
    rank, size = len(shape), shape[dim]
    pads = [0] * (2 * (rank - dim))
    pads[-2:] = [start, size - end]                 # F.pad's order: the last dim's pair first
    placed = t.emit("pad", [src], {"pads": tuple(pads), "value": 0.0}) if start or end != size else src
    positions = torch.zeros([size if d == dim else 1 for d in range(rank)], dtype=torch.bool)
    positions.narrow(dim, start, end - start).fill_(True)
    return t.emit("where", [t.constant("written", positions), placed, base])


@maps("slice_scatter")
def _slice_scatter(t: Translator, a: dict) -> str:
    base, src = t.value(a["self"]), t.value(a["src"])
    shape = t.type_of(base).shape
    dim = wrap_dim(a.get("dim") or 0, len(shape))
    start, end, step = slice(a.get("start"), a.get("end"), a.get("step") or 1).indices(shape[dim])
    if step != 1:
        raise Unmapped(f"slice_scatter with step {step}")
    return _written(t, base, src, dim, start, max(start, end))


@maps("select_scatter")
def _select_scatter(t: Translator, a: dict) -> str:
    base, src = t.value(a["self"]), t.value(a["src"])
    shape = t.type_of(base).shape
    dim = wrap_dim(a["dim"], len(shape))
    index = wrap_dim(a["index"], shape[dim])
    src = t.emit("reshape", [src], {"shape": [1 if d == dim else s for d, s in enumerate(shape)]})
    return _written(t, base, src, dim, index, index + 1)
