"""The ops that run alone (`OpDef.kernel`), registered into `opfuse.ir.ops.REGISTRY` when it is imported: never fused,
each a kernel of its own. A mixture of experts' experts as opfuse's grouped GEMM (`opfuse.codegen.grouped_gemm`); its
routing (topk, sort, histc), recurrent layers (an LSTM), scatters, grid sampling, determinants, bit casts, a max
pool's indices and
torchvision's RoI align and deformable convolution as library calls, PyTorch's own CUDA kernels (cuDNN's LSTM), which
read nothing back to the host, so a CUDA graph holds them. A (values, indices) or (output, h, c) call is one op per
output read, `output` naming which (`CALLS`); the planner puts the outputs read of one call in one group, which calls
it once (`opfuse.fusion.planner_horizontal.HorizontalFusion.call_outputs`).
"""

from __future__ import annotations

import torch

from opfuse.ir.attrs import DIM, MAX_INT, SPATIAL, Bool, Dtype, Float, Int, Word
from opfuse.ir.graph import torch_dtype
from opfuse.ir.op_costs import per_input_element, per_output_element, pool_flops
from opfuse.ir.ops import MAX_POOL_ATTRS, OpDef, FusionKind, register

O = FusionKind.OPAQUE


def _run_grouped_mm(xs, a):
    x, w, ends = xs
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=x.dtype, device=x.device)
    bounds = ends.tolist() if x.device.type != "meta" else []     # (shape inference: no values)
    for expert, (start, end) in enumerate(zip([0, *bounds[:-1]], bounds)):
        out[start:end] = x[start:end] @ w[expert]
    return out


# the calls of several outputs: the whole tuple, of which each op's reference reads its `output`
CALLS = {
    "topk": lambda xs, a: torch.topk(xs[0], a["k"], a["dim"], a["largest"], a["sorted"]),
    "sort": lambda xs, a: torch.sort(xs[0], dim=a["dim"], descending=a["descending"], stable=a["stable"]),
    "lstm": lambda xs, a: torch.lstm(xs[0], xs[1:3], xs[3:], a["has_biases"], a["num_layers"], 0.0, False,
                                     a["bidirectional"], a["batch_first"]),
}


def call_of(node) -> tuple:
    """What the nodes reading outputs of one call share: its op, inputs and attrs but `output`."""
    return (node.op, tuple(node.inputs), tuple(sorted((key, repr(value)) for key, value in node.attrs.items()
                                                      if key != "output")))


def _output_of(op: str):
    return lambda xs, a: CALLS[op](xs, a)[a["output"]]


def _run_scatter(xs, a):
    data, index, src = xs
    if a["reduce"] == "none":
        return torch.scatter(data, a["dim"], index, src)
    return torch.scatter_reduce(data, a["dim"], index, src, a["reduce"], include_self=a["include_self"])


GRID_MODES = ("bilinear", "nearest", "bicubic")      # torch.grid_sampler's interpolation_mode 0, 1, 2
GRID_PADDINGS = ("zeros", "border", "reflection")   # and its padding_mode 0, 1, 2


def _run_grid_sample(xs, a):
    return torch.nn.functional.grid_sample(xs[0], xs[1], a["mode"], a["padding_mode"], a["align_corners"])


def _lstm_flops(ins, out, a) -> int:
    """Its GEMMs: 2 per weight element per step and sequence (each weight matrix once a step, biases aside)."""
    x = ins[0].shape
    steps = x[0] * x[1] if len(x) == 3 else x[0]
    return 2 * steps * sum(w.numel for w in ins[3:] if len(w.shape) == 2)


register(OpDef("grouped_mm", O, _run_grouped_mm, lambda ins, out, a: 2 * out.numel * ins[0].shape[-1],
               kernel="grouped_gemm", doc="inputs x[S, K] (rows by expert), w[E, K, N], ends[E] (int, non-decreasing: "
               "each expert's end row); rows [ends[e-1], ends[e]) of out[S, N] are x's @ w[e], the rows past zero"))
register(OpDef("topk", O, _output_of("topk"), per_input_element(1), kernel="library",
               doc="torch.topk's values (output 0) or int64 indices (1)",
               attrs={"k": Int(0, MAX_INT), "dim": DIM, "largest": Bool(), "sorted": Bool(), "output": Int(0, 1)}))
register(OpDef("sort", O, _output_of("sort"), per_input_element(8), kernel="library",
               doc="torch.sort's values (output 0) or int64 indices (1)",
               attrs={"dim": DIM, "descending": Bool(), "stable": Bool(), "output": Int(0, 1)}))
register(OpDef("histc", O, lambda xs, a: torch.histc(xs[0], a["bins"], a["min"], a["max"]), per_input_element(1),
               kernel="library", doc="torch.histc over [min, max] (min < max)",
               attrs={"bins": Int(1, MAX_INT), "min": Float(), "max": Float()}))
