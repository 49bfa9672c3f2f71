"""GEMM anchor kernels with fused epilogues: linear, matmul (2-D and batched), and 1x1 convolutions.

Entry point: `lower_gemm_group(graph, group, device)` for groups anchored on linear or matmul; `GemmKernel` is
also what `opfuse.codegen.conv` uses for 1x1 convolutions with no padding (a GEMM over pixels).

One template computes C[b, m, n] = sum_k A[b, m, k] · B[b, k, n] on BLOCK_M x BLOCK_N tiles with float32
accumulation, then runs the group's epilogue (`opfuse.codegen.epilogue`) on the tile. A is read through its
strides with its row index split over 4 row groups and its reduction index over 2 (`opfuse.ir.strided`): N, H, W
of an NHWC activation, the leading dims of a [..., K] input, or the views a linear reads its input through
(`opfuse.fusion.legality_views.operand_chain`: the head merge after attention reads heads and head dim as two reduction
groups), so channels-last activations, channel-slice views and reshapes PyTorch would copy need no copy. B is the
weight packed at build time as [K, N] contiguous (linear, conv) or, for matmul, the second operand read through its
strides. Batched matmul (with torch.matmul broadcasting of the batch dims) uses grid axis 1.

Traffic per tile: BLOCK_M·K + K·BLOCK_N operand elements, BLOCK_M·BLOCK_N outputs; FLOPs 2·BLOCK_M·BLOCK_N·K.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import triton

from opfuse.codegen.base import KernelConfig, Outputs, compiled_info, rows_jit
from opfuse.codegen.epilogue import (TILE_INDEX, Epilogue, TileLayout, compute_dtype, generate_kernel,
                                     siblings_and_chains)
from opfuse.codegen.forms import EpilogueKernel, LibraryAnchor, is_library, is_unfused
from opfuse.codegen.library_fused import FusedLinearLibrary, fused_chain
from opfuse.codegen.split_k import SplitK, sliced_template, slices_of, with_slices
from opfuse.codegen.expr import Unsupported, emit, refusal
from opfuse.codegen.prologue import Prologue
from opfuse.fusion.legality_anchors import GatedPair, anchor_prologue, gated_pair
from opfuse.fusion.legality_common import Users
from opfuse.fusion.legality_views import operand_chain
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import INTERPRETER, anchor_steps, anchor_tiles
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir import strided
from opfuse.ir.graph import Graph, torch_dtype
from opfuse.ir.interpret import run_nodes
from opfuse.ir.ops import get_op
from opfuse.numerics import dot_precision

GROUP_M = 8   # tiles of 8 consecutive row blocks share B in L2 (the Triton matmul tutorial's swizzle)


def swizzled_tile(columns: str) -> str:
    """Template lines giving program `pid` its tile (pid_m, pid_n) of M rows by `columns` columns in GROUP_M
    order: consecutive programs take GROUP_M row blocks of one column block, then the next column block."""
    return f"""\
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv({columns}, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    first_m = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_rows
    pid_n = (pid % group_width) // group_rows
"""

# the template's integers that address its vectorised dims (N of the tile and B, K of A), rebound as multiples of
# UNIT (`opfuse.codegen.base.unit_code`)
GEMM_UNITS = ("N", "K", "s_ab0", "s_ab1", "s_ar0", "s_ar1", "s_ar2", "s_ar3", "s_ako", "s_bb0", "s_bb1", "s_bk")
# its row count, rebound as a multiple of ROW_UNIT from A's row strides (and the epilogue's and the prologue's)
# (`opfuse.codegen.base.row_unit_of`)
GEMM_ROWS = ("M",)
GEMM_ROW_STRIDES = ("s_ar0", "s_ar1", "s_ar2", "s_ar3")

GEMM_TEMPLATE = '''
import triton
import triton.language as tl


''' + rows_jit(GEMM_ROWS) + '''
def KERNEL_NAME(
    a_ptr, b_ptr,
    M, N, K, R1, R2, B1,
    s_ab0, s_ab1, AR1, AR2, AR3, s_ar0, s_ar1, s_ar2, s_ar3, AK, s_ako, s_ak,
    s_bb0, s_bb1, s_bk, s_bn,
    {params}{prologue_params}
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, A_SPLIT_K: tl.constexpr, PRECISION: tl.constexpr, UNIT: tl.constexpr,
    ROW_UNIT: tl.constexpr,
):
{units}
    pid = tl.program_id(0)
    pid_b = tl.program_id(1)
''' + swizzled_tile("N") + '''
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
''' + TILE_INDEX + '''\

    # A's rows: 4 groups (opfuse.ir.strided.OPERAND_ROW_GROUPS) of sizes (M / (AR1 AR2 AR3), AR1, AR2, AR3); its
    # reduction: 2 groups (K / AK, AK), the outer one used only with A_SPLIT_K (else the reduction is one stride and
    # the pointers just advance)
    a_g0 = offs_m // (AR1 * AR2 * AR3)
    a_g1 = (offs_m // (AR2 * AR3)) % AR1
    a_g2 = (offs_m // AR3) % AR2
    a_g3 = offs_m % AR3
    a_rows = a_ptr + (b0 * s_ab0 + b1 * s_ab1) + a_g0 * s_ar0 + a_g1 * s_ar1 + a_g2 * s_ar2 + a_g3 * s_ar3
    a_ptrs = a_rows[:, None] + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + (b0 * s_bb0 + b1 * s_bb1) + offs_k[:, None] * s_bk + offs_n[None, :] * s_bn
{prologue_stats}
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_at = k0 + offs_k
        if A_SPLIT_K:
            a_ptrs = a_rows[:, None] + ((k_at // AK) * s_ako + (k_at % AK) * s_ak)[None, :]
        if EVEN_K:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=mask_m[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & mask_n[None, :], other=0.0)
{prologue}
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
{prologue_scale}
{epilogue}
'''


# split-K: the same kernel with its K loop restricted to one slice (grid axis 2) that stores its fp32 partial tile to
# ws[slice, batch, row, column] instead of running the epilogue (GEMM_TEMPLATE itself stays as it is)
GEMM_SLICE_TEMPLATE = sliced_template(GEMM_TEMPLATE, [
    ("    {params}{prologue_params}\n", "    {params}{prologue_params}\n    SLICE_STEPS,\n"),
    ("    pid_b = tl.program_id(1)\n", "    pid_b = tl.program_id(1)\n    pid_k = tl.program_id(2)\n"),
    ("    for k0 in range(0, K, BLOCK_K):\n",
     "    k_first = pid_k * SLICE_STEPS * BLOCK_K\n    a_ptrs += k_first * s_ak\n    b_ptrs += k_first * s_bk\n"
     "    for k0 in range(k_first, tl.minimum(K, k_first + SLICE_STEPS * BLOCK_K), BLOCK_K):\n")])
GEMM_TILE_AT = "(({s}) * tl.num_programs(1) + pid_b) * M * N + offs_m[:, None] * N + offs_n[None, :]"   # ws[slice, batch, row, column]


def gemm_configs(m: int, n: int, k: int, batch: int = 1, itemsize: int = 2, gather: bool = False,
                 hw: HardwareProfile | None = None) -> list[KernelConfig]:
    """The anchor tiles for GPU `hw` (`opfuse.fusion.tiles.anchor_tiles`, the default first; `kernel_profile`) as
    launch configs; the interpreter's one tiny tile where Triton's interpreter runs them."""
    hw = kernel_profile(hw)
    tiles = [INTERPRETER] if hw.interpreted else anchor_tiles(m, n, k, batch, itemsize, gather, hw=hw)
    return [KernelConfig.of(num_warps=t["num_warps"], num_stages=t["num_stages"], BLOCK_M=t["BLOCK_M"],
                            BLOCK_N=t["BLOCK_N"], BLOCK_K=t["BLOCK_K"]) for t in tiles]


def _with_prologue(template: str, prologue: Prologue | None) -> str:
    """`template` with the prologue's parameters and code in its slots (none without one)."""
    params, code, stats, scale = ((prologue.params, prologue.code(), prologue.stats_code(), prologue.scale_code())
                                  if prologue is not None else ("", "", "", ""))
    code, stats, scale = (text.replace("{", "{{").replace("}", "}}")   # the template is formatted again for the
                          for text in (code, stats, scale))             # epilogue
    return (template.replace("{prologue_params}", params).replace("{prologue_stats}\n", stats + "\n" if stats else "")
            .replace("{prologue}", code).replace("{prologue_scale}\n", scale + "\n" if scale else ""))


class OperandMap:
    """How a linear reads its input through views (`operand_chain`): the views replayed on the source's strides
    (`opfuse.ir.strided`) give the kernel's row and reduction groups; a source whose strides give more groups than
    the kernel has (not the contiguous tensor the planner assumed) is read through PyTorch's copy instead."""

    def __init__(self, graph: Graph, chain: Sequence[str], row_dims: int):
        self.views = [graph[name] for name in chain]
        self.row_dims = row_dims
        self._groups: dict[tuple, tuple[list[strided.Atom], list[strided.Atom]] | None] = {}

    def groups(self, source: torch.Tensor) -> tuple[list[strided.Atom], list[strided.Atom]] | None:
        """(row groups, reduction groups) of the operand for this source, or None when it does not map."""
        key = (tuple(source.shape), source.stride())
        if key not in self._groups:
            dims = strided.through_views(source.shape, source.stride(), self.views)
            self._groups[key] = None if dims is None else strided.operand_groups(dims, self.row_dims)
        return self._groups[key]

    def materialize(self, source: torch.Tensor) -> torch.Tensor:
        """The operand as PyTorch computes it (a copy where a reshape needs one)."""
        return run_nodes(self.views, {self.views[0].inputs[0]: source})[self.views[-1].name]


class GemmKernel(EpilogueKernel):
    """C = A @ B (+ epilogue) for one group; A is a tensor read through strides, B packed or read through strides."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, epilogue: Epilogue,
                 a: str, k: int, b_packed: torch.Tensor | None = None, b: str | None = None,
                 b_layout: TileLayout | None = None,
                 a_view: Callable[[torch.Tensor], torch.Tensor] | None = None, a_map: OperandMap | None = None,
                 prologue: Prologue | None = None, hw: HardwareProfile | None = None,
                 conv: bool = False, library_anchor: LibraryAnchor | None = None, template: str = GEMM_TEMPLATE):
        if prologue is not None and (a_view is not None or a_map is not None and (prologue.norm is None
                                                                                  or prologue.operands)):
            raise Unsupported(f"group {group.name}: a prologue on an operand read through views", Code.EPILOGUE_FORM)
        self.prologue = prologue
        if prologue is not None:     # what the library forms compute the anchor's input through
            self.operand_nodes, self.operand_constants = [graph[n] for n in prologue.nodes], prologue.constants
        elif a_map is not None:
            self.operand_nodes = a_map.views
        row_strides = (*GEMM_ROW_STRIDES, *(prologue.row_stride_names if prologue is not None else ()))
        name, source, self.kernel = generate_kernel(_with_prologue(template, prologue), epilogue,
                                                    units=GEMM_UNITS, rows=GEMM_ROWS, row_strides=row_strides)
        super().__init__(graph, group, name, source)
        self.device, self.epilogue, self.layout = device, epilogue, epilogue.layout
        self.a, self.k, self.a_view, self.a_map = a, k, a_view, a_map
        self.b, self.b_packed, self.b_layout = b, b_packed, b_layout
        self.conv = conv    # a 1x1 conv: float32 follows cuDNN's tf32 switch, a GEMM torch's matmul precision
        self.library_anchor = library_anchor
        hw = kernel_profile(hw)
        self._configs = gemm_configs(self.layout.rows, self.layout.channels, k, self.layout.batch,
                                     graph[a].type.itemsize, hw=hw)
        self.split = None
        # the planner split K: each config runs the slices the plan gives its tile (never with row statistics,
        # which need all of K: the planner offers no split for them)
        if group.split_k and (prologue is None or prologue.norm is None):
            self.split = SplitK(_with_prologue(GEMM_SLICE_TEMPLATE, prologue), GEMM_TILE_AT, epilogue, GEMM_UNITS,
                                GEMM_ROWS, (*row_strides, "N"))
            self._configs = with_slices(self._configs, group)
            self.source += "\n\n" + self.split.sources   # every kernel it may run: what the tuning cache keys
        self._sizes = (self.layout.rows, self.layout.channels, *self.layout.row_sizes()[1:],
                       self.layout.batch_sizes()[1] if self.layout.batch_dims else 1)
        if self.split is not None:
            self.split.count_tiles((self._tiles(c) * self.layout.batch for c in self._configs if slices_of(c) > 1),
                                   device)
        # constant operands (a matmul with a constant side) are held by the kernel, on the device
        self.constants = {v: graph.constants[v].to(device) for v in (a, b) if v is not None and graph.is_constant(v)}

    def streamed_weight(self, config: KernelConfig | None) -> torch.Tensor | None:
        """The packed weight, which the Triton form and a linear's library forms read (a 1x1 conv's go through
        cuDNN's own weight; the unfused form reads the graph's)."""
        if self.b_packed is None or is_unfused(config) or is_library(config) and self.conv:
            return None
        return self.b_packed

    def _steps(self, config: KernelConfig) -> int:
        """K-loop steps of the template for `config`."""
        return anchor_steps(1, self.k, config["BLOCK_K"])

    def _tiles(self, config: KernelConfig) -> int:
        """Tiles of `config` in one batch: its programs along grid axis 0."""
        return triton.cdiv(self._sizes[0], config["BLOCK_M"]) * triton.cdiv(self._sizes[1], config["BLOCK_N"])

    def precision(self) -> str:
        """tl.dot precision of float32 operands: TF32 where PyTorch's own kernel would use it."""
        return dot_precision(self.conv)

    def operand_a(self, values: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[int], bool]:
        """(A, its index arguments s_ab0 .. s_ak of the template, whether its reduction splits in two groups)."""
        a = values[self.a] if self.a_view is None else self.a_view(values[self.a])
        if self.a_map is not None:
            groups = self.a_map.groups(a)
            if groups is not None:
                rows, (outer, inner) = groups
                return a, [0, 0, *(size for size, _ in rows[1:]), *(stride for _, stride in rows),
                           inner[0], outer[1], inner[1]], outer[0] > 1
            a = self.a_map.materialize(a)
        a, strides = self.layout.strides(a, channels=self.k)
        batch, (r0, r1, r2, channel) = ([0, 0], strides) if not self.layout.batch_dims else (strides[:2], strides[2:])
        _, size1, size2 = self.layout.row_sizes()
        return a, [*batch, size1, size2, 1, r0, r1, r2, 0, self.k, 0, channel], False

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
                   outputs: Outputs = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config, outputs=outputs)
        a, a_strides, a_split_k = self.operand_a(values)
        prologue = self.prologue.launch_args(values) if self.prologue is not None else []
        if self.b_packed is not None:
            b, b_strides = self.b_packed, [0, 0, self.b_packed.stride(0), self.b_packed.stride(1)]
        else:
            b, strides = self.b_layout.strides(values[self.b])
            b_strides = strides[:2] + strides[-2:]      # batch 0, batch 1, k (last row dim), n
        m, n, r1, r2, b1 = self._sizes
        tiles = self._tiles(config)
        slices = slices_of(config)
        launch = dict(BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"], BLOCK_K=config["BLOCK_K"],
                      GROUP_M=GROUP_M, EVEN_K=self.k % config["BLOCK_K"] == 0, A_SPLIT_K=a_split_k,
                      PRECISION=self.precision(),
                      num_warps=config.num_warps, num_stages=config.num_stages)
        if slices > 1:   # K slices store fp32 partial tiles; the last of a tile sums them and runs the epilogue
            workspace = torch.empty((slices, self.layout.batch, m, n), dtype=torch.float32, device=a.device)
            counts = self.split.counts.of(tiles * self.layout.batch, a.device, self.name)
            compiled = self.split.partial[(tiles, self.layout.batch, slices)](
                a, b, m, n, self.k, r1, r2, b1, *a_strides, *b_strides, workspace, counts, *args, *prologue,
                SLICE_STEPS=triton.cdiv(self._steps(config), slices), **launch)
        else:
            compiled = self.kernel[(tiles, self.layout.batch)](
                a, b, m, n, self.k, r1, r2, b1, *a_strides, *b_strides, *args, *prologue, **launch)
        self.last_compiled = compiled_info(compiled)
        return outputs


