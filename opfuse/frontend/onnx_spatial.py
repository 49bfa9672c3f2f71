"""ONNX converters of the sliding-window operators: Conv, ConvTranspose and the pools; DeformConv and RoiAlign as
torchvision's kernels (library calls, `opfuse.ir.ops_alone`). Registered in `opfuse.frontend.onnx_converters.CONVERTERS`
(see there for the converter contract).
"""

from __future__ import annotations

import itertools
import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from opfuse.frontend.conv3d import conv3d_as_conv2d
from opfuse.frontend.onnx_converters import Converter, Unsupported, converts
from opfuse.frontend.onnx_index import as_int64
from opfuse.ir.graph import torch_dtype
from opfuse.ir.ops import get_op

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


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
    """(input, its stride, padding and dilation) of a 2-D or 3-D conv or pool: ONNX's padding where PyTorch's
    symmetric one expresses it (for a pool, at most half the dilated window), else an explicit `pad` of the input
    by `pad_value` (None: unsupported) and no padding."""
    spatial = len(importer.type(xs[0]).shape) - 2
    if spatial not in (2, 3):
        raise Unsupported("only 1-D, 2-D and 3-D convolutions and pools are mapped")
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


def _as_2d(importer: Importer, node, xs, attrs, convert: Converter) -> list[str]:
    """A 1-D conv or pool of [N, C, L] as the 2-D one of [N, C, 1, L], its window (and weight) 1 high."""
    n, c, length = importer.type(xs[0]).shape
    x = importer.emit("reshape", [xs[0]], {"shape": (n, c, 1, length)})
    flat = {key: [1, *attrs[key]] for key in ("kernel_shape", "strides", "dilations", "output_padding",
                                              "output_shape") if key in attrs}
    if "pads" in attrs:
        flat["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
    inputs = [x, *xs[1:]]
    if node.op_type == "Conv":   # the weight [A, B, K] as [A, B, 1, K]
        inputs[1] = importer.emit("reshape", [xs[1]], {"shape": (*importer.type(xs[1]).shape[:2], 1,
                                                                  importer.type(xs[1]).shape[2])},
                                  name=f"{xs[1]}_2d")
    (result,) = convert(importer, node, inputs, {**attrs, **flat})
    out = importer.type(result).shape
    return [importer.emit("reshape", [result], {"shape": (out[0], out[1], out[3])})]


@converts("Conv", attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(importer: Importer, node, xs, attrs):
    if len(importer.type(xs[0]).shape) == 3:
        return _as_2d(importer, node, xs, attrs, _conv)
    x, window = _window(importer, xs, attrs, importer.type(xs[1]).shape[2:], pad_value=0.0)
    if len(importer.type(x).shape) == 5:    # as a 2-D conv (`opfuse.frontend.conv3d`)
        def step(op: str, inputs: list, attributes: dict) -> str:
            return importer.emit(op, inputs, attributes, name=f"{node.output[0]}_{op}")
        bias = xs[2] if len(xs) > 2 else None
        return [conv3d_as_conv2d(step, importer.emit, x, importer.type(x).shape, xs[1], importer.type(xs[1]).shape,
                                 bias, window["stride"], window["padding"], window["dilation"], attrs.get("group", 1))]
    inputs = [x] + [w for w in xs[1:3] if w is not None]
    return [importer.emit("conv2d", inputs, {**window, "groups": attrs.get("group", 1)})]


def _transposed_pads(attrs: dict, size, kernel, strides, dilations, output_padding) -> tuple[list[int], list[int]]:
    """ConvTranspose's cropping of its full output, (before each spatial dim, after it), as ONNX's reference
    computes it: from `pads`, else from `output_shape` or auto_pad SAME_* (the output `stride` times the input)."""
    rank = len(size)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    full = [s * (n - 1) + p + (k - 1) * d + 1
            for n, k, s, d, p in zip(size, kernel, strides, dilations, output_padding)]
    if "pads" in attrs or auto_pad not in ("SAME_UPPER", "SAME_LOWER"):
        if "pads" not in attrs and "output_shape" in attrs:   # the output's first output_shape elements
            return [0] * rank, [f - o for f, o in zip(full, attrs["output_shape"][-rank:])]
        pads = list(attrs.get("pads", [0] * 2 * rank))
        return pads[:rank], pads[rank:]
    target = attrs.get("output_shape", [n * s for n, s in zip(size, strides)])[-rank:]
    totals = [f - o for f, o in zip(full, target)]
    small, large = [t // 2 for t in totals], [t - t // 2 for t in totals]
    return (small, large) if auto_pad == "SAME_UPPER" else (large, small)


@converts("ConvTranspose", attributes=("auto_pad", "dilations", "group", "kernel_shape", "output_padding",
                                       "output_shape", "pads", "strides"))
def _conv_transpose(importer: Importer, node, xs, attrs):
    """PyTorch's conv_transpose (1-D to 3-D), whose padding crops each end equally; other cropping (or an output_padding
    PyTorch refuses) is the full output cropped or extended by a `pad` and the bias added after."""
    size, kernel = importer.type(xs[0]).shape[2:], importer.type(xs[1]).shape[2:]
    spatial = len(size)
    if spatial not in (1, 2, 3):
        raise Unsupported("only 1-D, 2-D and 3-D ConvTranspose are mapped")
    strides, dilations = tuple(attrs.get("strides", (1,) * spatial)), tuple(attrs.get("dilations", (1,) * spatial))
    extra = tuple(attrs.get("output_padding", (0,) * spatial))
    begin, end = _transposed_pads(attrs, size, kernel, strides, dilations, extra)
    window = {"stride": strides, "dilation": dilations, "groups": attrs.get("group", 1)}
    bias = xs[2] if len(xs) > 2 else None
    weights = [xs[1]] + ([bias] if bias is not None else [])
    # PyTorch: output_padding below the stride or the dilation, added at the end after cropping `padding`
    if all(b - e >= 0 and b - e < max(s, d) for b, e, s, d in zip(begin, end, strides, dilations)) and \
            all(b >= 0 for b in begin):
        padding = tuple(begin)
        output_padding = tuple(b - e + p for b, e, p in zip(begin, end, extra))
        if all(p < max(s, d) for p, s, d in zip(output_padding, strides, dilations)):
            return [importer.emit("conv_transpose", [xs[0], *weights],
                                  {**window, "padding": padding, "output_padding": output_padding})]
    zeros = (0,) * spatial
    full = importer.emit("conv_transpose", [xs[0], xs[1]], {**window, "padding": zeros, "output_padding": zeros},
                         name=f"{node.output[0]}_full")
    # a negative pad crops; output_padding adds rows no input reaches (only the bias)
    pads = tuple(v for b, e, p in zip(reversed(begin), reversed(end), reversed(extra)) for v in (-b, p - e))
    result = importer.emit("pad", [full], {"pads": pads, "value": 0.0},
                           name=node.output[0] if bias is None else f"{node.output[0]}_cropped")
    if bias is None:
        return [result]
    channels = importer.type(xs[1]).shape[1] * window["groups"]
    shaped = importer.emit("reshape", [bias], {"shape": (channels,) + (1,) * spatial}, name=f"{bias}_per_channel")
    return [importer.emit("add", [result, shaped])]


# storage_order only changes the optional Indices output, which is not mapped
@converts("MaxPool", attributes=("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides",
                                 "storage_order"))
def _max_pool(importer: Importer, node, xs, attrs):
    if len(importer.type(xs[0]).shape) == 3:
        return _as_2d(importer, node, xs, attrs, _max_pool)
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=float("-inf"), pool=True)
    pool = {"kernel_size": tuple(attrs["kernel_shape"]), **window, "ceil_mode": bool(attrs.get("ceil_mode", 0))}
    op = {2: "max_pool2d", 3: "max_pool3d"}[len(window["stride"])]
    values = _onnx_windows(importer, importer.emit(op, [x], pool), xs, attrs)
    if len(node.output) < 2 or node.output[1] not in importer.used:
        return [values]
    if op != "max_pool2d":
        raise Unsupported("the Indices of a MaxPool of other than 2-D images")
    indices = importer.emit("max_pool2d_indices", [x], pool, name=f"{node.output[1]}_in_plane")
    return [values, _onnx_indices(importer, _onnx_windows(importer, indices, xs, attrs), x, xs[0], node.output[1],
                                  attrs.get("storage_order", 0))]


def _onnx_indices(importer: Importer, plane: str, pooled: str, x: str, out: str, column_major: int) -> str:
    """ONNX's MaxPool Indices from PyTorch's (h * W + w over the plane of `pooled`, the input as padded): the position
    in x (its padding taken off), flattened over all of x, row-major (w * H + h in the plane with `storage_order`)."""
    n, c, h, w = importer.type(x).shape
    padded_w = importer.type(pooled).shape[3]
    left, top = importer.graph[pooled].attrs["pads"][0::2] if pooled != x else (0, 0)   # `_window`'s pad, if any

    def constant(value, suffix: str) -> str:
        return importer.add_constant(torch.tensor(value, dtype=torch.int64), f"{out}_{suffix}")

    width = constant(padded_w, "width")
    padded_row = importer.emit("floor_div", [plane, width], name=f"{out}_hp")
    padded_column = importer.emit("sub", [plane, importer.emit("mul", [padded_row, width], name=f"{out}_rows")],
                                  name=f"{out}_wp")
    row = importer.emit("sub", [padded_row, constant(top, "top")], name=f"{out}_h")
    column = importer.emit("sub", [padded_column, constant(left, "left")], name=f"{out}_w")
    major, minor, size = (column, row, h) if column_major else (row, column, w)
    in_plane = importer.emit("add", [importer.emit("mul", [major, constant(size, "size")], name=f"{out}_major"),
                                     minor], name=f"{out}_flat")
    planes = importer.add_constant((torch.arange(n * c) * (h * w)).reshape(n, c, 1, 1), f"{out}_planes")
    return importer.emit("add", [in_plane, planes], name=out)


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
        return _as_2d(importer, node, xs, attrs, _average_pool)
    include_pad, ceil_mode = bool(attrs.get("count_include_pad", 0)), bool(attrs.get("ceil_mode", 0))
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=0.0, pool=True)
    if any(d != 1 for d in window.pop("dilation")):
        return [_dilated_average_pool(importer, node, xs, attrs)]
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


def _dilated_average_pool(importer: Importer, node, xs, attrs) -> str:
    """A dilated AveragePool (opset 19 on; PyTorch has none): each window's sum divided by the count of its elements
    ONNX divides by (those inside the input, or with count_include_pad inside the input and its pads). A 2-D one sums
    by a depthwise conv2d; a 3-D one as the sum of its taps, each a strided slice of the input (index maps of one
    elementwise kernel). In ceil mode the input is first padded at the end so that the last windows fit."""
    shape = importer.type(xs[0]).shape
    spatial, out = len(shape) - 2, node.output[0]
    size, kernel = shape[2:], tuple(attrs["kernel_shape"])
    strides, dilations = tuple(attrs.get("strides", (1,) * spatial)), tuple(attrs["dilations"])
    begin, end = _pads(attrs, size, kernel, strides, dilations)
    spans = [(k - 1) * d + 1 for k, d in zip(kernel, dilations)]
    padded = [n + b + e for n, b, e in zip(size, begin, end)]
    rounding = math.ceil if attrs.get("ceil_mode", 0) else math.floor
    counts = [rounding((p - w) / s) + 1 for p, w, s in zip(padded, spans, strides)]
    if attrs.get("ceil_mode", 0):   # ONNX drops a last window that starts in the trailing padding
        counts = [c - 1 if (c - 1) * s >= n + b else c for c, s, n, b in zip(counts, strides, size, begin)]
    tail = [max((c - 1) * s + w - p, 0) for c, s, w, p in zip(counts, strides, spans, padded)]
    pads = tuple(v for d in reversed(range(spatial)) for v in (begin[d], end[d] + tail[d]))   # F.pad: last dim first
    x = importer.emit("pad", [xs[0]], {"pads": pads, "value": 0.0}, name=f"{out}_padded")
    dtype = torch_dtype(importer.type(xs[0]).dtype)
    taps = [tuple(slice(k * d, k * d + (c - 1) * s + 1, s) for k, d, c, s in zip(tap, dilations, counts, strides))
            for tap in itertools.product(*(range(k) for k in kernel))]
    if spatial == 2:
        window = {"stride": strides, "padding": (0, 0), "dilation": dilations}
        ones = torch.ones((shape[1], 1, *kernel), dtype=dtype)
        summed = importer.emit("conv2d", [x, importer.add_constant(ones, f"{out}_window")],
                               {**window, "groups": shape[1]}, name=f"{out}_sums")
        for dim, count in enumerate(counts, start=2):
            if importer.type(summed).shape[dim] != count:
                summed = importer.emit("slice", [summed], {"dim": dim, "start": 0, "end": count, "step": 1})
    else:
        summed = None
        for t, tap in enumerate(taps):
            part = x
            for dim, cut in enumerate(tap, start=2):
                part = importer.emit("slice", [part], {"dim": dim, "start": cut.start, "end": cut.stop,
                                                       "step": cut.step}, name=f"{out}_tap{t}_{dim}")
            summed = part if summed is None else importer.emit("add", [summed, part], name=f"{out}_sum{t}")
    counted = torch.zeros((1, 1, *(p + t for p, t in zip(padded, tail))), dtype=torch.float64)
    inside = [slice(0, p) for p in padded] if attrs.get("count_include_pad", 0) else \
        [slice(b, b + n) for b, n in zip(begin, size)]
    counted[(..., *inside)] = 1
    count = sum(counted[(..., *tap)] for tap in taps)
    return importer.emit("div", [summed, importer.add_constant(count.to(dtype), f"{out}_counts")])


@converts("GlobalMaxPool")
def _global_max_pool(importer: Importer, node, xs, attrs):
    rank = len(importer.type(xs[0]).shape)
    return [importer.emit("amax", [xs[0]], {"dims": list(range(2, rank)), "keepdim": True})]


@converts("LpPool", attributes=("auto_pad", "ceil_mode", "dilations", "kernel_shape", "p", "pads", "strides"))
def _lp_pool(importer: Importer, node, xs, attrs):
    """(sum of |x|^p over each window)^(1/p): |x|^p, zero-padded (padding adds nothing), summed by a depthwise
    conv2d of ones (3-D: the IR has no 3-D convolution, so an avg_pool3d counting the padding, times the window's
    size, undilated only), then the p-th root."""
    shape = importer.type(xs[0]).shape
    if len(shape) == 3:
        return _as_2d(importer, node, xs, attrs, _lp_pool)
    if len(shape) not in (4, 5):
        raise Unsupported("only 1-D, 2-D and 3-D LpPool are mapped")
    if attrs.get("ceil_mode", 0):
        raise Unsupported("LpPool in ceil mode")
    out = node.output[0]
    p = attrs.get("p", 2)
    x = xs[0]
    if p == 1:
        powered = importer.emit("abs", [x], name=f"{out}_abs")
    elif p == 2:
        powered = importer.emit("mul", [x, x], name=f"{out}_squares")
    else:
        powered = importer.emit("pow", [importer.emit("abs", [x], name=f"{out}_abs"), importer.scalar(float(p), x)],
                                name=f"{out}_powers")
    kernel = tuple(attrs["kernel_shape"])
    if len(shape) == 5:
        if any(d != 1 for d in attrs.get("dilations", (1, 1, 1))):
            raise Unsupported("dilated 3-D LpPool")
        padded, window = _window(importer, [powered], attrs, kernel, pad_value=0.0, pool=True)
        window.pop("dilation")
        pool = {"kernel_size": kernel, **window, "ceil_mode": False, "count_include_pad": True}
        averaged = importer.emit("avg_pool3d", [padded], pool, name=f"{out}_averages")
        summed = importer.emit("mul", [averaged, importer.scalar(float(math.prod(kernel)), averaged)],
                               name=f"{out}_sums")
    else:
        padded, window = _window(importer, [powered], attrs, kernel, pad_value=0.0)
        ones = torch.ones((shape[1], 1, *kernel), dtype=torch_dtype(importer.type(x).dtype))
        summed = importer.emit("conv2d", [padded, importer.add_constant(ones, f"{out}_window")],
                               {**window, "groups": shape[1]}, name=f"{out}_sums")
    if p == 1:
        return [importer.emit("identity", [summed], name=out)]
    if p == 2:
        return [importer.emit("sqrt", [summed], name=out)]
    return [importer.emit("pow", [summed, importer.scalar(1.0 / p, summed)], name=out)]


@converts("CausalConvWithState", attributes=("activation",))
def _causal_conv_with_state(importer: Importer, node, xs, attrs):
    """Opset 27's stateful causal depthwise conv1d: the past state (zeros without one) concatenated in front of the
    input along the length, a depthwise conv2d of it seen one high, the bias added and an optional SiLU; the
    present state is the last k - 1 positions of the concatenation."""
    x, weight = xs[:2]
    bias = xs[2] if len(xs) > 2 else None
    past = xs[3] if len(xs) > 3 else None
    out = node.output[0]
    activation = attrs.get("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise Unsupported(f"activation {activation!r}")
    n, c, length = importer.type(x).shape
    k = importer.type(weight).shape[2]
    if past is None:
        past = importer.add_constant(torch.zeros((n, c, k - 1), dtype=torch_dtype(importer.type(x).dtype)),
                                     f"{out}_no_past")
    padded = importer.emit("cat", [past, x], {"dim": 2}, name=f"{out}_padded") if k > 1 else x
    rows = importer.emit("reshape", [padded], {"shape": (n, c, 1, length + k - 1)}, name=f"{out}_rows")
    kernel = importer.emit("reshape", [weight], {"shape": (c, 1, 1, k)}, name=f"{out}_kernel")
    window = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": c}
    conv = importer.emit("conv2d", [rows, kernel] + ([bias] if bias is not None else []), window,
                         name=f"{out}_conv")
    result = importer.emit("reshape", [conv], {"shape": (n, c, length)}, name=f"{out}_flat" if activation != "none"
                           else out)
    if activation != "none":
        result = importer.emit("silu", [result], name=out)
    if k > 1:
        present = importer.emit("slice", [padded], {"dim": 2, "start": length, "end": length + k - 1, "step": 1},
                                name=f"{out}_present")
    else:   # no state to carry: an empty one
        present = importer.add_constant(torch.zeros((n, c, 0), dtype=torch_dtype(importer.type(x).dtype)),
                                        f"{out}_present")
    return [result, present]


@converts("Col2Im", attributes=("dilations", "pads", "strides"), constant_inputs=(1, 2))
def _col2im(importer: Importer, node, xs, attrs):
    """Sliding blocks [N, C * prod(block), L] summed back into an image [N, C, *image]: F.fold's col2im (an index
    map of the kernel that reads it) for 2-D images padded alike on both sides of each dim; otherwise a grouped
    transposed convolution (1-D to 3-D) whose weight puts block element k at its kernel position (one-hot, so the
    sums are of the blocks' own values), then ONNX's pads cropped (and any rows no block reaches added as zeros)."""
    x, out = xs[0], node.output[0]
    image = importer.ints(node, xs, {}, "image_shape", 1)
    block = importer.ints(node, xs, {}, "block_shape", 2)
    spatial = len(image)
    if spatial not in (1, 2, 3):
        raise Unsupported("Col2Im of other than 1 to 3 spatial dims")
    n, rows, length = importer.type(x).shape
    kernel = math.prod(block)
    channels = rows // kernel
    strides = tuple(attrs.get("strides", (1,) * spatial))
    dilations = tuple(attrs.get("dilations", (1,) * spatial))
    pads = list(attrs.get("pads", [0] * 2 * spatial))
    counts = [(size + pads[d] + pads[d + spatial] - dilation * (k - 1) - 1) // stride + 1
              for d, (size, k, stride, dilation) in enumerate(zip(image, block, strides, dilations))]
    if math.prod(counts) != length or channels * kernel != rows:
        raise Unsupported(f"{length} blocks for an image of {image} in blocks of {block}")
    if spatial == 2 and pads[:2] == pads[2:]:
        window = {"output_size": image, "kernel_size": block, "dilation": dilations, "padding": pads[:2],
                  "stride": strides}
        return [importer.emit("col2im", [x], {key: [int(v) for v in value] for key, value in window.items()},
                              name=out)]
    blocks = importer.emit("reshape", [x], {"shape": (n, rows, *counts)}, name=f"{out}_blocks")
    weight = torch.zeros((rows, 1, *block), dtype=torch_dtype(importer.type(x).dtype))
    for c in range(channels):
        for k in range(kernel):
            weight[(c * kernel + k, 0, *np.unravel_index(k, block))] = 1
    full = importer.emit("conv_transpose", [blocks, importer.add_constant(weight, f"{out}_placement")],
                         {"stride": strides, "padding": (0,) * spatial, "output_padding": (0,) * spatial,
                          "dilation": dilations, "groups": channels}, name=f"{out}_full")
    reached = importer.type(full).shape[2:]
    # the full image spans the padded one from its start: crop the leading pads, pad or crop its end to the image
    crop = tuple(v for d in reversed(range(spatial)) for v in (-pads[d], image[d] + pads[d] - reached[d]))
    if not any(crop):
        return [importer.emit("identity", [full], name=out)]
    return [importer.emit("pad", [full], {"pads": crop, "value": 0.0}, name=out)]


@converts("DeformConv", attributes=("dilations", "group", "kernel_shape", "offset_group", "pads", "strides"))
def _deform_conv(importer: Importer, node, xs, attrs):
    """torchvision's deform_conv2d: 2-D, symmetric pads; the groups and offset groups follow from the weight's and
    the offset's channels, as torchvision reads them."""
    x, weight, offset = xs[:3]
    bias = xs[3] if len(xs) > 3 and xs[3] else None
    mask = xs[4] if len(xs) > 4 and xs[4] else None
    if len(importer.type(x).shape) != 4:
        raise Unsupported("a deformable convolution of other than 2-D images")
    pads = list(attrs.get("pads") or [0, 0, 0, 0])
    if pads[:2] != pads[2:]:
        raise Unsupported(f"pads {pads} differ at the start and end of a dim")
    inputs = [x, weight, offset] + [v for v in (bias, mask) if v is not None]
    return [importer.emit("deform_conv2d", inputs, {
        "stride": tuple(attrs.get("strides") or (1, 1)), "padding": tuple(pads[:2]),
        "dilation": tuple(attrs.get("dilations") or (1, 1)), "has_bias": bias is not None,
        "has_mask": mask is not None}, name=node.output[0])]


@converts("RoiAlign", attributes=("coordinate_transformation_mode", "mode", "output_height", "output_width",
                                  "sampling_ratio", "spatial_scale"))
def _roi_align(importer: Importer, node, xs, attrs):
    """torchvision's roi_align: average mode only; half_pixel (opset 16's default) is its aligned form,
    output_half_pixel its unaligned one."""
    mode = attrs.get("mode", "avg")
    transform = attrs.get("coordinate_transformation_mode",
                          "half_pixel" if importer.opset >= 16 else "output_half_pixel")
    if mode != "avg":
        raise Unsupported(f"mode {mode!r} (torchvision's roi_align averages)")
    batch = as_int64(importer, xs[2], f"{node.output[0]}_batch")
    return [importer.emit("roi_align", [xs[0], xs[1], batch], {
        "height": int(attrs.get("output_height", 1)), "width": int(attrs.get("output_width", 1)),
        "spatial_scale": float(attrs.get("spatial_scale", 1.0)), "sampling_ratio": int(attrs.get("sampling_ratio", 0)),
        "aligned": transform == "half_pixel"}, name=node.output[0])]
