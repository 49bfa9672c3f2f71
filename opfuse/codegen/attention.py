"""Attention anchor kernels: a flash-style forward pass for groups anchored on `sdpa`, with a fused epilogue.

Entry point: `lower_attention(graph, group, device, hw)`. One program takes BLOCK_M query rows of one (batch, head)
and walks the keys in blocks of BLOCK_N with an online softmax (the running row maximum and sum, the accumulator
rescaled as the maximum grows; scores in base 2, `exp2`), so the Sq x Sk score matrix never leaves the chip:

    S = Q·Kᵀ · scale (c·tanh(S / c) with a softcap c) (+ additive mask, or -inf where a boolean mask or is_causal
        forbids)                                                                              [BLOCK_M, BLOCK_N]
    m' = max(m, rowmax S);  P = exp(S - m');  l = l·exp(m - m') + rowsum P
    acc = acc·exp(m - m') + P·V                                                               [BLOCK_M, D]
    out = acc / l   (0 for a row every key of which is masked, as torch's sdpa gives)

then the group's elementwise epilogue (`opfuse.codegen.epilogue`: the contract's acc, offs_n over the head dim,
b0/b1 over batch and heads) runs on the tile and stores it. Both products accumulate in float32; P is cast to V's
dtype for the second (fp16, bf16 or fp32 inputs; fp32 follows torch's matmul precision, as the GEMMs do).
is_causal is top-left aligned like torch's (query i sees keys 0..i, also where Sq != Sk), and a causal program stops
at its last visible key block. The mask (boolean: True attends; or float: added to the scores) is expanded to
[..., Sq, Sk] and read through its strides, so a [Sq, Sk] or [B, 1, 1, Sk] mask costs stride 0 on the broadcast
dims. Q, K and V are read through their strides (the head-split views before attention cost nothing). Q's and K's
head dim D and V's Dv may differ (LeViT's 16 and 32): each is padded to the next power of two (at least 16) and
masked, 64 and 128 need no padding; the accumulator and the epilogue's columns are Dv. K and V may have fewer heads
than Q (grouped-query attention, `opfuse.ir.ops.kv_heads_shared`): query head h reads key/value head h // (H / Hkv).

Count, per (batch, head), with D the head dim and b bytes per element:
  FLOPs:  4·Sq·Sk·D for the two products (half of it with is_causal) + about 5·Sq·Sk for scale, max, exp, sums
          (`opfuse.ir.op_costs.attention_flops`, the plan's count).
  Bytes:  Q read once, the output written once: 2·Sq·D·b; K and V read once per query block:
          2·ceil(Sq / BLOCK_M)·Sk·D·b, of which DRAM sees 2·Sk·D·b when the heads' K and V stay in L2; a mask
          Sq·Sk·(its bytes) per distinct (batch, head) it has. The unfused ops would also write and read the
          Sq·Sk scores and probabilities (4 passes of Sq·Sk·b): the kernel is compute bound from Sk of a few
          hundred on.

Output layout: [B, H, Sq, D] stored with the heads inside the tokens ([B, Sq, H, D] in memory), as torch's flash
attention returns it on a GPU, so the transformers' transpose(1, 2).reshape(B, Sq, H·D) before the output projection
is a view and the projection reads contiguous rows; every opfuse kernel reads its inputs through their strides, so
either layout is correct downstream.

Key slices (flash-decoding). Where the plan splits the keys (`FusionGroup.split_k`, by
`opfuse.fusion.tiles.key_split_table`: one query a head over a long cache leaves most SMs idle), each config runs
its tile's slices (SPLIT_K): slice s of a third grid axis walks its run of whole key blocks and stores its rows'
unnormalized output, running max and sum in float32 (`ATTENTION_SLICE_TEMPLATE`), and the last slice of each tile
to finish (a count a tile, kept by the kernel) rescales the slices to their common max, sums them in slice order
(the same every run), normalizes and runs the epilogue (`COMBINE_CODE`): one launch. The unsplit form of the first
split config is offered beside it.

Forms (`KernelConfig.form`). A group of the sdpa alone: first the library form (`TORCH_ATTENTION`: torch's
scaled_dot_product_attention, exactly as opfuse ran it before this kernel), then the Triton tiles. Untuned (tuning
off, or no GPU to time on) it runs PyTorch's flash/cuDNN attention, which is the safest for speed: this kernel is
only kept where the autotuner measures it faster. One launch either way, as the plan counts. A group with an
epilogue: first the Triton tiles (one kernel, as the plan counts it), and with `library` the unfused form (the sdpa
and the epilogue ops through PyTorch, what ran before) for the autotuner to measure against. The GEMMs' other library
form (the library's result, then a generated epilogue kernel) is not offered: that epilogue kernel reads a
contiguous result, and flash attention's is not, so it would cost a copy kernel too. An sdpa the template cannot
compute (head dims over MAX_HEAD_DIM: DaViT's channel attention over 3136 pixels; `_untiled`) is its
library form alone, a library call the plan keeps without an epilogue (`opfuse.fusion.legality.library_anchor_rule`)
and the analysis lists as one (`opfuse.codegen.lower.library_calls`).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton

from opfuse.codegen.base import FORM_LIBRARY, KernelConfig, Outputs, compiled_info
from opfuse.codegen.epilogue import Epilogue, TileLayout, compute_dtype, generate_kernel, siblings_and_chains
from opfuse.codegen.expr import Unsupported, refusal
from opfuse.codegen.forms import UNFUSED, EpilogueKernel
from opfuse.codegen.split_k import LAST_ARRIVAL, ArrivalCounts, planned_slices, sliced_template, slices_of, unsplit
from opfuse.fusion.legality_common import Users
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import estimate_resources
from opfuse.fusion.tiles import ATTENTION_TILES, INTERPRETED_ATTENTION, MAX_HEAD_DIM, attention_key
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import Graph
from opfuse.ir.ops import get_op, kv_heads_shared, memory_order
from opfuse.numerics import dot_precision

LOG2E = 1.4426950408889634
# the mask input, as the template's MASK constexpr reads it
NO_MASK, BOOLEAN_MASK, ADDITIVE_MASK = 0, 1, 2
INTERPRETER_TILE = KernelConfig.of(**INTERPRETED_ATTENTION)
# the library form of a bare sdpa: torch's attention picks its own kernel, so the config has no tile
TORCH_ATTENTION = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_LIBRARY)

ATTENTION_TEMPLATE = '''
import triton
import triton.language as tl


@triton.jit
def KERNEL_NAME(
    q_ptr, k_ptr, v_ptr, m_ptr,
    M, N_KEYS, D, DV, B1, qk_scale, softcap,
    s_qb0, s_qb1, s_qm, s_qd,
    s_kb0, s_kb1, s_kn, s_kd,
    s_vb0, s_vb1, s_vn, s_vd,
    s_mb0, s_mb1, s_mm, s_mn,
    {params}
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    CAUSAL: tl.constexpr, MASK: tl.constexpr, PRECISION: tl.constexpr, K_SHARED: tl.constexpr,
    V_SHARED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_b = tl.program_id(1)
    b0 = pid_b // B1
    b1 = pid_b % B1
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)          # q's and k's head dim
    offs_n = tl.arange(0, BLOCK_DV)         # v's head dim: the epilogue's columns
    offs_key = tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_d = offs_d < D
    mask_n = offs_n < DV

    q = tl.load(q_ptr + b0 * s_qb0 + b1 * s_qb1 + offs_m[:, None] * s_qm + offs_d[None, :] * s_qd,
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b0 * s_kb0 + (b1 // K_SHARED) * s_kb1     # grouped-query attention: query head b1 reads
    v_base = v_ptr + b0 * s_vb0 + (b1 // V_SHARED) * s_vb1     # key/value head b1 // (query heads per kv head)
    m_base = m_ptr + b0 * s_mb0 + b1 * s_mb1 + offs_m[:, None] * s_mm

    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    if CAUSAL:    # top-left aligned: query i sees keys 0..i, none past this block's last row
        key_end = tl.minimum(N_KEYS, (pid_m + 1) * BLOCK_M)
    else:
        key_end = N_KEYS
    for start in range(0, key_end, BLOCK_N):
        keys = start + offs_key
        key_ok = keys < N_KEYS
        k_t = tl.load(k_base + keys[None, :] * s_kn + offs_d[:, None] * s_kd,
                      mask=key_ok[None, :] & mask_d[:, None], other=0.0)
        scores = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale        # log2 units
        if SOFTCAP:     # c·tanh(S / c), c in log2 units too (tanh as 2·sigmoid(2x) - 1)
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        allowed = key_ok[None, :] & mask_m[:, None]
        if CAUSAL:
            allowed = allowed & (keys[None, :] <= offs_m[:, None])
        if MASK == 1:
            allowed = allowed & (tl.load(m_base + keys[None, :] * s_mn, mask=allowed, other=0) != 0)
        if MASK == 2:
            bias = tl.load(m_base + keys[None, :] * s_mn, mask=allowed, other=0.0)
            scores = scores + bias.to(tl.float32) * 1.4426950408889634
        scores = tl.where(allowed, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # a row with no allowed key so far keeps max -inf: subtract 0 there so exp2 gives 0, not NaN
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        p = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(p, 1)
        v = tl.load(v_base + keys[:, None] * s_vn + offs_n[None, :] * s_vd,
                    mask=key_ok[:, None] & mask_n[None, :], other=0.0)
        acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        row_max = new_max
    # a row with no allowed key has acc 0 and sum 0: it stays 0
    acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]

    r0 = 0
    r1 = 0
    r2 = offs_m
{epilogue}
'''

# the key-split form (flash-decoding: `opfuse.fusion.tiles.key_split_table`): slice pid_s of the grid's third axis walks
# KEYS_PER_SLICE keys and stores its rows' unnormalized output, running max and sum (float32); the last slice of a
# tile to arrive (`opfuse.codegen.split_k.LAST_ARRIVAL`) rescales every slice's rows to their common maximum, sums
# them in slice order (the same order every run, whichever slice is last), normalizes and runs the epilogue.
COMBINE_CODE = """\
    row = (pid_s * tl.num_programs(1) + pid_b) * M + offs_m      # (slice, batch, query)
    tl.store(ws_ptr + row[:, None] * DV + offs_n[None, :], acc, mask=mask_m[:, None] & mask_n[None, :])
    tl.store(stat_ptr + row * 2, row_max, mask=mask_m)
    tl.store(stat_ptr + row * 2 + 1, row_sum, mask=mask_m)
