"""The experts' grouped GEMM of a mixture of experts, and the library calls of its routing: one kernel each.

`grouped_mm(x[S, K], w[E, K, N], ends[E])`: rows [ends[e-1], ends[e]) of x (sorted by expert, ends cumulative)
times w[e], the rows past ends[E-1] zero. One launch for every expert: program p along grid axis 0 finds its
group among E + 1 (the experts, then the rows past the last one, which it zeroes) by the prefix sum of the groups'
row tiles, ceil(rows / BLOCK_M) each, read from `ends` on the device. The grid holds ceil(S / BLOCK_M) + E + 1 row
tiles, as many as any split of S rows into E + 1 groups needs (each group wastes less than one tile); programs
past the groups' tiles do nothing. Nothing waits on the host: a CUDA graph holds it, where transformers' own loop
reads the offsets back (`.tolist()`) and launches a GEMM per expert. Tiles: the anchor tile space
(`opfuse.fusion.tiles.anchor_tiles`) for a GEMM of an expert's average rows. With its gated product (a SwiGLU over
the output's two column halves, `opfuse.fusion.legality_anchors.gated_experts`) the kernel reads the weight's
halves interleaved and stores act(gate) * up (`opfuse.codegen.gemm.gated_code`), as a gated pair of linears does.

The routing ops (topk, sort, histc, index_copy; `OpDef.kernel` == "library") run as PyTorch's own CUDA kernels
(`LibraryKernel`), a launch each.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from opfuse.codegen.base import (FORM_LIBRARY, GroupKernel, KernelConfig, Outputs, compiled_info, kernel_name,
                                 load_kernel)
from opfuse.codegen.expr import Unsupported, refusal
from opfuse.codegen.gemm import gated_code, interleaved
from opfuse.codegen.template_kernel import INT32_LIMIT
from opfuse.fusion.legality_anchors import GatedExperts, gated_experts
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import INTERPRETER, anchor_tiles
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import Graph, Node, torch_dtype
from opfuse.ir.ops import get_op
from opfuse.ir.ops_alone import CALLS, call_of
from opfuse.numerics import dot_precision

GROUPED_GEMM_TEMPLATE = '''
import triton
import triton.language as tl


@triton.jit
def KERNEL_NAME(
    x_ptr, w_ptr, ends_ptr, out_ptr,
    S, N, K, E,
    s_xs, s_xk, s_we, s_wk, s_wn, s_os, s_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUPS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # group g < E: expert g's rows [ends[g - 1], ends[g]); group E: the rows past ends[E - 1], zeroed; beyond: none
    groups = tl.arange(0, GROUPS)
    ends = tl.minimum(tl.load(ends_ptr + groups, mask=groups < E, other=0).to(tl.int32), S)
    tail = tl.max(ends, 0)                      # the rows from the last end on are zeroed
    starts = tl.where(groups == 0, 0, tl.load(ends_ptr + groups - 1, mask=(groups >= 1) & (groups < E), other=0))
    starts = tl.where(groups == E, tail, tl.minimum(starts.to(tl.int32), S))
    ends = tl.where(groups < E, tl.maximum(ends, starts), tl.where(groups == E, S, starts))
    tiles = (ends - starts + BLOCK_M - 1) // BLOCK_M
    last_tile = tl.cumsum(tiles, 0)             # one past each group's last row tile
    pid = tl.program_id(0)
    group = tl.sum((last_tile <= pid).to(tl.int32), 0)
    mine = groups == group
    row_start = tl.sum(tl.where(mine, starts, 0), 0) + (pid - tl.sum(tl.where(mine, last_tile - tiles, 0), 0)) * BLOCK_M
    row_end = tl.where(group < GROUPS, tl.sum(tl.where(mine, ends, 0), 0), 0)
    expert = tl.minimum(group, E - 1)
    k_end = tl.where(group < E, K, 0)           # the rows past the experts' sum nothing: zeros

    offs_m = row_start + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * s_xs + offs_k[None, :] * s_xk
    w_ptrs = w_ptr + expert * s_we + offs_k[:, None] * s_wk + offs_n[None, :] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K * s_xk
        w_ptrs += BLOCK_K * s_wk
{product}
    out_ptrs = out_ptr + offs_m[:, None] * s_os + offs_n[None, :] * s_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])
'''

class GroupedGemmKernel(GroupKernel):
    """One grouped_mm node (module docstring), or with its gated product (`gated_experts`)."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, hw: HardwareProfile | None = None):
        node, self.gated = _grouped(graph, group, graph.users())
        self.node = node
        x, w, ends = (graph[name].type for name in node.inputs)
        (self.rows, self.k), (self.experts, _, self.n) = x.shape, w.shape
        source = GROUPED_GEMM_TEMPLATE.replace(     # a gated product as a gated pair of linears computes it
            "{product}\n", gated_code(graph, self.gated.activation) if self.gated else "")
        name, source, self.function = load_kernel("fused", [graph[n].op for n in group.nodes], source)
        super().__init__(graph, group, name, source)
        self.device = device
        self.constants = {v: graph.constants[v].to(device) for v in node.inputs if graph.is_constant(v)}
        if self.gated:      # the weight's halves interleaved: columns gate_j, up_j
            weight = self.constants[node.inputs[1]]
            self.constants[node.inputs[1]] = interleaved(*weight.split(self.n // 2, -1)).contiguous()
        self.output = self.gated.product if self.gated else node.name
        hw = kernel_profile(hw)
        average = max(1, self.rows // self.experts)
        tiles = [INTERPRETER] if hw.interpreted else anchor_tiles(average, self.n, self.k, 1, x.itemsize, hw=hw)
        self._configs = [KernelConfig.of(num_warps=t["num_warps"], num_stages=t["num_stages"], BLOCK_M=t["BLOCK_M"],
                                         BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"]) for t in tiles
                         if not self.gated or t["BLOCK_N"] % 32 == 0]     # half tiles of 16 columns or more
        if not self._configs:
            raise Unsupported(f"group {group.name}: no tile of 32 columns or more for the gated product",
                              Code.OPERAND_SHAPE)

    def configs(self) -> list[KernelConfig]:
        return list(self._configs)

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """(Stores its own outputs: `outputs` is not used.)"""
        config = config or self._configs[0]
        values = dict(zip(self.runtime_inputs, inputs)) | self.constants
        x, w, ends = (values[name] for name in self.node.inputs)
        output = self.graph[self.output].type
        out = torch.empty(output.shape, dtype=torch_dtype(output.dtype), device=x.device)
        grid = (triton.cdiv(self.rows, config["BLOCK_M"]) + self.experts + 1, triton.cdiv(self.n, config["BLOCK_N"]))
        compiled = self.function[grid](
            x, w, ends, out, self.rows, self.n, self.k, self.experts, *x.stride(), *w.stride(), *out.stride(),
            BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
            GROUPS=triton.next_power_of_2(self.experts + 1), PRECISION=dot_precision(False),
            num_warps=config.num_warps, num_stages=config.num_stages)
        self.last_compiled = compiled_info(compiled)
        return [out]


LIBRARY_CALL = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_LIBRARY)


class LibraryKernel(GroupKernel):
    """One op run as PyTorch's own kernel (`OpDef.kernel` == "library"): its reference implementation, a launch;
    or the outputs read of one call of several (`ops_alone.CALLS`: topk's values and indices), one call for all."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, hw: HardwareProfile | None = None):
        _one_call(graph, group)
        self.nodes = [graph[name] for name in group.nodes]
        self.node = first = self.nodes[0]
        source = f"# library call: {first.op} {call_of(first)[2]}"    # (one source for every call site)
        super().__init__(graph, group, kernel_name("library", [first.op], source), source)
        self.constants = {v: graph.constants[v].to(device) for v in first.inputs if graph.is_constant(v)}

    def configs(self) -> list[KernelConfig]:
        return [LIBRARY_CALL]

    def describe_library_form(self, config: KernelConfig | None = None) -> str:
        return f"{self.node.op} ({', '.join(n.name for n in self.nodes)}) as PyTorch's kernel"

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """(Stores its own outputs: `outputs` is not used.)"""
        values = dict(zip(self.runtime_inputs, inputs)) | self.constants
        operands = [values[name] for name in self.node.inputs]
        if len(self.nodes) == 1:
            return [get_op(self.node.op).run(operands, self.node.attrs)]
        results = CALLS[self.node.op](operands, self.node.attrs)
        by_name = {n.name: results[n.attrs["output"]] for n in self.nodes}
        return [by_name[name] for name in self.group.outputs]


def lower_grouped_gemm(graph: Graph, group: FusionGroup, device: torch.device,
                       hw: HardwareProfile | None = None) -> GroupKernel:
    return GroupedGemmKernel(graph, group, device, hw)


def supports_grouped_gemm(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """None where the grouped GEMM template takes `group`, else why not (`_grouped`'s checks)."""
    return refusal("grouped_gemm", lambda: _grouped(graph, group, graph.users() if users is None else users))


def _grouped(graph: Graph, group: FusionGroup, users) -> tuple[Node, GatedExperts | None]:
    """The group's grouped_mm and its gated product (None: alone); `Unsupported` where the template cannot take
    them: rows and weights of different or non-float dtypes, more elements than int32 offsets reach, other ops."""
    node = next(graph[n] for n in group.nodes if graph[n].op == "grouped_mm")
    x, w = (graph[name].type for name in node.inputs[:2])
    if x.dtype != w.dtype or x.dtype not in ("float16", "bfloat16", "float32"):
        raise Unsupported(f"{node.describe()}: a grouped GEMM of {x.dtype} rows and {w.dtype} weights",
                          Code.OPERAND_DTYPE)
    if max(x.numel, w.numel, node.type.numel) > INT32_LIMIT:
        raise Unsupported(f"{node.describe()}: more elements than the template's int32 offsets reach",
                          Code.OPERAND_SHAPE)
    gated = gated_experts(graph, node.name, users) if len(group.nodes) > 1 else None
    if len(group.nodes) > 1 and (gated is None or gated.nodes != set(group.nodes)):
        raise Unsupported(f"group {group.name}: a grouped GEMM takes only a gated product after it",
                          Code.EPILOGUE_FORM)
    return node, gated


def lower_library(graph: Graph, group: FusionGroup, device: torch.device,
                  hw: HardwareProfile | None = None) -> GroupKernel:
    return LibraryKernel(graph, group, device, hw)


def supports_library(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """None where the group is one library call (or outputs of one call), else why not."""
    return refusal("library", lambda: _one_call(graph, group))


def _one_call(graph: Graph, group: FusionGroup) -> None:
    first = graph[group.nodes[0]]
    if any(call_of(graph[n]) != call_of(first) for n in group.nodes[1:]):
        raise Unsupported(f"group {group.name}: library calls of ops that are no outputs of one call",
                          Code.SEVERAL_ANCHORS)
