"""Resource model: what the Triton kernel of a group needs per tile, and whether it fits (`estimate_resources`).

XLA and nvFuser refuse a fusion that would spill registers or overflow shared memory; so does opfuse (the
seed's warning: fuse too much and the kernel gets slower, not faster). The model follows the kernel each group
becomes, counted the way a Triton kernel holds data:

- anchors (conv as implicit GEMM, linear, matmul): an output tile BLOCK_M x BLOCK_N, a K loop of BLOCK_K with
  `num_stages` buffers in shared memory. Registers per thread: the float32 accumulator (BM*BN/threads), each
  full-size epilogue operand held as a tile (a residual: BM*BN*itemsize/4/threads, two 16-bit values a
  register), each per-channel vector (bias, BN scale: BN/threads), each epilogue value alive twice (x*sigmoid(x))
  as another float32 tile, and ADDRESSING_REGISTERS for pointers, offsets and masks. A layer norm prologue adds
  its row statistics (mean and rstd, BM/threads each), its weight and bias per K tile (BK/threads each) and the
  A tile normalized in float32 (BM*BK/threads).
- conv-conv chains (depthwise -> 1x1, optionally after a 1x1 expansion; `opfuse.codegen.conv_conv`): a
  BLOCK_M pixels x BLOCK_N output channels accumulator for the pointwise conv, plus, per chunk of BLOCK_K mid
  channels, the depthwise tile computed on the fly (a float32 BLOCK_M x BLOCK_K accumulator and the input tap
  being multiplied in), its per-channel epilogue vectors, and the expansion's tile and input tap when the block's
  expand conv is fused too. Shared memory: the pointwise weight chunk per pipeline stage, the depthwise result
  staged as the MMA's A operand, the expansion weight chunk and input tap. Both tiles must fit together.
- attention (sdpa): flash attention, a BLOCK_M x head_dim accumulator plus a BLOCK_M x BLOCK_N score tile;
  K and V blocks in shared memory.
- row reductions (softmax, layer norm, mean, sum, cumsum, amax, global pools): the row template's chunk of
  BLOCK_M rows x BLOCK_L elements (`tiles.row_kernel_tiles`; a longer row is walked in chunks); every live operand
  costs a chunk of registers, each reduction a cross-warp exchange in shared memory. Pooling windows: the pooling
  template's BLOCK_P pixels x BLOCK_C channels (`tiles.pool_tiles`).
- everything else (elementwise, pooling windows, copies): BLOCK elements per program (`tiles.POINTWISE`, the
  template's blocks); every live operand costs BLOCK/threads registers.

Each family tries the tiles its template launches (one tile space, `opfuse.fusion.tiles`: the templates take their
configs from the same lists) from the default down and takes the first that fits; only when none fits is the group
over budget, with the reason in words. Hardware limits come from `HardwareProfile` only.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from opfuse.fusion.legality_anchors import ROW_NORMS, row_norm_epilogue
from opfuse.fusion.legality_conv import conv_stages
from opfuse.fusion.plan import ResourceEstimate
from opfuse.fusion.tiles import (ADDRESSING_REGISTERS, ATTENTION_TILES, POINTWISE, RowView, anchor_loop, anchor_tiles,
                                 attention_tile, depthwise_tiles, pool_tiles, row_kernel_tiles, row_view)
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import DTYPE_BYTES, Graph, dtype_name
from opfuse.ir.ops import FusionKind, get_op, kind_of

# conv-conv tiles: pixels x output channels x mid channels. A depthwise + pointwise kernel walks its mid channels
# in a chain of BLOCK_K chunks, each waiting for its taps, so small pixel tiles with 4 warps win at both batch sizes;
# 3 stages put the taps in shared memory (126 registers where 2 stages took 237). Measured on the H200 (2026-11-30,
# triton 3.6, `benchmarks/conv_conv_sweep.py`, mobilenet_v2 at batch 1 and 64): the old wide tiles (128 x 256, 8
# warps, still the whole block's, below) ran 1.25x to 9.4x slower than the best measured config in every block.
DEPTHWISE_POINTWISE_TILES = (
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32, "num_stages": 3, "num_warps": 4},
    # where the pixels fill the GPU, 64-pixel tiles over 16-deep mid chunks in one stage win (run 55 in
    # RESULTS.md), so a short tuning times both shapes
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 1, "num_warps": 4},
    {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 32, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 1, "num_warps": 4},   # the smallest, to fit
)
WHOLE_BLOCK_TILES = (  # with the expansion fused too; wide BLOCK_N first: each N tile recomputes the depthwise
    {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 32, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 32, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 64, "num_stages": 2, "num_warps": 4},   # few pixels, long loops
    {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "num_stages": 1, "num_warps": 4},
)
CONV_CONV_SLICES = (1, 2, 4, 8)   # mid-channel slices a depthwise + pointwise tile grid may run (`conv_conv_slices`)
# registers per thread the last slice's unrolled sum may hold (all partial tiles at once): on the H200 (2026-11-30,
# runs 16, 17, 19) 64 ran without spills (16x64 with 8 slices, 32x64 with 4, 4 warps), 128 spilled up to 2 values
# (32x256 with 2 slices) and 256 spilled 32 to 360 (32x128 with 8, 32x256 with 4, 64x64 with 8)
SLICE_SUM_REGISTERS = 64

# reduced quantities the row template keeps per row, by its mode (max and sum, mean and variance, a scan's carry; 1
# for the others): its cross-warp scratch
ROW_STATISTICS = {"softmax": 2, "layer_norm": 2}


def estimate_resources(graph: Graph, nodes: Iterable[str], anchor: str | None, hw: HardwareProfile,
                       dtype: str, tile: Mapping[str, int] | None = None) -> ResourceEstimate:
    """Registers and shared memory of the group's kernel for `tile` (or the first candidate tile that fits). `nodes`
    with their views: the permute that leads a depthwise conv's epilogue to its norm (`row_norm_epilogue`)."""
    nodes = list(nodes)
    norm = row_norm_epilogue(graph, anchor, nodes) if anchor is not None else None
    nodes = [n for n in nodes if not get_op(graph[n].op).alias]
    if not nodes:
        return ResourceEstimate(tile={}, registers_per_thread=0, shared_memory_bytes=0, fits=True,
                                reason="views only: no kernel")
    itemsize = DTYPE_BYTES[dtype_name(dtype)]
    if anchor is not None and graph[anchor].op == "sdpa":
        candidates = [_attention(graph, nodes, anchor, hw, itemsize, t) for t in _tiles(ATTENTION_TILES, tile)]
    elif anchor is not None and (chain := conv_chain(graph, nodes)):
        candidates = [_conv_conv(graph, nodes, chain, hw, itemsize, t)
                      for t in conv_conv_tiles(graph, chain, hw.sm_count, tile)]
    elif norm is not None:   # tiles over all the channels
        candidates = [_whole_rows(graph, nodes, anchor, hw, itemsize, t)
                      for t in _depthwise_tiles(graph, anchor, itemsize, hw, tile, whole_rows=True)]
    elif anchor is not None and (problem := anchor_problem(graph, nodes, anchor)) is not None:
        tiles = [dict(tile)] if tile is not None else anchor_tiles(*problem, itemsize, anchor_loop(graph, anchor)[1],
                                                                   hw=hw)
        candidates = [_gemm(graph, nodes, anchor, hw, itemsize, t) for t in tiles]
        estimate = _first_fit(candidates)
        estimate.rate_tile = rate_tile(problem, [c.tile for c in candidates if c.fits])
        return estimate
    elif anchor is not None:     # a conv of one input channel a group: no GEMM, the depthwise template
        candidates = [_depthwise(graph, nodes, anchor, hw, itemsize, t)
                      for t in _depthwise_tiles(graph, anchor, itemsize, hw, tile)]
    elif (reduction := reduction_of(graph, nodes)) is not None:
        candidates = _reduction_candidates(graph, nodes, reduction, hw, tile)
    else:
        candidates = [_pointwise(graph, nodes, hw, t) for t in _pointwise_tiles(tile)]
    return _first_fit(candidates)


