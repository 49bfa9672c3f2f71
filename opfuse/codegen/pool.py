"""The pooling template (`PoolKernel`): max_pool2d / avg_pool2d (kernel, stride, padding, dilation, ceil_mode) and
adaptive_avg_pool2d of even windows on NHWC, a program [BLOCK_P output pixels, BLOCK_C channels] visiting the
window taps, with the group's elementwise epilogue (`opfuse.codegen.reduction.lower_reduction_group` dispatches
here)."""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.expr import Unsupported, int_pair
from opfuse.codegen.operands import Emitter, build_kernel, next_power_of_2
from opfuse.codegen.reduction import NEG_INF, indent
from opfuse.codegen.reduction_group import split_outputs, store_epilogue
from opfuse.codegen.template_kernel import TemplateKernel, held_constants
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code
from opfuse.fusion.tiles import pool_tiles
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, Node

POOL_OPS = ("max_pool2d", "avg_pool2d")


class PoolKernel(TemplateKernel):
    """max/avg pool2d on NHWC tiles of [BLOCK_P output pixels, BLOCK_C channels]."""

    def __init__(self, graph: Graph, group: FusionGroup, device, node: Node, hw: HardwareProfile):
        self.node, self.hw = node, hw     # (built by `lower_reduction_group` once `pool_problem` found nothing)
        _, epilogue = split_outputs(graph, group, node)
        x = graph[node.inputs[0]]
        n, c, h, w = x.type.shape
        out_h, out_w = node.type.shape[2:]
        attrs = node.attrs
        if node.op == "adaptive_avg_pool2d":
            kernel = stride = (h // out_h, w // out_w)
            padding, dilation, self.is_max, include_pad = (0, 0), (1, 1), False, True
        else:
            kernel = int_pair(attrs["kernel_size"], node, "kernel_size")
            stride = int_pair(attrs.get("stride") or kernel, node, "stride")
            padding = int_pair(attrs.get("padding", 0), node, "padding")
            dilation = int_pair(attrs.get("dilation", 1), node, "dilation")
            self.is_max = node.op == "max_pool2d"
            include_pad = bool(attrs.get("count_include_pad", True))
        self.pixels, self.channels = n * out_h * out_w, c
        constants, scalars = held_constants(graph, group, device)
        emitter = Emitter(graph, group, scalars)
        head = emitter.region("[BLOCK_P, 1]", "out_mask")
        batch, oh, ow = head.unravel("pixels", [n, out_h, out_w])
        oh, ow = oh or "pixel_zero", ow or "pixel_zero"
        channel = "channels" if c > 1 else None
        body = ["pid = tl.program_id(0)", "if INT64:", "    pid = pid.to(tl.int64)",
                "pixels = pid * BLOCK_P + tl.arange(0, BLOCK_P)[:, None]", "pixel_zero = pixels * 0",
                "channels = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]",
                f"out_mask = (pixels < {self.pixels}) & (channels < {c})"] + head.lines
        body.append(f"acc = tl.full([BLOCK_P, BLOCK_C], {NEG_INF if self.is_max else '0.0'}, tl.float32)")
        (kh, kw), (sh, sw), (ph, pw), (dh, dw) = kernel, stride, padding, dilation
        tap = emitter.region("[BLOCK_P, BLOCK_C]", "mask")
        value = tap.value(x.name, (batch, channel, "ih", "iw"))
        # a NaN in the window makes PyTorch's max pool NaN: propagate it as PyTorch does
        combine = (f"acc = tl.maximum(acc, tl.where(mask, {value}, {NEG_INF}), propagate_nan=tl.PropagateNan.ALL)"
                   if self.is_max
                   else f"acc += tl.where(mask, {value}, 0.0)")
        body += [f"for kh in tl.static_range({kh}):", f"    ih = {oh} * {sh} + (kh * {dh} - {ph})",
                 f"    for kw in tl.static_range({kw}):", f"        iw = {ow} * {sw} + (kw * {dw} - {pw})",
                 f"        mask = out_mask & (ih >= 0) & (ih < {h}) & (iw >= 0) & (iw < {w})"]
        body += indent(tap.lines + [combine], 2)
        if self.is_max:
            body.append("result = acc")
        else:   # PyTorch's divisor: the window clipped to the padded image, or to the image without padding
            body += [f"h0 = {oh} * {sh} - {ph}", f"w0 = {ow} * {sw} - {pw}",
                     f"h1 = tl.minimum(h0 + {kh}, {h + ph})", f"w1 = tl.minimum(w0 + {kw}, {w + pw})"]
            if not include_pad:
                body += ["h0 = tl.maximum(h0, 0)", "w0 = tl.maximum(w0, 0)",
                         f"h1 = tl.minimum(h1, {h})", f"w1 = tl.minimum(w1, {w})"]
            body.append("result = acc / ((h1 - h0) * (w1 - w0)).to(tl.float32)")
        out_coords = (batch, channel, oh if out_h > 1 else None, ow if out_w > 1 else None)
        region = emitter.region("[BLOCK_P, BLOCK_C]", "out_mask")
        region.bind(node.name, out_coords, "result")
        store_epilogue(region, group, node, out_coords, epilogue)
        body += region.lines
        name, source, function = build_kernel(graph, group, emitter, body, ["BLOCK_P", "BLOCK_C", "INT64"])
        super().__init__(graph, group, name, source, device, emitter.args, constants, function)

    def configs(self) -> list[KernelConfig]:
        channels = next_power_of_2(self.channels)
        if self.hw.interpreted:
            return [KernelConfig.of(BLOCK_P=16, BLOCK_C=min(channels, 32), num_warps=1)]
        return [KernelConfig.of(**tile) for tile in pool_tiles(self.channels)]

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Outputs (in group.outputs order) of the group for its runtime inputs; `outputs` may be preallocated."""
        config = config or self.configs()[0]
        tensors = self.bind(inputs)
        results = self.outputs_for(tensors, outputs)
        grid = (-(-self.pixels // config["BLOCK_P"]), -(-self.channels // config["BLOCK_C"]))
        self.launch(grid, config, tensors | dict(zip(self.group.outputs, results)),
                    (grid[0] + 1) * config["BLOCK_P"])
        return results


def pool_problem(graph: Graph, node: Node, prologue: Sequence[str]) -> None:
    """`Unsupported` (its code says which kind) where the template cannot pool: an input of other than 4 dims, an
    adaptive pooling of uneven windows, or prologue values the group stores (windows overlap or skip pixels)."""
    shape = graph[node.inputs[0]].type.shape
    if len(shape) != 4:
        raise Unsupported(f"{node.describe()}: only batched 4-D pooling is generated", Code.OPERAND_SHAPE)
    out_h, out_w = node.type.shape[-2:]
    if node.op == "adaptive_avg_pool2d" and (shape[2] % out_h or shape[3] % out_w):
        raise Unsupported(f"{node.describe()}: adaptive pooling to {out_h}x{out_w} of {shape[2]}x{shape[3]} has "
                          "uneven windows", Code.OPERAND_SHAPE)
    if prologue:
        raise Unsupported(f"{node.describe()}: pool windows overlap or skip pixels, so prologue values "
                          f"({', '.join(prologue)}) cannot be written from this kernel", Code.EPILOGUE_FORM)
