"""The cost formulas of the op registry (`opfuse.ir.ops`): FLOPs, and bytes where an op reads less than its
inputs, as functions of the input types, the output type and the attrs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from opfuse.ir.graph import TensorType

Types = Sequence[TensorType]
Attrs = dict[str, Any]


def per_output_element(cost: int) -> Callable[[Types, TensorType, Attrs], int]:
    return lambda ins, out, attrs: cost * out.numel


def per_input_element(cost: int) -> Callable[[Types, TensorType, Attrs], int]:
    return lambda ins, out, attrs: cost * ins[0].numel


def conv2d_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    """2·N·Hout·Wout·Cout·(Cin/groups)·Kh·Kw (one multiply and one add per MAC; bias not counted)."""
    n, c_out, h_out, w_out = out.shape
    _, c_in_per_group, kh, kw = ins[1].shape
    return 2 * n * h_out * w_out * c_out * c_in_per_group * kh * kw


def conv_transpose_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    # every input element meets (C_out / groups) * the kernel's weights: weight [C_in, C_out / groups, *kernel]
    return 2 * ins[0].numel * math.prod(ins[1].shape[1:])


def linear_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    """2·M·N·K, M = rows of x, N = output features, K = input features."""
    k = ins[0].shape[-1]
    return 2 * out.numel * k


def matmul_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    """2·(batch·M·N)·K, K being the contracted dimension."""
    k = ins[0].shape[-1]
    return 2 * out.numel * k


def attention_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    """Q·Kᵀ and P·V (2·2·B·H·Sq·Sk·D) plus about 5 FLOPs per score for the softmax and scaling."""
    q, k = ins[0], ins[1]
    batch_heads = math.prod(q.shape[:-2])
    s_q, d = q.shape[-2], q.shape[-1]
    s_k = k.shape[-2]
    return batch_heads * (4 * s_q * s_k * d + 5 * s_q * s_k)


def pool_flops(ins: Types, out: TensorType, attrs: Attrs) -> int:
    return out.numel * math.prod(attrs["kernel_size"])


def embedding_bytes(ins: Types, out: TensorType, attrs: Attrs) -> int:
    """Only the gathered rows of the table are read, plus the indices (embedding, take, gather)."""
    return out.nbytes + ins[1].nbytes