def anchor_of(graph: Graph, nodes: Iterable[str]) -> str | None:
    """The group's first anchor node (the first sibling in a horizontal group), or None."""
    return next((n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR), None)


def gemm_view(graph: Graph, anchor: str) -> tuple[int, int, int, int] | None:
    """(rows, columns, reduction length, independent GEMMs) of an anchor as its kernel computes it: a linear or
    matmul directly (a 1-D matmul operand is one row, left, or one column, right, as torch.matmul reads it), a conv as
    implicit GEMM per conv group (pixels x output channels of a group x taps * input channels of a group); None for
    other anchors and depthwise convs (their kernel reduces nothing across channels)."""
    node = graph[anchor]
    shape = node.type.shape
    if node.op == "linear":
        return math.prod(shape[:-1]), shape[-1], graph[node.inputs[1]].type.shape[1], 1
    if node.op == "matmul":
        x, w = (graph[i].type.shape for i in node.inputs[:2])
        rows, columns = (x[-2] if len(x) > 1 else 1), (w[-1] if len(w) > 1 else 1)
        return rows, columns, x[-1], math.prod(shape) // (rows * columns)
    if node.op == "conv2d" and len(shape) == 4:
        groups = int(node.attrs.get("groups", 1))
        cin_g, kh, kw = graph[node.inputs[1]].type.shape[1:]
        if groups > 1 and cin_g == 1:
            return None
        return shape[0] * shape[2] * shape[3], shape[1] // groups, cin_g * kh * kw, groups
    return None


