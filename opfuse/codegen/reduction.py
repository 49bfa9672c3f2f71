"""Reduction groups with an elementwise prologue and epilogue as one Triton kernel: `lower_reduction_group`.

Two templates:
- rows (`RowReductionKernel`): softmax over any dim, layer_norm over the last dims (weight, bias), rms_norm over the
  last dim (weight), mean/sum/any/amax/amin over given dims, and adaptive_avg_pool2d to (1,1) (global average pool =
  mean over H, W). The reduction input is viewed as [rows, L] (kept dims x reduced dims, through its strides); a program
  takes BLOCK_M rows and walks each row in chunks of BLOCK_L. When one chunk holds the row (ONE_PASS) it stays in
  registers: one read, one write. Otherwise softmax keeps an online max and sum, layer norm merges per-chunk mean and M2
  (Chan et al.), and a second sweep recomputes the prologue and writes the result: two reads, one write. A sum, mean,
  any, amax or amin with fewer row blocks than the GPU has SMs (a squeeze-and-excitation pool of few channels over a
  large image, any reduction at batch 1) splits each row into SPLIT slices: launch one (PHASE 0, programs over row
  blocks x slices) writes each slice's float32 sum (or extreme) to a workspace, launch two (PHASE 1) combines a row's
  SPLIT of them (one fixed tree) and runs the epilogue. A layer or RMS norm or a softmax of so few, long rows (a group
  norm of one group at batch 1) splits likewise: launch one writes each slice's mean and M2 (sum of squares; max and sum
  of exponentials), launch two, over the same programs, merges a row's and writes its own slice. Deterministic, no
  atomics; the unsplit form is an alternative the autotuner times beside it, and the resource screen reads launch one's
  registers. cumsum and cumprod over any dim are scans of the same rows: one sweep, each chunk's `tl.cumsum`
  (`tl.cumprod`) combined with the running carry of the chunks before it, written (and its epilogue computed) as it
  goes; an integer scan carries int64 exactly (`_scan`).
- pools (`opfuse.codegen.pool.PoolKernel`): max_pool2d / avg_pool2d and divisible adaptive_avg_pool2d on NHWC.

The prologue is evaluated wherever the reduction reads its input (a prologue value that is also a group output is
stored on the first sweep); the epilogue is evaluated at the reduction's output coordinates, and after a reshape of
them (group norm's back to [N, C, H, W]) at the coordinates they map to in row-major order (`store_epilogue`).
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.coordinates import Coords, broadcast_coords
from opfuse.codegen.expr import Unsupported, refusal, triton_dtype
from opfuse.codegen.operands import Emitter, Region, build_kernel, next_power_of_2
from opfuse.codegen.reduction_group import reduction_node, split_outputs, store_epilogue, store_outputs
from opfuse.codegen.template_kernel import TemplateKernel, group_operands, held_constants
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import (EXTREMES, ROW_SPLIT_MODES, ROW_WRITING_MODES, RowView, row_kernel_tiles, row_view,
                                 slice_statistics)
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import FLOAT_DTYPES, WIDE_INTEGERS, Graph, Node, torch_dtype
from opfuse.ir.ops import SCAN_OPS, kind_of

NEG_INF = 'float("-inf")'
# softmax's running max never drops below this finite floor: a chunk of only -inf (a padding mask) would
# otherwise rescale the running sum by exp(-inf - -inf) = NaN; a row of only -inf still gives 0/0 = NaN, as in PyTorch
MAX_FLOOR = "-3.0e38"


def lower_reduction_group(graph: Graph, group: FusionGroup, device, hw: HardwareProfile | None = None
                          ) -> TemplateKernel:
    """Lower a group of one reduction with elementwise prologue/epilogue ops to one Triton kernel, its tiles for
    GPU `hw` (default: the default profile)."""
    group_operands(graph, group)
    node, view = _taken(graph, group)
    if view is not None:
        return RowReductionKernel(graph, group, device, node, view, kernel_profile(hw))
    from opfuse.codegen.pool import PoolKernel      # (the pooling template builds on this module's)
    return PoolKernel(graph, group, device, node, kernel_profile(hw))


def supports(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """None where the reduction template takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("reduction", lambda: _taken(graph, group))