# a gated pair's GEMM (`opfuse.fusion.legality_anchors.gated_pair`): B holds the two weights' columns interleaved
# (gate_0, up_0, gate_1, up_1, ...), so each tile of BLOCK_N columns holds BLOCK_N / 2 of each for the same outputs;
# after the K loop the tile splits into the two over BLOCK_N / 2 output columns of N / 2 (N: the interleaved
# columns), each takes its bias, the gate's activation runs on its half and the product is the value the epilogue
# starts from
GATED_CODE = """\
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
    offs_n = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask_n = offs_n < N // 2
{bias}{activation}
    acc = gate * up

"""


def gated_code(graph: Graph, activation: Sequence[str], biases: Sequence[str | None] = (None, None)) -> str:
    """GATED_CODE with the gate's activation, `activation`'s elementwise ops in order, after the gate's and the up
    projection's bias (load expressions at the output columns, or None)."""
    bias = "".join(f"    {half} = {half} + {load}\n" for half, load in zip(("gate", "up"), biases) if load)
    return GATED_CODE.format(bias=bias, activation="\n".join(
        f"    gate = {emit(graph[name].op, graph[name].attrs, ['gate'])}" for name in activation))


def interleaved(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Two weights' columns (their last dim) interleaved, gate_0, up_0, gate_1, ...: what GATED_CODE splits."""
    return torch.stack([gate, up], -1).flatten(-2)


class GatedGemmKernel(GemmKernel):
    """act(x W_gate^T) * (x W_up^T) (+ epilogue) as one GEMM over the interleaved weights (`GATED_CODE`); no split-K
    and no library form (the unfused form remains)."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, pair: GatedPair, epilogue: Epilogue,
                 a: str, k: int, weight: torch.Tensor, hw: HardwareProfile | None, prologue: Prologue | None = None):
        biases = [epilogue.channel_vector([bias]) if bias is not None else None
                  for bias in anchor_biases(graph, [pair.gate, pair.up])]
        template = GEMM_TEMPLATE.replace("{epilogue}", gated_code(graph, pair.activation, biases) + "{epilogue}")
        super().__init__(graph, group, device, epilogue, a=a, k=k, b_packed=weight, hw=hw, template=template,
                         prologue=prologue)
        self.split = None
        self._configs = [c for c in self._configs if c["BLOCK_N"] % 32 == 0]   # half tiles of 16 columns or more
        self._sizes = (self._sizes[0], 2 * self._sizes[1], *self._sizes[2:])     # the B columns the grid covers


def _lower_gated(graph: Graph, group: FusionGroup, device: torch.device, pair: GatedPair,
                 hw: HardwareProfile | None, users: Users) -> GemmKernel:
    """The gated pair's kernel; a row norm the two linears alone read (`anchor_prologue`, with
    FusionConfig.norm_prologue) normalizes its A tiles as it loads them."""
    gate = graph[pair.gate]
    x = gate.inputs[0]
    dtype = compute_dtype(graph, x, gate)
    weights = [graph.constants[graph[name].inputs[1]].to(device=device, dtype=torch_dtype(dtype))
               for name in (pair.gate, pair.up)]
    n, k = weights[0].shape
    weight = interleaved(weights[0].t(), weights[1].t()).contiguous()     # [k, 2 n]: columns gate_j, up_j
    ops = anchor_prologue(graph, pair.gate, group.nodes, users)
    after = _gated_epilogue(graph, group, pair, users)
    shape = graph[pair.product].type.shape
    epilogue = Epilogue(graph, group, [after], TileLayout(shape, channel_dim=len(shape) - 1), device)
    prologue = linear_prologue(graph, ops, x, k, device, fold_weight=True)
    if prologue is not None and prologue.row_scale is not None:    # the norm's weight on B's rows (K)
        folded = (weight.float() * prologue.row_scale.to(device)[:, None]).to(weight.dtype)
        if folded.is_meta or torch.isfinite(folded).all():    # (meta: lowered to learn the plan's outcome)
            weight = folded
        else:           # past the dtype's range: the tiles take the weight instead
            prologue = linear_prologue(graph, ops, x, k, device)
    return GatedGemmKernel(graph, group, device, pair, epilogue, prologue.source if prologue else x, k, weight, hw,
                           prologue)


def _pack_linear_weights(graph: Graph, anchors: list[str], dtype: str, device: torch.device) -> torch.Tensor:
    """The siblings' weights [N_i, K] concatenated and transposed to [K, sum N_i], contiguous, in `dtype`."""
    weights = [graph.constants[graph[name].inputs[1]].to(device=device, dtype=torch_dtype(dtype)) for name in anchors]
    return torch.cat(weights, 0).t().contiguous()


