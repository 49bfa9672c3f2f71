"""ATen handlers of indexed reads and writes (`opfuse.frontend.aten_ops`), as index maps of the IR: gather, the
functional writes of a slice or a select back into a tensor (slice_scatter, select_scatter, which torch.export
makes of `x[:, 1:] = y` on a fresh tensor: BART's shift of its decoder tokens), and the fills and copies such
writes carry.

A scatter is the written value padded to the base's shape, picked over the base where a constant mask of the
written positions is true: `where(mask, pad(src), base)`, all three index maps an elementwise kernel computes on its
loads (`opfuse.codegen.operands`), exactly for integers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

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
