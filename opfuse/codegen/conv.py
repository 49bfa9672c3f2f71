"""Convolution anchor kernels with fused epilogues: implicit GEMM, 1x1 as GEMM, and depthwise direct convolution.

Entry point: `lower_conv_group(graph, group, device)` for groups anchored on conv2d (or horizontal groups of
sibling conv2ds on one input). Which kernel a conv gets:
  depthwise (groups == Cin > 1, Cout a multiple of Cin)  -> `DepthwiseConvKernel`: a direct kernel over
      [BLOCK_M pixels, BLOCK_N channels] tiles, one multiply-add per tap, float32 accumulation; its runs form
      (COLS > 1) takes the pixels as runs of COLS neighbours along a row, which load each input column once;
  1x1, no padding, groups == 1                            -> `opfuse.codegen.gemm.GemmKernel` over pixels (a
      strided 1x1 conv is a GEMM over the strided view x[:, :, ::s, ::s]);
  anything else                                          -> `ConvKernel`: implicit GEMM with M = N·Hout·Wout
      pixels, N = Cout/groups channels and K = Kh·Kw·Cin/groups, the weight packed at build time as [K, Cout]
      with K ordered (kh, kw, cin) to match NHWC gathers; conv groups run along grid axis 1.
Group-blocked configs of a grouped conv (BLOCK_G = G > 1, `blocked_configs`): with few channels per group most of
a BLOCK_N x BLOCK_K tile would be masked, so one program computes G consecutive groups as one implicit GEMM with
N = G·Cout/groups and K = Kh·Kw·G·Cin/groups over a block-diagonal weight (`pack_conv_weight`: each column dense
in its own group's rows, zeros elsewhere), ceil(groups/G) blocks along grid axis 1; where G does not divide the
groups the last block is padded with groups that do not exist, whose input channels are never loaded and whose
outputs are never stored. The plan, the resource model and the analysis do not see G: a program's tile (its
registers, shared memory) is the same whatever G is, G changes the grid and the K loop's length, and the FLOPs
counted are the conv's own; the zero rows a blocked program multiplies are executed work the roofline leaves out,
as it leaves out the masked columns of an unblocked program. The memory pre-flight does count the packings, G
times the weight each (`packed_weight_extra_bytes`, from the same configs the kernel gets: `implicit_gemm_configs`).
All kernels read the activation through its 4 strides (channels-last in practice; a channel-slice view works),
load zeros for padding taps, and store channels-last outputs through the shared epilogue.

Traffic: the input is read once per output-channel tile (Kh·Kw times through L2/shared memory), the packed
weight once per pixel tile, the output written once; FLOPs as `opfuse.ir.ops.conv2d_flops`.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton

from opfuse.codegen.base import FORM_TRITON, GroupKernel, KernelConfig, compiled_info, rows_jit, tuned_configs
from opfuse.codegen.epilogue import (Epilogue, TileLayout, compute_dtype, generate_kernel, interpreting,
                                     siblings_and_chains)
from opfuse.codegen.forms import EpilogueKernel
from opfuse.codegen.split_k import SplitK, sliced_template, slices_of, with_slices
from opfuse.codegen.expr import Unsupported, int_pair
from opfuse.codegen.gemm import GROUP_M, GemmKernel, prologue_source, anchor_biases, gemm_configs
from opfuse.codegen.library_fused import FusedConvLibrary, fused_chain
from opfuse.codegen.lower import find_anchor
from opfuse.codegen.prologue import Prologue
from opfuse.fusion.legality import anchor_prologue, row_norm_epilogue
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.resources import ADDRESSING_REGISTERS
from opfuse.fusion.tiles import (GATHER_CHANNELS, anchor_steps, by_occupancy, conv_as_gemm, group_block,
                                 whole_row_tile)
from opfuse.hardware import HardwareProfile, get_hardware
from opfuse.ir.graph import Graph, Node, torch_dtype
from opfuse.numerics import dot_precision

CONV_TEMPLATE = '''
import triton
import triton.language as tl


''' + rows_jit(["M"]) + '''
def KERNEL_NAME(
    x_ptr, w_ptr,
    M, N_TOTAL, COUT_G, CIN_G, C_IN, H, W, R1, R2,
    s_xn, s_xc, s_xh, s_xw,
    {params}
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_GATHER: tl.constexpr, PRECISION: tl.constexpr, UNIT: tl.constexpr, ROW_UNIT: tl.constexpr,
):
{units}
    pid = tl.program_id(0)
    group = tl.program_id(1)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(COUT_G, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    first_m = (pid // group_width) * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_rows
    pid_n = (pid % group_width) // group_rows

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)       # output pixel
    offs_c = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)       # output channel within the (blocked) conv group
    offs_n = group * COUT_G + offs_c                        # output channel
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    # the last block of conv groups may be padded with groups that do not exist: no channel of theirs is read or
    # written (their weight rows are zeros in the real groups' columns)
    mask_n = (offs_c < COUT_G) & (offs_n < N_TOTAL)
    cin_here = tl.minimum(CIN_G, C_IN - group * CIN_G)      # input channels of this (blocked) group that exist
    r2 = offs_m % R2                                        # output column
    r1 = (offs_m // R2) % R1                                # output row
    r0 = offs_m // (R2 * R1)                                # image
    ih0 = r1 * STRIDE_H - PAD_H
    iw0 = r2 * STRIDE_W - PAD_W
    x_rows = x_ptr + r0 * s_xn + (group * CIN_G) * s_xc
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if K_GATHER:
        # few input channels per group: each K block gathers across taps, so no MMA lane idles on padding
        k_total = KH * KW * CIN_G
        # rows past M gather row M - 1's window (in bounds; the epilogue stores none of them), so the load mask
        # has no row term: a third fewer instructions a K step, whatever M is (RESULTS.md, 2026-12-04 offline)
        g_m = tl.minimum(offs_m, M - 1)
        g_ih0 = ((g_m // R2) % R1) * STRIDE_H - PAD_H
        g_iw0 = (g_m % R2) * STRIDE_W - PAD_W
        x_origin = x_ptr + (g_m // (R2 * R1)) * s_xn + (group * CIN_G) * s_xc + g_ih0 * s_xh + g_iw0 * s_xw
        for k0 in range(0, k_total, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < k_total
            c = k % CIN_G
            tap = k // CIN_G
            dh = (tap // KW) * DIL_H
            dw = (tap % KW) * DIL_W
            ih = g_ih0[:, None] + dh[None, :]
            iw = g_iw0[:, None] + dw[None, :]
            a_ok = (k_ok & (c < cin_here))[None, :] & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load(x_origin[:, None] + (c * s_xc + dh * s_xh + dw * s_xw)[None, :], mask=a_ok, other=0.0)
            b = tl.load(w_ptr + k[:, None] * N_TOTAL + offs_n[None, :],
                        mask=k_ok[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
    else:
        # one tap and one block of input channels per step: the gather is a strided 2-D tile load
        c_blocks = tl.cdiv(CIN_G, BLOCK_K)
        for t in range(0, KH * KW * c_blocks):
            tap = t // c_blocks
            c = (t % c_blocks) * BLOCK_K + offs_k
            c_ok = c < cin_here
            ih = ih0 + (tap // KW) * DIL_H
            iw = iw0 + (tap % KW) * DIL_W
            row_ok = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
            a = tl.load((x_rows + ih * s_xh + iw * s_xw)[:, None] + c[None, :] * s_xc,
                        mask=row_ok[:, None] & c_ok[None, :], other=0.0)
            b = tl.load(w_ptr + (tap * CIN_G + c)[:, None] * N_TOTAL + offs_n[None, :],
                        mask=c_ok[:, None] & mask_n[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)

{epilogue}
'''

# split-K: the same kernel with its K loop restricted to one slice (grid axis 2) that stores its fp32 partial tile to
# ws[slice, 0, pixel, output channel] instead of running the epilogue (CONV_TEMPLATE itself stays as it is)
CONV_SLICE_TEMPLATE = sliced_template(CONV_TEMPLATE, [
    ("    {params}\n", "    {params}\n    SLICE_STEPS,\n"),
    ("    group = tl.program_id(1)\n", "    group = tl.program_id(1)\n    pid_k = tl.program_id(2)\n"),
    ("        for k0 in range(0, k_total, BLOCK_K):\n",
     "        k_first = pid_k * SLICE_STEPS * BLOCK_K\n"
     "        for k0 in range(k_first, tl.minimum(k_total, k_first + SLICE_STEPS * BLOCK_K), BLOCK_K):\n"),
    ("        for t in range(0, KH * KW * c_blocks):\n",
     "        t_first = pid_k * SLICE_STEPS\n"
     "        for t in range(t_first, tl.minimum(KH * KW * c_blocks, t_first + SLICE_STEPS)):\n")])
# the templates' integers that address their channel dims, rebound as multiples of UNIT
# (`opfuse.codegen.base.unit_code`)
CONV_UNITS = ("N_TOTAL", "COUT_G", "CIN_G", "C_IN", "s_xn", "s_xh", "s_xw")
DEPTHWISE_UNITS = ("N", "s_xn", "s_xh", "s_xw")
# the input's strides along the output rows' pixels, which set ROW_UNIT with the epilogue's
# (`opfuse.codegen.base.row_unit_of`)
X_ROW_STRIDES = ("s_xn", "s_xh", "s_xw")
CONV_PARTIAL = '''\
    ws = ws_ptr + pid_k * M * N_TOTAL + offs_m[:, None] * N_TOTAL + offs_n[None, :]
    tl.store(ws, acc, mask=mask_m[:, None] & mask_n[None, :])'''

DEPTHWISE_TEMPLATE = '''
import triton
import triton.language as tl


@triton.jit
def filter_row(acc, kh, ih, iw0, x_rows, x_cols, w_ptr, offs_n, mask_m, mask_n, N, H, W, s_xh, s_xw,
               KW: tl.constexpr, DIL_W: tl.constexpr):
    """`acc` plus the taps of filter row `kh` (input row `ih`), unrolled."""
    for kw in tl.static_range(KW):
        iw = iw0 + kw * DIL_W
        ok = mask_m & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        x = tl.load((x_rows + ih * s_xh + iw * s_xw)[:, None] + x_cols[None, :],
                    mask=ok[:, None] & mask_n[None, :], other=0.0)
        w = tl.load(w_ptr + (kh * KW + kw) * N + offs_n, mask=mask_n, other=0.0)
        acc += x.to(tl.float32) * w.to(tl.float32)[None, :]
    return acc


''' + rows_jit(["M"]) + '''
def KERNEL_NAME(
    x_ptr, w_ptr,
    M, N, H, W, R1, R2,
    s_xn, s_xc, s_xh, s_xw,
    {params}
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    MULTIPLIER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_LOOP: tl.constexpr,
    UNIT: tl.constexpr, ROW_UNIT: tl.constexpr,
):
{units}
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)   # output pixel
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)   # output channel
    mask_m = offs_m < M
    mask_n = offs_n < N
    r2 = offs_m % R2
    r1 = (offs_m // R2) % R1
    r0 = offs_m // (R2 * R1)
    ih0 = r1 * STRIDE_H - PAD_H
    iw0 = r2 * STRIDE_W - PAD_W
    x_rows = x_ptr + r0 * s_xn
    x_cols = (offs_n // MULTIPLIER) * s_xc                      # output channel c reads input channel c // mult
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ROW_LOOP:    # filter rows in a loop, each row's taps unrolled
        for kh in range(KH):
            acc = filter_row(acc, kh, ih0 + kh * DIL_H, iw0, x_rows, x_cols, w_ptr, offs_n, mask_m, mask_n, N, H, W,
                             s_xh, s_xw, KW, DIL_W)
    else:           # every tap unrolled
        for kh in tl.static_range(KH):
            acc = filter_row(acc, kh, ih0 + kh * DIL_H, iw0, x_rows, x_cols, w_ptr, offs_n, mask_m, mask_n, N, H, W,
                             s_xh, s_xw, KW, DIL_W)

{epilogue}
'''


# The runs form of the depthwise kernel: a program's BLOCK_M output pixels are BLOCK_M // COLS runs of COLS
# neighbours along an output row. Each filter row's input columns under a run are loaded once, each into the
# accumulators of every output of the run whose window covers it ({taps}: generated for the filter's width, stride
# and dilation by `run_taps`), so a run of COLS outputs of a 7-wide filter loads COLS + 6 input columns a filter row
# instead of 7·COLS. The accumulators are then interleaved into one [BLOCK_M, BLOCK_N] tile (row = run·COLS + column)
# for the shared epilogue.
DEPTHWISE_RUNS_TEMPLATE = '''
import triton
import triton.language as tl


''' + rows_jit(["P"]) + '''
def KERNEL_NAME(
    x_ptr, w_ptr,
    P, N, H, W, R1, R2,
    s_xn, s_xc, s_xh, s_xw,
    {{params}}
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
    MULTIPLIER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS: tl.constexpr,
    UNIT: tl.constexpr, ROW_UNIT: tl.constexpr,
):
{{units}}
    RUNS: tl.constexpr = BLOCK_M // COLS
    runs_per_row = (R2 + COLS - 1) // COLS
    offs_p = tl.program_id(0) * RUNS + tl.arange(0, RUNS)       # run of COLS outputs: (image, row, run in row)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # output channel
    mask_p = offs_p < P
    mask_n = offs_n < N
    p2 = offs_p % runs_per_row
    p1 = (offs_p // runs_per_row) % R1
    p0 = offs_p // (runs_per_row * R1)
    ih0 = p1 * STRIDE_H - PAD_H
    iw0 = p2 * (COLS * STRIDE_W) - PAD_W
    x_runs = x_ptr + p0 * s_xn
    x_cols = (offs_n // MULTIPLIER) * s_xc                       # output channel c reads input channel c // mult
{zeros}
    for kh in range(KH):
        ih = ih0 + kh * DIL_H
        dw_ok = mask_p & (ih >= 0) & (ih < H)
        dw_row = x_runs + ih * s_xh
        dw_w = w_ptr + kh * KW * N + offs_n
{taps}
{interleave}
    rows = tl.arange(0, BLOCK_M)
    run = tl.program_id(0) * RUNS + rows // COLS
    r2 = (run % runs_per_row) * COLS + rows % COLS
    r1 = (run // runs_per_row) % R1
    r0 = run // (runs_per_row * R1)
    mask_m = (run < P) & (r2 < R2)

{{epilogue}}
'''


def run_taps(cols: int, kw: int, stride: int, dilation: int, indent: str = "        ") -> str:
    """The body of one filter row of the runs form: the row's `kw` weights, then each input column under a run of
    `cols` outputs (`stride` and `dilation` along the row) loaded once and multiplied into the accumulator of every
    output whose window covers it."""
    lines = [f"dw_w{k} = tl.load(dw_w + {k} * N, mask=mask_n, other=0.0).to(tl.float32)[None, :]" for k in range(kw)]
    for j in range((cols - 1) * stride + (kw - 1) * dilation + 1):
        users = [(t, (j - t * stride) // dilation) for t in range(cols)
                 if j >= t * stride and (j - t * stride) % dilation == 0 and (j - t * stride) // dilation < kw]
        if not users:
            continue
        lines += [f"iw = iw0 + {j}",
                  "dw_x = tl.load((dw_row + iw * s_xw)[:, None] + x_cols[None, :],",
                  "               mask=(dw_ok & (iw >= 0) & (iw < W))[:, None] & mask_n[None, :], other=0.0)",
                  "dw_x = dw_x.to(tl.float32)"]
        lines += [f"dw_acc{t} += dw_x * dw_w{k}" for t, k in users]
    return "\n".join(indent + line for line in lines)


def interleave(names: list[str], rows: str, indent: str = "    ") -> str:
    """Lines binding `acc` to the [RUNS, BLOCK_N] tiles `names` (a power of two of them) interleaved by rows into
    [`rows`, BLOCK_N]: row r·len(names) + t of `acc` is row r of names[t]."""
    lines, level, count = [], list(names), 0
    while len(level) > 1:     # join t with t + half: each join's new last dim is the next lower bit of t
        half = len(level) // 2
        joined = []
        for i in range(half):
            lines.append(f"dw_j{count} = tl.join({level[i]}, {level[i + half]})")
            joined.append(f"dw_j{count}")
            count += 1
        level = joined
    depth = len(names).bit_length() - 1
    if depth == 0:
        lines.append(f"acc = {level[0]}")
    else:
        order = ", ".join(str(d) for d in (0, *range(2, depth + 2), 1))     # [runs, t's bits high to low, N]
        lines.append(f"acc = tl.reshape(tl.permute({level[0]}, ({order})), ({rows}, BLOCK_N))")
    return "\n".join(indent + line for line in lines)


def depthwise_runs_template(cols: int, kw: int, stride: int, dilation: int) -> str:
    """`DEPTHWISE_RUNS_TEMPLATE` for runs of `cols` outputs (a power of two) of a filter `kw` wide."""
    names = [f"dw_acc{t}" for t in range(cols)]
    zeros = "\n".join(f"    {n} = tl.zeros((RUNS, BLOCK_N), dtype=tl.float32)" for n in names)
    return DEPTHWISE_RUNS_TEMPLATE.format(zeros=zeros, taps=run_taps(cols, kw, stride, dilation),
                                          interleave=interleave(names, "BLOCK_M"))


# [pixels, channels] tiles, in the order measured best on an H200 for MobileNet-sized layers (64 x 32 second: it
# beat 128 x 32 on EfficientNet's batch-64 layers, RESULTS.md run 55), then smaller ones for layers too small to
# fill the GPU with those (`depthwise_configs`)
DEPTHWISE_CONFIGS = [KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=128, BLOCK_N=32),
                     KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=64, BLOCK_N=32),
                     KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=64, BLOCK_N=64),
                     KernelConfig.of(num_warps=8, num_stages=1, BLOCK_M=256, BLOCK_N=32),
                     KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=32, BLOCK_N=128),
                     KernelConfig.of(num_warps=8, num_stages=1, BLOCK_M=128, BLOCK_N=64),
                     KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=128)]
INTERPRETED_DEPTHWISE = {"BLOCK_M": 32, "BLOCK_N": 16}    # the one tile Triton's interpreter runs (tests)
SMALL_DEPTHWISE_CONFIGS = [KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=16, BLOCK_N=64),
                           KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=32, BLOCK_N=32),
                           KernelConfig.of(num_warps=2, num_stages=1, BLOCK_M=16, BLOCK_N=32)]


# the runs form's tiles (COLS outputs a run), in the order of their geometric mean over the zoo's depthwise layers at
# batch 64 (RESULTS.md run 92), then smaller ones for layers too small to fill the GPU with those
DEPTHWISE_RUN_CONFIGS = [KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=128, BLOCK_N=32, COLS=8),
                         KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=128, BLOCK_N=64, COLS=8),
                         KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=64, BLOCK_N=64, COLS=8),
                         KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=128, BLOCK_N=32, COLS=4),
                         KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=64, BLOCK_N=32, COLS=4),
                         KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=32, BLOCK_N=64, COLS=4)]


def unrolled_tap_registers(config: KernelConfig, taps: int, itemsize: int) -> int:
    """Registers per thread a depthwise tile needs with all `taps` unrolled: ptxas issues every tap's load before
    the multiply-adds, so each thread holds all of its elements' taps (packed 32 bits to a register), its float32
    accumulator and the addressing."""
    elements = config["BLOCK_M"] * config["BLOCK_N"] // (32 * config.num_warps)
    return -(-taps * elements * itemsize // 4) + elements + ADDRESSING_REGISTERS


def depthwise_configs(m: int, n: int, sm_count: int, taps: int = 1, itemsize: int = 2,
                      max_registers: int = 255, width: int | None = None, whole_rows: bool = False
                      ) -> list[KernelConfig]:
    """Tile candidates of the direct depthwise kernel over `m` output pixels x `n` channels (in rows of `width`)
    with a filter of `taps` taps on `itemsize`-byte inputs, on a GPU of `sm_count` SMs and `max_registers`
    registers per thread, the default first. A depthwise conv does a few multiply-adds per element it loads, so its
    speed is the loads it issues: the runs form's tiles (`DEPTHWISE_RUN_CONFIGS`: a run of outputs along a row
    loads each input column once; only where a row's runs are at least half outputs, not the padding past its end)
    come before the pixel tiles, and all are ordered `by_occupancy`, those whose grid has a program for every SM first, in
    the listed (measured) order (a 7x7 layer of ConvNeXt's last stage, 49 pixels x 768 channels at batch 1, fills 24
    of an H200's 132 SMs with the first tile). A pixel tile whose taps unrolled would not fit the registers
    (`unrolled_tap_registers`) loops over the filter rows instead (ROW_LOOP=1), each row's taps unrolled: unrolled,
    they spill (a 7x7 filter on a 128 x 32 tile: 6 KB per thread, 20x slower than cuDNN), and a row loop keeps the
    loads of one row in flight. With `whole_rows` (a norm over the channels in the epilogue) each tile becomes its
    `whole_row_tile`, spanning all `n` channels with as many elements."""
    runs = [c for c in DEPTHWISE_RUN_CONFIGS if width is None or -(-width // c["COLS"]) * c["COLS"] < 2 * width]
    configs: list[KernelConfig] = []
    for c in runs + DEPTHWISE_CONFIGS + SMALL_DEPTHWISE_CONFIGS:
        params = whole_row_tile(dict(c.params), n) if whole_rows else dict(c.params)
        tile = KernelConfig.of(num_warps=c.num_warps, num_stages=c.num_stages, **params)
        if "COLS" not in params:
            tile = KernelConfig.of(num_warps=c.num_warps, num_stages=c.num_stages, **params,
                                   ROW_LOOP=int(unrolled_tap_registers(tile, taps, itemsize) > max_registers))
        if tile not in configs:
            configs.append(tile)
    return by_occupancy(configs, m, n, 1, sm_count)


class ConvGeometry:
    """Stride, padding, dilation, groups and kernel size of a conv2d node, as the kernels take them."""

    def __init__(self, graph: Graph, node: Node):
        x_type, w_type = graph[node.inputs[0]].type, graph[node.inputs[1]].type
        if len(x_type.shape) != 4:
            raise Unsupported(f"{node.describe()}: input {x_type} is not [N, C, H, W]")
        self.stride = int_pair(node.attrs.get("stride", 1), node, "stride")
        self.padding = int_pair(node.attrs.get("padding", 0), node, "padding")
        self.dilation = int_pair(node.attrs.get("dilation", 1), node, "dilation")
        self.groups = int(node.attrs.get("groups", 1))
        self.batch, self.cin, self.height, self.width = x_type.shape
        self.cin_per_group, self.kh, self.kw = w_type.shape[1:]

    def key(self) -> tuple:
        return self.stride, self.padding, self.dilation, self.groups, self.cin_per_group, self.kh, self.kw

    def is_depthwise(self, cout: int) -> bool:
        """Whether the conv, with `cout` output channels, runs as `DepthwiseConvKernel`: one input channel a group
        (groups == Cin > 1) and Cout a multiple of Cin."""
        return self.groups > 1 and self.groups == self.cin and cout % self.cin == 0

    def constexprs(self) -> dict[str, int]:
        return dict(KH=self.kh, KW=self.kw, STRIDE_H=self.stride[0], STRIDE_W=self.stride[1],
                    PAD_H=self.padding[0], PAD_W=self.padding[1], DIL_H=self.dilation[0], DIL_W=self.dilation[1])


def group_block_of(config: KernelConfig) -> int:
    """Conv groups one program of `config` computes (BLOCK_G; 1 where the config does not block groups)."""
    return dict(config.params).get("BLOCK_G", 1)


def weights_on_device(weights: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The anchors' weights [Cout, Cin/g, Kh, Kw] (the graph's, on the host) as one tensor, concatenated along Cout,
    on `device` in `dtype`: one copy to the device each call, so a kernel calls it once for each device copy it
    holds."""
    return torch.cat(list(weights), 0).to(device=device, dtype=dtype)


def packed_shape(weight_shape: Sequence[int], block: int = 1) -> tuple[int, int]:
    """The shape of `pack_conv_weight` of a weight of `weight_shape` [Cout, Cin/g, Kh, Kw] for programs of `block`
    conv groups: [Kh·Kw·block·Cin/g, Cout], so a block of G groups packs G times the weight's elements."""
    cout, cin_per_group, kh, kw = weight_shape
    return kh * kw * block * cin_per_group, cout


def pack_conv_weight(weight: torch.Tensor, groups: int, block: int = 1) -> torch.Tensor:
    """A conv weight [Cout, Cin/g, Kh, Kw] packed as the implicit GEMM's B operand for programs of `block`
    consecutive conv groups: `packed_shape` [Kh·Kw·block·Cin/g, Cout] with K ordered (kh, kw, group within the
    block, cin) to match NHWC gathers, each output channel's column dense in its own group's rows and zero in the
    other groups' (block diagonal). One group a block is the plain packing [Kh·Kw·Cin/g, Cout]."""
    shape = packed_shape(weight.shape, block)
    cout, cin_per_group, kh, kw = weight.shape
    if block > 1:
        position = (torch.arange(cout, device=weight.device) // (cout // groups)) % block
        dense = weight.new_zeros(cout, block, cin_per_group, kh, kw)
        dense[torch.arange(cout, device=weight.device), position] = weight
        weight = dense.reshape(cout, block * cin_per_group, kh, kw)
    return weight.permute(2, 3, 1, 0).reshape(shape).contiguous()


def blocked_configs(configs: Sequence[KernelConfig], geometry: ConvGeometry, cout_per_group: int, pixels: int,
                    sm_count: int) -> list[KernelConfig]:
    """`configs` (the tiles, default first, with the plan's K slices where it split) each with its group-blocked
    form beside it where blocking pays (`opfuse.fusion.tiles.group_block` of its BLOCK_N: few channels per group),
    so a short tuning (`FusionConfig.tune_top`) times both forms of the first tiles.

    Split-K and group blocking exclude each other, per tile: a tile the plan splits (its grid leaves most SMs idle)
    gets no blocked form, which would shrink its grid G-fold more, and a blocked form runs unsplit (no SPLIT_K;
    the plan's slices are counted for the one-group-a-program grid). The default (first) config is the default
    tile blocked where its blocked grid still gives every SM a program (pixel tiles x blocks of groups >=
    `sm_count`: a blocked program walks G groups' K loops one after the other, which only pays where programs wait
    for SMs); else the default tile one group a program."""
    ordered: list[KernelConfig] = []
    for config in configs:
        block = group_block(geometry.groups, cout_per_group, geometry.cin_per_group, config["BLOCK_N"])
        if block > 1 and slices_of(config) == 1:
            params = {k: v for k, v in config.params if k != "SPLIT_K"} | {"BLOCK_G": block}
            ordered.append(KernelConfig.of(config.num_warps, config.num_stages, **params))
        ordered.append(config)
    first = ordered[0]
    if group_block_of(first) > 1:
        programs = triton.cdiv(pixels, first["BLOCK_M"]) * triton.cdiv(geometry.groups, group_block_of(first))
        if programs < sm_count:
            ordered[0], ordered[1] = ordered[1], ordered[0]
    return ordered


def implicit_gemm_configs(group: FusionGroup, geometry: ConvGeometry, layout: TileLayout, itemsize: int,
                          hw: HardwareProfile) -> list[KernelConfig]:
    """`ConvKernel`'s configs for a conv of `geometry` whose output tiles as `layout`, computing in `itemsize`-byte
    elements on GPU `hw`, the default first: the GEMM tiles (`gemm_configs`) with the plan's K slices where it split
    (`group.split_k`), each with its group-blocked form beside it where blocking pays (`blocked_configs`)."""
    cout_per_group = layout.channels // geometry.groups
    k = geometry.kh * geometry.kw * geometry.cin_per_group
    configs = gemm_configs(layout.rows, cout_per_group, k, geometry.groups, itemsize,
                           gather=geometry.cin_per_group < GATHER_CHANNELS, hw=hw)
    if group.split_k:
        configs = with_slices(configs, group)
    return blocked_configs(configs, geometry, cout_per_group, layout.rows, hw.sm_count)


def packed_weight_extra_bytes(graph: Graph, group: FusionGroup, hw: HardwareProfile, tuning: bool,
                              tune_top: int | None) -> tuple[int, int]:
    """(held, while_tuned): device bytes beyond one plain copy of the weight that the packed weights of the kernel
    `lower_conv_group` makes for `group` on GPU `hw` take; (0, 0) unless it is a grouped conv's `ConvKernel` with
    group-blocked configs, whose every block size packs its own weight (`packed_shape`: G times the weight for G
    groups a program). `held`: what it keeps outside its own recording and tuning: its default config's packing
    without `tuning`, with it the largest packing of the configs it is tuned with (the kept one is one of them).
    `while_tuned`: what it holds at once while its configs run one after the other (precompile's recording, then
    its tuning; `ConvKernel.keep_form` frees the rest after each): the packings of its first `tune_top` configs
    (all where None or 0) and of one group a program (the unsplit form the tuner also times)."""
    node = graph[find_anchor(graph, group)]
    geometry = ConvGeometry(graph, node)
    layout = TileLayout(node.type.shape, channel_dim=1, channels_last=True)
    if geometry.groups == 1 or geometry.is_depthwise(layout.channels):
        return 0, 0
    dtype = torch_dtype(compute_dtype(graph, node.inputs[0], node))
    blocks = [group_block_of(c) for c in implicit_gemm_configs(group, geometry, layout, dtype.itemsize, hw)]
    weight_shape = graph[node.inputs[1]].type.shape
    plain = math.prod(packed_shape(weight_shape))

    def extra(held: set[int]) -> int:
        return (sum(math.prod(packed_shape(weight_shape, block)) for block in held) - plain) * dtype.itemsize

    if not tuning:
        return extra({blocks[0]}), extra({blocks[0]})
    tuned = set(tuned_configs(blocks, tune_top)) | {1}
    return extra({max(tuned)}), extra(tuned)


class ConvKernel(EpilogueKernel):
    """Implicit-GEMM convolution (+ epilogue) of one group; a grouped conv's configs may block its conv groups
    (BLOCK_G: `blocked_configs`), each block size with its own packed weight (`packed_weight`)."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, epilogue: Epilogue, x: str,
                 geometry: ConvGeometry, weights: Sequence[torch.Tensor], dtype: torch.dtype,
                 hw: HardwareProfile | None = None):
        name, source, self.kernel = generate_kernel(CONV_TEMPLATE, epilogue, units=CONV_UNITS, rows=("M",),
                                                    row_strides=X_ROW_STRIDES)
        hw = hw or get_hardware()
        super().__init__(graph, group, name, source)
        self.epilogue, self.layout, self.x, self.geometry = epilogue, epilogue.layout, x, geometry
        # the anchors' weights as the graph holds them: each block size's packing starts from them, on first use
        self.weights, self.device, self.dtype = list(weights), device, dtype
        self._packed: dict[int, torch.Tensor] = {}
        self.constants = {x: graph.constants[x].to(device)} if graph.is_constant(x) else {}
        self._configs = implicit_gemm_configs(group, geometry, self.layout, dtype.itemsize, hw)
        # the planner split K: each config runs the slices the plan gives its tile
        self.split = (SplitK(CONV_SLICE_TEMPLATE, CONV_PARTIAL, epilogue, CONV_UNITS, ("M",),
                             (*X_ROW_STRIDES, "N_TOTAL")) if group.split_k else None)
        if self.split is not None:      # every kernel it may run: what the tuning cache and a package compare
            self.source += "\n\n" + self.split.sources
        self.packed_weight(group_block_of(self._configs[0]))   # the default config's, packed at build time

    def packed_weight(self, block: int) -> torch.Tensor:
        """The weight packed for programs of `block` conv groups (`pack_conv_weight`), on the device."""
        if block not in self._packed:
            weight = weights_on_device(self.weights, self.device, self.dtype)
            self._packed[block] = pack_conv_weight(weight, self.geometry.groups, block)
        return self._packed[block]

    def keep_form(self, config: KernelConfig) -> None:
        """Also hold only the packed weight `config` runs, packed now if it was not (none for the library and
        unfused forms): a block of G groups packs G times the weight. Another config packs its own again on first
        use."""
        super().keep_form(config)
        keep = group_block_of(config) if config.form == FORM_TRITON else None
        self._packed = {block: w for block, w in self._packed.items() if block == keep}
        if keep is not None:
            self.packed_weight(keep)

    def _steps(self, config: KernelConfig) -> int:
        """K-loop steps of the template for `config` (the gather form walks taps x channels in BLOCK_K blocks)."""
        g = self.geometry
        return anchor_steps(g.kh * g.kw, group_block_of(config) * g.cin_per_group, config["BLOCK_K"])

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config)
        g = self.geometry
        x = values[self.x]
        m, channels = self.layout.rows, self.layout.channels
        block = group_block_of(config)
        # a program's conv group is `block` consecutive groups (the last block padded where they do not divide)
        cout_per_block, cin_per_block = block * (channels // g.groups), block * g.cin_per_group
        _, r1, r2 = self.layout.row_sizes()
        tiles = triton.cdiv(m, config["BLOCK_M"]) * triton.cdiv(cout_per_block, config["BLOCK_N"])
        blocks = triton.cdiv(g.groups, block)
        slices = slices_of(config)
        launch = dict(**g.constexprs(), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                      BLOCK_K=config["BLOCK_K"], GROUP_M=GROUP_M, K_GATHER=cin_per_block < config["BLOCK_K"],
                      PRECISION=dot_precision(conv=True),
                      num_warps=config.num_warps, num_stages=config.num_stages)
        common = (x, self.packed_weight(block), m, channels, cout_per_block, cin_per_block, g.cin, g.height,
                  g.width, r1, r2, *x.stride())
        if slices > 1:   # K slices store fp32 partial tiles; the reduce kernel sums them and runs the epilogue
            workspace = torch.empty((slices, 1, m, channels), dtype=torch.float32, device=x.device)
            compiled = self.split.partial[(tiles, blocks, slices)](
                *common, workspace, SLICE_STEPS=triton.cdiv(self._steps(config), slices), **launch)
            self.split.run_reduce(workspace, self.layout, args)
        else:
            compiled = self.kernel[(tiles, blocks)](*common, *args, **launch)
        self.last_compiled = compiled_info(compiled)
        return outputs


class DepthwiseConvKernel(EpilogueKernel):
    """Direct depthwise convolution (+ epilogue) of one group: one channel per column, no reduction over Cin."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, epilogue: Epilogue, x: str,
                 geometry: ConvGeometry, weight: torch.Tensor, hw: HardwareProfile | None = None):
        """An epilogue of `whole_rows` (a norm over the channels) gets tiles spanning every channel."""
        name, source, self.kernel = generate_kernel(DEPTHWISE_TEMPLATE, epilogue, units=DEPTHWISE_UNITS,
                                                    rows=("M",), row_strides=X_ROW_STRIDES)
        super().__init__(graph, group, name, source)
        self._runs: dict[int, tuple[str, object]] = {}    # COLS: the runs form's (source, kernel)
        self.epilogue, self.layout, self.x, self.geometry = epilogue, epilogue.layout, x, geometry
        # [Cout, 1, Kh, Kw] -> [Kh·Kw, Cout]: one contiguous row of channel weights per tap
        self.weight = weight[:, 0].permute(1, 2, 0).reshape(-1, weight.shape[0]).contiguous()
        self.multiplier = self.layout.channels // geometry.cin
        self.constants = {x: graph.constants[x].to(device)} if graph.is_constant(x) else {}
        hw = hw or get_hardware()
        whole = epilogue.whole_rows
        self._configs = (depthwise_configs(self.layout.rows, self.layout.channels, hw.sm_count, geometry.kh * geometry.kw,
                                           weight.element_size(), hw.max_registers_per_thread,
                                           self.layout.row_sizes()[2], whole)
                         if not interpreting() else
                         [KernelConfig.of(**(whole_row_tile(INTERPRETED_DEPTHWISE, self.layout.channels) if whole
                                             else INTERPRETED_DEPTHWISE), ROW_LOOP=0)])
        # the kernel's source is every form it may run: what the tuning cache and a package's check compare
        for cols in sorted({dict(c.params).get("COLS", 1) for c in self._configs} - {1}):
            self.source += "\n\n" + self._runs_form(cols)[0]

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config)
        g = self.geometry
        x = values[self.x]
        m, channels = self.layout.rows, self.layout.channels
        _, r1, r2 = self.layout.row_sizes()
        params = dict(config.params)
        cols = params.get("COLS", 1)
        options = dict(**g.constexprs(), MULTIPLIER=self.multiplier, BLOCK_M=config["BLOCK_M"],
                       BLOCK_N=config["BLOCK_N"], num_warps=config.num_warps, num_stages=config.num_stages)
        if cols & (cols - 1) or config["BLOCK_M"] % cols:
            raise Unsupported(f"{self.name}: runs of {cols} outputs need a power of two dividing BLOCK_M "
                              f"({config['BLOCK_M']})")
        if self.epilogue.whole_rows and config["BLOCK_N"] < channels:
            raise Unsupported(f"{self.name}: its norm over the channels needs a tile of all {channels} channels, "
                              f"not {config['BLOCK_N']}")
        if cols > 1:      # runs of COLS outputs along a row: the row's runs, the last one cut at the row's end
            runs = m // (r1 * r2) * r1 * triton.cdiv(r2, cols)
            grid = (triton.cdiv(runs, config["BLOCK_M"] // cols), triton.cdiv(channels, config["BLOCK_N"]))
            compiled = self.runs_kernel(cols)[grid](x, self.weight, runs, channels, g.height, g.width, r1, r2,
                                                    *x.stride(), *args, COLS=cols, **options)
        else:
            grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(channels, config["BLOCK_N"]))
            compiled = self.kernel[grid](x, self.weight, m, channels, g.height, g.width, r1, r2, *x.stride(), *args,
                                         ROW_LOOP=params.get("ROW_LOOP", 0), **options)
        self.last_compiled = compiled_info(compiled)
        return outputs

    def runs_kernel(self, cols: int):
        """The runs form's kernel for runs of `cols` outputs (`DEPTHWISE_RUNS_TEMPLATE`)."""
        return self._runs_form(cols)[1]

    def _runs_form(self, cols: int) -> tuple[str, object]:
        if cols not in self._runs:
            g = self.geometry
            template = depthwise_runs_template(cols, g.kw, g.stride[1], g.dilation[1])
            self._runs[cols] = generate_kernel(template, self.epilogue, units=DEPTHWISE_UNITS, rows=("P",),
                                               row_strides=X_ROW_STRIDES)[1:]
        return self._runs[cols]


def lower_conv_group(graph: Graph, group: FusionGroup, device: torch.device | str,
                     hw: HardwareProfile | None = None) -> GroupKernel:
    """The kernel of a group anchored on conv2d (horizontal: sibling convs of one geometry on one input), with
    tiles for GPU `hw` (default: the default profile)."""
    device = torch.device(device)
    users = graph.users()      # once for the whole lowering: each step below reads it
    anchors, chains = siblings_and_chains(graph, group, ("conv2d",), users)
    if len(anchors) > 1 and group.kind is not GroupKind.HORIZONTAL:
        raise Unsupported(f"group {group.name} ({group.kind.value}) holds several convolutions: "
                          f"{', '.join(anchors)}")
    first = graph[anchors[0]]
    x = first.inputs[0]
    geometry = ConvGeometry(graph, first)
    for name in anchors:
        node = graph[name]
        if node.inputs[0] != x or ConvGeometry(graph, node).key() != geometry.key():
            raise Unsupported(f"horizontal group {group.name}: {node.describe()} differs from "
                              f"{first.describe()} in input or geometry")
        if not graph.is_constant(node.inputs[1]):
            raise Unsupported(f"{node.describe()}: the weight is not a constant")
    if len(anchors) > 1 and geometry.groups != 1:
        raise Unsupported(f"horizontal group {group.name}: grouped convolutions are not concatenated")
    dtype = torch_dtype(compute_dtype(graph, x, first))
    # the graph's weights: each kernel below copies them to the device once (`weights_on_device`), ConvKernel as
    # the packing of its default config
    weights = [graph.constants[graph[a].inputs[1]] for a in anchors]
    n, _, h_out, w_out = first.type.shape
    layout = TileLayout((n, sum(w.shape[0] for w in weights), h_out, w_out), channel_dim=1, channels_last=True)
    biases = anchor_biases(graph, anchors)
    norm = row_norm_epilogue(graph, anchors[0], group.nodes)
    if norm is not None and (len(anchors) > 1 or not geometry.is_depthwise(layout.channels)):
        raise Unsupported(f"group {group.name}: norm {norm} in the epilogue of {first.describe()}")
    epilogue = Epilogue(graph, group, chains, layout, device, biases, whole_rows=norm is not None)

    g = geometry
    library = ConvLibraryAnchor(x, weights, dtype, device, geometry)
    ops = anchor_prologue(graph, anchors[0], group.nodes, users)
    if ops:     # a 1x1 conv computes them on its input tiles (the planner takes them for no other conv)
        if len(anchors) > 1 or not (conv_as_gemm((g.kh, g.kw), g.padding, g.groups) and g.stride == (1, 1)):
            raise Unsupported(f"group {group.name}: a prologue ({', '.join(ops)}) before {first.describe()}")
        weight = weights_on_device(weights, device, dtype)
        source = prologue_source(graph, ops)
        input_layout = TileLayout(graph[x].type.shape, channel_dim=1, channels_last=True)
        kernel = GemmKernel(graph, group, device, epilogue, a=source, k=g.cin,
                            b_packed=weight[:, :, 0, 0].t().contiguous(), conv=True,
                            prologue=Prologue(graph, ops, source, input_layout, g.cin, device), hw=hw)
    elif g.is_depthwise(layout.channels):
        kernel = DepthwiseConvKernel(graph, group, device, epilogue, x, geometry,
                                     weights_on_device(weights, device, dtype), hw)
    elif conv_as_gemm((g.kh, g.kw), g.padding, g.groups):
        weight = weights_on_device(weights, device, dtype)
        stride_h, stride_w = g.stride
        a_view = None if g.stride == (1, 1) else (lambda t: t[:, :, ::stride_h, ::stride_w])
        kernel = GemmKernel(graph, group, device, epilogue, a=x, k=g.cin,
                            b_packed=weight[:, :, 0, 0].t().contiguous(), a_view=a_view, hw=hw,
                            conv=True)
    else:
        kernel = ConvKernel(graph, group, device, epilogue, x, geometry, weights, dtype, hw)
    if norm is not None:    # no library form: its epilogue kernel's tiles would have to span the channels too
        return kernel
    kernel.library_anchor = library
    chain = fused_chain(graph, group, anchors, chains, device)
    if chain is not None:
        kernel.library_fused = FusedConvLibrary(chain, library.device_weight, x, biases[0], layout.channels, geometry)
    return kernel


class ConvLibraryAnchor:
    """The convolution through PyTorch (cuDNN), as [1, pixels, channels]: its channels-last output, flattened.

    Its weight in PyTorch's layout, channels-last as the input is (whatever layout the frontend gave the constant:
    ONNX initializers come contiguous), goes to the device on first use and `release` drops it, so a conv kernel
    holds one device copy of its weight (the packed one) unless the autotuner keeps its library form."""

    def __init__(self, x: str, weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                 geometry: ConvGeometry):
        self.x, self.weights, self.dtype, self.device, self.geometry = x, weights, dtype, device, geometry
        self.weight: torch.Tensor | None = None

    def device_weight(self) -> torch.Tensor:
        """The weight on the device, made on first use (the fused library form reads this same copy)."""
        if self.weight is None:   # channels-last like the input: cuDNN would transpose a mismatched one per call
            weight = weights_on_device(self.weights, self.device, self.dtype)
            self.weight = weight.contiguous(memory_format=torch.channels_last)
        return self.weight

    def __call__(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        g = self.geometry
        y = torch.nn.functional.conv2d(values[self.x], self.device_weight(), None, g.stride, g.padding, g.dilation,
                                       g.groups)
        y = y.contiguous(memory_format=torch.channels_last)
        return y.permute(0, 2, 3, 1).reshape(1, -1, y.shape[1])

    def release(self) -> None:
        self.weight = None
