"""The op registry: the one source of truth for what each IR op is, costs and computes.

Each `OpDef` declares the op's fusion kind (the planner's rules are written over kinds, TVM style), its FLOPs
and bytes read/written as functions of the input and output types, and a reference implementation in PyTorch.
The reference implementation is the op's semantics: the interpreter, shape inference (run on the ``meta``
device) and the fallback path for anything opfuse does not fuse all go through it.

Entry points: `get_op(name)`, `infer_type(op, input_types, attrs)`, `node_flops`, `node_bytes`. The cost formulas
are in `opfuse.ir.op_costs`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn.functional as F

from opfuse.ir.attrs import (ANY, DIM, DIMS, MAX_INT, SHAPE, SIZE, SPATIAL, Bool, Dtype, Float, Int, Ints, Optional,
                              Rule, Word)
from opfuse.ir.attention import kv_heads_shared, softcapped_sdpa
from opfuse.ir.graph import Graph, GraphError, Node, TensorType, torch_dtype
from opfuse.ir.op_costs import (Attrs, Types, attention_flops, conv2d_flops, conv_transpose_flops, embedding_bytes,
                                linear_flops, matmul_flops, per_input_element, per_output_element, pool_flops)


class FusionKind(str, Enum):
    """How an op may take part in fusion (after TVM's OpPatternKind)."""

    SOURCE = "source"          # graph input or constant: no kernel
    POINTWISE = "pointwise"    # out[i] = f(in[i]); one input tensor (plus scalars)
    BROADCAST = "broadcast"    # elementwise over inputs broadcast to the output shape
    INJECTIVE = "injective"    # each output element reads one input element: layout, gather, concat
    REDUCTION = "reduction"    # reduces over some axes: softmax, layer norm, mean, pooling
    ANCHOR = "anchor"          # compute-heavy op a group is built around: conv, gemm, attention
    OPAQUE = "opaque"          # anything else: runs through PyTorch, never fused

    @property
    def elementwise(self) -> bool:
        return self in (FusionKind.POINTWISE, FusionKind.BROADCAST)




@dataclass(frozen=True)
class OpDef:
    """What the compiler knows about one op."""

    name: str
    kind: FusionKind
    run: Callable[[list[torch.Tensor], Attrs], torch.Tensor]   # reference semantics
    flops: Callable[[Types, TensorType, Attrs], int] = lambda ins, out, attrs: 0
    bytes_read: Callable[[Types, TensorType, Attrs], int] | None = None   # default: every input once
    alias: bool = False       # a view: no kernel and no traffic when run unfused
    doc: str = ""
    # the attributes the op takes and what each may hold (`opfuse.ir.attrs`); ANY (None): not checked
    attrs: Mapping[str, Rule] | None = field(default_factory=dict)
    bytes_written: Callable[[Types, TensorType, Attrs], int] | None = None   # default: the whole output
    # an opaque-kind op that still gets a kernel, alone: the name of the template that runs it (`grouped_gemm`:
    # opfuse's own; `library`: a library call, as torch's sort) where it is no state written in place
    kernel: str | None = None

    def read_bytes(self, ins: Types, out: TensorType, attrs: Attrs) -> int:
        if self.alias or self.kind is FusionKind.SOURCE:
            return 0
        if self.bytes_read is not None:
            return self.bytes_read(ins, out, attrs)
        return sum(t.nbytes for t in ins)

    def written_bytes(self, ins: Types, out: TensorType, attrs: Attrs) -> int:
        if self.alias or self.kind is FusionKind.SOURCE:
            return 0
        if self.bytes_written is not None:
            return self.bytes_written(ins, out, attrs)
        return out.nbytes

    @property
    def launches_kernel(self) -> bool:
        """Whether running this op alone (unfused) costs a kernel launch."""
        return not self.alias and self.kind is not FusionKind.SOURCE


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name} registered twice")
    REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise GraphError(f"unknown IR op {name!r}") from None


# ---- reference implementations ---------------------------------------------------------------------

