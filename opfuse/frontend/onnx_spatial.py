"""ONNX converters of the sliding-window operators: Conv and the pools. Registered in
`opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import Converter, Unsupported, converts
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
    """(input, its stride, padding and dilation) of a 2-D conv or a 2-D or 3-D pool: ONNX's padding where PyTorch's
    symmetric one expresses it (for a pool, at most half the dilated window), else an explicit `pad` of the input
    by `pad_value` (None: unsupported) and no padding."""
    spatial = len(importer.type(xs[0]).shape) - 2
    if spatial not in ((2, 3) if pool else (2,)):
        raise Unsupported("only 2-D convolution and 1-D, 2-D or 3-D pooling are mapped")
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


@converts("Conv", attributes=("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"))
def _conv(importer: Importer, node, xs, attrs):
    x, window = _window(importer, xs, attrs, importer.type(xs[1]).shape[2:], pad_value=0.0)
    inputs = [x] + [w for w in xs[1:3] if w is not None]
    return [importer.emit("conv2d", inputs, {**window, "groups": attrs.get("group", 1)})]


# storage_order only changes the optional Indices output, which is not mapped
@converts("MaxPool", attributes=("auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads", "strides",
                                 "storage_order"))
def _max_pool(importer: Importer, node, xs, attrs):
    if len(importer.type(xs[0]).shape) == 3:
        return _pool_1d_as_2d(importer, node, xs, attrs, _max_pool)
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=float("-inf"), pool=True)
    pool = {"kernel_size": tuple(attrs["kernel_shape"]), **window, "ceil_mode": bool(attrs.get("ceil_mode", 0))}
    op = {2: "max_pool2d", 3: "max_pool3d"}[len(window["stride"])]
    return [_onnx_windows(importer, importer.emit(op, [x], pool), xs, attrs)]


def _pool_1d_as_2d(importer: Importer, node, xs, attrs, pool: Converter) -> list[str]:
    """A 1-D pool of [N, C, L] as the 2-D one of [N, C, 1, L], its window 1 high."""
    n, c, length = importer.type(xs[0]).shape
    x = importer.emit("reshape", [xs[0]], {"shape": (n, c, 1, length)})
    flat = {"kernel_shape": [1, *attrs["kernel_shape"]], "strides": [1, *attrs.get("strides", [1])],
            "dilations": [1, *attrs.get("dilations", [1])]}
    if "pads" in attrs:
        flat["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
    (pooled,) = pool(importer, node, [x], {**attrs, **flat})
    return [importer.emit("reshape", [pooled], {"shape": (n, c, importer.type(pooled).shape[3])})]


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
        return _pool_1d_as_2d(importer, node, xs, attrs, _average_pool)
    include_pad, ceil_mode = bool(attrs.get("count_include_pad", 0)), bool(attrs.get("ceil_mode", 0))
    x, window = _window(importer, xs, attrs, attrs["kernel_shape"], pad_value=0.0, pool=True)
    if any(d != 1 for d in window.pop("dilation")):
        raise Unsupported("dilated average pooling (PyTorch has none)")
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