def conv_chain(graph: Graph, nodes: Iterable[str]) -> list[str]:
    """The convs of a conv-conv group in order ([expand,] depthwise, pointwise) when each one feeds the next, else
    [] (one anchor, or sibling anchors of a horizontal group)."""
    nodes = list(nodes)
    anchors = [n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR]
    if len(anchors) < 2 or any(graph[a].op != "conv2d" for a in anchors):
        return []
    within = set(nodes)
    if all(later in _downstream(graph, earlier, within) for earlier, later in zip(anchors, anchors[1:])):
        return anchors
    return []


def reduction_of(graph: Graph, nodes: Iterable[str]) -> str | None:
    """The group's reduction node (a row reduction, an extreme, a pooling window), or None."""
    return next((n for n in nodes if kind_of(graph[n]) is FusionKind.REDUCTION), None)


# ---- the anchor kernels --------------------------------------------------------------------------------

def anchor_problem(graph: Graph, nodes: Iterable[str], anchor: str) -> tuple[int, int, int, int] | None:
    """(rows, columns, reduction length, independent GEMMs) of the GEMM a group anchored on `anchor` runs: the
    anchor's `gemm_view`, with the columns of every sibling anchor of a horizontal group (one GEMM over their
    concatenated weights); None where the anchor is no GEMM (a depthwise conv)."""
    view = gemm_view(graph, anchor)
    if view is None:
        return None
    rows, columns, reduction, batch = view
    siblings = [n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR]
    if len(siblings) > 1:
        columns = sum(graph[n].type.shape[-1 if graph[n].op == "linear" else 1] for n in siblings)
    return rows, columns, reduction, batch


def rate_tile(problem: tuple[int, int, int, int], fitting: list[dict[str, int]]) -> dict[str, int] | None:
    """The tile whose tensor-core rate prices an anchor kernel (`opfuse.fusion.cost.tile_efficiency`): of the tiles
    that fit, the one of most operand reuse BM*BN/(BM+BN), each dim clipped to the problem (at least 16). The
    autotuner keeps the fastest tile, and the rate the calibration measured (`HardwareProfile.matrix_efficiency`)
    is that of a large tile; the default tile a kernel launches untuned (`anchor_tiles`, priced for registers and
    shared memory) is often smaller. None where nothing fits (the fitted tile prices it). `problem`: the anchor's
    `anchor_problem`."""
    if not fitting:
        return None
    rows, columns = problem[:2]

    def clipped(t: dict[str, int]) -> tuple[int, int]:
        return min(t["BLOCK_M"], _pow2(rows)), min(t["BLOCK_N"], _pow2(columns))

    m, n = max((clipped(t) for t in fitting), key=lambda mn: mn[0] * mn[1] / (mn[0] + mn[1]))
    return {"BLOCK_M": m, "BLOCK_N": n}


def _depthwise_tiles(graph: Graph, anchor: str, itemsize: int, hw: HardwareProfile, tile: Mapping[str, int] | None,
                     whole_rows: bool = False) -> list[dict[str, int]]:
    """The tiles a depthwise conv's kernel runs, the default first: `depthwise_tiles` for GPU `hw`, the list its
    template takes its configs from."""
    if tile is not None:
        return [dict(tile)]
    n, channels, _, width = graph[anchor].type.shape
    kh, kw = graph[graph[anchor].inputs[1]].type.shape[2:]
    pixels = graph[anchor].type.numel // channels
    return depthwise_tiles(pixels, channels, hw.sm_count, kh * kw, itemsize, hw.max_registers_per_thread, width,
                           whole_rows)


