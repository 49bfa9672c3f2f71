"""The tiles an anchor kernel (GEMM, 1x1 conv, implicit-GEMM conv) tries, the one it runs untuned, and its K loop:
one source for the Triton templates (`opfuse.codegen.gemm.gemm_configs`,
`opfuse.codegen.conv_implicit_gemm.ConvKernel`) and for the planner, which decides the K slices of each tile
(`split_k_table`, carried by the plan) and prices split-K's partial tiles only where the default tile splits the
reduction.

A tile is a dict: BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages. `anchor_tiles(m, n, k, batch, itemsize,
gather, hw=...)` lists the candidates for a GPU (`opfuse.hardware.HardwareProfile`: its SMs pick the default, its
shared memory bounds the pipelines), the default first; `anchor_steps(taps, channels, block_k)` counts the K-loop
steps of a tile, `split_k_slices` its K slices, `group_block` how many conv groups one program of a grouped
conv computes together; `anchor_loop(graph, anchor)` says which loop a graph's anchor gets. These are the GPU's
rules, and the plan always follows them; only the kernels, under Triton's interpreter (tests: a profile whose
`interpreted` is set, `opfuse.hardware.kernel_profile`), run one tiny tile instead (`INTERPRETER`, whose K slices
the plan decides too), so there an interpreted model may launch other split-K kernels than its plan counts.

Row reductions (softmax, norms, sums and means, the scans cumsum and cumprod, global pools) the same way: `row_view`
says how the row template sees one, `row_tiles` lists its tiles with the row slices of each (`row_slices`), the
default first, for the kernel and for the planner, which counts the second launch of a split default tile; under the
interpreter the kernel runs one unsplit tile, so there it may launch fewer kernels than its plan counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, TypeVar

from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph
from opfuse.ir.ops import HEADS_INSIDE_TOKENS_HEAD_DIM, SCAN_OPS

Tile = TypeVar("Tile")      # a tile dict, or a kernel config: what has BLOCK_M and BLOCK_N items


def _tile(m: int, n: int, k: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": warps, "num_stages": stages}


# Hopper-friendly tiles: 128x128 (x256) with 8 warps for big GEMMs, 4-warp 64/128 tiles for few output channels,
# short reductions or few tiles, and 16/32-row tiles for batch-1 GEMMs (M of 1 to 32: reading the weight is
# the whole cost). The autotuner measures them in this order where each fills the GPU and fits the output
# (`by_occupancy`; the first N of them with tune_top=N); the rules of `anchor_tiles` only pick the default. The
# 128x256 tile comes second so that a short tuning still tries it where its grid fills the GPU.
LARGE = [_tile(128, 128, 64, 8, 4), _tile(128, 256, 64, 8, 3), _tile(128, 128, 64, 8, 3)]
MEDIUM = [_tile(128, 64, 32, 4, 4), _tile(64, 128, 32, 4, 4), _tile(64, 64, 64, 4, 3), _tile(64, 64, 32, 4, 4)]
SMALL_M = [_tile(16, 32, 128, 4, 4), _tile(16, 64, 128, 4, 4), _tile(16, 32, 256, 4, 3), _tile(16, 128, 64, 4, 4),
           _tile(32, 64, 64, 4, 4), _tile(32, 128, 64, 4, 3)]
# 32-column tiles for GEMMs whose output store is the whole cost (a reduction of 32 or less, or 32 output columns
# or less): in the sweep of RESULTS.md run 55 (EfficientNet's and MobileNet's batch-64 1x1 convs) a 32-wide tile
# was the fastest of every kernel, 64 and 128 columns 1.03-1.9x slower; BLOCK_K 16 where K is (`narrow_tiles`)
NARROW = [_tile(64, 32, 32, 4, 1), _tile(256, 32, 32, 4, 1), _tile(128, 32, 32, 4, 1), _tile(64, 32, 32, 4, 3)]
# convolutions that gather taps (few input channels): 32-deep K blocks measured best (ResNet's 7x7 stem, H200)
GATHER = _tile(64, 64, 32, 4, 4)
GATHER_CHANNELS = 32                # input channels per group under which a conv gathers taps
INTERPRETER = _tile(32, 32, 16, 4, 1)
KERNEL_TILES = LARGE + MEDIUM + SMALL_M + NARROW + [dict(t, BLOCK_K=16) for t in NARROW] + [GATHER, INTERPRETER]
#              (every tile an anchor kernel may run)
SHARED_SLACK = 27 * 1024    # a block's shared memory the operand pipeline leaves to the epilogue and Triton itself


def next_power_of_2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


def fits(tile: dict[str, int], itemsize: int, hw: HardwareProfile) -> bool:
    """Whether the operand tiles of every pipeline stage fit in a block's shared memory, less SHARED_SLACK."""
    return (tile["BLOCK_M"] + tile["BLOCK_N"]) * tile["BLOCK_K"] * itemsize * tile["num_stages"] \
        <= hw.shared_memory_per_block - SHARED_SLACK