""" + LAST_ARRIVAL + """\
    batches = tl.num_programs(1)
    top = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for s in range(tl.num_programs(2)):
        top = tl.maximum(top, tl.load(stat_ptr + ((s * batches + pid_b) * M + offs_m) * 2, mask=mask_m,
                                      other=float("-inf"), cache_modifier=".cg"))
    # rows no slice saw an allowed key of keep max -inf: subtract 0 there so exp2 gives 0, not NaN
    shift = tl.where(top == float("-inf"), 0.0, top)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
    for s in range(tl.num_programs(2)):
        row = (s * batches + pid_b) * M + offs_m
        weight = tl.exp2(tl.load(stat_ptr + row * 2, mask=mask_m, other=float("-inf"), cache_modifier=".cg") - shift)
        row_sum += weight * tl.load(stat_ptr + row * 2 + 1, mask=mask_m, other=0.0, cache_modifier=".cg")
        acc += weight[:, None] * tl.load(ws_ptr + row[:, None] * DV + offs_n[None, :],
                                         mask=mask_m[:, None] & mask_n[None, :], other=0.0, cache_modifier=".cg")
    acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
"""
ATTENTION_SLICE_TEMPLATE = sliced_template(ATTENTION_TEMPLATE, [
    ("    s_mb0, s_mb1, s_mm, s_mn,\n", "    s_mb0, s_mb1, s_mm, s_mn,\n    KEYS_PER_SLICE, ws_ptr, stat_ptr, cnt_ptr,\n"),
    ("    pid_b = tl.program_id(1)\n", "    pid_b = tl.program_id(1)\n    pid_s = tl.program_id(2)\n"),
    ("    for start in range(0, key_end, BLOCK_N):\n",
     "    key_first = pid_s * KEYS_PER_SLICE\n    key_end = tl.minimum(key_end, key_first + KEYS_PER_SLICE)\n"
     "    for start in range(key_first, key_end, BLOCK_N):\n"),
    ("    acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]\n", COMBINE_CODE)])


def attention_configs(graph: Graph, group: FusionGroup, anchor: str, hw: HardwareProfile) -> list[KernelConfig]:
    """The ATTENTION_TILES (`opfuse.fusion.resources`) whose registers and shared memory fit GPU `hw`, as launch
    configs in their order, each query block cut to the queries (distinct tiles only); the interpreter's one small
    tile under Triton's interpreter. None fitting: the smallest, so the group still has a kernel to measure."""
    if hw.interpreted:
        return [INTERPRETER_TILE]
    dtype = graph[graph[anchor].inputs[0]].type.dtype
    configs: list[KernelConfig] = []
    estimates = [estimate_resources(graph, group.nodes, anchor, hw, dtype, tile) for tile in ATTENTION_TILES]
    for estimate in [e for e in estimates if e.fits] or estimates[-1:]:
        tile = estimate.tile     # BLOCK_M already at most the queries' power of two
        config = KernelConfig.of(num_warps=tile["num_warps"], num_stages=tile["num_stages"],
                                 BLOCK_M=tile["BLOCK_M"], BLOCK_N=tile["BLOCK_N"])
        if config not in configs:
            configs.append(config)
    return configs