def _binary(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    return lambda xs, a: fn(xs[0], xs[1])


def _unary(fn: Callable[[torch.Tensor], torch.Tensor]):
    return lambda xs, a: fn(xs[0])


def _optional(xs: list[torch.Tensor], i: int) -> torch.Tensor | None:
    return xs[i] if len(xs) > i else None


def _run_conv2d(xs, a):
    return F.conv2d(xs[0], xs[1], _optional(xs, 2), a["stride"], a["padding"], a["dilation"], a["groups"])


def _run_conv_transpose(xs, a):
    transpose = {3: F.conv_transpose1d, 4: F.conv_transpose2d, 5: F.conv_transpose3d}[xs[0].dim()]
    return transpose(xs[0], xs[1], _optional(xs, 2), a["stride"], a["padding"], a["output_padding"], a["groups"],
                     a["dilation"])


def _run_batch_norm(xs, a):
    x, weight, bias, mean, var = xs
    return F.batch_norm(x, mean, var, weight, bias, training=False, eps=a["eps"])


def _run_sdpa(xs, a):
    """torch's sdpa; k and v with fewer heads (dim -3) than q are grouped-query attention (`kv_heads_shared`). With
    a softcap c (Gemma 2's), the scores S = q·kᵀ·scale become c·tanh(S / c) before the mask: written out in
    float32 (`opfuse.ir.attention.softcapped_sdpa`), as torch's sdpa has no such step."""
    if a.get("softcap"):
        return softcapped_sdpa(*xs[:3], xs[3] if len(xs) > 3 else None, a)
    grouped = any(kv_heads_shared(xs[0].shape, x.shape) > 1 for x in xs[1:3])
    return F.scaled_dot_product_attention(xs[0], xs[1], xs[2], attn_mask=_optional(xs, 3),
                                          is_causal=a.get("is_causal", False), scale=a.get("scale"),
                                          **({"enable_gqa": True} if grouped else {}))


def _run_clamp(xs, a):
    return torch.clamp(xs[0], a.get("min"), a.get("max"))


def _run_slice(xs, a):
    dim, start, end, step = a["dim"], a["start"], a["end"], a.get("step", 1)
    index = [slice(None)] * xs[0].dim()
    index[dim] = slice(start, end, step)
    return xs[0][tuple(index)]


def _run_rms_norm(xs, a):
    """In float32 at least, as the models that write it out upcast (x^2 of a float16 value overflows past 256)."""
    x = xs[0]
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    y = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + a["eps"])
    return (y * xs[1] if len(xs) > 1 else y).to(x.dtype)


def _run_scan(scan):
    def run(xs, a):
        dtype = a.get("dtype")
        return scan(xs[0], a["dim"], dtype=torch_dtype(dtype) if dtype is not None else None)
    return run


def _run_prod(xs, a):
    """torch.prod over each of `dims` in turn (it takes one dim at a time), the reduced dims kept or dropped."""
    x, dims = xs[0], sorted({d % xs[0].dim() for d in a["dims"]}, reverse=True)
    for dim in dims:
        x = torch.prod(x, dim, keepdim=True)
    return x if a.get("keepdim", False) else x.reshape([n for d, n in enumerate(x.shape) if d not in dims])


def _run_mean(xs, a):
    return torch.mean(xs[0], dim=a["dims"], keepdim=a.get("keepdim", False))


