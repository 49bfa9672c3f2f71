"""Cost model: bytes, FLOPs and predicted time of a kernel (`group_traffic`, `predict_time`, `estimate_kernel`).

The seed's rules, written down once:

- a kernel takes max(FLOPs / (peak * efficiency), bytes / (bandwidth * memory efficiency)) plus one launch
  (roofline): tensor-core peak for groups built around a conv/gemm/attention anchor, CUDA-core peak otherwise;
- an op whose density (FLOPs per byte moved) is under `config.density_threshold` (10) is a fusion candidate.

Traffic: a group reads each value from outside it once and writes each value that is read outside it or is a
graph output; views inside it are free. A group of one node moves exactly what the op registry says
(`opfuse.ir.ops.node_bytes` / `node_flops`, the one source of truth for per-op formulas).

One refinement, so that the seed's warning ("fuse too much and registers or shared memory overflow, and the
kernel gets slower") shows up in the predictions: when the resource model has to shrink an anchor's tile to
fit a fused epilogue, the tensor-core rate drops with the tile's operand reuse (see `tile_efficiency`).
Depthwise convolutions have one input channel per filter: no tensor-core GEMM, so they run at the CUDA-core rate.
A linear with a layer norm prologue recomputes the norm once per column tile: the repeats are priced at the
CUDA-core rate on top of the roofline (`_row_norm_recompute`).

A squeeze-and-excitation squeeze (a global average pool and two small GEMMs in one kernel) is priced by
`opfuse.fusion.squeeze.squeeze_seconds`: the pool at the roofline, then one program per sample runs the GEMMs.

Conv-conv kernels (`conv_conv_estimate`) are counted as the kernel `opfuse.codegen.conv_conv` runs: device-memory
traffic as any group (the intermediate tensors are gone), and the work actually executed, recomputation included:

- every BLOCK_N tile of output channels recomputes the depthwise result of its pixels, so the depthwise FLOPs (and
  its epilogue's) are executed ceil(C_out / BLOCK_N) times, on the CUDA cores;
- a fused expansion conv (the whole inverted-residual block) is recomputed for every depthwise tap of every output
  pixel (the halo: KH*KW input pixels per output pixel instead of stride^2 of them), with its input channels
  padded to one power-of-two K block, on the tensor cores at the reuse of a BLOCK_M x BLOCK_K tile;
- the pointwise GEMM runs once, on the tensor cores at the reuse of its BLOCK_M x BLOCK_N tile.

The compute part is the tensor-core time plus the CUDA-core time (they share the SM's issue slots), against the
traffic. The depthwise (and expansion) work moves from its own kernel's grid into the pointwise conv's grid (pixel
tiles x output-channel tiles x mid-channel slices), usually far fewer programs, each of which runs its mid-channel
loop itself: when that grid has fewer programs than the GPU has SMs, the moved work runs on only that many SMs
(`busy`). The pointwise GEMM keeps the grid it would have alone, so it is priced as any GEMM. A depthwise + pointwise
kernel without the expansion is priced at `conv_conv_efficiency` of the model's rates (measured: about half the
efficiency of the kernels it replaces). Each program walks its mid channels in BLOCK_K chunks, one after the other,
each chunk waiting for its taps: the kernel takes at least its chain of steps (the floor that makes the fusion lose
where few programs run long loops, as in mobilenet_v2's late blocks at batch 1). A whole block's step is
`serial_step`; a depthwise + pointwise step is fitted per tile (`conv_conv_step` plus per depthwise-tile element and
per multiply-add), and its grid may split the mid channels into slices (`opfuse.fusion.resources.conv_conv_slices`)
whose chain is their slice plus one step for the sum (their partial tiles go through L2 and are not counted as
device-memory traffic). Every candidate tile that fits is priced and the fastest is taken (the smallest tile, last,
only where none of the others fits: it was never measured fastest); the re-reads of the input that the
recomputation causes are served by L2 and are not counted either (as for any implicit-GEMM conv).
All hardware numbers come from `opfuse.hardware.HardwareProfile`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.legality_anchors import ROW_NORMS
from opfuse.fusion.legality_conv import conv_stages, is_depthwise_conv
from opfuse.fusion.plan import Moves, ResourceEstimate
from opfuse.fusion.resources import (ATTENTION_TILES, anchor_of, conv_chain, conv_conv_tiles,
                                     describe_tile, estimate_resources, expansion_block)
from opfuse.fusion.squeeze import SqueezeChain, fitting_resources, squeeze_chain, squeeze_seconds
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, get_op, kind_of, launches_kernel, node_bytes, node_flops
from opfuse.numerics import matrix_dtype

Users = Mapping[str, Sequence[Node]]


@dataclass(frozen=True)
class GroupTraffic(Moves):
    """FLOPs and bytes of one kernel, and the values it reads and writes."""

    flops: int
    bytes_read: int
    bytes_written: int
    inputs: tuple[str, ...]      # values read from outside, in first-use order
    outputs: tuple[str, ...]     # values written (read outside, or graph outputs)


@dataclass(frozen=True)
class KernelEstimate:
    """What the cost and resource models say about one group: traffic, tile and predicted seconds."""

    traffic: GroupTraffic
    resources: ResourceEstimate | None   # None for views and opaque ops (no kernel of ours)
    time: float
    anchor: str | None
    note: str = ""                       # what the time includes beyond the roofline of the traffic (recompute)


def predict_time(flops: float, bytes_moved: float, hw: HardwareProfile, dtype: str, matrix: bool,
                 tile_efficiency: float = 1.0, conv: bool = False) -> float:
    """Roofline seconds of one kernel plus its launch, times the profile's `time_factor`; `matrix` selects the
    tensor-core peak, at the precision a float32 product runs in (`matrix_dtype`: `conv` for a convolution)."""
    if matrix:
        flop_rate = hw.matrix_peak(matrix_dtype(dtype, conv)) * hw.matrix_efficiency * tile_efficiency
    else:
        flop_rate = hw.vector_flops * hw.vector_efficiency
    byte_rate = hw.memory_bandwidth * hw.memory_efficiency
    return (max(flops / flop_rate, bytes_moved / byte_rate) + hw.launch_overhead) * hw.time_factor


def group_traffic(graph: Graph, nodes: Iterable[str], users: Users) -> GroupTraffic:
    """FLOPs and bytes of the kernel running `nodes` (external values read once, views free)."""
    nodes = list(nodes)
    if len(nodes) == 1:   # one node alone: exactly the registry's numbers
        node = graph[nodes[0]]
        read, written = node_bytes(graph, node)
        outputs = (node.name,) if written else ()
        return GroupTraffic(node_flops(graph, node), read, written, tuple(dict.fromkeys(node.inputs)), outputs)
    node_set = set(nodes)
    graph_outputs = set(graph.outputs)
    inputs: dict[str, None] = {}
    outputs: list[str] = []
    flops = 0
    for name in nodes:
        node = graph[name]
        flops += node_flops(graph, node)
        for value in node.inputs:
            if value not in node_set:
                inputs[value] = None
        if name in graph_outputs or any(u.name not in node_set for u in users[name]):
            outputs.append(name)
    if all(get_op(graph[n].op).alias for n in nodes):   # views only: no kernel, no traffic
        return GroupTraffic(0, 0, 0, tuple(inputs), tuple(outputs))
    # a state written in place (a KV cache's update) is not read, and only its source's rows are written
    in_place = {n for n in nodes if graph.writes_state_in_place(n, users)}
    states = {graph[n].inputs[0] for n in in_place}
    read = sum(graph[v].type.nbytes for v in inputs if v not in states)
    written = sum(math.prod(graph.stored_shape(v)) * graph[v].type.itemsize for v in outputs)
    return GroupTraffic(flops, read, written, tuple(inputs), tuple(outputs))


CALIBRATED_TILE = {"BLOCK_M": 128, "BLOCK_N": 128}   # the GEMM tile `matrix_efficiency` was fitted on


def tile_efficiency(resources: ResourceEstimate | None) -> float:
    """Tensor-core rate of a tile (the estimate's `rate_tile`, else its tile) relative to CALIBRATED_TILE: operand
    reuse BM*BN/(BM+BN), at most 1.

    A BM x BN tile loads (BM + BN) * BK operand elements per 2 * BM * BN * BK FLOPs, so a smaller tile feeds
    the tensor cores from memory proportionally more often; `matrix_efficiency` is calibrated on that tile.
    """
    if resources is None or "BLOCK_M" not in resources.tile or "BLOCK_N" not in resources.tile:
        return 1.0
    default = ATTENTION_TILES[0] if "HEAD_DIM" in resources.tile else CALIBRATED_TILE
    tile = resources.rate_tile or resources.tile
    return reuse_efficiency(tile["BLOCK_M"], tile["BLOCK_N"], default)


def reuse_efficiency(rows: int, columns: int, default: Mapping[str, int] = CALIBRATED_TILE) -> float:
    """Operand reuse of a rows x columns MMA tile relative to the `default` tile's, at most 1."""
    def reuse(m: int, n: int) -> float:
        return m * n / (m + n)

    return min(1.0, reuse(rows, columns) / reuse(default["BLOCK_M"], default["BLOCK_N"]))


def is_conv(graph: Graph, anchor: str | None) -> bool:
    """Whether the anchor is a convolution (its float32 precision follows cuDNN's tf32 switch)."""
    return anchor is not None and graph[anchor].op == "conv2d"


def estimate_kernel(graph: Graph, nodes: Sequence[str], users: Users, hw: HardwareProfile,
                    dtype: str) -> KernelEstimate:
    """Traffic, resources and predicted time of the kernel that runs `nodes` (in topological order)."""
    traffic = group_traffic(graph, nodes, users)
    kernels = [n for n in nodes if launches_kernel(graph, graph[n])]
    if not kernels:
        return KernelEstimate(traffic, None, 0.0, None)
    anchor = anchor_of(graph, kernels)
    opaque = any(kind_of(graph[n]) is FusionKind.OPAQUE and not graph.writes_state_in_place(n, users) for n in kernels)
    if not opaque and isinstance(squeeze := squeeze_chain(graph, kernels, users), SqueezeChain):
        return KernelEstimate(traffic, fitting_resources(squeeze, hw, dtype),
                              squeeze_seconds(squeeze, traffic.bytes_moved, traffic.flops, hw, dtype), squeeze.first,
                              "global average pool and two small GEMMs: the last program of each sample runs them")
    if not opaque and (chain := conv_chain(graph, kernels)):
        return conv_conv_estimate(graph, kernels, chain, traffic, hw, dtype)
    resources = None
    if not opaque:
        resources = estimate_resources(graph, nodes, anchor, hw, dtype)   # (views too: a norm epilogue's)
    matrix = anchor is not None and not is_depthwise_conv(graph, anchor)
    time = predict_time(traffic.flops, traffic.bytes_moved, hw, dtype, matrix=matrix,
                        tile_efficiency=tile_efficiency(resources), conv=is_conv(graph, anchor))
    norm = next((n for n in kernels if graph[n].op in ROW_NORMS), None) \
        if anchor is not None and graph[anchor].op == "linear" else None    # (a depthwise conv's norm runs once)
    if norm is not None and resources is not None and "BLOCK_N" in resources.tile:
        return _row_norm_recompute(graph, norm, anchor, traffic, resources, time, hw)
    return KernelEstimate(traffic, resources, time, anchor)


def _row_norm_recompute(graph: Graph, norm: str, anchor: str, traffic: GroupTraffic, resources: ResourceEstimate,
                        time: float, hw: HardwareProfile) -> KernelEstimate:
    """A linear with a row norm prologue (`opfuse.fusion.legality_anchors.row_norm_prologue`): every BLOCK_N column tile
    recomputes the statistics and the normalization of its rows, on the CUDA cores (the extra pass over A is
    served by L2 and not counted as device-memory traffic)."""
    repeats = -(-graph[anchor].type.shape[-1] // resources.tile["BLOCK_N"])
    extra = node_flops(graph, graph[norm]) * (repeats - 1)
    seconds = extra / (hw.vector_flops * hw.vector_efficiency) * hw.time_factor
    return KernelEstimate(traffic, resources, time + seconds, anchor,
                          f"layer norm {norm} computed {repeats}x (once per column tile)")


@dataclass(frozen=True)
class ConvConvWork:
    """FLOPs a conv-conv kernel executes with one tile: on the tensor cores (each dot with its tile's reuse) and
    on the CUDA cores, recomputation included."""

    matrix_seconds_at_peak: float         # the pointwise GEMM: FLOPs / (peak * reuse efficiency)
    moved_matrix_seconds_at_peak: float   # the fused expansion's dots, recompute included
    vector_flops: int                     # epilogues and the depthwise (recompute included)
    moved_vector_flops: int               # the part of vector_flops that moved into the pointwise grid
    executed_flops: int                   # everything executed, for the note
    depthwise_repeats: int                # output-channel tiles: how often each depthwise value is computed
    expansion_repeats: float              # expansion FLOPs executed / needed (0 without a fused expansion)
    programs: int                         # the grid: pixel tiles x output-channel tiles x mid-channel slices
    iterations: int                       # steps each program walks one after the other: its slice's mid-channel
    #                                       chunks, plus the last slice's sum of the partial tiles when split
    slices: int                           # mid-channel slices (SPLIT_K)
    tile_taps: int                        # BLOCK_M x BLOCK_K: the depthwise tile of one chunk
    tile_macs: int                        # BLOCK_M x BLOCK_N x BLOCK_K: the pointwise dot of one chunk
    whole_block: bool                     # the expansion conv is fused too

    def compute_seconds(self, hw: HardwareProfile) -> float:
        """Tensor-core plus CUDA-core time; the moved work only on the SMs the pointwise grid keeps busy."""
        busy = min(1.0, self.programs / hw.sm_count)
        vector_rate = hw.vector_flops * hw.vector_efficiency
        moved = self.moved_matrix_seconds_at_peak + self.moved_vector_flops / vector_rate
        return self.matrix_seconds_at_peak + (self.vector_flops - self.moved_vector_flops) / vector_rate + moved / busy

    def serial_seconds(self, hw: HardwareProfile) -> float:
        """The floor of the loop: every program walks its steps in turn, each chunk waiting for its taps (what makes
        the fused kernel slow when few programs run long loops; many programs hide it). A depthwise + pointwise
        step costs what the H200 measured for its tile (`HardwareProfile.conv_conv_step`); a whole block's
        `serial_step`."""
        if self.whole_block:
            return self.iterations * hw.serial_step
        step = hw.conv_conv_step + self.tile_taps * hw.conv_conv_tap_step + self.tile_macs * hw.conv_conv_mac_step
        return self.iterations * step


def conv_conv_work(graph: Graph, nodes: Sequence[str], chain: list[str], tile: Mapping[str, int],
                   peak: float) -> ConvConvWork:
    """What the fused kernel computes with `tile` (see the module docstring)."""
    stages = conv_stages(graph, nodes, chain)
    pointwise = graph[chain[-1]]
    n, c_out, h_out, w_out = pointwise.type.shape
    pixels = n * h_out * w_out
    repeats = -(-c_out // tile["BLOCK_N"])
    matrix = node_flops(graph, pointwise) / (peak * reuse_efficiency(tile["BLOCK_M"], tile["BLOCK_N"]))
    executed = node_flops(graph, pointwise)
    vector = sum(node_flops(graph, graph[name]) for name in stages[-1][1:])   # the pointwise epilogue, once
    moved_vector = 0
    for name in stages[-2]:          # the depthwise and its epilogue, once per output-channel tile
        moved_vector += repeats * node_flops(graph, graph[name])
    moved_matrix = 0.0
    expansion_repeats = 0.0
    if len(chain) == 3:
        expand, depthwise = graph[chain[0]], graph[chain[1]]
        c_mid = expand.type.shape[1]
        taps = math.prod(graph[depthwise.inputs[1]].type.shape[2:])
        flops = 2 * pixels * taps * expansion_block(graph, expand.name) * c_mid * repeats
        moved_matrix = flops / (peak * reuse_efficiency(tile["BLOCK_M"], tile["BLOCK_K"]))
        executed += flops
        epilogue = sum(node_flops(graph, graph[name]) for name in stages[0][1:])
        moved_vector += epilogue * flops // max(1, node_flops(graph, expand))
        expansion_repeats = flops / max(1, node_flops(graph, expand))
    vector += moved_vector
    executed += vector
    slices = tile.get("SPLIT_K", 1)
    programs = -(-pixels // tile["BLOCK_M"]) * repeats * slices
    chunks = -(-graph[chain[-2]].type.shape[1] // tile["BLOCK_K"])
    iterations = -(-chunks // slices) + (1 if slices > 1 else 0)
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    return ConvConvWork(matrix, moved_matrix, vector, moved_vector, executed, repeats, expansion_repeats, programs,
                        iterations, slices, bm * bk, bm * bn * bk, len(chain) == 3)


def conv_conv_estimate(graph: Graph, nodes: Sequence[str], chain: list[str], traffic: GroupTraffic,
                       hw: HardwareProfile, dtype: str) -> KernelEstimate:
    """The fastest fitting tile of a conv-conv kernel, of those measured (the smallest tile, last in the list, only
    where none of them fits); over budget (and priced at the smallest tile) if none fits."""
    peak = hw.matrix_peak(matrix_dtype(dtype, conv=True)) * hw.matrix_efficiency
    memory = traffic.bytes_moved / (hw.memory_bandwidth * hw.memory_efficiency)
    efficiency = hw.conv_conv_efficiency if len(chain) == 2 else 1.0   # measured: see HardwareProfile

    def seconds(work: ConvConvWork) -> float:
        return (max(max(work.compute_seconds(hw), memory) / efficiency, work.serial_seconds(hw))
                + hw.launch_overhead) * hw.time_factor

    best: tuple[float, ResourceEstimate, ConvConvWork] | None = None
    *measured, smallest = conv_conv_tiles(graph, chain, sm_count=hw.sm_count)
    for tile in measured or [smallest]:
        resources = estimate_resources(graph, nodes, chain[0], hw, dtype, tile)
        if not resources.fits:
            continue
        work = conv_conv_work(graph, nodes, chain, tile, peak)
        time = seconds(work)
        if best is None or time < best[0]:
            best = (time, resources, work)
    if best is None:   # the smallest tile (last) only where no other fits; if it does not fit either, the planner
        #                refuses the fusion as over budget, priced at that tile anyway
        resources = estimate_resources(graph, nodes, chain[0], hw, dtype, smallest)
        work = conv_conv_work(graph, nodes, chain, resources.tile, peak)
        best = (seconds(work), resources, work)
    time, resources, work = best
    note = (f"tile {describe_tile(resources.tile)}: depthwise computed {work.depthwise_repeats}x "
            f"(once per output-channel tile)")
    if work.expansion_repeats:
        note += f", expansion {work.expansion_repeats:.2f}x (halo recompute per depthwise tap)"
    note += (f"; {work.executed_flops / max(1, traffic.flops):.2f}x the useful FLOPs executed by "
             f"{work.programs} programs of {work.iterations} loop steps")
    return KernelEstimate(traffic, resources, time, chain[0], note)


def fusion_densities(graph: Graph, first: Sequence[str], second: Sequence[str], users: Users
                     ) -> tuple[float, float]:
    """FLOPs per byte of two groups run apart (their FLOPs over their summed traffic) and fused into one kernel."""
    apart = [group_traffic(graph, part, users) for part in (first, second)]
    fused = group_traffic(graph, list(first) + list(second), users)
    moved = sum(t.bytes_moved for t in apart)
    return (sum(t.flops for t in apart) / moved if moved else 0.0), fused.density


def op_density(graph: Graph, node: Node) -> float:
    """FLOPs per byte the op moves when it runs alone (0 for views and sources)."""
    read, written = node_bytes(graph, node)
    return node_flops(graph, node) / (read + written) if read + written else 0.0


def is_fusion_candidate(graph: Graph, node: Node, config: FusionConfig) -> bool:
    """The seed's rule: a kernel-launching op under the density threshold is worth fusing."""
    return get_op(node.op).launches_kernel and op_density(graph, node) < config.density_threshold
