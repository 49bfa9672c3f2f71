"""ONNX converters of indexing and tensor-making operators, written out in the IR's gathers (`take`), views,
elementwise ops and scan: GatherElements, GatherND, OneHot, Trilu, EyeLike, Compress, CumSum, TopK, CenterCropPad,
DepthToSpace, SpaceToDepth, ReverseSequence, AffineGrid, and Range, the window functions and MelWeightMatrix (whose output's
shape is their inputs' value: constants, which the importer evaluates). Registered in
`opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

GatherElements and GatherND read data at indices known only at run time: each becomes one `take` from the data
seen flat, at a flat index computed elementwise from the indices (negative ones counted from the end of their
dim) and a constant offset per output position. No new gather op is needed.

TopK is the first k of a stable sort (a library call): ONNX puts the lower index first among equal values.
ScatterElements (and the older Scatter), ScatterND, MaxUnpool and TensorScatter write at run-time indices: one
`scatter` op each, a library call (ScatterND's along the rows of the data seen as [the indexed dims, the rest], at the
flat index GatherND reads at; MaxUnpool's into zeros seen flat, at MaxPool's flat indices; TensorScatter's, a KV
cache's update, along its axis at each batch row's write index plus the update's positions).
GridSample is torch's grid sampling, a library call too.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from opfuse.frontend.onnx_converters import ONNX_DTYPES, Unsupported, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


def _strides(shape) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]


def as_int64(importer: Importer, indices: str, name: str) -> str:
    """Integer indices as int64 (the IR's index ops and library calls take int64), cast where they are not."""
    if importer.type(indices).dtype == "int64":
        return indices
    return importer.emit("cast", [indices], {"dtype": "int64"}, name=f"{name}_int64")


def _wrapped(importer: Importer, indices: str, sizes: torch.Tensor, name: str) -> str:
    """Indices as int64, a negative one plus its dim's size (`sizes` broadcasts against them)."""
    indices = as_int64(importer, indices, name)
    size_node = importer.add_constant(sizes.to(torch.int64), f"{name}_sizes")
    zero = importer.add_constant(torch.tensor(0), f"{name}_zero")
    negative = importer.emit("lt", [indices, zero], name=f"{name}_negative")
    return importer.emit("where", [negative, importer.emit("add", [indices, size_node], name=f"{name}_from_end"),
                                   indices], name=f"{name}_wrapped")


def _flat(importer: Importer, x: str, name: str) -> str:
    return importer.emit("reshape", [x], {"shape": (math.prod(importer.type(x).shape),)}, name=f"{name}_flat")


@converts("GatherElements", attributes=("axis",))
def _gather_elements(importer: Importer, node, xs, attrs):
    """out[p] = data[p with its `axis` coordinate replaced by indices[p]]: a take from the flat data at
    offset(p) + indices[p] * stride(axis), offset(p) the flat position of p's other coordinates."""
    data, indices = xs[:2]
    out = node.output[0]
    shape, index_shape = importer.type(data).shape, importer.type(indices).shape
    axis = attrs.get("axis", 0) % len(shape)
    strides = _strides(shape)
    grids = torch.meshgrid(*[torch.arange(n) for n in index_shape], indexing="ij")
    offsets = sum((grid * strides[d] for d, grid in enumerate(grids) if d != axis),
                  torch.zeros(index_shape, dtype=torch.int64))
    known = importer.constant(indices)
    if known is not None:   # the whole flat index is a constant
        wrapped = torch.where(known < 0, known + shape[axis], known).to(torch.int64)
        flat_index = importer.add_constant(offsets + wrapped * strides[axis], f"{out}_flat_index")
    else:
        wrapped = _wrapped(importer, indices, torch.tensor(shape[axis]), out)
        scaled = wrapped if strides[axis] == 1 else importer.emit(
            "mul", [wrapped, importer.add_constant(torch.tensor(strides[axis]), f"{out}_stride")],
            name=f"{out}_scaled")
        flat_index = importer.emit("add", [scaled, importer.add_constant(offsets, f"{out}_offsets")],
                                   name=f"{out}_flat_index")
    return [importer.emit("take", [_flat(importer, data, out), flat_index], {"axis": 0}, name=out)]


@converts("GatherND", attributes=("batch_dims",))
def _gather_nd(importer: Importer, node, xs, attrs):
    """data[batch, indices[..., 0], ..., indices[..., k-1]] for each leading position of the indices: a take from
    data seen as [batch * the k indexed dims, the rest], at batch * their size + the flat index of the k."""
    data, indices = xs[:2]
    out = node.output[0]
    shape, index_shape = importer.type(data).shape, importer.type(indices).shape
    batch_dims = attrs.get("batch_dims", 0)
    depth = index_shape[-1]
    indexed = shape[batch_dims:batch_dims + depth]
    rest = shape[batch_dims + depth:]
    batch = math.prod(shape[:batch_dims])
    rows = importer.emit("reshape", [data], {"shape": (batch * math.prod(indexed), *rest)}, name=f"{out}_rows")
    wrapped = _wrapped(importer, indices, torch.tensor(indexed), out)
    strides = importer.add_constant(torch.tensor(_strides(indexed), dtype=torch.int64), f"{out}_strides")
    flat_index = importer.emit("sum", [importer.emit("mul", [wrapped, strides], name=f"{out}_terms")],
                               {"dims": [len(index_shape) - 1], "keepdim": False}, name=f"{out}_index")
    if batch_dims:   # each leading batch position reads its own block of rows
        lead = index_shape[:batch_dims]
        block = torch.arange(batch).reshape(lead + (1,) * (len(index_shape) - 1 - batch_dims)) * math.prod(indexed)
        flat_index = importer.emit("add", [flat_index, importer.add_constant(block, f"{out}_blocks")],
                                   name=f"{out}_row")
    return [importer.emit("take", [rows, flat_index], {"axis": 0}, name=out)]


@converts("OneHot", attributes=("axis",), constant_inputs=(1,))
def _one_hot(importer: Importer, node, xs, attrs):
    """values[1] where the index (negative ones from the end of depth) is the position along the new axis,
    values[0] elsewhere (an index out of range matches nowhere)."""
    indices, depth_input, values = xs[:3]
    out = node.output[0]
    depth_value = importer.constant(depth_input)
    if depth_value is None:
        raise Unsupported("input 1 (depth) is not a constant")
    depth = int(depth_value.reshape(-1)[0].item())
    index_shape = importer.type(indices).shape
    rank = len(index_shape) + 1
    axis = attrs.get("axis", -1) % rank
    index_dtype = torch_dtype(importer.type(indices).dtype)
    size = importer.add_constant(torch.tensor(depth, dtype=index_dtype), f"{out}_depth")
    zero = importer.add_constant(torch.tensor(0, dtype=index_dtype), f"{out}_zero")
    wrapped = importer.emit("where", [importer.emit("lt", [indices, zero], name=f"{out}_negative"),
                                      importer.emit("add", [indices, size], name=f"{out}_from_end"), indices],
                            name=f"{out}_wrapped")
    spread = importer.emit("reshape", [wrapped], {"shape": index_shape[:axis] + (1,) + index_shape[axis:]},
                           name=f"{out}_spread")
    along = [1] * rank
    along[axis] = depth
    positions = importer.add_constant(torch.arange(depth, dtype=index_dtype).reshape(along), f"{out}_positions")
    hot = importer.emit("eq", [spread, positions], name=f"{out}_hot")
    off = importer.emit("slice", [values], {"dim": 0, "start": 0, "end": 1, "step": 1}, name=f"{out}_off")
    on = importer.emit("slice", [values], {"dim": 0, "start": 1, "end": 2, "step": 1}, name=f"{out}_on")
    return [importer.emit("where", [hot, on, off], name=out)]


@converts("Trilu", attributes=("upper",), constant_inputs=(1,))
def _trilu(importer: Importer, node, xs, attrs):
    """x where j - i >= k (upper) or <= k (lower) in its last two dims, zero elsewhere: a constant mask."""
    shape = importer.type(xs[0]).shape
    k = 0
    if len(xs) > 1 and xs[1] is not None:
        value = importer.constant(xs[1])
        if value is None:
            raise Unsupported("input 1 (k) is not a constant")
        k = int(value.reshape(-1)[0].item())
    rows, cols = shape[-2:]
    ones = torch.ones(rows, cols, dtype=torch.bool)
    mask = torch.triu(ones, k) if attrs.get("upper", 1) else torch.tril(ones, k)
    zero = importer.add_constant(torch.tensor(0, dtype=torch_dtype(importer.type(xs[0]).dtype)),
                                 f"{node.output[0]}_zero")
    return [importer.emit("where", [importer.add_constant(mask, f"{node.output[0]}_mask"), xs[0], zero])]


@converts("EyeLike", attributes=("dtype", "k"))
def _eye_like(importer: Importer, node, xs, attrs):
    """A constant: ones on the k-th diagonal of the input's 2-D shape, in `dtype` (the input's by default)."""
    rows, cols = importer.type(xs[0]).shape
    dtype = ONNX_DTYPES.get(attrs["dtype"]) if "dtype" in attrs else importer.type(xs[0]).dtype
    if dtype is None:
        raise Unsupported("EyeLike of a dtype opfuse does not support")
    eye = torch.from_numpy(np.eye(rows, cols, attrs.get("k", 0))).to(torch_dtype(dtype))
    return [importer.add_constant(eye, node.output[0])]


@converts("Compress", attributes=("axis",), constant_inputs=(1,))
def _compress(importer: Importer, node, xs, attrs):
    """The slices along the axis (of the flat input without one) where the condition is true: a take at the
    condition's true positions, which fix the output's shape and so are read as a constant."""
    condition = importer.constant(xs[1])
    if condition is None:
        raise Unsupported("input 1 (condition) is not a constant: it fixes the output's shape")
    x = xs[0]
    if "axis" in attrs:
        axis = attrs["axis"] % len(importer.type(x).shape)
    else:
        x, axis = _flat(importer, x, node.output[0]), 0
    picked = torch.nonzero(condition.reshape(-1).to(torch.bool)).reshape(-1)
    if len(picked) and int(picked.max()) >= importer.type(x).shape[axis]:
        raise Unsupported("a condition longer than the axis with a true past its end")
    return [importer.emit("take", [x, importer.add_constant(picked, f"{node.output[0]}_picked")], {"axis": axis})]


@converts("CumSum", "CumProd", attributes=("exclusive", "reverse"), constant_inputs=(1,))
def _scan(importer: Importer, node, xs, attrs):
    """The IR's scan (cumsum, cumprod) along `axis`: `reverse` scans the axis read backwards (a take at descending
    indices, before and after), `exclusive` scans the input shifted one place along it (a pad of one zero, or one
    one, before, cropping the last), so every sum or product is of the input's own values."""
    op = "cumsum" if node.op_type == "CumSum" else "cumprod"
    axis = importer.constant(xs[1])
    if axis is None or axis.numel() != 1:
        raise Unsupported("input 1 (axis) is not a constant of one element")
    x, out = xs[0], node.output[0]
    shape = importer.type(x).shape
    dim = int(axis.reshape(-1)[0]) % len(shape)
    backwards = None
    if attrs.get("reverse", 0):
        backwards = importer.add_constant(torch.arange(shape[dim] - 1, -1, -1), f"{out}_backwards")
        x = importer.emit("take", [x, backwards], {"axis": dim}, name=f"{out}_reversed")
    if attrs.get("exclusive", 0):
        pads = [0] * (2 * (len(shape) - dim))
        pads[-2:] = [1, -1]                         # F.pad's order: the last dim's pair first
        x = importer.emit("pad", [x], {"pads": tuple(pads), "value": 0.0 if op == "cumsum" else 1.0},
                          name=f"{out}_shifted")
    dtype = importer.type(xs[0]).dtype
    scanned = importer.emit(op, [x], {"dim": dim, "dtype": dtype}, name=out if backwards is None else
                            f"{out}_scanned")
    if backwards is None:
        return [scanned]
    return [importer.emit("take", [scanned, backwards], {"axis": dim}, name=out)]


@converts("CenterCropPad", attributes=("axes",), constant_inputs=(1,))
def _center_crop_pad(importer: Importer, node, xs, attrs):
    """Each listed axis cropped (a slice) or zero-padded (a pad) to its target size about its centre, the odd
    element at the end."""
    target = importer.ints(node, xs, {}, "shape", 1)
    x = xs[0]
    rank = len(importer.type(x).shape)
    axes = [a % rank for a in attrs.get("axes", range(rank))]
    out = node.output[0]
    for axis, size in zip(axes, target):
        dim = importer.type(x).shape[axis]
        if size < dim:
            start = (dim - size) // 2
            x = importer.emit("slice", [x], {"dim": axis, "start": start, "end": start + size, "step": 1},
                              name=f"{out}_crop{axis}")
        elif size > dim:
            before = (size - dim) // 2
            pads = [0] * (2 * rank)
            pads[2 * (rank - 1 - axis)], pads[2 * (rank - 1 - axis) + 1] = before, size - dim - before
            x = importer.emit("pad", [x], {"pads": tuple(pads), "value": 0.0}, name=f"{out}_pad{axis}")
    return [x if x != xs[0] else importer.emit("identity", [x])]


@converts("DepthToSpace", attributes=("blocksize", "mode"))
def _depth_to_space(importer: Importer, node, xs, attrs):
    """[N, C, H, W] -> [N, C / b^2, H * b, W * b]: a reshape, a permute, a reshape (DCR: depth, column, row order
    of the channels; CRD: column, row, depth)."""
    n, c, h, w = importer.type(xs[0]).shape
    b = attrs["blocksize"]
    if attrs.get("mode", "DCR") == "DCR":
        split, dims = (n, b, b, c // (b * b), h, w), (0, 3, 4, 1, 5, 2)
    else:
        split, dims = (n, c // (b * b), b, b, h, w), (0, 1, 4, 2, 5, 3)
    out = node.output[0]
    blocks = importer.emit("reshape", [xs[0]], {"shape": split}, name=f"{out}_blocks")
    moved = importer.emit("permute", [blocks], {"dims": dims}, name=f"{out}_moved")
    return [importer.emit("reshape", [moved], {"shape": (n, c // (b * b), h * b, w * b)}, name=out)]


@converts("SpaceToDepth", attributes=("blocksize", "mode"))
def _space_to_depth(importer: Importer, node, xs, attrs):
    """DepthToSpace's inverse: [N, C, H, W] -> [N, C * b^2, H / b, W / b], the channels in DCR (default) or CRD
    order (opset 28's mode)."""
    n, c, h, w = importer.type(xs[0]).shape
    b = attrs["blocksize"]
    out = node.output[0]
    dims = (0, 3, 5, 1, 2, 4) if attrs.get("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    blocks = importer.emit("reshape", [xs[0]], {"shape": (n, c, h // b, b, w // b, b)}, name=f"{out}_blocks")
    moved = importer.emit("permute", [blocks], {"dims": dims}, name=f"{out}_moved")
    return [importer.emit("reshape", [moved], {"shape": (n, c * b * b, h // b, w // b)}, name=out)]


# ---- constants of the shape their inputs' values give: the importer evaluates these (`Importer.fold`) ------

@converts("Range", constant_inputs=(0, 1, 2))
def _range(importer: Importer, node, xs, attrs):
    """start + i * delta for i below max(ceil((limit - start) / delta), 0): reached only where the importer could
    not evaluate it, for bfloat16 (computed here in float32, then rounded)."""
    values = [importer.constant(x) for x in xs[:3]]
    if any(v is None for v in values):
        raise Unsupported("Range of a value known only at run time: its output's length is that value")
    start, limit, delta = (float(v.float()) for v in values)
    count = max(math.ceil((limit - start) / delta), 0)
    result = torch.tensor(start) + torch.arange(count, dtype=torch.float32) * torch.tensor(delta)
    return [importer.add_constant(result.to(values[0].dtype), node.output[0])]


@converts("HannWindow", "HammingWindow", "BlackmanWindow", attributes=("output_datatype", "periodic"),
          constant_inputs=(0,))
@converts("MelWeightMatrix", attributes=("output_datatype",), constant_inputs=(0, 1, 2, 3, 4))
def _value_shaped(importer: Importer, node, xs, attrs):
    raise Unsupported(f"{node.op_type} of a value known only at run time: its output's length is that value")


@converts("ReverseSequence", attributes=("batch_axis", "time_axis"))
def _reverse_sequence(importer: Importer, node, xs, attrs):
    """Each batch entry's first sequence_lens[b] steps reversed, the rest kept: a take from the flat input at
    offset(p) + source_step * stride(time), the source step len - 1 - t below len, else t (at run time)."""
    x, lengths = xs[:2]
    out = node.output[0]
    shape = importer.type(x).shape
    batch_axis, time_axis = attrs.get("batch_axis", 1), attrs.get("time_axis", 0)
    strides = _strides(shape)
    grids = torch.meshgrid(*[torch.arange(n) for n in shape], indexing="ij")
    offsets = sum((grid * strides[d] for d, grid in enumerate(grids) if d != time_axis),
                  torch.zeros(shape, dtype=torch.int64))
    along_time = [1] * len(shape)
    along_time[time_axis] = shape[time_axis]
    along_batch = [1] * len(shape)
    along_batch[batch_axis] = shape[batch_axis]
    steps = importer.add_constant(torch.arange(shape[time_axis]).reshape(along_time), f"{out}_steps")
    length = importer.emit("reshape", [importer.emit("cast", [lengths], {"dtype": "int64"}, name=f"{out}_lengths")],
                           {"shape": tuple(along_batch)}, name=f"{out}_lengths_along_batch")
    mirrored = importer.emit("sub", [importer.emit("sub", [length, importer.add_constant(torch.tensor(1),
                                                                                         f"{out}_one")],
                                                   name=f"{out}_last"), steps], name=f"{out}_mirrored")
    source = importer.emit("where", [importer.emit("lt", [steps, length], name=f"{out}_inside"), mirrored, steps],
                           name=f"{out}_source_step")
    scaled = importer.emit("mul", [source, importer.add_constant(torch.tensor(strides[time_axis]), f"{out}_stride")],
                           name=f"{out}_source_offset")
    flat_index = importer.emit("add", [scaled, importer.add_constant(offsets, f"{out}_offsets")],
                               name=f"{out}_flat_index")
    return [importer.emit("take", [_flat(importer, x, out), flat_index], {"axis": 0}, name=out)]


@converts("AffineGrid", attributes=("align_corners",), constant_inputs=(1,))
def _affine_grid(importer: Importer, node, xs, attrs):
    """theta [N, 2, 3] (or [N, 3, 4]) times the constant homogeneous grid of normalised positions: one matmul,
    then [N, H, W, 2] (or [N, D, H, W, 3])."""
    theta, out = xs[0], node.output[0]
    size = importer.ints(node, xs, {}, "size", 1)
    spatial = size[2:]
    corners = bool(attrs.get("align_corners", 0))
    axes = []
    for n in spatial:   # positions in [-1, 1]: the pixel centres, or the corners with align_corners
        i = np.arange(n, dtype=np.float64)
        axes.append((-1 + 2 * i / (n - 1)) if corners and n > 1 else (-1 + (2 * i + 1) / n) if not corners
                    else np.zeros(1))
    mesh = np.meshgrid(*axes, indexing="ij")
    # homogeneous coordinates, x first: (x, y, 1) or (x, y, z, 1)
    columns = [m.reshape(-1) for m in reversed(mesh)] + [np.ones(math.prod(spatial))]
    base = torch.from_numpy(np.stack(columns)).to(torch_dtype(importer.type(theta).dtype))   # [dims + 1, points]
    grid = importer.emit("matmul", [theta, importer.add_constant(base, f"{out}_positions")], name=f"{out}_mapped")
    points_last = importer.emit("permute", [grid], {"dims": (0, 2, 1)}, name=f"{out}_points_first")
    return [importer.emit("reshape", [points_last], {"shape": (size[0], *spatial, len(spatial))}, name=out)]


@converts("TopK", attributes=("k", "axis", "largest", "sorted"), constant_inputs=(1,))
def _top_k(importer: Importer, node, xs, attrs):
    """Values and int64 indices of the k largest (smallest) along the axis, the lower index first among equals:
    the first k of a stable sort, each output read its own sort."""
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", -1) % len(shape)
    k = importer.ints(node, xs, attrs, "k", 1)[0]
    order = {"dim": axis, "descending": bool(attrs.get("largest", 1)), "stable": True}
    outputs = []
    for index, name in enumerate(node.output[:2]):
        if name not in importer.used:
            outputs.append(None)
            continue
        ranked = importer.emit("sort", [xs[0]], order | {"output": index}, name=f"{name}_sorted")
        outputs.append(importer.emit("slice", [ranked], {"dim": axis, "start": 0, "end": k, "step": 1}, name=name))
    return outputs


SCATTER_REDUCTIONS = {"none": "none", "add": "sum", "mul": "prod", "max": "amax", "min": "amin"}  # ONNX's -> the IR's


def _scatter_reduction(attrs) -> str:
    reduction = attrs.get("reduction", "none")
    if reduction not in SCATTER_REDUCTIONS:
        raise Unsupported(f"reduction {reduction!r}")
    return SCATTER_REDUCTIONS[reduction]


@converts("ScatterElements", "Scatter", attributes=("axis", "reduction"))
def _scatter_elements(importer: Importer, node, xs, attrs):
    """data with updates[p] written (or reduced) at p with its `axis` coordinate replaced by indices[p] (negative
    ones from the end)."""
    data, indices, updates = xs[:3]
    out = node.output[0]
    shape = importer.type(data).shape
    axis = attrs.get("axis", 0) % len(shape)
    wrapped = _wrapped(importer, indices, torch.tensor(shape[axis]), out)
    return [importer.emit("scatter", [data, wrapped, updates], {"dim": axis, "reduce": _scatter_reduction(attrs),
                                                                "include_self": True}, name=out)]


@converts("ScatterND", attributes=("reduction",))
def _scatter_nd(importer: Importer, node, xs, attrs):
    """data[indices[..., 0], ..., indices[..., q-1]] = updates[...] (or reduced into it): a scatter along the rows
    of data seen as [the q indexed dims, the rest], each update's row at the flat index of its q indices."""
    data, indices, updates = xs[:3]
    out = node.output[0]
    shape, index_shape = importer.type(data).shape, importer.type(indices).shape
    depth = index_shape[-1]
    indexed, rest = shape[:depth], math.prod(shape[depth:])
    count = math.prod(index_shape[:-1])
    rows = importer.emit("reshape", [data], {"shape": (math.prod(indexed), rest)}, name=f"{out}_rows")
    wrapped = _wrapped(importer, indices, torch.tensor(indexed), out)
    strides = importer.add_constant(torch.tensor(_strides(indexed), dtype=torch.int64), f"{out}_strides")
    flat_index = importer.emit("sum", [importer.emit("mul", [wrapped, strides], name=f"{out}_terms")],
                               {"dims": [len(index_shape) - 1], "keepdim": False}, name=f"{out}_index")
    column = importer.emit("reshape", [flat_index], {"shape": (count, 1)}, name=f"{out}_column")
    at = importer.emit("expand", [column], {"shape": (count, rest)}, name=f"{out}_at")
    values = importer.emit("reshape", [updates], {"shape": (count, rest)}, name=f"{out}_values")
    scattered = importer.emit("scatter", [rows, at, values], {"dim": 0, "reduce": _scatter_reduction(attrs),
                                                             "include_self": True}, name=f"{out}_scattered")
    return [importer.emit("reshape", [scattered], {"shape": shape}, name=out)]


@converts("MaxUnpool", attributes=("kernel_shape", "pads", "strides"), constant_inputs=(2,))
def _max_unpool(importer: Importer, node, xs, attrs):
    """X's values written at MaxPool's flat indices into zeros of the unpooled shape (each spatial size (in - 1) *
    stride + kernel - its pads), padded with zeros at the end of each dim to the output shape a third input gives."""
    x, indices = xs[:2]
    out = node.output[0]
    shape = importer.type(x).shape
    spatial = len(shape) - 2
    kernel = list(attrs["kernel_shape"])
    strides = list(attrs.get("strides") or [1] * spatial)
    pads = list(attrs.get("pads") or [0] * (2 * spatial))
    unpooled = shape[:2] + tuple((shape[2 + d] - 1) * strides[d] + kernel[d] - pads[d] - pads[spatial + d]
                                 for d in range(spatial))
    given = importer.ints(node, xs, attrs, "output_shape", 2) if len(xs) > 2 and xs[2] else None
    wanted = tuple(given) if given is not None else unpooled
    if len(wanted) != len(unpooled) or any(w < u for w, u in zip(wanted, unpooled)):
        raise Unsupported(f"output shape {wanted} smaller than the unpooled {unpooled}")
    zeros = importer.add_constant(torch.zeros(math.prod(unpooled), dtype=torch_dtype(importer.type(x).dtype)),
                                  f"{out}_zeros")
    at = as_int64(importer, _flat(importer, indices, f"{out}_indices"), f"{out}_at")
    flat = importer.emit("scatter", [zeros, at, _flat(importer, x, out)], {"dim": 0, "reduce": "none",
                                                                          "include_self": True}, name=f"{out}_flat")
    if wanted == unpooled:
        return [importer.emit("reshape", [flat], {"shape": unpooled}, name=out)]
    y = importer.emit("reshape", [flat], {"shape": unpooled}, name=f"{out}_unpooled")
    ends = [p for d in reversed(range(len(wanted))) for p in (0, wanted[d] - unpooled[d])]
    return [importer.emit("pad", [y], {"pads": tuple(ends), "value": 0.0}, name=out)]


@converts("TensorScatter", attributes=("axis", "mode"))
def _tensor_scatter(importer: Importer, node, xs, attrs):
    """The cache with the update written along `axis` (not the batch) at write_indices[b] + i for the update's
    position i in batch row b (write_indices absent: 0); "circular" wraps past the cache's length."""
    cache, update = xs[:2]
    out = node.output[0]
    shape, size = importer.type(cache).shape, importer.type(update).shape
    axis = attrs.get("axis", -2) % len(shape)
    mode = attrs.get("mode", "linear")
    if mode not in ("linear", "circular") or axis == 0:
        raise Unsupported(f"mode {mode!r} along axis {axis}")
    at = importer.add_constant(torch.arange(size[axis]).reshape([size[axis] if d == axis else 1
                                                                 for d in range(len(size))]), f"{out}_steps")
    if len(xs) > 2 and xs[2]:
        starts = importer.emit("reshape", [as_int64(importer, xs[2], f"{out}_starts")],
                               {"shape": (size[0],) + (1,) * (len(size) - 1)}, name=f"{out}_starts")
        at = importer.emit("add", [starts, at], name=f"{out}_positions")
    if mode == "circular":
        length = importer.add_constant(torch.tensor(shape[axis]), f"{out}_length")
        laps = importer.emit("mul", [importer.emit("trunc_div", [at, length], name=f"{out}_laps"), length],
                             name=f"{out}_lapped")
        at = importer.emit("sub", [at, laps], name=f"{out}_wrapped")
    at = importer.emit("expand", [at], {"shape": size}, name=f"{out}_at")
    return [importer.emit("scatter", [cache, at, update], {"dim": axis, "reduce": "none", "include_self": True},
                          name=out)]


GRID_MODES = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
              "cubic": "bicubic"}   # opset 16's words and opset 20's -> torch's


@converts("GridSample", attributes=("align_corners", "mode", "padding_mode"))
def _grid_sample(importer: Importer, node, xs, attrs):
    mode = attrs.get("mode", "bilinear")
    padding = attrs.get("padding_mode", "zeros")
    if mode not in GRID_MODES or padding not in ("zeros", "border", "reflection"):
        raise Unsupported(f"mode {mode!r} with padding mode {padding!r}")
    rank = len(importer.type(xs[0]).shape)
    if rank not in (4, 5) or rank == 5 and GRID_MODES[mode] == "bicubic":
        raise Unsupported(f"{mode} sampling of a {rank}-d input (torch samples 4-d inputs, and 5-d ones but not "
                          "cubically)")
    return [importer.emit("grid_sample", xs[:2], {"mode": GRID_MODES[mode], "padding_mode": padding,
                                                  "align_corners": bool(attrs.get("align_corners", 0))},
                          name=node.output[0])]