def _run_local_response_norm(xs, a):
    """ONNX's LRN: x / (bias + alpha / size * sum of x^2 over the channels c - floor((size-1)/2) to
    c + ceil((size-1)/2))^beta; PyTorch's local_response_norm centres an even window one channel earlier."""
    x = xs[0]
    size = a["size"]
    squares = x.float().pow(2).reshape(x.shape[0], 1, x.shape[1], -1)
    padded = F.pad(squares, (0, 0, (size - 1) // 2, size // 2))
    window_mean = F.avg_pool2d(padded, (size, 1), stride=1).reshape(x.shape)
    return (x.float() / (a["bias"] + a["alpha"] * window_mean).pow(a["beta"])).to(x.dtype)


def _run_take(xs, a):
    """numpy.take(x, indices, axis): negative indices count from the end of the axis."""
    x, indices, axis = xs[0], xs[1], a["axis"]
    flat = indices.reshape(-1).long()
    flat = torch.where(flat < 0, flat + x.shape[axis], flat)
    return torch.index_select(x, axis, flat).reshape(x.shape[:axis] + indices.shape + x.shape[axis + 1:])


UPSAMPLES = {("nearest", 1): torch.ops.aten.upsample_nearest1d, ("nearest", 2): torch.ops.aten.upsample_nearest2d,
             ("nearest", 3): torch.ops.aten.upsample_nearest3d,
             ("nearest-exact", 1): torch.ops.aten._upsample_nearest_exact1d,
             ("nearest-exact", 2): torch.ops.aten._upsample_nearest_exact2d,
             ("nearest-exact", 3): torch.ops.aten._upsample_nearest_exact3d,
             ("linear", 1): torch.ops.aten.upsample_linear1d, ("linear", 2): torch.ops.aten.upsample_bilinear2d,
             ("linear", 3): torch.ops.aten.upsample_trilinear3d, ("cubic", 2): torch.ops.aten.upsample_bicubic2d}
UPSAMPLE_TAPS = {"nearest": 0, "nearest-exact": 0, "linear": 2, "cubic": 4}     # weighted taps a dim (nearest: none)


def _run_upsample(xs, a):
    """PyTorch's upsample of the mode over the last 1 to 3 dims (its ATen call: `scales` are the scale factors it
    was given, which decide the source index, or None, where size in / size out does)."""
    x, size = xs[0], list(a["size"])
    if x.dim() - len(size) != 2:
        raise GraphError(f"upsample of {len(size)} spatial dims takes a tensor of {len(size) + 2}, not {x.dim()}")
    if (a["mode"], len(size)) not in UPSAMPLES:
        raise GraphError(f"{a['mode']} upsample of {len(size)} spatial dims: PyTorch has it in 2 only")
    scales = list(a.get("scales") or [None] * len(size))
    upsample = UPSAMPLES[(a["mode"], len(size))]
    if a["mode"] in ("linear", "cubic"):
        return upsample(x, size, a.get("align_corners", False), *scales)
    return upsample(x, size, *scales)


def sliding_windows(size: int, kernel: int, dilation: int, padding: int, stride: int) -> int:
    """How many windows of `kernel` taps `dilation` apart, `stride` apart, fit along a dim of `size` padded by
    `padding` on both sides (im2col's and col2im's block count along that dim)."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _run_im2col(xs, a):
    return torch.ops.aten.im2col(xs[0], a["kernel_size"], a["dilation"], a["padding"], a["stride"])


def _run_col2im(xs, a):
    return torch.ops.aten.col2im(xs[0], a["output_size"], a["kernel_size"], a["dilation"], a["padding"], a["stride"])


def _run_opaque(xs, a):
    fn = a.get("fn")
    if fn is None:
        raise GraphError(f"opaque op {a.get('target', '?')} has no PyTorch implementation; it can be "
                         "analysed but not run")
    return fn(xs)


# ---- the registry ----------------------------------------------------------------------------------

REDUCE_ATTRS = {"dims": DIMS, "keepdim": Bool()}
POOL_ATTRS = {"kernel_size": SPATIAL, "stride": Optional(SPATIAL), "padding": SPATIAL, "ceil_mode": Bool()}
MAX_POOL_ATTRS = POOL_ATTRS | {"dilation": SPATIAL}
AVG_POOL_ATTRS = POOL_ATTRS | {"count_include_pad": Bool()}
PAIR = Ints(Int(1, 1 << 20), 2)
WINDOW_ATTRS = {"kernel_size": PAIR, "dilation": PAIR, "padding": Ints(Int(0, 1 << 20), 2), "stride": PAIR}

S, P, B, I, R, A, O = (FusionKind.SOURCE, FusionKind.POINTWISE, FusionKind.BROADCAST, FusionKind.INJECTIVE,
                       FusionKind.REDUCTION, FusionKind.ANCHOR, FusionKind.OPAQUE)


def _source_not_runnable(xs, a):
    raise GraphError("input and constant nodes are not run")


register(OpDef("input", S, _source_not_runnable, doc="graph input"))
register(OpDef("constant", S, _source_not_runnable, doc="compile-time tensor (weights, scalars)"))
register(OpDef("state", S, _source_not_runnable, doc="the model's state (a KV cache): its tensor before the first "
               "call in graph.constants, its value after each call the node graph.state names"))

# anchors: inputs (x, weight[, bias]) with PyTorch's weight layouts
register(OpDef("conv2d", A, _run_conv2d, conv2d_flops,
               doc="attrs stride, padding, dilation (pairs), groups; inputs x[N,C,H,W], w[Co,Ci/g,Kh,Kw], bias?",
               attrs={"stride": SPATIAL, "padding": SPATIAL, "dilation": SPATIAL, "groups": Int(1, 1 << 20)}))
# no Triton template: runs through PyTorch (cuDNN), never fused
register(OpDef("conv_transpose", O, _run_conv_transpose, conv_transpose_flops,
               doc="1-D, 2-D or 3-D transposed convolution; attrs stride, padding, output_padding, dilation (one "
                   "per spatial dim), groups; inputs x[N,C,*spatial], w[C,Co/g,*kernel], bias?",
               attrs={"stride": SPATIAL, "padding": SPATIAL, "output_padding": SPATIAL, "dilation": SPATIAL,
                      "groups": Int(1, 1 << 20)}))
register(OpDef("linear", A, lambda xs, a: F.linear(xs[0], xs[1], _optional(xs, 2)), linear_flops,
               doc="inputs x[..., K], w[N, K], bias?[N]"))
register(OpDef("matmul", A, _binary(torch.matmul), matmul_flops, doc="batched matmul with broadcasting"))
register(OpDef("sdpa", A, _run_sdpa, attention_flops,
               doc="scaled dot-product attention; inputs q[..., H, Sq, D], k[..., Hkv, Sk, D], v[..., Hkv, Sk, Dv]"
                   "[, mask]; Hkv may divide H (grouped-query attention: `kv_heads_shared`); attrs is_causal, scale, "
                   "softcap (None or 0: none; c: the scores capped to c·tanh(S / c) before the mask)",
               attrs={"is_causal": Bool(), "scale": Optional(Float()), "softcap": Optional(Float())}))

# elementwise
register(OpDef("batch_norm", B, _run_batch_norm, per_output_element(2),
               doc="eval-mode batch norm; inputs x, weight, bias, running_mean, running_var; attrs eps",
               attrs={"eps": Float()}))
for _name, _fn in {"add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div}.items():
    register(OpDef(_name, B, _binary(_fn), per_output_element(1)))
register(OpDef("trunc_div", B, lambda xs, a: torch.div(xs[0], xs[1], rounding_mode="trunc"), per_output_element(1),
               doc="division rounded toward zero: integer division as C and ONNX do it"))
register(OpDef("floor_div", B, lambda xs, a: torch.div(xs[0], xs[1], rounding_mode="floor"),
               per_output_element(1), doc="division rounded toward minus infinity (torch.floor_divide)"))
register(OpDef("pow", B, _binary(torch.pow), per_output_element(4)))
register(OpDef("maximum", B, _binary(torch.maximum), per_output_element(1)))
for _name, _fn in {"lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq,
                   "ne": torch.ne}.items():
    register(OpDef(_name, B, _binary(_fn), per_output_element(1), doc="bool comparison, broadcast"))
register(OpDef("where", B, lambda xs, a: torch.where(xs[0], xs[1], xs[2]), per_output_element(1),
               doc="inputs condition (bool), value where true, value where false; broadcast"))
register(OpDef("minimum", B, _binary(torch.minimum), per_output_element(1)))
for _name, _fn, _cost in [
    ("relu", F.relu, 1), ("sigmoid", torch.sigmoid, 4), ("tanh", torch.tanh, 4), ("silu", F.silu, 5),
    ("hardswish", F.hardswish, 5), ("hardsigmoid", F.hardsigmoid, 4), ("erf", torch.erf, 8),
    ("exp", torch.exp, 4), ("log", torch.log, 4), ("sqrt", torch.sqrt, 2), ("rsqrt", torch.rsqrt, 2),
    ("neg", torch.neg, 1), ("abs", torch.abs, 1), ("reciprocal", torch.reciprocal, 1),
]:
    register(OpDef(_name, P, _unary(_fn), per_output_element(_cost)))
for _name, _fn, _cost in [
    ("square", torch.square, 1), ("mish", F.mish, 12), ("log_sigmoid", F.logsigmoid, 6), ("sin", torch.sin, 4),
    ("cos", torch.cos, 4), ("log1p", torch.log1p, 4), ("expm1", torch.expm1, 4), ("floor", torch.floor, 1),
    ("ceil", torch.ceil, 1), ("sign", torch.sign, 2), ("tan", torch.tan, 9), ("sinh", torch.sinh, 9),
    ("cosh", torch.cosh, 9), ("asinh", torch.asinh, 9), ("acosh", torch.acosh, 9), ("atanh", torch.atanh, 9),
    ("atan", torch.atan, 12), ("asin", torch.asin, 12), ("acos", torch.acos, 12), ("bitwise_not", torch.bitwise_not, 1),
]:
    register(OpDef(_name, P, _unary(_fn), per_output_element(_cost)))
for _name, _fn in {"bitwise_and": torch.bitwise_and, "bitwise_or": torch.bitwise_or,
                   "bitwise_xor": torch.bitwise_xor}.items():
    register(OpDef(_name, B, _binary(_fn), per_output_element(1), doc="on integers or bools, broadcast"))
register(OpDef("leaky_relu", P, lambda xs, a: F.leaky_relu(xs[0], a["negative_slope"]), per_output_element(2),
               doc="x if x > 0 else negative_slope * x; attrs negative_slope",
               attrs={"negative_slope": Float()}))
register(OpDef("softplus", P, lambda xs, a: F.softplus(xs[0], a["beta"], a["threshold"]), per_output_element(6),
               doc="log(1 + exp(beta * x)) / beta, x itself where beta * x > threshold; attrs beta, threshold",
               attrs={"beta": Float(), "threshold": Float(infinite=True)}))
register(OpDef("elu", P, lambda xs, a: torch.ops.aten.elu(xs[0], a["alpha"], a["scale"], a["input_scale"]),
               per_output_element(5),
               doc="scale * (x if x > 0 else alpha * (exp(input_scale * x) - 1)): ELU, SELU and CELU (input_scale "
                   "1 / alpha); attrs alpha, scale, input_scale",
               attrs={"alpha": Float(), "scale": Float(), "input_scale": Float()}))
register(OpDef("isinf", P, _unary(torch.isinf), per_output_element(1), doc="bool: |x| is infinite"))
register(OpDef("logical_not", P, _unary(torch.logical_not), per_output_element(1), doc="bool: x == 0"))
register(OpDef("gelu", P, lambda xs, a: F.gelu(xs[0], approximate=a.get("approximate", "none")),
               per_output_element(10), doc="attrs approximate: 'none' (erf) or 'tanh'",
               attrs={"approximate": Word(("none", "tanh"))}))
register(OpDef("clamp", P, _run_clamp, per_output_element(2), doc="attrs min, max (None for unbounded); relu6",
               attrs={"min": Optional(Float(infinite=True)), "max": Optional(Float(infinite=True))}))
register(OpDef("cast", P, lambda xs, a: xs[0].to(torch_dtype(a["dtype"])), per_output_element(0),
               doc="dtype conversion; attrs dtype", attrs={"dtype": Dtype()}))

# reductions
register(OpDef("softmax", R, lambda xs, a: torch.softmax(xs[0], a["dim"]), per_output_element(5),
               doc="attrs dim", attrs={"dim": DIM}))
register(OpDef("layer_norm", R, lambda xs, a: F.layer_norm(xs[0], a["normalized_shape"], _optional(xs, 1),
                                                          _optional(xs, 2), a["eps"]),
               per_output_element(8), doc="inputs x, weight?, bias?; attrs normalized_shape, eps",
               attrs={"normalized_shape": Ints(SIZE), "eps": Float()}))
register(OpDef("rms_norm", R, lambda xs, a: _run_rms_norm(xs, a), per_output_element(4),
               doc="x * rsqrt(mean(x^2 over the last dim) + eps) [* weight]; inputs x, weight?; attrs eps",
               attrs={"eps": Float()}))
register(OpDef("mean", R, _run_mean, per_input_element(1), doc="attrs dims, keepdim", attrs=REDUCE_ATTRS))
register(OpDef("prod", R, lambda xs, a: _run_prod(xs, a), per_input_element(1),
               doc="product over dims (1 over none); bool and integer inputs give int64, as torch.prod; attrs dims, "
                   "keepdim", attrs=REDUCE_ATTRS))
register(OpDef("any", R, lambda xs, a: torch.amax(xs[0] != 0, dim=a["dims"], keepdim=a.get("keepdim", False)),
               per_input_element(1), doc="bool: any element non-zero over dims; attrs dims, keepdim",
               attrs=REDUCE_ATTRS))
register(OpDef("sum", R, lambda xs, a: torch.sum(xs[0], dim=a["dims"], keepdim=a.get("keepdim", False)),
               per_input_element(1), doc="attrs dims, keepdim", attrs=REDUCE_ATTRS))
for _name, _fn in {"amax": torch.amax, "amin": torch.amin}.items():
    register(OpDef(_name, R, (lambda fn: lambda xs, a: fn(xs[0], dim=a["dims"], keepdim=a.get("keepdim", False)))(_fn),
                   per_input_element(1), doc="largest (smallest) element over dims, NaN if any is; attrs dims, "
                                             "keepdim", attrs=REDUCE_ATTRS))
SCAN_OPS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod}   # reductions that keep every element: running values
for _name, _scan in SCAN_OPS.items():
    register(OpDef(_name, R, _run_scan(_scan), per_output_element(1),
                   doc=f"inclusive prefix {_name[3:]} along dim (a scan: one row per index of the other dims, every "
                       f"element kept); bool and integer inputs give int64, as torch.{_name}; attrs dim, dtype "
                       f"(None: that rule; else the input is cast to it first, as torch.{_name}'s dtype= does)",
                   attrs={"dim": DIM, "dtype": Optional(Dtype())}))
register(OpDef("local_response_norm", O, _run_local_response_norm, lambda ins, out, a: (a["size"] + 4) * out.numel,
               doc="ONNX LRN over dim 1; attrs size, alpha, beta, bias",
               attrs={"size": Int(1, 1 << 20), "alpha": Float(), "beta": Float(), "bias": Float()}))
register(OpDef("max_pool2d", R, lambda xs, a: F.max_pool2d(xs[0], a["kernel_size"], a["stride"], a["padding"],
                                                          a["dilation"], a["ceil_mode"]),
               pool_flops, doc="attrs kernel_size, stride, padding, dilation, ceil_mode", attrs=MAX_POOL_ATTRS))
register(OpDef("avg_pool2d", R, lambda xs, a: F.avg_pool2d(xs[0], a["kernel_size"], a["stride"], a["padding"],
                                                          a["ceil_mode"], a["count_include_pad"]),
               pool_flops, doc="attrs kernel_size, stride, padding, ceil_mode, count_include_pad",
               attrs=AVG_POOL_ATTRS))
register(OpDef("max_pool3d", R, lambda xs, a: F.max_pool3d(xs[0], a["kernel_size"], a["stride"], a["padding"],
                                                          a["dilation"], a["ceil_mode"]),
               pool_flops, doc="attrs kernel_size, stride, padding, dilation (triples), ceil_mode",
               attrs=MAX_POOL_ATTRS))
register(OpDef("avg_pool3d", R, lambda xs, a: F.avg_pool3d(xs[0], a["kernel_size"], a["stride"], a["padding"],
                                                          a["ceil_mode"], a["count_include_pad"]),
               pool_flops, doc="attrs kernel_size, stride, padding (triples), ceil_mode, count_include_pad",
               attrs=AVG_POOL_ATTRS))
register(OpDef("adaptive_avg_pool2d", R, lambda xs, a: F.adaptive_avg_pool2d(xs[0], a["output_size"]),
               per_input_element(1), doc="attrs output_size", attrs={"output_size": Ints(SIZE)}))

# layout and gathers; views cost nothing when run unfused
register(OpDef("reshape", I, lambda xs, a: xs[0].reshape(a["shape"]), alias=True, doc="attrs shape",
               attrs={"shape": SHAPE}))
register(OpDef("permute", I, lambda xs, a: xs[0].permute(a["dims"]), alias=True, doc="attrs dims",
               attrs={"dims": DIMS}))
register(OpDef("expand", I, lambda xs, a: xs[0].expand(a["shape"]), alias=True, doc="attrs shape",
               attrs={"shape": SHAPE}))
register(OpDef("slice", I, _run_slice, alias=True, doc="attrs dim, start, end, step",
               attrs={"dim": DIM, "start": Optional(Int()), "end": Optional(Int()), "step": Int(1, MAX_INT)}))
register(OpDef("identity", I, lambda xs, a: xs[0], alias=True, doc="dropout in eval, Identity"))
register(OpDef("cat", I, lambda xs, a: torch.cat(xs, a["dim"]), doc="attrs dim", attrs={"dim": DIM}))
register(OpDef("roll", I, lambda xs, a: torch.roll(xs[0], a["shifts"], a["dims"]),
               doc="cyclic shift; attrs shifts, dims (lists of one length)",
               attrs={"shifts": Ints(), "dims": DIMS}))
register(OpDef("pad", I, lambda xs, a: F.pad(xs[0], a["pads"], value=a["value"]),
               doc="constant padding; attrs pads (F.pad's order: last dim's begin and end first), value",
               attrs={"pads": Ints(Int(), None), "value": Float(infinite=True, nan=True)}))
register(OpDef("upsample", I, _run_upsample, lambda ins, out, a: UPSAMPLE_TAPS[a["mode"]] ** len(a["size"])
               * 2 * out.numel,
               doc="x[N, C, *spatial] resampled to spatial size `size` (1 to 3 dims): mode nearest (source index "
                   "floor(i * scale)), nearest-exact (floor((i + 0.5) * scale)), linear (bilinear, trilinear: the "
                   "2^dims neighbours weighted) or cubic (bicubic, 2 dims: 4 taps a dim, Keys' kernel with A = "
                   "-0.75); scale is in / out, or 1 / the scale factor where `scales` gives one; attrs mode, size, "
                   "scales (per dim, or None), align_corners (linear, cubic)",
               attrs={"mode": Word(("nearest", "nearest-exact", "linear", "cubic")), "size": Ints(Int(1, MAX_INT)),
                      "scales": Optional(Ints(Optional(Float()))), "align_corners": Bool()}))
register(OpDef("unfold", I, lambda xs, a: xs[0].unfold(a["dim"], a["size"], a["step"]).contiguous(),
               doc="sliding windows (Tensor.unfold, a copy): dim's L positions become (L - size) // step + 1 windows "
                   "and a new last dim of size; out[..., i, ..., j] = x[..., i * step + j, ...]; attrs dim, size, step",
               attrs={"dim": DIM, "size": Int(1, MAX_INT), "step": Int(1, MAX_INT)}))
register(OpDef("im2col", I, _run_im2col,
               doc="F.unfold, sliding blocks as columns: x[N?, C, H, W] -> [N?, C * kh * kw, oh * ow], "
                   "out[n, (c * kh + i) * kw + j, p * ow + q] = x[n, c, p * sh - ph + i * dh, q * sw - pw + j * dw], "
                   "0 outside x (oh, ow: `sliding_windows`); attrs kernel_size, dilation, padding, stride (pairs)",
               attrs=WINDOW_ATTRS))
register(OpDef("col2im", I, _run_col2im, per_input_element(1),
               doc="F.fold, im2col's adjoint: x[N?, C * kh * kw, oh * ow] -> [N?, C, *output_size], each column "
                   "entry added at the image position im2col reads it from (padding dropped); attrs output_size, "
                   "kernel_size, dilation, padding, stride (pairs)",
               attrs={"output_size": Ints(Int(1, MAX_INT), 2)} | WINDOW_ATTRS))
register(OpDef("take", I, _run_take, bytes_read=embedding_bytes,
               doc="inputs x, indices (negative from the end); attrs axis: ONNX's Gather, numpy.take",
               attrs={"axis": DIM}))
register(OpDef("gather", I, lambda xs, a: torch.gather(xs[0], a["dim"], xs[1]), bytes_read=embedding_bytes,
               doc="inputs x, index (of the output's shape): x at index's value along dim, at each position of "
                   "index elsewhere (torch.gather); attrs dim", attrs={"dim": DIM}))
register(OpDef("embedding", I, lambda xs, a: F.embedding(xs[1], xs[0]), bytes_read=embedding_bytes,
               doc="inputs weight[V, D], indices"))

# a write into the model's state: runs through PyTorch, in place where it updates a state node (the compiled model's
# runtime); what it moves is the rows written, not the whole state
register(OpDef("index_copy", O, lambda xs, a: xs[0].index_copy(a["dim"], xs[1], xs[2]),
               bytes_read=lambda ins, out, a: ins[1].nbytes + ins[2].nbytes,
               bytes_written=lambda ins, out, a: ins[2].nbytes,
               kernel="library",
               doc="x with the slices `index` along dim replaced by src (a KV cache written at its positions); "
                   "inputs x, index (int64), src; attrs dim", attrs={"dim": DIM}))

register(OpDef("opaque", O, _run_opaque,
               doc="runs through PyTorch: attrs target (name), fn (callable on the input list), or none; pure "
                   "(fn is a deterministic function of its inputs: it may fold at compile time)", attrs=ANY))


# ---- per-node helpers ------------------------------------------------------------------------------

def along_channels(node: Node, position: int) -> bool:
    """Whether input `position` of `node` lies along dim 1 (the channels) instead of broadcasting from the right as
    other operands do: a batch norm's weight, bias, mean and variance, [C] vectors."""
    return node.op == "batch_norm" and position > 0


def infer_type(op: str, input_types: Sequence[TensorType], attrs: Attrs) -> TensorType:
    """Output type of `op` on inputs of these types, found by running its reference on the meta device. The answer
    is a function of the three, so it is kept where the attrs are plain values (`_INFERRED`): the verifier asks
    again for every node after every pass, and some references are slow even on meta tensors (batch norm:
    milliseconds)."""
    try:
        key = (op, tuple(input_types), _plain(attrs))
    except TypeError:     # an attr that is not a plain value (a callable): not kept
        return _infer_type(op, input_types, attrs)
    inferred = _INFERRED.get(key)
    if inferred is None:
        inferred = _infer_type(op, input_types, attrs)
        if len(_INFERRED) < _INFERRED_LIMIT:
            _INFERRED[key] = inferred
    return inferred


_INFERRED: dict[tuple, TensorType] = {}
_INFERRED_LIMIT = 1 << 16


def _plain(value: Any) -> tuple:
    """`value` as a hashable key of what it holds, each leaf with its type (1, 1.0 and True differ): a dict as its
    sorted items, a list or tuple as a tuple; TypeError for anything but numbers, strings, None and dtypes."""
    if isinstance(value, dict):
        return ("dict", tuple((k, _plain(v)) for k, v in sorted(value.items())))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_plain(v) for v in value))
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return (type(value).__name__, value)
    raise TypeError(f"not a plain attr value: {type(value).__name__}")