def anchor_biases(graph: Graph, anchors: list[str]) -> list[torch.Tensor | None]:
    """Each sibling's bias constant (input 2), or None where it has none."""
    biases = []
    for name in anchors:
        node = graph[name]
        if len(node.inputs) < 3:
            biases.append(None)
        elif graph.is_constant(node.inputs[2]):
            biases.append(graph.constants[node.inputs[2]])
        else:
            raise Unsupported(f"{node.describe()}: the bias is not a constant", Code.NOT_CONSTANT)
    return biases


def _lower_linear(graph: Graph, group: FusionGroup, device: torch.device, anchors: list[str],
                  chains: list[list[str]], hw: HardwareProfile | None, users: Users) -> GemmKernel:
    first = graph[anchors[0]]
    x = first.inputs[0]
    dtype = compute_dtype(graph, x, first)
    weight = _pack_linear_weights(graph, anchors, dtype, device)
    k, n = weight.shape
    shape = first.type.shape[:-1] + (n,)
    layout = TileLayout(shape, channel_dim=len(shape) - 1)
    biases = anchor_biases(graph, anchors)
    epilogue = Epilogue(graph, group, chains, layout, device, biases)
    rows = layout.rows
    ops = anchor_prologue(graph, anchors[0], group.nodes, users)   # (siblings share only a norm prologue)
    # what the linear reads x through: its operand views, or the row views between a layer norm prologue and it,
    # mapped on the norm's input (of the norm's shape) as they would be on its output
    views = [n for n in ops if get_op(graph[n].op).alias] or operand_chain(graph, anchors[0], group.nodes, users)
    a_map = OperandMap(graph, views, len(shape) - 1) if views else None
    a = graph[views[0]].inputs[0] if views else x
    prologue = linear_prologue(graph, ops, x, k, device)
    if prologue is not None:    # what the linear computes on its input tiles: it reads the prologue's source
        a = prologue.source

    # the library forms read x itself: the kernel computes it through PyTorch first (`operand_nodes`)
    kernel = GemmKernel(graph, group, device, epilogue, a=a, k=k, b_packed=weight, a_map=a_map, prologue=prologue,
                        hw=hw, library_anchor=lambda values: torch.matmul(values[x], weight).reshape(1, rows, n))
    if all(len(chain) == 1 for chain in chains):
        kernel.library_outputs = _bare_linears(graph, x, weight, anchors, biases, group.outputs)
    chain = fused_chain(graph, group, anchors, chains, device)
    if chain is not None:
        kernel.library_fused = FusedLinearLibrary(chain, x, weight, biases[0], first.type.shape[:-1])
    return kernel