def _taken(graph: Graph, group: FusionGroup) -> tuple[Node, RowView | None]:
    """The group's reduction and its row view (None: a pooling); `Unsupported` (its code says which kind) where the
    template cannot take the group."""
    from opfuse.codegen.pool import POOL_OPS, pool_problem
    node = reduction_node(graph, group)
    if node.type.dtype in WIDE_INTEGERS and node.op not in SCAN_OPS and node.op != "sum":
        raise Unsupported(f"{node.describe()}: its {node.type.dtype} result would be reduced in float32, which "
                          "rounds past 2^24 (only a scan or a sum carries an integer exactly)", Code.OPERAND_DTYPE)
    prologue, _ = split_outputs(graph, group, node)
    view = row_view(graph, node)
    if view is None and node.op not in (*POOL_OPS, "adaptive_avg_pool2d"):
        raise Unsupported(f"no reduction template for {node.describe()}", Code.NO_TEMPLATE)
    if view is None:
        pool_problem(graph, node, prologue)
    return node, view


def walk_orders(mode: str, sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """The orders (positions of the reduced dims, outermost first) a row kernel may walk a row in, row-major
    first: every order of two or three reduced dims of more than one element where the result does not depend on
    the order (all but scans and prod), so that a row lies in memory as it is walked (a group norm's channels and
    pixels of a channels-last image: pixels outermost), else row-major alone."""
    big = tuple(position for position, size in enumerate(sizes) if size > 1)
    if mode not in ROW_SPLIT_MODES or not 2 <= len(big) <= 3:
        return [big]
    return list(itertools.permutations(big))


def indent(lines: Sequence[str], depth: int = 1) -> list[str]:
    return ["    " * depth + line for line in lines]


class RowReductionKernel(TemplateKernel):
    """softmax / layer_norm / rms_norm / mean / sum / prod / any / cumsum / cumprod over some dims of one input,
    BLOCK_M rows a program; every mode but the scans and prod in SPLIT slices per row where there are fewer row
    blocks than the GPU `hw` has SMs (`opfuse.fusion.tiles.row_slices`)."""

    def __init__(self, graph: Graph, group: FusionGroup, device, node: Node, view: RowView, hw: HardwareProfile):
        self.node, self.view, self.mode, self.hw = node, view, view.mode, hw
        x = graph[node.inputs[0]]
        shape = x.type.shape
        mode = view.mode
        self.reduced = list(view.dims)
        self.kept = [d for d in range(len(shape)) if d not in view.dims]
        self.rows, self.length, self.channels_inner = view.rows, view.length, view.channels_inner
        self.orders = walk_orders(mode, [shape[d] for d in self.reduced])
        self._integer_sum = mode == "sum" and node.type.dtype not in FLOAT_DTYPES
        prologue, epilogue = split_outputs(graph, group, node)
        constants, scalars = held_constants(graph, group, device)
        emitter = Emitter(graph, group, scalars)

        head = emitter.region("[BLOCK_M, 1]", "row_mask")
        kept_coords = head.unravel("rows", [shape[d] for d in self.kept])
        self._kept = dict(zip(self.kept, kept_coords))
        body = ["pid = tl.program_id(0)", "if INT64:", "    pid = pid.to(tl.int64)",
                "rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]", f"row_mask = rows < {self.rows}",
                "lanes = tl.arange(0, BLOCK_L)[None, :]"] + head.lines
        self._emitter, self._x, self._shape = emitter, x.name, shape
        self._prologue, self._epilogue = prologue, epilogue
        if mode == "softmax":
            body += self._softmax()
        elif mode == "layer_norm":
            body += self._layer_norm()
        elif mode == "rms_norm":
            body += self._rms_norm()
        elif mode in EXTREMES:
            body += self._extreme(mode)
        elif mode in SCAN_OPS:
            body += self._scan(mode)
        elif mode == "prod":
            body += self._product()
        else:
            body += self._sum(mode)
        constexprs = ["BLOCK_M", "BLOCK_L", "ONE_PASS", "INT64", "ORDER"]
        params: list[str] = []
        if mode in ROW_SPLIT_MODES:
            constexprs += ["SPLIT", "PHASE", "SPAN"]
            params.append("partials_ptr")
        name, source, function = build_kernel(graph, group, emitter, body, constexprs, params)
        super().__init__(graph, group, name, source, device, emitter.args, constants, function)

    def output_channels_last(self, name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """A 4-D reduction that keeps its input's shape (softmax, a norm) lays out its outputs of that shape as the
        kernel walks them, rows of the kept dims and lanes of the reduced ones innermost: channels-last for one over
        the channels alone, dense for one over the trailing dims. Any other output (a mean's, a prologue value of
        a mean over H, W) takes the largest input's layout (`TemplateKernel`): that rule would give channels-last to
        ConvNeXt's [N, H, W, C] layer norm reading the permute of a channels-last [N, C, H, W] residual, which
        stores it with H innermost."""
        shape = tuple(self._shape)
        if len(shape) == 4 and tuple(self.node.type.shape) == shape == tuple(self.graph[name].type.shape):
            reduced = sorted(self.reduced)
            if reduced == [1]:
                return True
            if reduced == list(range(4 - len(reduced), 4)):
                return False
        return super().output_channels_last(name, tensors)

    def order(self, tensors: dict[str, torch.Tensor]) -> int:
        """ORDER: the walk (`walk_orders`) that visits the reduced dims as the reduction input lies in memory, the
        largest stride outermost (`_layout_source`); row-major where no layout is known."""
        return self._order_of(self._layout_source(tensors))

    def _order_of(self, source: torch.Tensor | None) -> int:
        if len(self.orders) == 1 or source is None:
            return 0
        strides = [source.stride(d) for d in self.reduced]
        walk = tuple(sorted(self.orders[0], key=lambda position: -strides[position]))   # stable: ties keep order
        return self.orders.index(walk)

    def _layout_source(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The reduction input as it lies in memory: its tensor; or, where the group computes it, the tensor it is
        computed from through reshapes and permutes (group norm's [N, C, H, W] image as [N, G, C/G, H*W]) viewed
        so, and through elementwise ops from an operand of their shape; None where no view gives it."""
        name, views = self._x, []
        while name not in tensors and name in self.group.nodes:
            node = self.graph[name]
            if node.op in ("reshape", "permute"):
                views.append(node)
                name = node.inputs[0]
                continue
            same = [i for i in node.inputs if tuple(self.graph[i].type.shape) == tuple(node.type.shape)]
            if not (kind_of(node).elementwise and same):
                return None
            name = next((i for i in same if i in tensors), same[0])
        if name not in tensors:
            return None
        tensor = tensors[name]
        try:
            for node in reversed(views):
                tensor = tensor.permute(node.attrs["dims"]) if node.op == "permute" else tensor.view(node.type.shape)
        except RuntimeError:        # a reshape no view gives: the kernel reads it through row-major order
            return None
        return tensor

    def _output(self, name: str, tensors: dict[str, torch.Tensor], given: torch.Tensor | None = None
                ) -> torch.Tensor:
        """Where the kernel walks its rows in another order than row-major (`order`), an output of the input's size
        (the row written again, group norm's view of it back to [N, C, H, W]) takes the strides of the input viewed
        as its shape (`empty_like`: where they fill memory densely), so that the walk writes it as it reads the
        input; any other as `TemplateKernel` lays it out."""
        shape = tuple(self.graph[name].type.shape)
        source = self._layout_source(tensors)
        if (given is None and source is not None and math.prod(shape) == source.numel()
                and self.graph[name].op != "index_copy" and self._order_of(source) != 0):
            try:
                like = source.view(shape)
            except RuntimeError:
                like = None
            if like is not None:
                tensor = torch.empty_like(like, dtype=torch_dtype(self.graph[name].type.dtype), device=self.device)
                return tensor if self.output_fill is None else tensor.fill_(self.output_fill)
        return super()._output(name, tensors, given)

    # ---- code generation ------------------------------------------------------------------------------
    def _chunk(self, first: str, store_prologue: bool, load: Callable[[Region, Coords], str] | None = None
               ) -> tuple[list[str], Region, Coords, str]:
        """Lines loading one [BLOCK_M, BLOCK_L] chunk of the reduction input (prologue applied; `load` gives its
        expression, default `Region.value`: float32).

        Returns the lines so far, the region (to extend), the chunk's full coordinates and the input expression.
        """
        region = self._emitter.region("[BLOCK_M, BLOCK_L]", "mask")
        reduced = region.unravel_choice("cols", [self._shape[d] for d in self.reduced], self.orders, "ORDER")
        coords = dict(self._kept) | dict(zip(self.reduced, reduced))
        full = tuple(coords[d] for d in range(len(self._shape)))
        value = (load or (lambda r, c: r.value(self._x, c)))(region, full)
        if store_prologue:
            store_outputs(region, self._prologue, full, self._shape)
        lines = [f"cols = {first}", f"mask = row_mask & (cols < {self.length})"]
        return lines, region, full, value

    def _finish(self, lines: list[str], region: Region, coords: Coords, result: str) -> list[str]:
        """Bind the reduction's result at `coords`, then compute and store the epilogue outputs."""
        region.bind(self.node.name, coords, result)
        store_epilogue(region, self._emitter.group, self.node, coords, self._epilogue)
        return lines + region.lines

    def _loop(self, lines: list[str]) -> list[str]:
        return [f"for start in range(0, {self.length}, BLOCK_L):"] + indent(lines)

    def _softmax(self) -> list[str]:
        """One sweep when the row fits a chunk; else an online max and sum over the chunks, then a second sweep
        writes; in SPLIT slices (`_sliced`), each slice's max and sum through the workspace, rescaled to the row's
        max."""
        one, region, full, x = self._chunk("lanes", True)
        region.lines += [f"t = tl.where(mask, {x}, {NEG_INF})",
                         f"row_max = tl.maximum(tl.max(t, axis=1)[:, None], {MAX_FLOOR})",
                         "e = tl.exp(t - row_max)", "result = e / tl.sum(e, axis=1)[:, None]"]
        one = self._finish(one, region, full, "result")
        stats, region, _, x = self._chunk("start + lanes", True)
        stats += region.lines + [
            f"t = tl.where(mask, {x}, {NEG_INF})",
            "new_max = tl.maximum(row_max, tl.max(t, axis=1)[:, None])",
            "row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(tl.exp(t - new_max), axis=1)[:, None]",
            "row_max = new_max"]
        write, region, full, x = self._chunk("start + lanes", False)
        region.lines.append(f"result = tl.exp({x} - row_max) / row_sum")
        write = self._finish(write, region, full, "result")
        start = [f"row_max = tl.full([BLOCK_M, 1], {MAX_FLOOR}, tl.float32)",
                 "row_sum = tl.zeros([BLOCK_M, 1], dtype=tl.float32)"]
        rows = self.rows
        merge = [f"maxes = tl.load(partials_ptr + parts * {rows} + rows, mask=row_mask, other={MAX_FLOOR})",
                 f"sums = tl.load(partials_ptr + (SPLIT + parts) * {rows} + rows, mask=row_mask, other=0.0)",
                 "row_max = tl.max(maxes, axis=1)[:, None]",      # a slice past the row: the floor and 0 add 0
                 "row_sum = tl.sum(sums * tl.exp(maxes - row_max), axis=1)[:, None]"]
        return self._sliced(
            ["if ONE_PASS:"] + indent(one) + ["else:"] + indent(start + self._loop(stats) + self._loop(write)),
            start + self._slice_loop(stats) + [
                f"tl.store(partials_ptr + part * {rows} + rows, row_max, mask=row_mask)",
                f"tl.store(partials_ptr + (SPLIT + part) * {rows} + rows, row_sum, mask=row_mask)"],
            merge + self._slice_loop(write))

    def _affine(self, region: Region, full: Coords, normalized: str) -> str:
        """layer_norm's weight and bias (optional inputs 1 and 2), broadcast over the normalized dims."""
        for position, op in ((1, "*"), (2, "+")):
            if len(self.node.inputs) > position:
                name = self.node.inputs[position]
                operand = region.value(name, broadcast_coords(full, self._shape, self._shape_of(name)))
                normalized = region.assign(f"{normalized} {op} {operand}")
        return normalized

    def _shape_of(self, name: str) -> tuple[int, ...]:
        return self._emitter.graph[name].type.shape

    def _layer_norm(self) -> list[str]:
        """One sweep when the row fits a chunk; else per-chunk mean and M2 merged (Chan et al.), then a second sweep
        recomputes the prologue and writes; in SPLIT slices (`_sliced`), each slice's mean and M2 merged likewise
        from the workspace."""
        eps, n = repr(float(self.node.attrs["eps"])), self.length
        one, region, full, x = self._chunk("lanes", True)
        region.lines += [f"t = tl.where(mask, {x}, 0.0)", f"mean = tl.sum(t, axis=1)[:, None] / {n}",
                         "centered = tl.where(mask, t - mean, 0.0)",
                         f"rstd = tl.rsqrt(tl.sum(centered * centered, axis=1)[:, None] / {n} + {eps})"]
        one = self._finish(one, region, full, self._affine(region, full, region.assign("centered * rstd")))
        stats, region, _, x = self._chunk("start + lanes", True)
        stats += region.lines + [      # a chunk wholly past the row (a last slice's) counts 0 and changes nothing
            f"t = tl.where(mask, {x}, 0.0)",
            f"count = tl.sum(tl.where(cols < {n}, 1.0, 0.0), axis=1)[:, None]",
            "chunk_mean = tl.sum(t, axis=1)[:, None] / tl.maximum(count, 1.0)",
            "d = tl.where(mask, t - chunk_mean, 0.0)",
            "total = seen + count",
            "delta = chunk_mean - mean",
            "mean = mean + delta * (count / tl.maximum(total, 1.0))",
            "m2 = m2 + tl.sum(d * d, axis=1)[:, None] + delta * delta * (seen * count / tl.maximum(total, 1.0))",
            "seen = total"]
        write, region, full, x = self._chunk("start + lanes", False)
        result = self._affine(region, full, region.assign(f"({x} - mean) * rstd"))
        write = self._finish(write, region, full, result)
        start = ["mean = tl.zeros([BLOCK_M, 1], dtype=tl.float32)", "m2 = tl.zeros([BLOCK_M, 1], dtype=tl.float32)",
                 "seen = tl.zeros([1, 1], dtype=tl.float32)"]
        rows = self.rows
        merge = [f"means = tl.load(partials_ptr + parts * {rows} + rows, mask=row_mask, other=0.0)",
                 f"m2s = tl.load(partials_ptr + (SPLIT + parts) * {rows} + rows, mask=row_mask, other=0.0)",
                 f"counts = tl.minimum(tl.maximum({n} - parts * SPAN, 0), SPAN).to(tl.float32)",
                 f"mean = tl.sum(counts * means, axis=1)[:, None] / {n}",
                 "m2 = tl.sum(m2s + counts * (means - mean) * (means - mean), axis=1)[:, None]"]
        return self._sliced(
            ["if ONE_PASS:"] + indent(one) + ["else:"] + indent(
                start + self._loop(stats) + [f"rstd = tl.rsqrt(m2 / {n} + {eps})"] + self._loop(write)),
            start + self._slice_loop(stats) + [
                f"tl.store(partials_ptr + part * {rows} + rows, mean, mask=row_mask)",
                f"tl.store(partials_ptr + (SPLIT + part) * {rows} + rows, m2, mask=row_mask)"],
            merge + [f"rstd = tl.rsqrt(m2 / {n} + {eps})"] + self._slice_loop(write))

    def _sliced(self, whole: list[str], partial: list[str], finish: list[str]) -> list[str]:
        """A split reduction's lines: `whole` unsplit (SPLIT 1); in SPLIT slices, PHASE 0 (programs over row blocks
        x slices) runs `partial` (a slice's statistics into the workspace) and PHASE 1 `finish` (the row's
        statistics from every slice's; a norm's or a softmax's programs, the same as PHASE 0's, then write their
        own slice): each reads its slice, so a row of 200k elements is no longer one program's walk."""
        # the slice and the slices merged, in int64 where the kernel is (part * SPAN, part * rows may pass 2^31)
        split = ["part = tl.program_id(1)", "parts = tl.arange(0, SPLIT)[None, :]",
                 "if INT64:", "    part = part.to(tl.int64)", "    parts = parts.to(tl.int64)"]
        return (["if SPLIT == 1:"] + indent(whole) + ["else:"]
                + indent(split + ["if PHASE == 0:"] + indent(partial) + ["else:"] + indent(finish)))

    def _slice_loop(self, lines: list[str]) -> list[str]:
        return ["for start in range(part * SPAN, part * SPAN + SPAN, BLOCK_L):"] + indent(lines)

    def _rms_norm(self) -> list[str]:
        """x * rsqrt(mean(x^2) + eps) * weight: one sweep when the row fits a chunk, else sum the squares, then a
        second sweep recomputes the prologue and writes; in SPLIT slices (`_sliced`), each slice's sum of squares
        through the workspace."""
        eps, n = repr(float(self.node.attrs["eps"])), self.length
        one, region, full, x = self._chunk("lanes", True)
        region.lines += [f"t = tl.where(mask, {x}, 0.0)",
                         f"rstd = tl.rsqrt(tl.sum(t * t, axis=1)[:, None] / {n} + {eps})"]
        one = self._finish(one, region, full, self._scaled(region, full, region.assign("t * rstd")))
        stats, region, _, x = self._chunk("start + lanes", True)
        stats += region.lines + [f"t = tl.where(mask, {x}, 0.0)", "squares += tl.sum(t * t, axis=1)[:, None]"]
        write, region, full, x = self._chunk("start + lanes", False)
        write = self._finish(write, region, full, self._scaled(region, full, region.assign(f"({x}) * rstd")))
        start = ["squares = tl.zeros([BLOCK_M, 1], dtype=tl.float32)"]
        rows = self.rows
        return self._sliced(
            ["if ONE_PASS:"] + indent(one) + ["else:"] + indent(
                start + self._loop(stats) + [f"rstd = tl.rsqrt(squares / {n} + {eps})"] + self._loop(write)),
            start + self._slice_loop(stats) + [f"tl.store(partials_ptr + part * {rows} + rows, squares, "
                                               "mask=row_mask)"],
            [f"squares = tl.sum(tl.load(partials_ptr + parts * {rows} + rows, mask=row_mask, other=0.0), "
             "axis=1)[:, None]", f"rstd = tl.rsqrt(squares / {n} + {eps})"] + self._slice_loop(write))

    def _scaled(self, region: Region, full: Coords, normalized: str) -> str:
        """rms_norm's optional weight (input 1) over the last dim."""
        if len(self.node.inputs) < 2:
            return normalized
        name = self.node.inputs[1]
        weight = region.value(name, broadcast_coords(full, self._shape, self._shape_of(name)))
        return region.assign(f"{normalized} * {weight}")

    def _extreme(self, mode: str) -> list[str]:
        """amax or amin: a running max (min) of the row's chunks, and whether any element was NaN (the result is
        NaN then, as PyTorch's; Triton's max reduction may drop it); in SPLIT slices (`_sliced`), each slice's
        result (NaN included) through the workspace, PHASE 1 the extreme of them."""
        pick, empty = ("tl.maximum", NEG_INF) if mode == "amax" else ("tl.minimum", 'float("inf")')
        reduce = "tl.max" if mode == "amax" else "tl.min"

        def accumulate(first: str) -> list[str]:
            chunk, region, _, x = self._chunk("start + lanes", True)
            step = [f"t = tl.where(mask, {x}, {empty})", f"acc = {pick}(acc, t)",
                    "nans = tl.maximum(nans, tl.where(t != t, 1.0, 0.0))"]
            return [f"acc = tl.full([BLOCK_M, BLOCK_L], {empty}, tl.float32)",
                    "nans = tl.zeros([BLOCK_M, BLOCK_L], dtype=tl.float32)",
                    f"for start in range({first}, BLOCK_L):"] + indent(chunk + region.lines + step)

        def extreme(values: str, nans: str) -> str:
            return f"tl.where(tl.max({nans}, axis=1)[:, None] > 0.0, float('nan'), {reduce}({values}, axis=1)[:, None])"

        whole = self._finish_row(accumulate(f"0, {self.length}") + [f"result = {extreme('acc', 'nans')}"])
        rows = self.rows
        partial = (accumulate("part * SPAN, part * SPAN + SPAN")
                   + [f"tl.store(partials_ptr + part * {rows} + rows, {extreme('acc', 'nans')}, mask=row_mask)"])
        total = self._finish_row([
            f"values = tl.load(partials_ptr + parts * {rows} + rows, mask=row_mask, other={empty})",
            f"result = {extreme('values', 'tl.where(values != values, 1.0, 0.0)')}"])
        return self._sliced(whole, partial, total)

    def _finish_row(self, lines: list[str]) -> list[str]:
        """`lines`, then the row's `result` bound at the reduction's output coordinates and the epilogue stored."""
        return self._finish(lines, self._emitter.region("[BLOCK_M, 1]", "row_mask"), self._reduced_coords(), "result")

    def _reduced_coords(self) -> tuple:
        """The coordinates of a reduction's result: the kept dims', the reduced ones None where it keeps them."""
        out_shape = self.node.type.shape
        if len(out_shape) == len(self._shape):       # keepdim: reduced dims stay with size 1
            return tuple(None if d in self.reduced else self._kept[d] for d in range(len(out_shape)))
        return tuple(self._kept[d] for d in self.kept)

    def _scan(self, mode: str) -> list[str]:
        """The inclusive scan along the row (cumsum, cumprod), one sweep: each chunk's `tl.cumsum` plus (`tl.cumprod`
        times) the carry of the chunks before it, the carry then the chunk's last lane (lanes past the row add 0,
        multiply by 1). Float results carry float32;
        integer ones (int64 for bool and integer inputs) carry int64 exactly and read their input exactly (a wide
        integer as `Region.integer` computes it, a narrow or bool one exact in float32, a float truncated as torch
        casts it); an epilogue reads the int64 sum as `Region.integer` does."""
        integer = self.node.type.dtype not in FLOAT_DTYPES
        accumulator, zero = ("tl.int64", "0") if integer else ("tl.float32", "0.0")
        product = mode == "cumprod"
        identity, combine = ("1" if integer else "1.0", "*") if product else (zero, "+")
        cast = self.node.attrs.get("dtype")

        def load(region: Region, coords: Coords) -> str:
            if integer:
                return region.assign(region.as_integer(self._x, coords))
            value = region.value(self._x, coords)
            if cast is not None:      # the input cast to dtype first, as torch.cumsum does
                value = region.assign(f"({value}).to({triton_dtype(cast)}).to(tl.float32)")
            return value

        chunk, region, full, x = self._chunk("start + lanes", True, load)
        region.lines += [f"t = tl.where(mask, {x}, {identity})", f"scanned = tl.{mode}(t, axis=1) {combine} carry",
                         f"carry = tl.sum(tl.where(lanes == BLOCK_L - 1, scanned, {zero}), axis=1)[:, None]"]
        return [f"carry = tl.zeros([BLOCK_M, 1], dtype={accumulator}) + {identity}"] + self._loop(
            self._finish(chunk, region, full, "scanned"))

    def _sum(self, mode: str) -> list[str]:
        """mean, sum, or any (a running max of x != 0, as 1.0 / 0.0); also in slices (`_sliced`: PHASE 0 sums, or
        for any takes the max of, a slice of SPAN lanes of each row into the workspace, PHASE 1 combines them). An
        integer sum (a count of a comparison's trues, an int64 tensor's) reads its input exactly and adds in int64,
        never in slices (`configs`), as the scans do (`_scan`)."""
        integer = self._integer_sum
        load = (lambda region, coords: region.assign(region.as_integer(self._x, coords))) if integer else None

        def accumulate(first: str) -> list[str]:
            chunk, region, _, x = self._chunk("start + lanes", True, load)
            step = (f"acc = tl.maximum(acc, tl.where(mask & (({x}) != 0.0), 1.0, 0.0))" if mode == "any"
                    else f"acc += tl.where(mask, {x}, {'0' if integer else '0.0'})")
            return [f"acc = tl.zeros([BLOCK_M, BLOCK_L], dtype={'tl.int64' if integer else 'tl.float32'})",
                    f"for start in range({first}, BLOCK_L):"] + indent(chunk + region.lines + [step])

        scale = f" / {self.length}" if mode == "mean" else ""
        combine = "tl.max" if mode == "any" else "tl.sum"
        whole = self._finish_row(accumulate(f"0, {self.length}") + [f"result = {combine}(acc, axis=1)[:, None]{scale}"])
        rows = self.rows
        partial = (accumulate("part * SPAN, part * SPAN + SPAN")
                   + [f"tl.store(partials_ptr + part * {rows} + rows, {combine}(acc, axis=1)[:, None], "
                      "mask=row_mask)"])
        total = self._finish_row([f"sums = tl.load(partials_ptr + parts * {rows} + rows, mask=row_mask, other=0.0)",
                                  f"result = {combine}(sums, axis=1)[:, None]{scale}"])
        return self._sliced(whole, partial, total)

    def _product(self) -> list[str]:
        """prod: a running product of each lane's chunk (lanes past the row multiply by 1), then the lanes' product,
        the last lane of their `tl.cumprod` (Triton has no product reduction); never in slices."""
        chunk, region, _, x = self._chunk("start + lanes", True)
        return self._finish_row(
            ["acc = tl.full([BLOCK_M, BLOCK_L], 1.0, dtype=tl.float32)",
             f"for start in range(0, {self.length}, BLOCK_L):"] + indent(chunk + region.lines
                                                                        + [f"acc *= tl.where(mask, {x}, 1.0)"])
            + ["result = tl.sum(tl.where(lanes == BLOCK_L - 1, tl.cumprod(acc, axis=1), 0.0), axis=1)[:, None]"])

    # ---- runtime ----------------------------------------------------------------------------------
    def configs(self) -> list[KernelConfig]:
        split = self.mode in ROW_SPLIT_MODES
        if self.hw.interpreted:
            return [KernelConfig.of(BLOCK_M=min(next_power_of_2(self.rows), 16), num_warps=1,
                                    BLOCK_L=min(next_power_of_2(self.length), 128), **({"SPLIT": 1} if split else {}))]
        tiles = row_kernel_tiles(self.view, self.hw.sm_count)
        if self._integer_sum:       # its workspace would hold float32 slices: unsplit only, each tile once
            unsplit = [tile | {"SPLIT": 1} for tile in tiles]
            tiles = [tile for index, tile in enumerate(unsplit) if tile not in unsplit[:index]]
        return [KernelConfig.of(**tile) for tile in tiles]

    def alternatives(self, library: bool = True) -> list[KernelConfig]:
        """The first config unsplit, where it is split."""
        first = self.configs()[0]
        if dict(first.params).get("SPLIT", 1) == 1:
            return []
        return [KernelConfig.of(first.num_warps, first.num_stages, **(dict(first.params) | {"SPLIT": 1}))]

    def launches(self, config: KernelConfig | None = None) -> int:
        config = config or self.configs()[0]
        return 2 if dict(config.params).get("SPLIT", 1) > 1 else 1

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Outputs (in group.outputs order) of the group for its runtime inputs; `outputs` may be preallocated."""
        config = config or self.configs()[0]
        tensors = self.bind(inputs)
        results = self.outputs_for(tensors, outputs)
        tensors |= dict(zip(self.group.outputs, results))
        block_m, block_l = config["BLOCK_M"], config["BLOCK_L"]
        order = self.order(tensors)
        programs = -(-self.rows // block_m)
        index_space = (programs + 1) * block_m + self.length + block_l
        one_pass = block_l >= self.length
        if self.mode not in ROW_SPLIT_MODES:
            self.launch((programs,), config, tensors, index_space, ONE_PASS=one_pass, ORDER=order)
            return results
        params = dict(config.params)
        if "SPLIT" not in params:       # a config of no slices, written without them
            config = KernelConfig.of(config.num_warps, config.num_stages, **params, SPLIT=1)
        split = config["SPLIT"]
        if split == 1:      # the workspace pointer is not read: any tensor stands for it
            self.launch((programs,), config, tensors, index_space, ONE_PASS=one_pass, PHASE=0, SPAN=0,
                        partials_ptr=results[0], ORDER=order)
            return results
        span = -(-self.length // (split * block_l)) * block_l
        statistics = slice_statistics(self.mode)
        partials = torch.empty(statistics * split * self.rows, dtype=torch.float32, device=self.device)
        space = index_space + statistics * split * self.rows
        self.launch((programs, split), config, tensors, space, ONE_PASS=False, PHASE=0, SPAN=span,
                    partials_ptr=partials, ORDER=order)
        sweep = self.last_compiled           # the resource screen judges the launch that holds the row tiles
        # a sum's second launch adds a row's sums up; a norm's or a softmax's writes each slice of the row again
        self.launch((programs, split) if self.mode in ROW_WRITING_MODES else (programs,), config, tensors, space,
                    ONE_PASS=False, PHASE=1, SPAN=span, partials_ptr=partials, ORDER=order)
        self.last_compiled = sweep
        return results