def _infer_type(op: str, input_types: Sequence[TensorType], attrs: Attrs) -> TensorType:
    fakes = [torch.empty(t.shape, dtype=torch_dtype(t.dtype), device="meta") for t in input_types]
    try:
        result = get_op(op).run(fakes, attrs)
    except GraphError:
        raise
    except Exception as error:  # the reference raised: the inputs do not fit the op
        raise GraphError(f"{op} cannot take inputs {[str(t) for t in input_types]} with {attrs}: {error}") \
            from error
    return TensorType.of(result)


def node_flops(graph: Graph, node: Node) -> int:
    return get_op(node.op).flops(graph.input_types(node), node.type, node.attrs)


def node_bytes(graph: Graph, node: Node) -> tuple[int, int]:
    """(bytes read, bytes written) when the node runs as its own kernel."""
    op = get_op(node.op)
    ins = graph.input_types(node)
    if op.alias and view_copies(graph, node):
        return node.type.nbytes, node.type.nbytes
    return op.read_bytes(ins, node.type, node.attrs), op.written_bytes(ins, node.type, node.attrs)


def kind_of(node: Node) -> FusionKind:
    return get_op(node.op).kind


# head dims up to which an sdpa's [B, H, S, D] output lies in memory with its heads inside its tokens ([B, S, H, D]):
# flash attention returns it so, and opfuse's attention kernel, which tiles these head dims, writes it so too
HEADS_INSIDE_TOKENS_HEAD_DIM = 128