def _head_dim_block(head_dim: int) -> int:
    """The head dim padded to a power of two, at least 16 (tl.dot's smallest operand side)."""
    return max(16, triton.next_power_of_2(head_dim))


class AttentionKernel(EpilogueKernel):
    """softmax(Q·Kᵀ·scale + mask)·V (+ epilogue) for one group (module docstring)."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, anchor: str,
                 chains: list[list[str]], hw: HardwareProfile):
        node = graph[anchor]
        self.node = node
        self.q, self.k, self.v = node.inputs[:3]
        self.mask = node.inputs[3] if len(node.inputs) > 3 else None
        q_shape, k_shape, v_shape = (graph[i].type.shape for i in node.inputs[:3])
        head_dim, value_dim = q_shape[-1], v_shape[-1]
        self.bare = _bare(group, anchor, chains)
        # why the Triton template cannot run it; then a bare sdpa is torch's attention alone (the library form)
        untiled = _untiled(graph, node)
        self.untiled = None if untiled is None else str(untiled)
        self.mask_kind = NO_MASK
        if self.mask is not None:
            self.mask_kind = BOOLEAN_MASK if graph[self.mask].type.dtype == "bool" else ADDITIVE_MASK
        out_shape = node.type.shape
        batch_dims = tuple(range(len(out_shape) - 2))
        # heads inside the tokens in memory, as flash attention lays its output out (module docstring)
        order = memory_order(graph, node) if len(out_shape) == 4 else None
        layout = TileLayout(out_shape, channel_dim=len(out_shape) - 1, batch_dims=batch_dims, dim_order=order)
        epilogue = Epilogue(graph, group, chains, layout, device)
        name, source, self.kernel = generate_kernel(ATTENTION_TEMPLATE, epilogue)
        super().__init__(graph, group, name, source)
        self.device, self.epilogue, self.layout = device, epilogue, layout
        self.s_q, self.s_k, self.head_dim, self.value_dim = q_shape[-2], k_shape[-2], head_dim, value_dim
        self.block_d, self.block_dv = _head_dim_block(head_dim), _head_dim_block(value_dim)
        leading = out_shape[:-2]
        # operands broadcast to the output's batch dims, each read through the output layout's batch groups
        self.q_layout = TileLayout(leading + (self.s_q, head_dim), len(out_shape) - 1, batch_dims)
        # key/value heads several query heads share (grouped-query attention) are read as they are: head b1 of the
        # grid reads key/value head b1 // shared (`kv_heads_shared`), so a K or V with fewer heads has its own layout
        self.shared = [kv_heads_shared(q_shape, graph[i].type.shape) for i in (self.k, self.v)]
        self.k_layout, self.v_layout = (
            TileLayout(leading[:-1] + (leading[-1] // shared, self.s_k, dim), len(out_shape) - 1, batch_dims)
            for shared, dim in zip(self.shared, (head_dim, value_dim)))
        self.mask_layout = TileLayout(leading + (self.s_q, self.s_k), len(out_shape) - 1, batch_dims)
        scale = node.attrs.get("scale")
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.softcap = float(node.attrs.get("softcap") or 0.0)     # Gemma 2's: 0 for none
        self.constants = {v: graph.constants[v].to(device) for v in node.inputs if graph.is_constant(v)}
        self._configs = attention_configs(graph, group, anchor, hw) if self.untiled is None else []
        self.slice_kernel = self.counts = None
        if group.split_k and self._configs:     # the plan splits the keys (`key_split_table`): each tile's slices
            self._configs = list(dict.fromkeys(KernelConfig.of(
                c.num_warps, c.num_stages, **(dict(c.params) | {"SPLIT_K": planned_slices(group, attention_key(
                    dict(c.params)), "key slices")})) for c in self._configs))
            _, sliced, self.slice_kernel = generate_kernel(ATTENTION_SLICE_TEMPLATE, epilogue, "splitkeys")
            self.counts = ArrivalCounts((triton.cdiv(self.s_q, c["BLOCK_M"]) * self.layout.batch
                                         for c in self._configs if slices_of(c) > 1), device)
            self.source += "\n\n" + sliced     # every kernel it may run: what the cache keys
        # torch's sdpa is the whole group: the library form, first (module docstring); not with a softcap, which
        # torch's attention has not (the reference writes the scores out), unless the template cannot tile it
        if self.bare and (not self.softcap or self.untiled is not None):
            self.library_outputs = self._torch_attention
            self._configs = [TORCH_ATTENTION, *self._configs]

    def _torch_attention(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The library form: torch's scaled_dot_product_attention, as the runtime runs an sdpa node."""
        return [get_op("sdpa").run([values[i] for i in self.node.inputs], self.node.attrs)]

    def describe_library_form(self, config: KernelConfig | None = None) -> str:
        why = f" ({self.untiled.split(': ', 1)[-1]})" if self.untiled is not None else ""
        return (f"{self.node.name} through PyTorch's scaled_dot_product_attention (flash/cuDNN), no kernel of "
                f"opfuse's{why}")

    def alternatives(self, library: bool = True) -> list[KernelConfig]:
        """The unsplit form of the first key-split config, where the plan split the keys; a bare sdpa has its
        library form among its configs (and nothing else to unfuse); a group with an epilogue offers, with
        `library`, the unfused form: torch's sdpa, then the epilogue ops through PyTorch."""
        split = next((c for c in self._configs if slices_of(c) > 1), None)
        forms = [] if split is None else [unsplit(split)]
        return forms + ([UNFUSED] if library and not self.bare else [])

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """The outputs in form `config` (default: the first config, torch's attention for a bare sdpa)."""
        return super().run(inputs, config or self._configs[0], outputs)

    def precision(self) -> str:
        """tl.dot precision of float32 operands: TF32 where PyTorch's matmul would use it."""
        return dot_precision(conv=False)

    def _operand(self, layout: TileLayout, tensor: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """`tensor` broadcast to `layout` and its (batch 0, batch 1, row, column) strides."""
        tensor, strides = layout.strides(tensor)
        return tensor, [strides[0], strides[1], strides[-2], strides[-1]]

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
                   outputs: Outputs = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config, outputs=outputs)
        q, q_strides = self._operand(self.q_layout, values[self.q])
        k, k_strides = self._operand(self.k_layout, values[self.k])
        v, v_strides = self._operand(self.v_layout, values[self.v])
        if self.mask is not None:
            mask, m_strides = self._operand(self.mask_layout, values[self.mask])
            if mask.dtype == torch.bool:     # read as bytes: one a key, nonzero attends
                mask = mask.view(torch.uint8)
        else:
            mask, m_strides = q, [0, 0, 0, 0]    # never read
        block_m, block_n, heads = config["BLOCK_M"], config["BLOCK_N"], self.layout.batch
        common = (q, k, v, mask, self.s_q, self.s_k, self.head_dim, self.value_dim, self.layout.batch_sizes()[1],
                  self.scale * LOG2E, self.softcap * LOG2E, *q_strides, *k_strides, *v_strides, *m_strides)
        constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=self.block_d, BLOCK_DV=self.block_dv,
                          CAUSAL=bool(self.node.attrs.get("is_causal")), MASK=self.mask_kind,
                          PRECISION=self.precision(), K_SHARED=self.shared[0], V_SHARED=self.shared[1],
                          SOFTCAP=self.softcap > 0,
                          num_warps=config.num_warps, num_stages=config.num_stages)
        query_blocks = triton.cdiv(self.s_q, block_m)
        slices = slices_of(config)
        if slices == 1:
            compiled = self.kernel[(query_blocks, heads)](*common, *args, **constexprs)
        else:   # each slice a run of whole key blocks, none empty
            per_slice = triton.cdiv(triton.cdiv(self.s_k, block_n), slices) * block_n
            slices = triton.cdiv(self.s_k, per_slice)
            rows = slices * heads * self.s_q
            partial = torch.empty(rows * self.value_dim, device=q.device, dtype=torch.float32)
            stats = torch.empty(rows * 2, device=q.device, dtype=torch.float32)
            counts = self.counts.of(query_blocks * heads, q.device, self.name)
            compiled = self.slice_kernel[(query_blocks, heads, slices)](*common, per_slice, partial, stats, counts,
                                                                          *args, **constexprs)
        self.last_compiled = compiled_info(compiled)
        return outputs


