"""The direct depthwise convolution kernel (`DepthwiseConvKernel`), for a conv2d of groups == Cin > 1 and Cout a
multiple of Cin (`opfuse.codegen.conv.lower_conv_group` chooses): [BLOCK_M pixels, BLOCK_N channels] tiles, one
multiply-add per tap, float32 accumulation; its runs form (COLS > 1) takes the pixels as runs of COLS neighbours
along a row, which load each input column once. Its tiles (`depthwise_configs`) come in orders measured best.
"""

from __future__ import annotations

from typing import Sequence

import torch
import triton

from opfuse.codegen.base import KernelConfig, Outputs, compiled_info, rows_jit
from opfuse.codegen.conv_common import GEOMETRY_PARAMS, X_ROW_STRIDES, ConvGeometry
from opfuse.codegen.epilogue import Epilogue, generate_kernel
from opfuse.codegen.forms import EpilogueKernel
from opfuse.codegen.expr import Unsupported
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.tiles import INTERPRETED_DEPTHWISE, depthwise_tiles, whole_row_tile
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import Graph

# the template's integers that address its channel dims, rebound as multiples of UNIT
# (`opfuse.codegen.base.unit_code`)
DEPTHWISE_UNITS = ("N", "s_xn", "s_xh", "s_xw")

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
''' + GEOMETRY_PARAMS + '''    MULTIPLIER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_LOOP: tl.constexpr,
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
''' + GEOMETRY_PARAMS + '''    MULTIPLIER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, COLS: tl.constexpr,
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


def depthwise_configs(m: int, n: int, sm_count: int, taps: int = 1, itemsize: int = 2,
                      max_registers: int = 255, width: int | None = None, whole_rows: bool = False
                      ) -> list[KernelConfig]:
    """`opfuse.fusion.tiles.depthwise_tiles` (the default first) as launch configs."""
    return [KernelConfig.of(**t) for t in depthwise_tiles(m, n, sm_count, taps, itemsize, max_registers, width,
                                                           whole_rows)]


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
        hw = kernel_profile(hw)
        whole = epilogue.whole_rows
        self._configs = (depthwise_configs(self.layout.rows, self.layout.channels, hw.sm_count, geometry.kh * geometry.kw,
                                           weight.element_size(), hw.max_registers_per_thread,
                                           self.layout.row_sizes()[2], whole)
                         if not hw.interpreted else
                         [KernelConfig.of(**(whole_row_tile(INTERPRETED_DEPTHWISE, self.layout.channels) if whole
                                             else INTERPRETED_DEPTHWISE), ROW_LOOP=0)])
        # the kernel's source is every form it may run: what the tuning cache and a package's check compare
        for cols in sorted({dict(c.params).get("COLS", 1) for c in self._configs} - {1}):
            self.source += "\n\n" + self._runs_form(cols)[0]

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
                   outputs: Outputs = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config, outputs=outputs)
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