def memory_order(graph: Graph, node: Node) -> tuple[int, ...]:
    """The dims of `node`'s value, outermost first, in the order its kernel lays them out in memory: a 4-D sdpa's
    heads inside its tokens (0, 2, 1, 3) where its head dims are at most HEADS_INSIDE_TOKENS_HEAD_DIM, so the head
    merge after it (transpose(1, 2).reshape(B, S, H * D)) is a view; row-major for every other value."""
    rank = len(node.type.shape)
    if node.op == "sdpa" and rank == 4 and \
            all(graph[i].type.shape[-1] <= HEADS_INSIDE_TOKENS_HEAD_DIM for i in node.inputs[:3]):
        return (0, 2, 1, 3)
    return tuple(range(rank))


def view_chain(graph: Graph, name: str) -> list[str]:
    """`name` and the views it is a view of (alias ops over a source), back to the first value that is none; empty
    where `name` is none."""
    chain = []
    while get_op(graph[name].op).alias and graph[name].inputs:
        chain.append(name)
        name = graph[name].inputs[0]
    return chain


def view_source(graph: Graph, name: str) -> Node:
    """The first node at or behind `name` that is no view: whose storage `name` shares."""
    chain = view_chain(graph, name)
    return graph[graph[chain[-1]].inputs[0]] if chain else graph[name]