register(OpDef("lstm", O, _output_of("lstm"), _lstm_flops, kernel="library",
               doc="torch.lstm in inference (no dropout): inputs x, h0, c0, then the weights and biases of each layer "
                   "and direction; output 0 (the sequence), 1 (h) or 2 (c)",
               attrs={"has_biases": Bool(), "num_layers": Int(1, MAX_INT), "bidirectional": Bool(),
                      "batch_first": Bool(), "output": Int(0, 2)}))
register(OpDef("scatter", O, _run_scatter, per_input_element(1), kernel="library",
               doc="inputs data, index (int64, >= 0, data's rank), src (index's shape): data with each src element "
                   "written (reduce 'none') or reduced (sum, prod, mean, amax, amin; include_self: data's value "
                   "counts) into its place along dim at index, as torch.scatter and torch.scatter_reduce",
               attrs={"dim": DIM, "reduce": Word(("none", "sum", "prod", "mean", "amax", "amin")),
                      "include_self": Bool()}))
register(OpDef("grid_sample", O, _run_grid_sample, per_output_element(16), kernel="library",
               doc="torch.nn.functional.grid_sample: inputs x[N, C, *spatial] and grid[N, *out, len(spatial)] (x, y(, "
                   "z) in [-1, 1])",
               attrs={"mode": Word(GRID_MODES), "padding_mode": Word(GRID_PADDINGS), "align_corners": Bool()}))
def _run_det(xs, a):
    x = xs[0]
    wide = x if x.dtype in (torch.float32, torch.float64) else x.float()    # (no LU in 16 bits)
    return torch.linalg.det(wide).to(x.dtype)


register(OpDef("det", O, _run_det, lambda ins, out, a: ins[0].numel * ins[0].shape[-1], kernel="library",
               doc="torch.linalg.det of x[..., n, n] (an LU factorisation, at least in float32): one determinant per "
                   "leading index"))
def _run_bitcast(xs, a):
    """x's bits as `dtype`, x first taken in `source`: with torch functions' overrides off, since a reference run's
    mode that keeps floats in its own precision (`opfuse.numerics.float_casts_to`) would widen that conversion."""
    with torch._C.DisableTorchFunction():
        x = xs[0].to(torch_dtype(a["source"]))
    return x.view(torch_dtype(a["dtype"])).clone()


register(OpDef("bitcast", O, _run_bitcast, per_output_element(0), kernel="library",
               doc="x's bits, of dtype `source`, read as `dtype` (of the same width), as Tensor.view(dtype); x is "
                   "taken in `source` first (a reference run holds floats wider, a float16 compile narrower)",
               attrs={"source": Dtype(), "dtype": Dtype()}))


def _run_max_pool2d_indices(xs, a):
    return torch.nn.functional.max_pool2d(xs[0], a["kernel_size"], a["stride"], a["padding"], a["dilation"],
                                          a["ceil_mode"], return_indices=True)[1]


register(OpDef("max_pool2d_indices", O, _run_max_pool2d_indices, pool_flops, kernel="library",
               doc="the int64 indices of max_pool2d's (attrs the same) largest element of each window, flattened over "
                   "its image plane (h * W + w), the first of ties, as PyTorch's max_pool2d(return_indices=True)",
               attrs=MAX_POOL_ATTRS))


def _run_roi_align(xs, a):
    from torchvision.ops import roi_align

    x, rois, batch = xs
    boxes = torch.cat([batch.to(rois.dtype)[:, None], rois], 1)     # torchvision's [K, 5]: index, x1, y1, x2, y2
    return roi_align(x, boxes, (a["height"], a["width"]), a["spatial_scale"], a["sampling_ratio"], a["aligned"])


def _run_deform_conv(xs, a):
    from torchvision.ops import deform_conv2d

    x, weight, offset = xs[:3]
    rest = iter(xs[3:])
    bias = next(rest) if a["has_bias"] else None
    mask = next(rest) if a["has_mask"] else None
    return deform_conv2d(x, offset, weight, bias, a["stride"], a["padding"], a["dilation"], mask)


register(OpDef("roi_align", O, _run_roi_align, per_output_element(16), kernel="library",
               doc="torchvision.ops.roi_align (average): inputs x[N, C, H, W], rois[K, 4] (x1, y1, x2, y2), "
                   "batch_indices[K]; out[K, C, height, width]; aligned: the pixel-centre shift of half a pixel",
               attrs={"height": Int(1, MAX_INT), "width": Int(1, MAX_INT), "spatial_scale": Float(),
                      "sampling_ratio": Int(0, MAX_INT), "aligned": Bool()}))
register(OpDef("deform_conv2d", O, _run_deform_conv,
               lambda ins, out, a: 2 * out.numel * ins[1].numel // ins[1].shape[0], kernel="library",
               doc="torchvision.ops.deform_conv2d: inputs x, weight, offset, then bias (has_bias) and mask "
                   "(has_mask); attrs stride, padding, dilation",
               attrs={"stride": SPATIAL, "padding": SPATIAL, "dilation": SPATIAL, "has_bias": Bool(),
                      "has_mask": Bool()}))