def linear_prologue(graph: Graph, ops: Sequence[str], x: str, k: int, device: torch.device,
                    fold_weight: bool = False) -> Prologue | None:
    """The prologue of a linear (or a gated pair) that computes its input `x` through `ops` (`anchor_prologue`) on
    its A tiles, reading their source (`fold_weight`: a deferred RMS norm's weight goes to B's rows, which the caller
    scales by its `row_scale`); None without ops."""
    if not ops:
        return None
    shape = graph[x].type.shape
    return Prologue(graph, ops, prologue_source(graph, ops), TileLayout(shape, channel_dim=len(shape) - 1), k, device,
                    fold_weight)


def prologue_source(graph: Graph, ops: Sequence[str]) -> str:
    """The full-size value the first prologue op reads (`anchor_prologue`'s chain starts there)."""
    first = graph[ops[0]]
    return next(v for v in first.inputs if not graph.is_constant(v) and graph[v].type.numel == first.type.numel)


def _bare_linears(graph: Graph, x: str, weight: torch.Tensor, anchors: list[str],
                  biases: list[torch.Tensor | None], outputs: list[str]
                  ) -> Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]:
    """The library form of linears with no epilogue but their biases (bert's QKV siblings): one cuBLAS GEMM over
    the packed [K, sum N] weight with the concatenated bias (zeros for a sibling without one) in its epilogue; each
    sibling's output a column slice of the result, as the fused kernel's are, in the group's output order."""
    widths = [graph[a].type.shape[-1] for a in anchors]
    bias = torch.cat([torch.zeros(w, dtype=weight.dtype, device=weight.device) if b is None else b.to(weight)
                      for b, w in zip(biases, widths)])
    spans = {a: (sum(widths[:i]), w) for i, (a, w) in enumerate(zip(anchors, widths))}
    leading = graph[anchors[0]].type.shape[:-1]

    def run(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        result = torch.addmm(bias, values[x].reshape(-1, weight.shape[0]), weight).reshape(*leading, -1)
        return [result.narrow(-1, *spans[name]) for name in outputs]
    return run


def _lower_matmul(graph: Graph, group: FusionGroup, device: torch.device, anchor: str,
                  chains: list[list[str]], hw: HardwareProfile | None) -> GemmKernel:
    node = graph[anchor]
    a, b = node.inputs
    a_type = graph[a].type
    shape = node.type.shape
    batch_dims = tuple(range(len(shape) - 2))
    layout = TileLayout(shape, channel_dim=len(shape) - 1, batch_dims=batch_dims)
    k = a_type.shape[-1]
    b_layout = TileLayout(shape[:-2] + (k, shape[-1]), channel_dim=len(shape) - 1, batch_dims=batch_dims)
    epilogue = Epilogue(graph, group, chains, layout, device)
    batch, m, n = layout.batch, layout.rows, layout.channels
    return GemmKernel(graph, group, device, epilogue, a=a, k=k, b=b, b_layout=b_layout, hw=hw,
                      library_anchor=lambda values: torch.matmul(values[a], values[b]).reshape(batch, m, n))


def lower_gemm_group(graph: Graph, group: FusionGroup, device: torch.device | str,
                     hw: HardwareProfile | None = None) -> GemmKernel:
    """The kernel of a group anchored on linear or matmul (horizontal: sibling linears on one input), with tiles
    for GPU `hw` (default: the default profile)."""
    device = torch.device(device)
    users = graph.users()      # once for the whole lowering: each step below reads it
    taken = _taken(graph, group, users)
    if isinstance(taken, GatedPair):
        return _lower_gated(graph, group, device, taken, hw, users)
    anchors, chains = taken
    if graph[anchors[0]].op == "linear":
        return _lower_linear(graph, group, device, anchors, chains, hw, users)
    return _lower_matmul(graph, group, device, anchors[0], chains, hw)


def supports(graph: Graph, group: FusionGroup, users: Users | None = None) -> Reason | None:
    """None where the GEMM template takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("gemm", lambda: _taken(graph, group, graph.users() if users is None else users))


def _taken(graph: Graph, group: FusionGroup, users: Users) -> GatedPair | tuple[list[str], list[list[str]]]:
    """The group as the template takes it: its gated pair, or its anchors (several: horizontal linears on one
    input) with their epilogue chains; `Unsupported` (its code says which kind) where the template cannot."""
    pair = gated_pair(graph, group.nodes, users)
    if pair is not None:
        gate = graph[pair.gate]
        compute_dtype(graph, gate.inputs[0], gate)
        _constant_weights(graph, [pair.gate, pair.up])
        _gated_epilogue(graph, group, pair, users)
        return pair
    anchors, chains = siblings_and_chains(graph, group, ("linear", "matmul"), users)
    if len(anchors) > 1 and group.kind is not GroupKind.HORIZONTAL:
        raise Unsupported(f"group {group.name} ({group.kind.value}) holds several anchors: {', '.join(anchors)}",
                          Code.SEVERAL_ANCHORS)
    ops = {graph[a].op for a in anchors}
    first = graph[anchors[0]]
    if ops == {"linear"}:
        for name in anchors[1:]:
            if graph[name].inputs[0] != first.inputs[0]:
                raise Unsupported(f"horizontal group {group.name}: {graph[name].describe()} reads another input "
                                  f"than {first.describe()}", Code.SEVERAL_ANCHORS)
        compute_dtype(graph, first.inputs[0], first)
        _constant_weights(graph, anchors)
        anchor_biases(graph, anchors)
    elif len(anchors) > 1:
        raise Unsupported(f"horizontal group {group.name}: only linear siblings are concatenated, not {ops}",
                          Code.SEVERAL_ANCHORS)
    else:
        a_type, b_type = (graph[i].type for i in first.inputs[:2])
        if len(a_type.shape) < 2 or len(b_type.shape) < 2:
            raise Unsupported(f"{first.describe()}: matmul with a 1-D operand", Code.OPERAND_SHAPE)
        dtype = compute_dtype(graph, first.inputs[0], first)
        if b_type.dtype != dtype:
            raise Unsupported(f"{first.describe()}: operands of different dtypes {dtype} and {b_type.dtype}",
                              Code.OPERAND_DTYPE)
    return anchors, chains


def _constant_weights(graph: Graph, anchors: Sequence[str]) -> None:
    for name in anchors:
        if not graph.is_constant(graph[name].inputs[1]):
            raise Unsupported(f"{graph[name].describe()}: the weight is not a constant", Code.NOT_CONSTANT)


def _gated_epilogue(graph: Graph, group: FusionGroup, pair: GatedPair, users: Users) -> list[str]:
    """The gated pair's epilogue nodes, its product first (the template starts from the product)."""
    ops = anchor_prologue(graph, pair.gate, group.nodes, users)
    after = [name for name in group.nodes if name not in (pair.gate, pair.up, *pair.activation, *ops)]
    if not after or after[0] != pair.product:
        raise Unsupported(f"group {group.name}: the gated pair's product {pair.product} is not its first epilogue "
                          "node", Code.EPILOGUE_FORM)
    return after
