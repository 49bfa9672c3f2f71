"""ATen handlers of the anchor ops (`opfuse.frontend.aten_ops`): convolutions, linear layers and matmuls (einsum
among them) and attention, the ops a fusion group forms around.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from opfuse.frontend.aten_common import (Handler, MultiOutput, Unmapped, first_output, pair, permuted, registrar,
                                         reshaped, single, tensor_value, triple)
from opfuse.frontend.conv3d import conv3d_as_conv2d

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)


@maps("conv1d")
def _conv1d(t: Translator, a: dict) -> str:
    """A 1-D convolution of [N, C, L] as the 2-D one of [N, C, 1, L] with a [Co, Ci/g, 1, K] weight (reshapes, no
    copy; the weight's folds into a constant): the conv templates take it, the same arithmetic."""
    x, weight = t.value(a["input"]), t.value(a["weight"])
    if t.rank(x) != 3:
        raise Unmapped("an unbatched 1-D convolution")
    n, c, length = t.type_of(x).shape
    w_shape = list(t.type_of(weight).shape)
    padding = a["padding"]
    if padding == "same":
        total = single(a["dilation"]) * (w_shape[2] - 1)
        if total % 2:
            raise Unmapped("'same' padding that is not symmetric")
        padding = total // 2
    elif padding == "valid":
        padding = 0
    image = t.emit("reshape", [x], {"shape": [n, c, 1, length]})
    kernel = t.emit("reshape", [weight], {"shape": w_shape[:2] + [1, w_shape[2]]})
    inputs = [image, kernel] + ([a["bias"]] if a["bias"] is not None else [])
    y = t.emit("conv2d", inputs, {"stride": (1, single(a["stride"])), "padding": (0, single(padding)),
                                  "dilation": (1, single(a["dilation"])), "groups": int(a["groups"])})
    return t.emit("reshape", [y], {"shape": list(t.out_type.shape)})


@maps("conv2d", "convolution", "_convolution")
def _conv2d(t: Translator, a: dict) -> str:
    if a.get("transposed"):
        raise Unmapped("transposed convolution")
    if t.rank(a["input"]) == 3 and t.op_name != "conv2d" and len(list(a["stride"])) == 1:
        return _conv1d(t, a)
    if t.rank(a["input"]) == 5 and t.op_name != "conv2d":
        return _conv3d(t, a)
    if t.rank(a["input"]) != 4:
        raise Unmapped("only 1-D, 2-D and 3-D convolutions of batched inputs map to conv2d")
    stride, dilation, padding = pair(a["stride"]), pair(a["dilation"]), a["padding"]
    if padding == "valid":
        padding = 0
    elif padding == "same":
        kernel = t.type_of(t.value(a["weight"])).shape[2:]
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if any(p % 2 for p in total):
            raise Unmapped("'same' padding that is not symmetric")
        padding = [p // 2 for p in total]
    inputs = [a["input"], a["weight"]] + ([a["bias"]] if a["bias"] is not None else [])
    return t.emit("conv2d", inputs, {"stride": stride, "padding": pair(padding), "dilation": dilation,
                                     "groups": int(a["groups"])})


@maps("conv3d")
def _conv3d(t: Translator, a: dict) -> str:
    """A 3-D convolution as a 2-D one over two of its spatial dims (`opfuse.frontend.conv3d`)."""
    x, weight = t.value(a["input"]), t.value(a["weight"])
    if t.rank(x) != 5:
        raise Unmapped("an unbatched 3-D convolution")
    stride, dilation, padding = triple(a["stride"]), triple(a["dilation"]), a["padding"]
    kernel = t.type_of(weight).shape[2:]
    if padding == "valid":
        padding = [0, 0, 0]
    elif padding == "same":
        total = [d * (k - 1) for d, k in zip(dilation, kernel)]
        if any(p % 2 for p in total):
            raise Unmapped("'same' padding that is not symmetric")
        padding = [p // 2 for p in total]
    bias = t.value(a["bias"]) if a["bias"] is not None else None
    return conv3d_as_conv2d(t.emit, t.emit, x, t.type_of(x).shape, weight, t.type_of(weight).shape, bias, stride,
                            triple(padding), dilation, int(a["groups"]))


@maps("linear")
def _linear(t: Translator, a: dict) -> str:
    return t.emit("linear", [a["input"], a["weight"]] + ([a["bias"]] if a["bias"] is not None else []))


@maps("addmm")
def _addmm(t: Translator, a: dict) -> str:
    if a["beta"] != 1 or a["alpha"] != 1:
        raise Unmapped("addmm with beta or alpha other than 1")
    bias = t.value(a["self"])
    if len(t.type_of(bias).shape) != 1:
        return t.emit("add", [t.emit("matmul", [a["mat1"], a["mat2"]]), bias])
    weight = t.value(a["mat2"])
    source = t.graph[weight]
    if source.op == "permute" and list(source.attrs["dims"]) == [1, 0]:
        weight = source.inputs[0]  # mat2 is W.t(): take W itself (linear wants [N, K])
    else:
        weight = t.emit("permute", [weight], {"dims": [1, 0]})
    return t.emit("linear", [a["mat1"], weight, bias])


@maps("mm", "bmm", "matmul")
def _matmul(t: Translator, a: dict) -> str:
    """x @ W with W a 2-D weight (a parameter, maybe transposed: Falcon's and GPT-J's ``x @ self.weight.T``) is a
    linear of W^T, whose kernel reads its input through views and takes a prologue; anything else a matmul."""
    x, other = t.value(a["self"]), t.value(a.get("mat2", a.get("other")))
    if t.rank(x) >= 2 and t.rank(other) == 2:
        source = t.graph[other]
        if source.op == "permute" and list(source.attrs["dims"]) == [1, 0] and t.graph.is_constant(source.inputs[0]):
            return t.emit("linear", [x, source.inputs[0]])
        if t.graph.is_constant(other):
            return t.emit("linear", [x, t.emit("permute", [other], {"dims": [1, 0]})])
    return t.emit("matmul", [x, other])


@maps("baddbmm", "addbmm")
def _baddbmm(t: Translator, a: dict) -> str:
    """beta * self + alpha * (batch1 @ batch2): a matmul whose scale and add are its epilogue (beta 0 ignores self,
    NaN included, as PyTorch does); addbmm also sums the products over the batch."""
    if t.op_name == "addbmm":
        raise Unmapped("addbmm sums over the batch")
    product = t.emit("matmul", [a["batch1"], a["batch2"]])
    alpha, beta = a.get("alpha", 1), a.get("beta", 1)
    if alpha != 1:
        product = t.emit("mul", [product, t.operand(alpha)])
    if beta == 0:
        return product
    base = a["self"] if beta == 1 else t.emit("mul", [a["self"], t.operand(beta)])
    return t.emit("add", [base, product])


@maps("einsum")
def _einsum(t: Translator, a: dict) -> str:
    """One or two operands with an explicit output and no repeated letter within an operand: letters only one
    operand has and the output lacks are summed away first; then the two operands, permuted and reshaped to
    [batch, rows, K] and [batch, K, columns], are one batched matmul (a broadcast mul where nothing is contracted),
    reshaped and permuted to the output's letters (the batch letters kept as batch dims of the matmul)."""
    equation = a["equation"].replace(" ", "")
    if "..." in equation or "->" not in equation:
        raise Unmapped("einsum with an ellipsis or an implicit output")
    inputs, output = equation.split("->")
    specs = inputs.split(",")
    if len(specs) != len(a["tensors"]) or len(specs) > 2 or any(len(set(s)) != len(s) for s in specs + [output]):
        raise Unmapped("einsum of more than two operands, or with a diagonal")
    values = [t.value(x) for x in a["tensors"]]
    sizes: dict[str, int] = {}
    for spec, value in zip(specs, values):
        for letter, size in zip(spec, t.type_of(value).shape):
            if sizes.setdefault(letter, size) != size:
                raise Unmapped("einsum with broadcast letters")
    for i, spec in enumerate(specs):       # letters of this operand alone that the output lacks: summed away
        others = "".join(specs[:i] + specs[i + 1:]) + output
        alone = [d for d, letter in enumerate(spec) if letter not in others]
        if alone:
            values[i] = t.emit("sum", [values[i]], {"dims": alone, "keepdim": False})
            specs[i] = "".join(letter for letter in spec if letter in others)
    if len(specs) == 1:
        return permuted(t, values[0], [specs[0].index(letter) for letter in output])
    (sa, sb), (va, vb) = specs, values
    batch = [c for c in output if c in sa and c in sb]
    rows = [c for c in output if c in sa and c not in sb]
    columns = [c for c in output if c in sb and c not in sa]
    contracted = [c for c in sa if c in sb and c not in output]
    size = lambda letters: [sizes[c] for c in letters]      # noqa: E731
    count = lambda letters: math.prod(size(letters))        # noqa: E731
    va = permuted(t, va, [sa.index(c) for c in batch + rows + contracted])
    vb = permuted(t, vb, [sb.index(c) for c in batch + contracted + columns])
    if contracted:      # (the batch letters stay apart: merging them after a permute would copy)
        va = reshaped(t, va, size(batch) + [count(rows), count(contracted)])
        vb = reshaped(t, vb, size(batch) + [count(contracted), count(columns)])
        product = t.emit("matmul", [va, vb])
    else:       # an outer product per batch: broadcast
        va = reshaped(t, va, size(batch) + size(rows) + [1] * len(columns))
        vb = reshaped(t, vb, size(batch) + [1] * len(rows) + size(columns))
        product = t.emit("mul", [va, vb])
    letters = batch + rows + columns
    product = reshaped(t, product, size(letters))
    return permuted(t, product, [letters.index(c) for c in output])


@maps("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
      "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
      "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math")
def _sdpa(t: Translator, a: dict) -> str | MultiOutput:
    """Fewer key/value heads than query heads (enable_gqa) are the IR's grouped-query sdpa (`kv_heads_shared`)."""
    if a.get("dropout_p") or a.get("dropout_mask") is not None:
        raise Unmapped("attention with dropout")
    mask = a.get("attn_mask", a.get("attn_bias"))
    inputs = [a["query"], a["key"], a["value"]] + ([mask] if mask is not None else [])
    name = t.emit("sdpa", inputs, {"is_causal": bool(a.get("is_causal")), "scale": a.get("scale")})
    return name if tensor_value(t.node) is not None else first_output(t, name)
