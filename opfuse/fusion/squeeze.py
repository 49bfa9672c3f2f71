"""Squeeze-and-excitation's squeeze as one kernel: the chain (`squeeze_chain`), its tile, resources and price
(`squeeze_tile`, `squeeze_estimate`). The kernel itself is `opfuse.codegen.squeeze`.

The chain, read off kinds and shapes (never model names): a reduction that averages a 4-D [N, C, H, W] activation
over all of H x W (a global average pool, or a mean over dims 2 and 3) -> a small GEMM from C to R channels (a 1x1
conv on the 1x1 map, or a linear on [N, C]: M = N) with an elementwise epilogue (bias, SiLU or ReLU) -> a small
GEMM from R back to C with its epilogue (sigmoid). Its result scales the block's activation, which the next 1x1
conv takes as its prologue. Apart these are three launches of almost no work each (the pool, two M = N GEMMs);
fused they are one:

- programs over (sample, block of BLOCK_C channels, SPLIT slices of the spatial positions) each reduce their
  slice, add it into a float32 sum per (sample, channel) and take a ticket from a counter per sample; the program
  that takes the last ticket of its sample runs both GEMMs for it, streaming the two weights in chunks of BLOCK_K
  channels (the hidden R values stay in registers), writes the C outputs and resets the sums and the counter, so
  the next call (and a CUDA graph replay) starts from zero. SPLIT = 0 is the plain form: one program per sample
  reduces every channel chunk itself, no atomics.
- what must fit one program: the hidden vector (R padded to a power of two, float32), a BLOCK_R x BLOCK_K weight
  chunk and the pool tile. Past MAX_HIDDEN hidden channels the chain is refused (over budget, with the reason).

Price: the pool's traffic at the roofline, then the tail: one program per sample (in waves of the SMs) streams
both weights (`HardwareProfile.program_bandwidth`) after a load it waits for (`load_latency`), plus the launch.
The planner fuses the chain when that beats the three kernels apart (`opfuse.fusion.planner`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from opfuse.fusion.legality_common import reachable
from opfuse.fusion.legality_conv import is_pointwise_conv
from opfuse.fusion.plan import ResourceEstimate
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import DTYPE_BYTES, Graph, Node, dtype_name
from opfuse.ir.ops import FusionKind, kind_of

MAX_HIDDEN = 2048        # hidden (R) channels at most: their float32 vector and a weight chunk live in registers
TAIL_ELEMENTS = 4096     # elements of one BLOCK_R x BLOCK_K weight chunk of the tail (at least 16 channels deep)
POOL_ELEMENTS = 2048     # elements of one BLOCK_HW x BLOCK_C pool tile
POOL_CHANNELS = 64       # channels of a pool tile (BLOCK_C)
MAX_SPLIT = 64           # spatial slices per (sample, channel block) at most
SQUEEZE_WARPS = (4, 8)
ADDRESSING_REGISTERS = 40


@dataclass(frozen=True)
class SqueezeChain:
    """The nodes of one squeeze chain and its sizes."""

    pool: str                       # the global average (adaptive_avg_pool2d to 1x1, or mean over H, W)
    first: str                      # the GEMM from C to R channels
    second: str                     # the GEMM from R back to C channels
    first_epilogue: tuple[str, ...]     # elementwise nodes after `first`, in order
    second_epilogue: tuple[str, ...]    # elementwise nodes after `second`, in order
    batch: int
    channels: int                   # C
    hidden: int                     # R
    height: int
    width: int

    @property
    def spatial(self) -> int:
        return self.height * self.width


def global_average(graph: Graph, node: Node) -> bool:
    """A reduction averaging a 4-D activation over all of its spatial dims (H, W)."""
    if kind_of(node) is not FusionKind.REDUCTION or len(graph[node.inputs[0]].type.shape) != 4:
        return False
    if node.op == "adaptive_avg_pool2d":
        return tuple(node.type.shape[-2:]) == (1, 1) and len(node.type.shape) == 4
    if node.op == "mean":
        dims = node.attrs.get("dims")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        return sorted(d % 4 for d in dims) == [2, 3]
    return False


def small_gemm(graph: Graph, name: str, source: str) -> bool:
    """A 1x1 conv on a 1x1 map or a linear on a [N, C] matrix, reading `source`, with constant weight and bias."""
    node = graph[name]
    if kind_of(node) is not FusionKind.ANCHOR or not node.inputs or node.inputs[0] != source:
        return False
    if not all(graph.is_constant(v) for v in node.inputs[1:]):
        return False
    shape = graph[source].type.shape
    if node.op == "linear":
        return len(shape) == 2
    return is_pointwise_conv(graph, name) and tuple(shape[2:]) == (1, 1)


def squeeze_chain(graph: Graph, nodes: Sequence[str], users: Mapping[str, Sequence[Node]]
                  ) -> SqueezeChain | Reason | None:
    """The squeeze chain `nodes` are; a Reason (code not-squeeze) why a global average with two GEMMs after it is
    none; None when `nodes` hold no global average and two anchors at all."""
    nodes = list(nodes)
    reductions = [n for n in nodes if kind_of(graph[n]) is FusionKind.REDUCTION]
    anchors = [n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR]
    if len(reductions) != 1 or len(anchors) != 2 or not global_average(graph, graph[reductions[0]]):
        return None
    pool, within = reductions[0], set(nodes)

    def refuse(text: str) -> Reason:
        return Reason(Code.NOT_SQUEEZE, f"global average {pool} and GEMMs {', '.join(anchors)}: {text}")

    first = next((a for a in anchors if graph[a].inputs[0] == pool), None)
    if first is None or not small_gemm(graph, first, pool):
        return refuse("the first is no 1x1 conv on the pooled 1x1 map (or linear on it) with constant weights")
    second = next(a for a in anchors if a != first)
    first_stage = sorted(reachable(graph, first, within - {second}, users) - {first}, key=nodes.index)
    feeds = graph[second].inputs[0]
    if feeds not in first_stage + [first] or not small_gemm(graph, second, feeds) \
            or graph[second].op != graph[first].op:
        return refuse(f"{second} is no GEMM of the same kind on {first}'s result")
    second_stage = sorted(reachable(graph, second, within, users) - {second}, key=nodes.index)
    if set(nodes) != {pool, first, second, *first_stage, *second_stage}:
        return refuse("a node of the group is on neither GEMM's epilogue")
    n, c, h, w = graph[graph[pool].inputs[0]].type.shape
    r = graph[first].type.shape[1]
    if graph[second].type.shape[1] != c:
        return refuse(f"{second} gives {graph[second].type.shape[1]} channels, not the pooled {c}")
    for anchor, stage, size in ((first, first_stage, r), (second, second_stage, c)):
        for name in stage:    # (each stage is computed over its own channels: it reads its own values only)
            problem = _epilogue_problem(graph, graph[name], {anchor, *stage}, size)
            if problem:
                return refuse(problem)
    for name in [pool, first, *first_stage]:
        readers = [u.name for u in users[name] if u.name not in within]
        if readers or name in graph.outputs:
            return refuse(f"{name} is read outside the chain ({', '.join(readers) or 'a graph output'}): its "
                          "values stay in the kernel")
    return SqueezeChain(pool, first, second, tuple(first_stage), tuple(second_stage), n, c, r, h, w)


def _epilogue_problem(graph: Graph, node: Node, stage: set[str], channels: int) -> str | None:
    """Why an epilogue node is not elementwise over its GEMM's [N, channels] result (the values of `stage`) with
    per-channel constants."""
    if not kind_of(node).elementwise:
        return f"{node.name} ({node.op}) is not elementwise"
    for value in node.inputs:
        if value in stage:
            if graph[value].type.numel != node.type.numel:
                return f"{node.name} ({node.op}) changes the number of elements"
            continue
        if not graph.is_constant(value):
            return f"{node.name} reads {value}, no constant nor a value of its own GEMM's epilogue"
        shape = graph[value].type.shape
        aligned = (1,) * (len(node.type.shape) - len(shape)) + tuple(shape)
        if any(size != 1 for dim, size in enumerate(aligned) if dim != 1) or (len(aligned) > 1 and aligned[1]
                                                                               not in (1, channels)):
            return f"{node.name} reads {value} {graph[value].type}, which is no per-channel constant"
    return None


# ---- tile and resources --------------------------------------------------------------------------------

def _pow2(n: int, least: int = 2) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


def squeeze_tile(chain: SqueezeChain, sm_count: int, num_warps: int = 4, split: int | None = None
                 ) -> dict[str, int]:
    """The kernel's tile: BLOCK_R (hidden, padded), BLOCK_K (channels of a tail chunk), BLOCK_C x BLOCK_HW (the pool
    tile) and SPLIT spatial slices (`split`, or enough for about two programs per SM; 0: the plain form, one
    program per sample)."""
    block_r = _pow2(chain.hidden)
    block_k = min(_pow2(chain.channels, 16), max(16, TAIL_ELEMENTS // block_r))
    block_c = min(_pow2(chain.channels), POOL_CHANNELS) if split != 0 else block_k
    block_hw = min(_pow2(chain.spatial), max(1, POOL_ELEMENTS // block_c))
    steps = -(-chain.spatial // block_hw)
    if split is None:
        per_sample = -(-2 * sm_count // chain.batch)
        split = min(steps, MAX_SPLIT, max(1, -(-per_sample // -(-chain.channels // block_c))))
    return {"BLOCK_R": block_r, "BLOCK_K": block_k, "BLOCK_C": block_c, "BLOCK_HW": block_hw,
            "SPLIT": min(split, steps), "num_warps": num_warps}


def squeeze_resources(chain: SqueezeChain, hw: HardwareProfile, itemsize: int, tile: Mapping[str, int]
                      ) -> ResourceEstimate:
    """Registers and shared memory of one program of the squeeze kernel with `tile`."""
    threads = 32 * tile["num_warps"]

    def per_thread(elements: int) -> int:
        return math.ceil(elements / threads)

    pool = tile["BLOCK_HW"] * tile["BLOCK_C"]
    chunk = tile["BLOCK_R"] * tile["BLOCK_K"]
    registers = [("pool accumulator", per_thread(pool)), ("pool tile", per_thread(pool * itemsize // 4 or 1)),
                 ("hidden vector", per_thread(tile["BLOCK_R"])),
                 ("weight chunk and its products", 2 * per_thread(chunk)),
                 ("pooled chunk", per_thread(tile["BLOCK_K"])), ("addressing", ADDRESSING_REGISTERS)]
    shared = [("cross-warp sums", 4 * tile["num_warps"] * max(tile["BLOCK_R"], tile["BLOCK_C"], tile["BLOCK_K"]))]
    regs, smem = sum(v for _, v in registers), sum(v for _, v in shared)
    problems = []
    if chain.hidden > MAX_HIDDEN:
        problems.append(f"{chain.hidden} hidden channels > {MAX_HIDDEN}, the most one program holds")
    if regs > hw.max_registers_per_thread:
        parts = ", ".join(f"{label} {v}" for label, v in registers if v)
        problems.append(f"needs {regs} registers/thread > {hw.max_registers_per_thread} ({parts})")
    if smem > hw.shared_memory_per_block:
        problems.append(f"needs {smem} B shared memory > {hw.shared_memory_per_block} B per block")
    return ResourceEstimate(tile=dict(tile), registers_per_thread=regs, shared_memory_bytes=smem,
                            fits=not problems, reason="; ".join(problems))


def fitting_resources(chain: SqueezeChain, hw: HardwareProfile, dtype: str) -> ResourceEstimate:
    """The first tile (4 warps, then 8) that fits, else the last, over budget with its reason."""
    itemsize = DTYPE_BYTES[dtype_name(dtype)]
    estimate = None
    for warps in SQUEEZE_WARPS:
        estimate = squeeze_resources(chain, hw, itemsize, squeeze_tile(chain, hw.sm_count, warps))
        if estimate.fits:
            return estimate
    return estimate


def tail_seconds(chain: SqueezeChain, hw: HardwareProfile, itemsize: int) -> float:
    """The two GEMMs after the pool: one program per sample, in waves of the SMs, streams both weights."""
    weights = 2 * chain.channels * chain.hidden * itemsize
    waves = -(-chain.batch // hw.sm_count)
    return waves * (2 * hw.load_latency + weights / hw.program_bandwidth)


def squeeze_seconds(chain: SqueezeChain, bytes_moved: int, flops: int, hw: HardwareProfile, dtype: str) -> float:
    """Predicted seconds of the squeeze kernel: the pool at the roofline, then the tail, plus the launch."""
    itemsize = DTYPE_BYTES[dtype_name(dtype)]
    pool = max(bytes_moved / (hw.memory_bandwidth * hw.memory_efficiency),
               flops / (hw.vector_flops * hw.vector_efficiency))
    return (pool + tail_seconds(chain, hw, itemsize) + hw.launch_overhead) * hw.time_factor