def anchor_tiles(m: int, n: int, k: int, batch: int = 1, itemsize: int = 2, gather: bool = False, *,
                 hw: HardwareProfile) -> list[dict[str, int]]:
    """Tile candidates on GPU `hw` for an M x N (x batch) output reducing over K with operands of `itemsize` bytes;
    the first is the default (`gather`: a convolution with under GATHER_CHANNELS input channels per group), the
    others `by_occupancy`. Tiles whose pipeline would not fit in shared memory (float32, or a GPU with less of it)
    are left out.

    The default rules were read off H200 fp16 measurements (CUDA-graph timed, 2026-11-30): ResNet-50 convs
    (3x3 64ch 56x56: 128x64x32 31.8 us vs 128x128x64 54.9 us; 1x1 64->256: 64x128x32 44.6 us vs 70.9 us),
    4096^3 linear (128x128x64 s4 258 us, 4-warp tiles 350+ us), batch-1 4096x4096 linear (16x32x128 10.3 us,
    16x128x64 18.1 us). A GEMM with a reduction of 32 or less, or 32 output columns or less, only stores: its
    `NARROW` tiles come first (RESULTS.md run 55), the others after them.
    """
    narrow = [t for t in narrow_tiles(k) if fits(t, itemsize, hw)]
    if m <= 32:
        candidates = [t for t in SMALL_M + MEDIUM[3:] if fits(t, itemsize, hw)]
        first = candidates[0]
    elif narrow and (k <= 32 or n <= 32):      # the store is the whole cost: narrow tiles first, by occupancy
        others = [t for t in LARGE + MEDIUM + SMALL_M[4:] if fits(t, itemsize, hw)]
        ordered = [narrow[0]] + by_occupancy(narrow[1:], m, n, batch, hw.sm_count) + by_occupancy(
            others, m, n, batch, hw.sm_count)
        return [GATHER] + [t for t in ordered if t != GATHER] if gather else ordered
    else:
        candidates = [t for t in LARGE + MEDIUM + SMALL_M[4:] if fits(t, itemsize, hw)] + narrow
        if n <= 64:         # a 128-wide tile would leave half its columns idle
            first = _tile(64, 64, 64, 4, 3) if k <= 256 else _tile(128, 64, 32, 4, 4)
        elif k <= 256:      # short reduction: the output store dominates, small tiles keep more of it in flight
            first = _tile(64, 128, 32, 4, 4)
        elif -(-m // 128) * -(-n // 128) * batch < 2 * hw.sm_count:
            first = _tile(64, 64, 64, 4, 3)   # too few big tiles to fill the GPU
        else:
            first = candidates[0]
    ordered = [first] + by_occupancy([t for t in candidates if t != first], m, n, batch, hw.sm_count)
    if gather:
        ordered = [GATHER] + [t for t in ordered if t != GATHER]
    return ordered


# ---- elementwise kernels ------------------------------------------------------------------------------------

# BLOCK elements a program of the elementwise template (`opfuse.codegen.pointwise`: elementwise ops, pooling windows,
# copies) computes, and its warps; the default first
POINTWISE = [{"BLOCK": 1024, "num_warps": 4}, {"BLOCK": 2048, "num_warps": 8}, {"BLOCK": 512, "num_warps": 4},
             {"BLOCK": 4096, "num_warps": 8}]


# ---- depthwise convs ---------------------------------------------------------------------------------------

ADDRESSING_REGISTERS = 40   # pointers, offsets, masks and loop counters every kernel holds besides its data


def _depthwise(m: int, n: int, warps: int = 4, cols: int | None = None) -> dict[str, int]:
    return {"BLOCK_M": m, "BLOCK_N": n, "num_warps": warps, "num_stages": 1} | ({"COLS": cols} if cols else {})


# [pixels, channels] tiles of the direct depthwise kernel (`opfuse.codegen.conv_depthwise`), in the order measured
# best on an H200 for MobileNet-sized layers (64 x 32 second: it beat 128 x 32 on EfficientNet's batch-64 layers,
# RESULTS.md run 55), then smaller ones for layers too small to fill the GPU with those (`depthwise_tiles`)
DEPTHWISE = [_depthwise(128, 32), _depthwise(64, 32), _depthwise(64, 64), _depthwise(256, 32, 8),
             _depthwise(32, 128), _depthwise(128, 64, 8), _depthwise(16, 128)]
SMALL_DEPTHWISE = [_depthwise(16, 64), _depthwise(32, 32), _depthwise(16, 32, 2)]
# the runs form's tiles (COLS outputs a run), in the order of their geometric mean over the zoo's depthwise layers at
# batch 64 (RESULTS.md run 92)
DEPTHWISE_RUNS = [_depthwise(128, 32, cols=8), _depthwise(128, 64, cols=8), _depthwise(64, 64, cols=8),
                  _depthwise(128, 32, cols=4), _depthwise(64, 32, cols=4), _depthwise(32, 64, cols=4)]
INTERPRETED_DEPTHWISE = {"BLOCK_M": 32, "BLOCK_N": 16}    # the one tile Triton's interpreter runs (tests)


def unrolled_tap_registers(tile: Mapping[str, int], taps: int, itemsize: int) -> int:
    """Registers per thread a depthwise tile (a tile dict or kernel config) needs with all `taps` unrolled: ptxas
    issues every tap's load before the multiply-adds, so each thread holds all of its elements' taps (packed 32 bits
    to a register), its float32 accumulator and the addressing."""
    elements = tile["BLOCK_M"] * tile["BLOCK_N"] // (32 * tile["num_warps"])
    return -(-taps * elements * itemsize // 4) + elements + ADDRESSING_REGISTERS


def depthwise_tiles(m: int, n: int, sm_count: int, taps: int = 1, itemsize: int = 2, max_registers: int = 255,
                    width: int | None = None, whole_rows: bool = False) -> list[dict[str, int]]:
    """Tile candidates of the direct depthwise kernel over `m` output pixels x `n` channels (in rows of `width`)
    with a filter of `taps` taps on `itemsize`-byte inputs, on a GPU of `sm_count` SMs and `max_registers`
    registers per thread, the default first. A depthwise conv does a few multiply-adds per element it loads, so its
    speed is the loads it issues: the runs form's tiles (`DEPTHWISE_RUNS`: a run of outputs along a row loads each
    input column once; only where a row's runs are at least half outputs, not the padding past its end) come before
    the pixel tiles, and all are ordered `by_occupancy`, those whose grid has a program for every SM first, in the
    listed (measured) order (a 7x7 layer of ConvNeXt's last stage, 49 pixels x 768 channels at batch 1, fills 24 of
    an H200's 132 SMs with the first tile). A pixel tile whose taps unrolled would not fit the registers
    (`unrolled_tap_registers`) loops over the filter rows instead (ROW_LOOP=1), each row's taps unrolled: unrolled,
    they spill (a 7x7 filter on a 128 x 32 tile: 6 KB per thread, 20x slower than cuDNN), and a row loop keeps the
    loads of one row in flight. With `whole_rows` (a norm over the channels in the epilogue) each tile becomes its
    `whole_row_tile`, spanning all `n` channels with as many elements."""
    runs = [t for t in DEPTHWISE_RUNS if width is None or -(-width // t["COLS"]) * t["COLS"] < 2 * width]
    tiles: list[dict[str, int]] = []
    for t in runs + DEPTHWISE + SMALL_DEPTHWISE:
        tile = whole_row_tile(t, n) if whole_rows else dict(t)
        if "COLS" not in tile:
            tile["ROW_LOOP"] = int(unrolled_tap_registers(tile, taps, itemsize) > max_registers)
        if tile not in tiles:
            tiles.append(tile)
    return by_occupancy(tiles, m, n, 1, sm_count)


MAX_ROW_CHANNELS = 4096    # channels a whole-row tile spans at most (`whole_row_tile`)
MAX_HEAD_DIM = HEADS_INSIDE_TOKENS_HEAD_DIM   # head dims the attention template tiles: its query tile and
                                             # accumulator hold whole rows (flash attention's, and its layout's)


def tiles_attention(graph: Graph, name: str) -> bool:
    """Whether the attention template tiles sdpa `name`: q's, k's and v's head dims (the last) at most MAX_HEAD_DIM.
    torch's attention, a library call, runs the others (DaViT's channel attention: head dims of 3136 pixels)."""
    return all(graph[value].type.shape[-1] <= MAX_HEAD_DIM for value in graph[name].inputs[:3])


# ---- attention -----------------------------------------------------------------------------------------

ATTENTION_TILES = (  # the Triton fused-attention tutorial's configurations
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_stages": 2, "num_warps": 8},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 2, "num_warps": 4},
    {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1, "num_warps": 4},
)
INTERPRETED_ATTENTION = {"BLOCK_M": 16, "BLOCK_N": 16, "num_stages": 1, "num_warps": 4}   # Triton's interpreter's


def attention_tile(tile: Mapping[str, int], queries: int) -> dict[str, int]:
    """An attention tile with its query block cut to the queries' power of two (at least 16, tl.dot's least)."""
    return dict(tile, BLOCK_M=min(tile["BLOCK_M"], max(16, next_power_of_2(queries))))


def attention_key(tile: Mapping[str, int]) -> str:
    """An attention tile's name in the plan's key-split table (`FusionGroup.split_k`): BLOCK_MxBLOCK_N."""
    return f"{tile['BLOCK_M']}x{tile['BLOCK_N']}"


def key_split_slices(programs: int, steps: int, sm_count: int) -> int:
    """Key slices of an attention kernel of `programs` query tiles (all heads) over `steps` key blocks: 1 unless
    the tiles leave three quarters of the SMs idle and there are two key blocks or more; else enough slices to
    fill the SMs, at most MAX_SPLIT_K, none empty. A key block is two dots, the exponentials and two loads the
    next block waits for, so a slice of one block already keeps an SM busy (a GEMM's slice needs
    MIN_STEPS_PER_SLICE): the decode step of RESULTS.md (32 heads over 384 keys) spent 9.8 us an attention
    walking six blocks on 32 of 132 SMs."""
    if 4 * programs > sm_count or steps < 2:
        return 1
    return nonempty_slices(steps, min(-(-sm_count // programs), steps, MAX_SPLIT_K))


def key_split_table(queries: int, keys: int, heads: int, sm_count: int) -> dict[str, int]:
    """{`attention_key`: key slices} of an attention kernel over `queries` x `keys` in `heads` (batch x heads)
    grid rows (`key_split_slices`), every tile the kernel may run cut to the queries (`attention_tile`), the
    interpreter's included. Decoding is the case: one query a head, a cache of keys. Each slice stores its rows'
    running max, sum and unnormalized output in float32; each tile's last slice combines them in slice order and
    runs the epilogue (flash-decoding); the autotuner measures the split against its unsplit twin."""
    table: dict[str, int] = {}
    for tile in (*ATTENTION_TILES, INTERPRETED_ATTENTION):
        cut = attention_tile(tile, queries)
        programs = -(-queries // cut["BLOCK_M"]) * heads
        table.setdefault(attention_key(cut), key_split_slices(programs, -(-keys // cut["BLOCK_N"]), sm_count))
    return table


def whole_row_tile(tile: Mapping[str, int], channels: int) -> dict[str, int]:
    """Depthwise `tile` (a tile dict or a kernel config's params: BLOCK_M pixels x BLOCK_N channels, COLS outputs a
    run in the runs form) made to span all `channels` of its pixels, as a depthwise conv that normalizes
    its rows in its epilogue runs it: BLOCK_N the least power of two >= channels, BLOCK_M shrunk to keep the tile's
    elements, at least one run (COLS) of outputs."""
    params = dict(tile)
    block_n = next_power_of_2(channels)
    block_m = max(params.get("COLS", 1), params["BLOCK_M"] * params["BLOCK_N"] // block_n)
    return params | {"BLOCK_M": block_m, "BLOCK_N": block_n}


def narrow_tiles(k: int) -> list[dict[str, int]]:
    """`NARROW`, 16 deep for a reduction of 16 or less."""
    return [dict(t, BLOCK_K=16) if k <= 16 else dict(t) for t in NARROW]


def by_occupancy(tiles: list[Tile], m: int, n: int, batch: int, sm_count: int) -> list[Tile]:
    """`tiles` (tile dicts or kernel configs) whose grid over an M x N (x batch) output has a program for every SM
    and computes mostly output, in their order; then those that fill the GPU but leave half their tile or more past
    the output's edge (a 128-wide tile over ShuffleNet's 58 channels), least padding first; then the others by
    their number of programs, most first. A short tuning (tune_top) so times the tiles that can fill the GPU (a
    batch-1 transformer's 128 x 3072 GEMM fills 24 of an H200's 132 SMs with a 128 x 128 tile, 192 with 32 x 64)
    and fit the output before the rest, and keeps the measured order where all do (large GEMMs). Padding is weighed
    for one GEMM only (`batch` 1): a grouped conv's tiles come with group-blocked forms that pack several of its
    narrow groups into one tile, so their listed order stands."""
    def programs(tile: Tile) -> int:
        return -(-m // tile["BLOCK_M"]) * -(-n // tile["BLOCK_N"]) * batch

    def padded(tile: Tile) -> int:      # the elements the grid computes, the output's and those past its edge
        return programs(tile) * tile["BLOCK_M"] * tile["BLOCK_N"]

    filling = [t for t in tiles if programs(t) >= sm_count]
    fitting = [t for t in filling if batch > 1 or padded(t) < 2 * m * n]
    wasteful = sorted((t for t in filling if t not in fitting), key=padded)
    return fitting + wasteful + sorted((t for t in tiles if programs(t) < sm_count), key=programs, reverse=True)


def anchor_steps(taps: int, channels: int, block_k: int) -> int:
    """K-loop steps of an anchor kernel reducing over `taps` x `channels` (a GEMM or 1x1 conv: one tap): a loop of
    BLOCK_K channels per tap, or, where the channels are fewer than BLOCK_K, over taps x channels at once (the
    conv template's gather form)."""
    if channels < block_k:
        return -(-(taps * channels) // block_k)
    return taps * -(-channels // block_k)


MAX_SPLIT_K = 16          # K slices at most: each slice's partial tile goes through device memory once
MIN_STEPS_PER_SLICE = 4   # K blocks a slice walks at least, so the pipeline fills
MIN_SPLIT_K = 3           # fewer slices do not pay for their partial tiles (set when a second kernel summed them)
# K blocks the unsplit loop must walk for a split to be planned. On the H200 (2026-11-30, batch 1, planner's tiles,
# no tuning) splitting took resnet50 from 0.632 to 0.480 ms (0.516 -> 0.378 ms of kernels) and bert-base from 0.748
# to 0.620 ms (0.589 -> 0.491); mobilenet_v2's kernels were unchanged (its planned splits' tiles need no slices).
# The autotuner also times each split kernel unsplit and keeps the faster: a split planned here is an offer.
MIN_SPLIT_STEPS = 16


def split_k_slices(programs: int, steps: int, sm_count: int) -> int:
    """How many K slices an anchor kernel of `programs` tiles and `steps` K blocks runs: 1 unless the tiles leave
    three quarters of the SMs idle and the reduction is long (MIN_SPLIT_STEPS blocks), else enough slices to
    fill the SMs (each at least MIN_STEPS_PER_SLICE blocks, at most MAX_SPLIT_K), none of them empty. The slices'
    fp32 partial tiles are summed in slice order by each tile's last slice, which runs the epilogue (so the result
    does not depend on timing)."""
    if 4 * programs > sm_count or steps < MIN_SPLIT_STEPS:
        return 1
    slices = min(-(-sm_count // programs), steps // MIN_STEPS_PER_SLICE, MAX_SPLIT_K)
    if slices < MIN_SPLIT_K:
        return 1
    return nonempty_slices(steps, slices)


def nonempty_slices(steps: int, slices: int) -> int:
    """The slices `steps` loop steps cut into at most `slices` runs of equal length take, none of them empty
    (17 steps in 4 slices: runs of 5, the last 2; 6 in 5: runs of 2, so 3 slices)."""
    per_slice = -(-steps // slices)
    return -(-steps // per_slice)


def tile_key(tile) -> str:
    """A tile's name in the plan's split-K table (`FusionGroup.split_k`): BLOCK_MxBLOCK_NxBLOCK_K, what its grid
    and its K loop depend on (a dict tile or a kernel config)."""
    return f"{tile['BLOCK_M']}x{tile['BLOCK_N']}x{tile['BLOCK_K']}"


def anchor_grid(tile, rows: int, columns: int, reduction: int, batch: int, taps: int = 1) -> tuple[int, int]:
    """(programs, K-loop steps) of an anchor kernel's `tile` over a rows x columns output (x batch) reducing over
    `reduction` = taps x channels."""
    return (-(-rows // tile["BLOCK_M"]) * -(-columns // tile["BLOCK_N"]) * batch,
            anchor_steps(taps, reduction // taps, tile["BLOCK_K"]))


def split_k_table(rows: int, columns: int, reduction: int, batch: int, taps: int, sm_count: int) -> dict[str, int]:
    """{`tile_key`: K slices} of an anchor kernel the planner splits: for every tile an anchor kernel may run
    (`KERNEL_TILES`), `split_k_slices` of that tile's own grid over the problem (`anchor_grid`). The autotuner
    measures several tiles, whose grids and K blocks each need their own count, and the kernel's configs read
    theirs from here (`opfuse.codegen.split_k.with_slices`). Every tile of the tables, not only the candidates
    `anchor_tiles` keeps for a problem: those depend on the operands' itemsize and the GPU's shared memory, so a
    kernel always finds its tiles here, the interpreter's one included."""
    table: dict[str, int] = {}
    for tile in KERNEL_TILES:
        programs, steps = anchor_grid(tile, rows, columns, reduction, batch, taps)
        table.setdefault(tile_key(tile), split_k_slices(programs, steps, sm_count))
    return table


# input channels one program of a group-blocked conv reduces over at most (its K loop walks Kh·Kw times them)
MAX_BLOCKED_CHANNELS = 256


def group_block(groups: int, cout_per_group: int, cin_per_group: int, block_n: int) -> int:
    """Conv groups one program of the implicit-GEMM conv computes together for a tile BLOCK_N wide (its BLOCK_G;
    1: one group a program). Blocking G groups gives a program G·Cout/g columns and a block-diagonal weight over
    G·Cin/g input channels: while the columns fit in BLOCK_N the grid's multiply-adds stay what they were (the
    masked columns of G programs become zero rows of one program's K) and the grid has G times fewer programs,
    each walking a G times longer K loop over G times the channels (contiguous in NHWC). So: as many groups as fit
    their output channels in BLOCK_N, with at most MAX_BLOCKED_CHANNELS input channels together, spread evenly over
    the fewest blocks that take them all (13 groups of 8 channels in a 64-wide tile: blocks of 7, the second padded
    with one group that does not exist, rather than 8 and 8 with three); 1 where fewer than two groups fit (wide
    groups, one group)."""
    most = min(groups, block_n // cout_per_group, MAX_BLOCKED_CHANNELS // cin_per_group)
    if most < 2:
        return 1
    blocks = -(-groups // most)
    return -(-groups // blocks)


def conv_as_gemm(kernel_size: tuple[int, int], padding: object, groups: int) -> bool:
    """Whether a convolution runs as the GEMM template over its pixels (1x1, no padding, one group) rather than the
    implicit-GEMM conv template (`padding`: an int or a pair, as the graph's conv2d attribute holds it)."""
    pad = (padding, padding) if isinstance(padding, int) else tuple(padding)
    return tuple(kernel_size) == (1, 1) and pad == (0, 0) and groups == 1


def anchor_loop(graph: Graph, anchor: str) -> tuple[int, bool]:
    """(taps the K loop walks, whether it gathers them) of an anchor's kernel: one tap for a linear, a matmul and a
    conv that runs as the GEMM template; a conv's kernel taps otherwise, gathered across taps when it has under
    GATHER_CHANNELS input channels per group."""
    node = graph[anchor]
    if node.op != "conv2d":
        return 1, False
    cin_per_group, kh, kw = graph[node.inputs[1]].type.shape[1:]
    if conv_as_gemm((kh, kw), node.attrs.get("padding", 0), int(node.attrs.get("groups", 1))):
        return 1, False
    return kh * kw, cin_per_group < GATHER_CHANNELS


# ---- row reductions ----------------------------------------------------------------------------------------

ROW_OPS = ("softmax", "layer_norm", "rms_norm", "mean", "sum", "prod", "any", *SCAN_OPS)
EXTREMES = ("amax", "amin")         # row ops of a running max or min
ROW_WRITING_MODES = ("softmax", "layer_norm", "rms_norm")    # row reductions whose output is the row again
ROW_SPLIT_MODES = ("sum", "mean", "any") + EXTREMES + ROW_WRITING_MODES   # rows that split into slices: all but scans
MAX_ROW_SLICES = 128                # slices of a row at most: the second launch holds [BLOCK_M, SPLIT] float32 sums


def slice_statistics(mode: str) -> int:
    """The float32 numbers a split row's slice leaves in the workspace: a layer norm's mean and M2, a softmax's max
    and sum of exponentials; one sum (or extreme) otherwise."""
    return 2 if mode in ("layer_norm", "softmax") else 1


@dataclass(frozen=True)
class RowView:
    """A reduction as the row template sees it (`opfuse.codegen.reduction.RowReductionKernel`): `mode` over the
    input's `dims`, as [rows, length] (kept x reduced elements); `channels_inner` for one over H, W of an NCHW
    image, whose kept channels lie adjacent in channels-last memory."""

    mode: str
    dims: tuple[int, ...]
    rows: int
    length: int
    channels_inner: bool


def row_view(graph: Graph, node) -> RowView | None:
    """How the row template computes `node`, or None where it does not (pools, adaptive pools to other sizes)."""
    shape = graph[node.inputs[0]].type.shape
    rank = len(shape)
    if node.op == "adaptive_avg_pool2d":
        if tuple(node.type.shape[-2:]) != (1, 1):
            return None
        mode, dims = "mean", [rank - 2, rank - 1]
    elif node.op in ROW_OPS + EXTREMES:     # (an extreme: a running max or min, NaN if any element is)
        mode, dims = node.op, _reduced_dims(node, rank)
    else:
        return None
    kept = [d for d in range(rank) if d not in dims]
    return RowView(mode, tuple(dims), math.prod(shape[d] for d in kept), math.prod(shape[d] for d in dims),
                   rank == 4 and 1 in kept and {2, 3} <= set(dims))


def _reduced_dims(node, rank: int) -> list[int]:
    if node.op in ("softmax", *SCAN_OPS):
        return [node.attrs["dim"] % rank]
    if node.op == "layer_norm":
        normalized = node.attrs["normalized_shape"]
        return list(range(rank - (1 if isinstance(normalized, int) else len(normalized)), rank))
    if node.op == "rms_norm":
        return [rank - 1]
    dims = node.attrs.get("dims")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    dims = [dims] if isinstance(dims, int) else dims
    return sorted({d % rank for d in dims})


def row_tiles(view: RowView, sm_count: int) -> list[tuple[int, int, int]]:
    """The (BLOCK_M rows, BLOCK_L lanes, SPLIT slices) tiles the row template tries on a GPU, its default first:
    many rows of short chunks where the kept channels are adjacent (larger tiles keep more bytes in flight; fewer
    rows than a tile's, its elements along the row: a group norm of one group at batch 1 is one row of 200k
    elements, which 64-lane chunks walked 22x slower, RESULTS.md), else about 2048-4096 elements a program along
    the row; each split by `row_slices`."""
    rows, length = next_power_of_2(view.rows), next_power_of_2(view.length)
    if view.channels_inner:     # rows fewer than a shape's take its elements along the row instead (up to 4096)
        shapes = [(min(m, rows), min(m * lanes // min(m, rows), max(lanes, 4096)))
                  for m, lanes in ((64, 64), (64, 32), (128, 16), (32, 256), (128, 64))]
    else:
        block_l = min(length, 4096)
        shapes = [(max(1, min(rows, target // block_l)), block_l) for target in (2048, 4096, 1024)]
        if length > 4096:
            shapes.append((1, 2048))
    tiles: list[tuple[int, int, int]] = []
    for block_m, block_l in shapes:
        block_m, block_l = min(block_m, rows), min(block_l, length)
        tile = (block_m, block_l, row_slices(view, block_m, block_l, sm_count))
        if tile not in tiles:
            tiles.append(tile)
    finer = _finer_slices(view, tiles[0], sm_count)
    return [finer] + [tile for tile in tiles if tile != finer]


MIN_SLICE_CHUNK = 1024  # a split row's chunks (rows x lanes) are not made smaller than this to reach more slices
SLICE_CHUNKS = (256, 4096)   # the chunks of a tile of one row a program, in slices: least and most elements


def _finer_slices(view: RowView, tile: tuple[int, int, int], sm_count: int) -> tuple[int, int, int]:
    """The tile, its chunks halved along the row (down to MIN_SLICE_CHUNK elements) while its programs times slices
    are fewer than the SMs and that gives more of them, where it splits at all: one row of 200k elements splits into
    16 slices of 4096-lane chunks, 64 of 1024. A tile of one row a program (long rows) takes instead the most
    slices (`_one_row_slices`)."""
    block_m, block_l, slices = tile
    if slices > 1 and block_m == 1:
        return _one_row_slices(view, sm_count)
    programs = -(-view.rows // block_m)
    while slices > 1 and programs * slices < sm_count and block_m * block_l > MIN_SLICE_CHUNK:
        finer = row_slices(view, block_m, block_l // 2, sm_count)
        if finer <= slices:
            break
        block_l, slices = block_l // 2, finer
    return block_m, block_l, slices


def _one_row_slices(view: RowView, sm_count: int) -> tuple[int, int, int]:
    """(1, BLOCK_L, SPLIT) for rows too few and too long for a tile of several: a few long rows at batch 1 are
    latency-bound (a 125 KB row read twice and written once), so each program walks a slice of one or two chunks,
    all loads in flight at once: SPLIT the most slices of the rows' programs (`row_slices` at the least chunk),
    BLOCK_L the largest power of two of SLICE_CHUNKS not past the slice (measured: RESULTS.md, "Long rows in
    slices")."""
    split = row_slices(view, 1, SLICE_CHUNKS[0] // 2, sm_count)
    span = -(-view.length // split)
    block_l = SLICE_CHUNKS[0]
    while block_l * 2 <= min(span, SLICE_CHUNKS[1]):
        block_l *= 2
    return 1, block_l, split


def row_slices(view: RowView, block_m: int, block_l: int, sm_count: int) -> int:
    """SPLIT for a tile of any row mode but a scan: a power of two giving about two programs per SM, each slice two
    chunks or more; 1 for a scan, for no rows, and where there are as many row blocks as SMs."""
    programs = -(-view.rows // block_m)
    if view.mode not in ROW_SPLIT_MODES or programs == 0 or programs >= sm_count:
        return 1
    split = min(next_power_of_2(-(-2 * sm_count // programs)), MAX_ROW_SLICES)
    while split > 1 and split * 2 * block_l > view.length:
        split //= 2
    return split


def row_kernel_tiles(view: RowView, sm_count: int) -> list[dict[str, int]]:
    """`row_tiles` as the row template launches them, the default first: BLOCK_M, BLOCK_L, SPLIT (the slices of
    every mode but a scan) and num_warps (`_row_warps`)."""
    split = view.mode in ROW_SPLIT_MODES
    return [{"BLOCK_M": m, "BLOCK_L": length, **({"SPLIT": slices} if split else {}),
             "num_warps": _row_warps(m * length, slices)}
            for m, length, slices in row_tiles(view, sm_count)]


def _row_warps(elements: int, slices: int) -> int:
    """A row tile's warps: 4 for up to 2048 elements a chunk, else 8; a split tile of fewer than 1024 elements one
    warp per 256 (8 per lane, 16-byte loads in float16)."""
    if slices > 1 and elements < 1024:
        return max(1, elements // 256)
    return 4 if elements <= 2048 else 8


# ---- pooling windows ---------------------------------------------------------------------------------------

POOL_SHAPES = ((32, 64), (64, 32), (16, 128), (64, 64))    # [output pixels, channels] of the pooling template


def pool_tiles(channels: int) -> list[dict[str, int]]:
    """The tiles of the pooling template (`opfuse.codegen.pool.PoolKernel`: max/avg pools, adaptive pools of
    even windows), the default first: BLOCK_P output pixels x BLOCK_C channels (at most the channels' power of two),
    4 warps."""
    tiles: list[dict[str, int]] = []
    for block_p, block_c in POOL_SHAPES:
        tile = {"BLOCK_P": block_p, "BLOCK_C": min(block_c, next_power_of_2(channels)), "num_warps": 4}
        if tile not in tiles:
            tiles.append(tile)
    return tiles