def lower_attention(graph: Graph, group: FusionGroup, device: torch.device | str,
                    hw: HardwareProfile | None = None) -> AttentionKernel:
    """The kernel of a group anchored on sdpa (with its elementwise epilogue), with tiles for GPU `hw` (default:
    the default profile)."""
    anchor, chains = _taken(graph, group, graph.users())
    return AttentionKernel(graph, group, torch.device(device), anchor, chains, kernel_profile(hw))


def supports(graph: Graph, group: FusionGroup, users: Users | None = None) -> Reason | None:
    """None where the attention template (its Triton tiles, or torch's attention for a bare sdpa it cannot tile)
    takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("attention", lambda: _taken(graph, group, graph.users() if users is None else users))


def _taken(graph: Graph, group: FusionGroup, users: Users) -> tuple[str, list[list[str]]]:
    """The group's sdpa and its epilogue chain; `Unsupported` (its code says which kind) where the template
    cannot take them: several attention anchors, q of no batch dims, q and k of different head dims, or an sdpa
    the tiles cannot compute (`_untiled`) with an epilogue (a bare one is torch's attention)."""
    anchors, chains = siblings_and_chains(graph, group, ("sdpa",), users)
    if len(anchors) > 1:
        raise Unsupported(f"group {group.name} holds several attention anchors: {', '.join(anchors)}",
                          Code.SEVERAL_ANCHORS)
    node = graph[anchors[0]]
    q_shape, k_shape = (graph[i].type.shape for i in node.inputs[:2])
    if len(q_shape) < 3:
        raise Unsupported(f"{node.describe()}: attention needs batch dims before [S, D]", Code.OPERAND_SHAPE)
    if k_shape[-1] != q_shape[-1]:
        raise Unsupported(f"{node.describe()}: q and k of different head dims ({q_shape[-1]}, {k_shape[-1]})",
                          Code.OPERAND_SHAPE)
    untiled = _untiled(graph, node)
    if untiled is not None and not _bare(group, anchors[0], chains):
        raise untiled
    return anchors[0], chains


def _bare(group: FusionGroup, anchor: str, chains: list[list[str]]) -> bool:
    """The group is its sdpa alone."""
    return len(chains[0]) == 1 and group.outputs == [anchor]


def _untiled(graph: Graph, node) -> Unsupported | None:
    """Why the Triton template cannot compute sdpa `node`, or None: head dims over MAX_HEAD_DIM (its query tile and
    accumulator hold whole rows), q, k and v of different dtypes, an additive mask of an integer dtype."""
    dims = [graph[i].type.shape[-1] for i in node.inputs[:3]]
    if max(dims) > MAX_HEAD_DIM:
        return Unsupported(f"{node.describe()}: head dims {dims}, over the {MAX_HEAD_DIM} the attention template "
                           "tiles", Code.OPERAND_SHAPE)
    dtype = compute_dtype(graph, node.inputs[0], node)
    if any(graph[i].type.dtype != dtype for i in node.inputs[1:3]):
        return Unsupported(f"{node.describe()}: q, k and v of different dtypes", Code.OPERAND_DTYPE)
    mask = graph[node.inputs[3]].type.dtype if len(node.inputs) > 3 else None
    if mask not in (None, "bool", "float16", "bfloat16", "float32"):
        return Unsupported(f"{node.describe()}: a {mask} attention mask", Code.OPERAND_DTYPE)
    return None