def _depthwise(graph: Graph, nodes: list[str], anchor: str, hw: HardwareProfile, itemsize: int,
               tile: dict[str, int]) -> ResourceEstimate:
    """A direct depthwise conv (`opfuse.codegen.conv_depthwise`): its float32 tile and epilogue as an anchor's, and
    the taps it holds at once, packed 32 bits to a register: every tap of the filter unrolled, one filter row where
    it loops over rows (ROW_LOOP) or runs along a row (COLS). Each tap is loaded straight into registers: no shared
    memory."""
    kh, kw = graph[graph[anchor].inputs[1]].type.shape[2:]
    threads = 32 * tile["num_warps"]
    elements = _per_thread(tile["BLOCK_M"] * tile["BLOCK_N"], threads)
    taps = kw if tile.get("ROW_LOOP") or tile.get("COLS") else kh * kw
    registers = _tile_registers(graph, nodes, anchor, itemsize, tile["BLOCK_M"], tile["BLOCK_N"], threads) + [
        (f"{taps} taps held", math.ceil(taps * elements * itemsize / 4))]
    return _check(hw, tile, threads, registers, [])


def _tile_registers(graph: Graph, nodes: list[str], anchor: str, itemsize: int, bm: int, bn: int,
                    threads: int) -> list[tuple[str, int]]:
    """The registers per thread of an anchor's bm x bn float32 output tile and its epilogue: the accumulator, the
    epilogue's operands (`epilogue_operands`, the anchor's own bias a per-channel vector among them) and the
    addressing."""
    full, vectors, twice = epilogue_operands(graph, nodes, anchor)
    if len(graph[anchor].inputs) > 2:
        vectors += 1   # the anchor's own bias is a per-channel vector of the epilogue
    return [("accumulator", _per_thread(bm * bn, threads)),
            (f"{full} full-tile operand(s)", full * _per_thread(bm * bn * itemsize // 4, threads)),
            (f"{vectors} per-channel vector(s)", vectors * _per_thread(bn, threads)),
            (f"{twice} value(s) used twice", twice * _per_thread(bm * bn, threads)),
            ("addressing", ADDRESSING_REGISTERS)]


def _gemm(graph: Graph, nodes: list[str], anchor: str, hw: HardwareProfile, itemsize: int,
          tile: dict[str, int]) -> ResourceEstimate:
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    threads = 32 * tile["num_warps"]
    full = epilogue_operands(graph, nodes, anchor)[0]
    registers = _tile_registers(graph, nodes, anchor, itemsize, bm, bn, threads)
    if any(graph[n].op in ROW_NORMS for n in nodes):   # legal only as a linear's prologue (`anchor_prologue`)
        registers += [("row statistics (mean, rstd)", 2 * _per_thread(bm, threads)),
                      ("norm weight and bias per K tile", 2 * _per_thread(bk, threads)),
                      ("normalized A tile in float32", _per_thread(bm * bk, threads))]
    shared = [(f"{tile['num_stages']} stages x ({bm}x{bk} + {bk}x{bn}) x {itemsize} B",
               tile["num_stages"] * (bm * bk + bk * bn) * itemsize),
              ("epilogue staging", bm * bn * itemsize if full else 0)]
    return _check(hw, tile, threads, registers, shared)


def _whole_rows(graph: Graph, nodes: list[str], anchor: str, hw: HardwareProfile, itemsize: int,
                tile: dict[str, int]) -> ResourceEstimate:
    """A depthwise conv whose tile spans the channels and normalizes its rows (`row_norm_epilogue`): its float32
    tile, the centered copy the variance is taken of, the row statistics, the epilogue's operands; each tap is
    loaded straight into registers, so no shared memory but the row sums' exchange between warps."""
    bm, bn = tile["BLOCK_M"], tile["BLOCK_N"]
    threads = 32 * tile["num_warps"]
    registers = _tile_registers(graph, nodes, anchor, itemsize, bm, bn, threads) + [
        ("the centered tile", _per_thread(bm * bn, threads)),
        ("row statistics (mean, rstd)", 2 * _per_thread(bm, threads))]
    shared = [("row sums exchanged between warps", 2 * bm * tile["num_warps"] * 4)]
    return _check(hw, tile, threads, registers, shared)


def conv_conv_tiles(graph: Graph, chain: list[str], sm_count: int, tile: Mapping[str, int] | None = None
                    ) -> list[dict[str, int]]:
    """Candidate conv-conv tiles clipped to the problem (`conv_conv_blocks`), with the mid-channel slices (SPLIT_K)
    their grid runs: `conv_conv_slices` for a depthwise + pointwise kernel, 1 for a whole block."""
    pointwise = graph[chain[-1]]
    n, c_out, h, w = pointwise.type.shape
    c_mid = graph[chain[-2]].type.shape[1]
    tiles = []
    for t in conv_conv_blocks(graph, chain, tile):
        if "SPLIT_K" not in t:
            programs = -(-(n * h * w) // t["BLOCK_M"]) * -(-c_out // t["BLOCK_N"])
            most = SLICE_SUM_REGISTERS // _per_thread(t["BLOCK_M"] * t["BLOCK_N"], 32 * t["num_warps"])
            t = dict(t, SPLIT_K=1 if len(chain) == 3 else
                     conv_conv_slices(programs, -(-c_mid // t["BLOCK_K"]), sm_count, most))
        tiles.append(t)
    return tiles


def conv_conv_slice_table(graph: Graph, chain: list[str], sm_count: int) -> dict[str, int]:
    """The planner's decision for a conv-conv kernel: the mid-channel slices of each candidate tile, by
    `conv_conv_key` (`FusionGroup.split_k`), which codegen reads and never works out again."""
    return {conv_conv_key(t): t["SPLIT_K"] for t in conv_conv_tiles(graph, chain, sm_count)}


def conv_conv_key(tile: Mapping[str, int]) -> str:
    """A conv-conv tile's name in the slice table: its blocks and warps, what its grid and its slices' sum
    registers depend on."""
    return f"{tile['BLOCK_M']}x{tile['BLOCK_N']}x{tile['BLOCK_K']}w{tile['num_warps']}"


def conv_conv_blocks(graph: Graph, chain: list[str], tile: Mapping[str, int] | None = None
                     ) -> list[dict[str, int]]:
    """Candidate conv-conv tiles clipped to the problem, without their slices: BLOCK_M to the pixels, BLOCK_N to
    the output channels, BLOCK_K to the mid (depthwise) channels, each at least 16 (Triton's smallest dot)."""
    pointwise = graph[chain[-1]]
    n, c_out, h, w = pointwise.type.shape
    c_mid = graph[chain[-2]].type.shape[1]
    whole = len(chain) == 3
    clipped = []
    for t in _tiles(WHOLE_BLOCK_TILES if whole else DEPTHWISE_POINTWISE_TILES, tile):
        t = dict(t, BLOCK_M=min(t["BLOCK_M"], _pow2(n * h * w)), BLOCK_N=min(t["BLOCK_N"], _pow2(c_out)),
                 BLOCK_K=min(t["BLOCK_K"], _pow2(c_mid)))
        if tile is None and whole and t["BLOCK_K"] > 32 and expansion_block(graph, chain[0]) > 16:
            continue   # 64-deep mid chunks of an expansion over more than 16 channels: 255 registers and 50 to 74
            #            spills measured (H200, triton 3.6, mobilenet_v2's blocks 3 to 7 at batch 1)
        if tile is None and whole and t["BLOCK_N"] > 32 and t["num_warps"] > 4:
            # a fused expansion is a second MMA in the loop: with 8 warps and more than 32 output channels Triton
            # held 255 registers and spilled (H200, triton 3.6: 64x64 and 128x64 tiles of mobilenet_v2's block 7
            # at batch 64), where 4 warps took 220 and did not; the register count below does not see layouts
            t["num_warps"] = 4
        if t not in clipped:
            clipped.append(t)
    return clipped


def conv_conv_slices(programs: int, chunks: int, sm_count: int, most: int = CONV_CONV_SLICES[-1]) -> int:
    """Mid-channel slices of a depthwise + pointwise kernel with `programs` tiles over `chunks` BLOCK_K chunks: of
    CONV_CONV_SLICES up to `most` (what the sum's registers allow, SLICE_SUM_REGISTERS), the count whose programs
    walk the shortest chain (their slice's chunks, plus one step for the last slice's sum when split) without more
    programs than SMs and without an empty slice; ties keep fewer slices. Measured on the H200 (2026-11-30,
    mobilenet_v2 at batch 1): blocks 15-17 took 17.5 us unsplit and 5.6 us with 8 slices; at batch 64, where the
    tiles fill the GPU, slicing only added work (0.6x to 0.9x)."""
    best, chain = 1, chunks
    for slices in CONV_CONV_SLICES[1:]:
        per_slice = -(-chunks // slices)
        if slices > most or programs * slices > sm_count or leaves_a_slice_empty(chunks, slices):
            continue
        if per_slice + 1 < chain:
            best, chain = slices, per_slice + 1
    return best


def leaves_a_slice_empty(chunks: int, slices: int) -> bool:
    """Whether `slices` slices of ceil(chunks / slices) chunks each leave the last one nothing to walk."""
    return -(-chunks // slices) * (slices - 1) >= chunks


def expansion_block(graph: Graph, expand: str) -> int:
    """Input channels of a fused expansion conv padded to its one power-of-two K block (at least 16)."""
    return _pow2(graph[graph[expand].inputs[0]].type.shape[1])


def _conv_conv(graph: Graph, nodes: list[str], chain: list[str], hw: HardwareProfile, itemsize: int,
               tile: dict[str, int]) -> ResourceEstimate:
    """The fused [expand ->] depthwise -> pointwise kernel: both tiles live at once (see the module docstring)."""
    bm, bn, bk = tile["BLOCK_M"], tile["BLOCK_N"], tile["BLOCK_K"]
    threads = 32 * tile["num_warps"]
    stages = conv_stages(graph, nodes, chain)
    full, vectors, twice = epilogue_operands(graph, stages[-1], chain[-1])
    vectors += 1 if len(graph[chain[-1]].inputs) > 2 else 0   # the pointwise conv's own bias
    registers = [("pointwise accumulator", _per_thread(bm * bn, threads)),
                 (f"{full} full-tile operand(s)", full * _per_thread(bm * bn * itemsize // 4, threads)),
                 (f"{vectors} per-channel vector(s)", vectors * _per_thread(bn, threads)),
                 (f"{twice} value(s) used twice", twice * _per_thread(bm * bn, threads))]
    shared = [(f"{tile['num_stages']} stages x pointwise weight {bk}x{bn} x {itemsize} B",
               tile["num_stages"] * bk * bn * itemsize),
              (f"depthwise result {bm}x{bk} (the MMA's A operand)", bm * bk * itemsize),
              ("epilogue staging", bm * bn * itemsize if full else 0)]
    for anchor, stage in zip(chain[:-1], stages[:-1]):
        role = "depthwise" if anchor == chain[-2] else "expansion"
        _, stage_vectors, stage_twice = epilogue_operands(graph, stage, anchor)
        stage_vectors += 1 if len(graph[anchor].inputs) > 2 else 0
        if role == "depthwise":   # the input tap multiplied in: BLOCK_K channels of BLOCK_M pixels
            tap = bk
        else:                     # the expansion's input tap: all its input channels, one K block
            tap = expansion_block(graph, anchor)
            shared += [(f"expansion weight {tap}x{bk}", tap * bk * itemsize),
                       (f"expansion input tap {bm}x{tap}", bm * tap * itemsize)]
        registers += [(f"{role} tile", _per_thread(bm * bk, threads)),
                      (f"{role} input tap", _per_thread(bm * tap * itemsize // 4, threads)),
                      (f"{stage_vectors} {role} per-channel vector(s)", stage_vectors * _per_thread(bk, threads)),
                      (f"{stage_twice} {role} value(s) used twice", stage_twice * _per_thread(bm * bk, threads))]
    slices = tile.get("SPLIT_K", 1)
    if slices > 1:   # the last slice's sum loads every partial tile at once (the loop is unrolled)
        registers.append((f"{slices} partial tiles summed", slices * _per_thread(bm * bn, threads)))
    registers.append(("addressing", ADDRESSING_REGISTERS))
    return _check(hw, tile, threads, registers, shared)


def _attention(graph: Graph, nodes: list[str], anchor: str, hw: HardwareProfile, itemsize: int,
               tile: dict[str, int]) -> ResourceEstimate:
    node = graph[anchor]
    q = graph[node.inputs[0]].type.shape
    s_q, head_dim, value_dim = q[-2], q[-1], graph[node.inputs[2]].type.shape[-1]
    tile = dict(attention_tile(tile, s_q), HEAD_DIM=_pow2(head_dim))
    bm, bn, d = tile["BLOCK_M"], tile["BLOCK_N"], tile["HEAD_DIM"]
    dv = _pow2(value_dim)       # the accumulator's and the epilogue's columns: V's head dim
    threads = 32 * tile["num_warps"]
    full, vectors, twice = epilogue_operands(graph, nodes, anchor)
    mask = 1 if len(node.inputs) > 3 else 0
    registers = [("accumulator", _per_thread(bm * dv, threads)),
                 ("scores", _per_thread(bm * bn, threads)),
                 ("query tile", _per_thread(bm * d * itemsize // 4, threads)),
                 (f"{mask} mask tile(s)", mask * _per_thread(bm * bn * itemsize // 4, threads)),
                 (f"{full} full-tile operand(s)", full * _per_thread(bm * dv * itemsize // 4, threads)),
                 (f"{vectors} vector(s)", vectors * _per_thread(dv, threads)),
                 (f"{twice} value(s) used twice", twice * _per_thread(bm * dv, threads)),
                 ("addressing", ADDRESSING_REGISTERS)]
    shared = [(f"{tile['num_stages']} stages x K and V blocks {bn}x{d} and {bn}x{dv} x {itemsize} B",
               tile["num_stages"] * bn * (d + dv) * itemsize)]
    return _check(hw, tile, threads, registers, shared)


def epilogue_operands(graph: Graph, nodes: list[str], anchor: str) -> tuple[int, int, int]:
    """(full-size operands, per-channel vectors, values read twice) of the anchor's epilogue.

    Only the anchor's own epilogue counts: in a horizontal group every sibling runs the same template.
    """
    node_set = set(nodes)
    epilogue = _downstream(graph, anchor, node_set)
    size = graph[anchor].type.numel
    seen: set[str] = set()
    full = vectors = 0
    readers: dict[str, int] = {}
    for name in epilogue - {anchor}:
        for value in graph[name].inputs:
            if value in epilogue:
                readers[value] = readers.get(value, 0) + 1
                continue
            if value in seen:
                continue
            seen.add(value)
            numel = graph[value].type.numel
            if numel >= size:
                full += 1
            elif numel > 1:   # scalars are immediates; anything smaller than the output is a broadcast vector
                vectors += 1
    twice = sum(1 for count in readers.values() if count > 1)
    return full, vectors, twice


# ---- rows and elementwise ------------------------------------------------------------------------------

def _reduction_candidates(graph: Graph, nodes: list[str], reduction: str, hw: HardwareProfile,
                          tile: Mapping[str, int] | None) -> list[ResourceEstimate]:
    """A reduction group priced on the tiles its template runs, the default first: the row template's
    (`row_kernel_tiles`: softmax, norms, sums, means, scans, extremes, global pools) or the pooling template's
    (`pool_tiles`: pooling windows, adaptive pools to other sizes)."""
    node = graph[reduction]
    view = row_view(graph, node)
    if view is not None:
        tiles = [dict(tile)] if tile is not None else row_kernel_tiles(view, hw.sm_count)
        return [_rows(graph, nodes, view, hw, t) for t in tiles]
    tiles = [dict(tile)] if tile is not None else pool_tiles(graph[node.inputs[0]].type.shape[1])
    return [_elements(graph, nodes, hw, t, t["BLOCK_P"] * t["BLOCK_C"]) for t in tiles]


def _rows(graph: Graph, nodes: list[str], view: RowView, hw: HardwareProfile, tile: dict[str, int]
          ) -> ResourceEstimate:
    """The row template: a chunk of BLOCK_M rows x BLOCK_L elements at a time (the row walked in chunks where it is
    longer), every live operand a chunk of registers, each row's statistics beside them, and the cross-warp
    exchange of each reduction in shared memory."""
    threads = 32 * tile["num_warps"]
    operands, twice = _live_operands(graph, nodes)
    chunk = _per_thread(tile["BLOCK_M"] * tile["BLOCK_L"], threads)
    statistics = ROW_STATISTICS.get(view.mode, 1)
    registers = [(f"{operands} operand chunk(s) of {tile['BLOCK_M']}x{tile['BLOCK_L']}", operands * chunk),
                 ("reduction scratch chunk", chunk),
                 (f"{twice} value(s) used twice", twice * chunk),
                 (f"{statistics} row statistic(s)", statistics * _per_thread(tile["BLOCK_M"], threads)),
                 ("addressing", ADDRESSING_REGISTERS)]
    shared = [(f"cross-warp scratch for {statistics} statistic(s)",
               tile["num_warps"] * 4 * statistics * tile["BLOCK_M"])]
    return _check(hw, tile, threads, registers, shared)


def _pointwise_tiles(tile: Mapping[str, int] | None) -> list[dict[str, int]]:
    """The blocks the elementwise template runs (`POINTWISE`), the default first."""
    return [dict(tile)] if tile is not None else [dict(t) for t in POINTWISE]


def _pointwise(graph: Graph, nodes: list[str], hw: HardwareProfile, tile: dict[str, int]) -> ResourceEstimate:
    return _elements(graph, nodes, hw, tile, tile["BLOCK"])


def _elements(graph: Graph, nodes: list[str], hw: HardwareProfile, tile: dict[str, int], block: int
              ) -> ResourceEstimate:
    """An elementwise or pooling kernel of `block` outputs a program: every live operand, the result and each
    pooling window's accumulator a block of registers."""
    threads = 32 * tile["num_warps"]
    operands, twice = _live_operands(graph, nodes)
    windows = sum(1 for n in nodes if kind_of(graph[n]) is FusionKind.REDUCTION)   # pooling accumulators
    per_block = _per_thread(block, threads)
    registers = [(f"{operands} operand(s)", operands * per_block),
                 ("result", per_block),
                 (f"{twice + windows} value(s) kept alive", (twice + windows) * per_block),
                 ("addressing", ADDRESSING_REGISTERS)]
    return _check(hw, tile, threads, registers, [])


def _live_operands(graph: Graph, nodes: list[str]) -> tuple[int, int]:
    """(distinct non-scalar values read from outside, values read twice inside) of an elementwise/row group."""
    node_set = set(nodes)
    outside: set[str] = set()
    readers: dict[str, int] = {}
    for name in nodes:
        for value in graph[name].inputs:
            if value in node_set:
                readers[value] = readers.get(value, 0) + 1
            elif graph[value].type.numel > 1:
                outside.add(value)
    return max(1, len(outside)), sum(1 for count in readers.values() if count > 1)


# ---- shared helpers ------------------------------------------------------------------------------------

def _check(hw: HardwareProfile, tile: dict[str, int], threads: int, registers: list[tuple[str, int]],
           shared: list[tuple[str, int]]) -> ResourceEstimate:
    """Compare one tile's needs with the profile; the reason lists what the registers go to."""
    regs = sum(v for _, v in registers)
    smem = sum(v for _, v in shared)
    problems = []
    if regs > hw.max_registers_per_thread:
        parts = ", ".join(f"{label} {v}" for label, v in registers if v)
        problems.append(f"needs {regs} registers/thread > {hw.max_registers_per_thread} ({parts})")
    elif threads * regs > hw.registers_per_sm:
        problems.append(f"{threads} threads x {regs} registers = {threads * regs} > {hw.registers_per_sm} "
                        "registers per SM")
    if smem > hw.shared_memory_per_block:
        parts = " + ".join(f"{label} {v}" for label, v in shared if v)
        problems.append(f"needs {smem} B shared memory > {hw.shared_memory_per_block} B per block ({parts})")
    return ResourceEstimate(tile=dict(tile), registers_per_thread=regs, shared_memory_bytes=smem,
                            fits=not problems, reason="; ".join(problems))


def _first_fit(candidates: list[ResourceEstimate]) -> ResourceEstimate:
    """The first candidate that fits (noting what the default needed), else the smallest (fewest registers, then
    least shared memory), explained."""
    for estimate in candidates:
        if estimate.fits:
            if estimate is not candidates[0]:
                estimate.reason = (f"fits with tile {describe_tile(estimate.tile)}; the default "
                                   f"{describe_tile(candidates[0].tile)} {candidates[0].reason}")
            return estimate
    least = min(candidates, key=lambda e: (e.registers_per_thread, e.shared_memory_bytes))
    tried = f"{len(candidates)} tiles tried, " if len(candidates) > 1 else ""
    least.reason = f"{tried}the smallest, tile {describe_tile(least.tile)}, {least.reason}"
    return least


def describe_tile(tile: Mapping[str, int]) -> str:
    """'128x128x32 (3 stages, 8 warps)', '2x1024 (4 warps)' (rows x lanes), '32x64 (4 warps)' (pixels x channels),
    'BLOCK 1024 (4 warps)'."""
    dims = "x".join(str(tile[k]) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "BLOCK_L", "BLOCK_P", "BLOCK_C")
                    if k in tile) or f"BLOCK {tile.get('BLOCK')}"
    stages = f"{tile['num_stages']} stages, " if "num_stages" in tile else ""
    split = tile.get("SPLIT_K", tile.get("SPLIT", 1))
    slices = f", {split} slices" if split > 1 else ""
    return f"{dims} ({stages}{tile['num_warps']} warps{slices})"


def _tiles(family: tuple[dict[str, int], ...], tile: Mapping[str, int] | None) -> list[dict[str, int]]:
    return [dict(tile)] if tile is not None else [dict(t) for t in family]


def _downstream(graph: Graph, start: str, within: set[str]) -> set[str]:
    """`start` and the nodes of `within` that read it, directly or through other nodes of `within`."""
    reached = {start}
    grew = True
    while grew:   # groups are small: a fixpoint over them is cheaper than walking the whole graph
        grew = False
        for name in within - reached:
            if any(i in reached for i in graph[name].inputs):
                reached.add(name)
                grew = True
    return reached


def _per_thread(elements: int, threads: int) -> int:
    return math.ceil(elements / threads)


def _pow2(n: int) -> int:
    """Next power of two of n, at least 16."""
    return max(16, 1 << max(0, n - 1).bit_length())
