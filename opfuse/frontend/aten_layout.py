"""ATen handlers of layout ops (`opfuse.frontend.aten_ops`): views, permutes, expands and repeats, cat and stack,
slices and splits, roll, padding, upsampling, sliding windows (unfold, im2col, col2im), embedding lookups and index
copies.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.fx as fx

from opfuse.frontend.aten_common import Handler, MultiOutput, Unmapped, pair, registrar, reshaped, wrap_dim
from opfuse.ir.graph import DTYPE_BYTES

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


def _split_like(t: Translator, a: dict[str, Any], squeeze: bool = False) -> MultiOutput:
    """split / chunk / unbind: each output read becomes a slice (plus a reshape that drops the dim for unbind)."""
    pieces = t.node.meta["val"]
    x = a["self"]
    dim = wrap_dim(a.get("dim") or 0, t.rank(x))
    sizes = [1 if squeeze else piece.shape[dim] for piece in pieces]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]

    def item(index: int) -> str:
        part = t.emit("slice", [x], {"dim": dim, "start": starts[index], "end": starts[index] + sizes[index],
                                     "step": 1})
        return t.emit("reshape", [part], {"shape": list(t.out_type.shape)}) if squeeze else part
    return MultiOutput(t.node, item)


@maps("view", "_unsafe_view", "reshape", "view_copy", "_reshape_alias", "flatten", "unflatten", "squeeze",
      "unsqueeze", "view_as", "reshape_as")
def _reshape(t: Translator, a: dict) -> str:
    """A reshape; Tensor.view(dtype) (a bit cast) as `bitcast` where the two dtypes are of one width."""
    if "dtype" in a:
        source, target = t.type_of(t.value(a["self"])).dtype, t.out_type.dtype
        if DTYPE_BYTES[source] != DTYPE_BYTES[target]:
            raise Unmapped(f"a view of {source} as {target}, a dtype of another width")
        return t.emit("bitcast", [a["self"]], {"source": source, "dtype": target})
    return t.emit("reshape", [a["self"]], {"shape": list(t.out_type.shape)})


@maps("permute", "transpose", "t", "swapaxes", "numpy_T")
def _permute(t: Translator, a: dict) -> str:
    rank, name = t.rank(a["self"]), t.op_name
    if name == "permute":
        dims = [wrap_dim(d, rank) for d in a["dims"]]
    elif name == "numpy_T":
        dims = list(reversed(range(rank)))
    else:  # transpose / swapaxes swap two dims; t() swaps the two of a matrix and leaves a vector alone
        first, second = {"transpose": ("dim0", "dim1"), "swapaxes": ("axis0", "axis1")}.get(name, (None, None))
        first, second = (a[first], a[second]) if first else (0, max(rank - 1, 0))
        dims = list(range(rank))
        if rank:
            first, second = wrap_dim(first, rank), wrap_dim(second, rank)
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
    x = reshaped(t, x, shape)
    split, grown = [], []
    for size, times in zip(shape, repeats):
        if size == 1 or times == 1:
            split.append(size)
            grown.append(size * times)
        else:
            split += [1, size]
            grown += [times, size]
    x = reshaped(t, x, split)
    if grown != split:
        x = t.emit("expand", [x], {"shape": grown})
    return reshaped(t, x, list(t.out_type.shape))


@maps("repeat_interleave")
def _repeat_interleave(t: Translator, a: dict) -> str:
    """Each element repeated `repeats` times along dim (of the flattened tensor without one): [.., s, ..] split
    [.., s, 1, ..], expanded to [.., s, r, ..] and merged (a size-1 dim is just expanded); tensor repeats are not
    mapped."""
    if "self" not in a or isinstance(a.get("repeats"), fx.Node):
        raise Unmapped("repeat_interleave by a tensor of repeats")
    x, times = t.value(a["self"]), int(a["repeats"])
    if a.get("dim") is None:
        x = reshaped(t, x, [t.type_of(x).numel])
    shape = list(t.type_of(x).shape)
    dim = wrap_dim(a.get("dim") or 0, len(shape))
    split = shape[:dim + 1] + ([1] if shape[dim] != 1 else []) + shape[dim + 1:]
    grown = list(split)
    grown[dim + (shape[dim] != 1)] = times
    x = t.emit("expand", [reshaped(t, x, split)], {"shape": grown}) if times != 1 else x
    return reshaped(t, x, list(t.out_type.shape))


@maps("cat", "concat", "concatenate")
def _cat(t: Translator, a: dict) -> str:
    return t.emit("cat", list(a["tensors"]), {"dim": wrap_dim(a["dim"], len(t.out_type.shape))})


@maps("stack")
def _stack(t: Translator, a: dict) -> str:
    """stack(tensors, dim): each tensor with a size-1 dim inserted at dim (a reshape, no copy), then their cat (an
    index map of the kernel that reads it)."""
    out = list(t.out_type.shape)
    dim = wrap_dim(a.get("dim") or 0, len(out))
    pieces = [t.emit("reshape", [x], {"shape": out[:dim] + [1] + out[dim + 1:]}) for x in a["tensors"]]
    return t.emit("cat", pieces, {"dim": dim}) if len(pieces) > 1 else pieces[0]


@maps("slice", "narrow", "select")
def _slice(t: Translator, a: dict) -> str:
    x = t.value(a["self"])
    shape = t.type_of(x).shape
    dim = wrap_dim(a.get("dim") or 0, len(shape))
    size = shape[dim]
    name = t.op_name
    if name == "select":
        start = wrap_dim(a["index"], size)
        end, step = start + 1, 1
    elif name == "narrow":
        start = wrap_dim(a["start"], size)
        end, step = start + a["length"], 1
    else:
        start = 0 if a["start"] is None else a["start"]
        end = size if a["end"] is None else a["end"]
        step = a["step"] or 1
    start, end = (min(max(wrap_dim(v, size), 0), size) for v in (start, end))  # Python's slice clamping
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
    return t.emit("roll", [a["self"]], {"shifts": shifts, "dims": [wrap_dim(d, rank) for d in dims]})


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
    | {"upsample_linear1d": "linear", "upsample_bilinear2d": "linear", "upsample_trilinear3d": "linear"} \
    | {"upsample_bicubic2d": "cubic"}


@maps(*UPSAMPLE_MODES)
def _upsample(t: Translator, a: dict) -> str:
    """Nearest, nearest-exact, (bi/tri)linear and bicubic upsampling of the last 1 to 3 dims (bicubic: 2), to the
    output's size; the scale factors it was given, which decide the source index (1 / factor instead of size in /
    size out), are kept."""
    mode = UPSAMPLE_MODES[t.op_name]
    size = list(t.out_type.shape[2:])
    if "scale_factors" in a:        # the .vec overloads
        scales = a.get("scale_factors")
    else:
        scales = [a.get(key) for key in ("scales_d", "scales_h", "scales_w", "scales") if key in a]
    scales = None if scales is None or all(v is None for v in scales) else [None if v is None else float(v)
                                                                            for v in scales]
    attrs = {"mode": mode, "size": size, "scales": scales}
    if mode in ("linear", "cubic"):
        attrs["align_corners"] = bool(a["align_corners"])
    return t.emit("upsample", [a.get("input", a.get("self"))], attrs)


@maps("_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
def _antialiased_upsample(t: Translator, a: dict) -> str:
    """F.interpolate's antialias=True stays PyTorch's: downsampling widens its filter with the scale (taps beyond
    the upsample op's fixed 2 or 4 a dim, normalised), and its bicubic kernel is PIL's (A = -0.5, not -0.75)."""
    raise Unmapped("antialiased resampling: a filter that widens with the scale, which the upsample op's fixed "
                   "taps do not cover")


@maps("unfold", "unfold_copy")
def _unfold(t: Translator, a: dict) -> str:
    """Tensor.unfold(dim, size, step): sliding windows along one dim, copied (halonet's overlapping key/value
    windows); computed as an index map of the load that reads them, never a view of the input."""
    rank = t.rank(a["self"])
    if rank == 0:
        raise Unmapped("unfold of a 0-d tensor")
    return t.emit("unfold", [a["self"]], {"dim": wrap_dim(a["dimension"], rank), "size": int(a["size"]),
                                          "step": int(a["step"])})


def _window_attrs(a: dict) -> dict:
    return {key: list(pair(a[key])) for key in ("kernel_size", "dilation", "padding", "stride")}


@maps("im2col")
def _im2col(t: Translator, a: dict) -> str:
    """F.unfold: sliding blocks of an image [N, C, H, W] (or one unbatched [C, H, W]) as columns (VOLO's outlook
    attention)."""
    return t.emit("im2col", [a["self"]], _window_attrs(a))


@maps("col2im")
def _col2im(t: Translator, a: dict) -> str:
    """F.fold: columns summed back into an image [N, C, H, W] (or one unbatched [C, H, W]); a symbolic output
    size is not mapped."""
    if not all(isinstance(v, int) for v in a["output_size"]):
        raise Unmapped("col2im to a symbolic output size")
    return t.emit("col2im", [a["self"]], {"output_size": list(pair(a["output_size"]))} | _window_attrs(a))


@maps("embedding")
def _embedding(t: Translator, a: dict) -> str:
    return t.emit("embedding", [a["weight"], a["indices"]])


@maps("index_copy")
def _index_copy(t: Translator, a: dict) -> str:
    """A KV cache written at the call's positions (`index_copy_` made functional, or as written)."""
    return t.emit("index_copy", [a["self"], a["index"], a["source"]], {"dim": wrap_dim(a["dim"], t.rank(a["self"]))})
