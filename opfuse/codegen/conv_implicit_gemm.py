"""The implicit-GEMM convolution kernel (`ConvKernel`), for every conv2d neither depthwise nor a 1x1 GEMM
(`opfuse.codegen.conv.lower_conv_group` chooses): M = N·Hout·Wout pixels, N = Cout/groups channels and
K = Kh·Kw·Cin/groups, the weight packed at build time as [K, Cout] with K ordered (kh, kw, cin) to match NHWC
gathers; conv groups run along grid axis 1, K slices (split-K) along grid axis 2.

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
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import triton

from opfuse.codegen.base import FORM_TRITON, KernelConfig, Outputs, compiled_info, find_anchor, rows_jit, tuned_configs
from opfuse.codegen.conv_common import GEOMETRY_PARAMS, X_ROW_STRIDES, ConvGeometry, weights_on_device
from opfuse.codegen.epilogue import Epilogue, TileLayout, compute_dtype, generate_kernel
from opfuse.codegen.forms import EpilogueKernel
from opfuse.codegen.split_k import SplitK, sliced_template, slices_of, with_slices
from opfuse.codegen.gemm import GROUP_M, gemm_configs, swizzled_tile
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.tiles import GATHER_CHANNELS, anchor_steps, group_block
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import Graph, torch_dtype
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
''' + GEOMETRY_PARAMS + '''    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    K_GATHER: tl.constexpr, PRECISION: tl.constexpr, UNIT: tl.constexpr, ROW_UNIT: tl.constexpr,
):
{units}
    pid = tl.program_id(0)
    group = tl.program_id(1)
''' + swizzled_tile("COUT_G") + '''
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
CONV_TILE_AT = "({s}) * M * N_TOTAL + offs_m[:, None] * N_TOTAL + offs_n[None, :]"   # ws[slice, 0, row, column]


def group_block_of(config: KernelConfig) -> int:
    """Conv groups one program of `config` computes (BLOCK_G; 1 where the config does not block groups)."""
    return dict(config.params).get("BLOCK_G", 1)


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
        hw = kernel_profile(hw)
        super().__init__(graph, group, name, source)
        self.epilogue, self.layout, self.x, self.geometry = epilogue, epilogue.layout, x, geometry
        # the anchors' weights as the graph holds them: each block size's packing starts from them, on first use
        self.weights, self.device, self.dtype = list(weights), device, dtype
        self._packed: dict[int, torch.Tensor] = {}
        self.constants = {x: graph.constants[x].to(device)} if graph.is_constant(x) else {}
        self._configs = implicit_gemm_configs(group, geometry, self.layout, dtype.itemsize, hw)
        # the planner split K: each config runs the slices the plan gives its tile
        self.split = (SplitK(CONV_SLICE_TEMPLATE, CONV_TILE_AT, epilogue, CONV_UNITS, ("M",),
                             (*X_ROW_STRIDES, "N_TOTAL")) if group.split_k else None)
        if self.split is not None:      # every kernel it may run: what the tuning cache and a package compare
            self.source += "\n\n" + self.split.sources
            self.split.count_tiles((math.prod(self._grid(c)) for c in self._configs if slices_of(c) > 1), device)
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

    def _grid(self, config: KernelConfig) -> tuple[int, int]:
        """Grid axes 0 and 1 of `config`: its tiles of a program's conv groups (`group_block_of` consecutive ones, the
        last block padded where they do not divide), and those blocks of groups."""
        block = group_block_of(config)
        cout_per_block = block * (self.layout.channels // self.geometry.groups)
        tiles = triton.cdiv(self.layout.rows, config["BLOCK_M"]) * triton.cdiv(cout_per_block, config["BLOCK_N"])
        return tiles, triton.cdiv(self.geometry.groups, block)

    def _steps(self, config: KernelConfig) -> int:
        """K-loop steps of the template for `config` (the gather form walks taps x channels in BLOCK_K blocks)."""
        g = self.geometry
        return anchor_steps(g.kh * g.kw, group_block_of(config) * g.cin_per_group, config["BLOCK_K"])

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
                   outputs: Outputs = None) -> list[torch.Tensor]:
        config, values, args, outputs = self.bind(inputs, config, outputs=outputs)
        g = self.geometry
        x = values[self.x]
        m, channels = self.layout.rows, self.layout.channels
        block = group_block_of(config)
        # a program's conv group is `block` consecutive groups (the last block padded where they do not divide)
        cout_per_block, cin_per_block = block * (channels // g.groups), block * g.cin_per_group
        _, r1, r2 = self.layout.row_sizes()
        tiles, blocks = self._grid(config)
        slices = slices_of(config)
        launch = dict(**g.constexprs(), BLOCK_M=config["BLOCK_M"], BLOCK_N=config["BLOCK_N"],
                      BLOCK_K=config["BLOCK_K"], GROUP_M=GROUP_M, K_GATHER=cin_per_block < config["BLOCK_K"],
                      PRECISION=dot_precision(conv=True),
                      num_warps=config.num_warps, num_stages=config.num_stages)
        common = (x, self.packed_weight(block), m, channels, cout_per_block, cin_per_block, g.cin, g.height,
                  g.width, r1, r2, *x.stride())
        if slices > 1:   # K slices store fp32 partial tiles; the last of a tile sums them and runs the epilogue
            workspace = torch.empty((slices, 1, m, channels), dtype=torch.float32, device=x.device)
            compiled = self.split.partial[(tiles, blocks, slices)](
                *common, workspace, self.split.counts.of(tiles * blocks, x.device, self.name), *args,
                SLICE_STEPS=triton.cdiv(self._steps(config), slices), **launch)
        else:
            compiled = self.kernel[(tiles, blocks)](*common, *args, **launch)
        self.last_compiled = compiled_info(compiled)
        return outputs