def view_copies(graph: Graph, node: Node) -> bool:
    """Whether this alias op cannot be a view of its source, laid out as its kernel writes it (`memory_order`), so
    PyTorch copies it: a reshape of a permuted tensor, for example. Decided by replaying the chain of views on a
    meta tensor."""
    if node.op != "reshape":
        return False
    chain = [graph[name] for name in view_chain(graph, node.name)]
    current = view_source(graph, node.name)
    order = memory_order(graph, current)
    laid_out = torch.empty([current.type.shape[d] for d in order], dtype=torch_dtype(current.type.dtype),
                           device="meta")
    value = laid_out.permute([order.index(d) for d in range(len(order))])
    for step in reversed(chain):
        if step.op == "reshape":
            try:
                value = value.view(step.attrs["shape"])
            except RuntimeError:
                return step is node
        else:
            value = get_op(step.op).run([value] + [torch.empty(graph[i].type.shape, device="meta")
                                                   for i in step.inputs[1:]], step.attrs)
    return False


def launches_kernel(graph: Graph, node: Node) -> bool:
    """Whether the node, run alone through PyTorch, launches a kernel (views do not, unless they must copy)."""
    return get_op(node.op).launches_kernel or view_copies(graph, node)


# the ops that run alone, registered by a module of their own (it imports this one: last)
from opfuse.ir import ops_alone  # noqa: E402,F401
