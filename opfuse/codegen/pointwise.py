"""Elementwise groups (POINTWISE, SINGLE, HORIZONTAL_POINTWISE) as one Triton kernel: `lower_pointwise_group`.

The nodes: elementwise ops, views and rolls (coordinate maps) and concatenations (each input loaded under the
mask of its slice of the output), and updates of the model's state written in place (`Graph.writes_state_in_place`:
a KV cache's index_copy, whose part iterates its source and stores each element into the state's tensor at the
index's position along its dim; the kernel returns the state's tensor as the update's value).

Each connected part of the group (one for a chain; several independent chains for a horizontal group) is an
iteration space: the shape of its largest output, walked by a flat index in the memory order its outputs get
(NHWC when the largest input is channels-last 4-D, else row-major). Programs [start_k, end_k) of the one launch take
part k. Each output is stored at its own coordinates (a reshaped output maps the row-major order), each operand is
loaded through its strides (operands.py), and tensors found dense in the iteration order at run time are addressed
by the flat index directly.

A part whose cat's coordinates are the iteration's (DenseNet's cat + batch norm + ReLU) is walked one input of it
at a time (`cat_segments`): the programs of a segment iterate that input's slice of the output and load that input
alone, so an element costs one load whatever the number of inputs (under masks, every input is addressed and loaded
for every element: a cat of 32 inputs issues 32 loads per element). Inputs of one shape and dtype loaded as they
are share one segment and one copy of the code: each program picks its input's address, strides and place in the
cat once (scalar selects), so the kernel's code, and its compile, grows with the number of distinct slices, not of
inputs.

Bytes: every input read once and every output written once; no intermediate touches memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.coordinates import is_channels_last, is_dense_in_order, layout_order, unravel_expressions
from opfuse.codegen.expr import INTEGER_OPS, SUPPORTED_OPS, Unsupported, refusal
from opfuse.codegen.operands import VIEW_OPS, Emitter, FlatIndex, Region, build_kernel, exact, next_power_of_2
from opfuse.codegen.template_kernel import TemplateKernel, group_operands, held_constants
from opfuse.fusion.legality_views import MAPPED_COPIES
from opfuse.fusion.tiles import POINTWISE
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import WIDE_INTEGERS, Graph


@dataclass
class Part:
    """One independent elementwise chain of the group and its iteration space."""

    key: int
    nodes: list[str]
    outputs: list[str]
    inputs: list[str] = field(default_factory=list)     # external values read (for the layout choice)
    shape: tuple[int, ...] = ()

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def has_layout_choice(self) -> bool:
        return len(self.shape) == 4


@dataclass(frozen=True)
class Segment:
    """Slices of a part's iteration space along a cat's dim, each filled by one input of the cat, all of one shape:
    `sources[i]` fills the slice from `starts[i]`. Several sources are inputs of the group loaded as they are (one
    dtype); a source computed in the group has a segment of its own."""

    cat: str
    sources: tuple[str, ...]
    starts: tuple[int, ...]     # where each source's slice begins along `dim`
    dim: int
    shape: tuple[int, ...]      # each slice's iteration shape (its source's)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def cat_segments(graph: Graph, part: Part) -> list[Segment] | None:
    """The segments of a part to walk one cat input at a time, or None (walk it whole): where the part holds one
    cat, of at least two non-empty inputs, whose coordinates are the iteration's: the cat has the part's shape and
    so has every node of the part that reads it, directly or not, none of them a view or another index map (a
    channel shuffle after the cat reads it elsewhere: walked whole, its cat computed under masks). A cat of wide
    integers is walked whole too: `Region.integer` computes it exactly (a segment's loads are float32)."""
    cats = [n for n in part.nodes if graph[n].op == "cat"]
    if len(cats) != 1 or graph[cats[0]].type.dtype in WIDE_INTEGERS:
        return None
    after, grown = {cats[0]}, True
    while grown:
        reading = {n for n in part.nodes if n not in after and any(i in after for i in graph[n].inputs)}
        after |= reading
        grown = bool(reading)
    if any(graph[n].type.shape != part.shape or (n != cats[0] and (graph[n].op in VIEW_OPS or
                                                                   graph[n].op in MAPPED_COPIES))
           for n in after):
        return None
    cat = graph[cats[0]]
    dim = cat.attrs["dim"] % len(part.shape)
    slices: list[tuple[str, int]] = []
    start = 0
    for source in cat.inputs:
        if graph[source].type.shape[dim]:
            slices.append((source, start))
        start += graph[source].type.shape[dim]
    if len(slices) < 2:
        return None
    members = set(part.nodes)
    runs: dict[tuple, list[tuple[str, int]]] = {}
    for source, start in slices:
        kind = graph[source].type
        shared = source not in members and not graph.is_constant(source)
        runs.setdefault((kind.shape, kind.dtype) if shared else (source, start), []).append((source, start))
    return [Segment(cat.name, tuple(s for s, _ in run), tuple(b for _, b in run), dim,
                    part.shape[:dim] + (graph[run[0][0]].type.shape[dim],) + part.shape[dim + 1:])
            for run in runs.values()]


def lower_pointwise_group(graph: Graph, group: FusionGroup, device, hw: HardwareProfile | None = None
                          ) -> "PointwiseKernel":
    """Lower an elementwise group (chains of POINTWISE/BROADCAST ops and views) to one Triton kernel, its blocks for
    GPU `hw` (as `kernel_profile` gives it)."""
    return PointwiseKernel(graph, group, device, hw)


def supports(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """None where the pointwise template takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("pointwise", lambda: _taken(graph, group))


def _taken(graph: Graph, group: FusionGroup) -> list[Part]:
    """The group's parts (`split_parts`); `Unsupported` (its code says which kind) where the template cannot compute
    a node, or the group writes nothing."""
    for name in group.nodes:
        node = graph[name]
        if node.op not in SUPPORTED_OPS | INTEGER_OPS and node.op not in VIEW_OPS and node.op not in MAPPED_COPIES \
                and not graph.writes_state_in_place(name):
            raise Unsupported(f"node {node.describe()} is not elementwise; the pointwise template cannot compute it",
                              Code.EPILOGUE_FORM)
    if not group.outputs:
        raise Unsupported(f"group {group.name} has no outputs", Code.EPILOGUE_FORM)
    return split_parts(graph, group)


def split_parts(graph: Graph, group: FusionGroup) -> list[Part]:
    """The group's connected parts (through values computed inside the group), ordered by first output."""
    members = set(group.nodes)
    root = {name: name for name in group.nodes}

    def find(name: str) -> str:
        while root[name] != name:
            root[name] = root[root[name]]
            name = root[name]
        return name

    for name in group.nodes:
        for i in graph[name].inputs:
            if i in members:
                root[find(i)] = find(name)
    parts: dict[str, Part] = {}
    for o in group.outputs:
        parts.setdefault(find(o), Part(len(parts), [], [])).outputs.append(o)
    for name in group.nodes:
        part = parts.get(find(name))
        if part is None:
            continue            # feeds no output: nothing to compute
        part.nodes.append(name)
        for i in graph[name].inputs:
            if i not in members and i not in part.inputs:
                part.inputs.append(i)
    for part in parts.values():
        largest = max(part.outputs, key=lambda o: math.prod(graph.stored_shape(o)))
        part.shape = graph.stored_shape(largest)
        for o in part.outputs:
            if math.prod(graph.stored_shape(o)) != part.numel:
                raise Unsupported(f"output {graph[o].describe()} of group {group.name} stores "
                                  f"{math.prod(graph.stored_shape(o))} elements, the group's iteration space "
                                  f"{part.numel}", Code.EPILOGUE_FORM)
    return list(parts.values())



class PointwiseKernel(TemplateKernel):
    """One launch computing every elementwise chain of a group."""

    def __init__(self, graph: Graph, group: FusionGroup, device, hw: HardwareProfile | None = None):
        self.hw = kernel_profile(hw)
        group_operands(graph, group)
        self.parts = _taken(graph, group)
        constants, scalars = held_constants(graph, group, device)
        # the iteration spaces, one range of programs each: a part, or each segment of it (`cat_segments`)
        self.spaces = [(part, segment) for part in self.parts
                       for segment in cat_segments(graph, part) or [None]]
        emitter = Emitter(graph, group, scalars)
        body = ["pid = tl.program_id(0)", "if INT64:", "    pid = pid.to(tl.int64)"]
        constexprs = ["BLOCK", "INT64"]
        start = "0"
        for index, (part, segment) in enumerate(self.spaces):
            numel, copies = (segment.numel, len(segment.sources)) if segment else (part.numel, 1)
            programs = f"{copies} * " * (copies > 1) + f"(({numel} + BLOCK - 1) // BLOCK)"
            end = f"{start} + {programs}" if start != "0" else programs
            lines = self._space_lines(emitter, part, segment, start, index)
            if len(self.spaces) == 1:
                body += lines
            else:
                body.append(f"{'if' if index == 0 else 'elif'} pid < {end}:  # part {part.key}"   # ops, not values
                            + (f", {', '.join(graph[s].op for s in segment.sources)} of {graph[segment.cat].op}"
                               if segment else ""))
                body += ["    " + line for line in lines]
            if part.has_layout_choice and f"CL{part.key}" not in constexprs:
                constexprs.append(f"CL{part.key}")
            start = end
        self.flags = emitter.flags
        constexprs += list(self.flags)
        name, source, function = build_kernel(graph, group, emitter, body, constexprs)
        super().__init__(graph, group, name, source, device, emitter.args, constants, function)

    def _space_lines(self, emitter: Emitter, part: Part, segment: Segment | None, start: str,
                     index: int) -> list[str]:
        """The code of one iteration space: `part` whole, or its `segment` (whose cat is its source there)."""
        shape = segment.shape if segment else part.shape
        numel = math.prod(shape)
        offsets, mask = f"offsets{index}", f"mask{index}"
        pid = "pid" if start == "0" else f"(pid - ({start}))"
        several = segment is not None and len(segment.sources) > 1
        if several:     # which source (`which`) and which of its blocks this program takes
            which, blocks = f"which{index}", f"(({numel} + BLOCK - 1) // BLOCK)"
            lines = [f"{which} = {pid} // {blocks}", f"{offsets} = ({pid} - {which} * {blocks}) * BLOCK + "
                     "tl.arange(0, BLOCK)"]
        else:
            lines = [f"{offsets} = {pid} * BLOCK + tl.arange(0, BLOCK)"]
        lines.append(f"{mask} = {offsets} < {numel}")
        names = [f"p{index}_d{d}" if size > 1 else None for d, size in enumerate(shape)]

        def coordinate_lines(channels_last: bool) -> list[str]:
            order = [d for d in layout_order(len(shape), channels_last) if shape[d] > 1]
            expressions = unravel_expressions(offsets, [shape[d] for d in order])
            return [f"{names[d]} = {e}" for d, e in zip(order, expressions)]

        if part.has_layout_choice:
            lines += [f"if CL{part.key}:"] + ["    " + line for line in coordinate_lines(True) or ["pass"]]
            lines += ["else:"] + ["    " + line for line in coordinate_lines(False) or ["pass"]]
        else:
            lines += coordinate_lines(False)
        coords = tuple(names)
        region = emitter.region("[BLOCK]", mask, FlatIndex(offsets, coords, shape, part.key))
        if segment is not None:     # the part's coordinates: the segment's, shifted along the cat's dim
            if several:
                first, value = self._picked_source(emitter, region, segment, which, coords, part.key, index)
            else:
                first, value = str(segment.starts[0]), region.value(segment.sources[0], coords)
            local = coords[segment.dim]
            shifted = first if local is None else local if first == "0" else f"({local} + {first})"
            whole = coords[:segment.dim] + (shifted,) + coords[segment.dim + 1:]
            region.bind(segment.cat, whole, value)
            coords = whole
        for o in part.outputs:
            if emitter.graph[o].op == "index_copy":     # a state written in place, at the index's positions
                region.store_at_index(o, coords)
                continue
            shape_o = emitter.graph[o].type.shape
            out_coords = coords if shape_o == part.shape else region.reshape_coords(coords, part.shape, shape_o)
            region.store(o, out_coords)
        return lines + region.lines

    @staticmethod
    def _picked_source(emitter: Emitter, region: Region, segment: Segment, which: str, coords: tuple, key: int,
                       index: int) -> tuple[str, str]:
        """(the variable holding where the program's source begins along the cat's dim, the variable holding the
        source loaded at `coords`): its address, strides and start picked by `which` (scalar selects, once per
        program), then one load, by the flat index where every source of the segment is dense in the iteration
        order, else through the picked strides."""
        params = [emitter.args.input(source) for source in segment.sources]
        for source in segment.sources:
            exact(emitter.graph[source])
        dims = [d for d, c in enumerate(coords) if c is not None]
        picked = {"ptr": f"src{index}", "start": f"first{index}"} | {d: f"src{index}_s{d}" for d in dims}
        choices = {"ptr": [f"{p.prefix}_ptr" for p in params], "start": [str(b) for b in segment.starts]}
        choices |= {d: [p.stride(d) for p in params] for d in dims}
        for what, variable in picked.items():
            region.lines.append(f"{variable} = {choices[what][0]}")
            region.lines += [f"{variable} = tl.where({which} == {i}, {choice}, {variable})"
                             for i, choice in enumerate(choices[what][1:], start=1)]
        flags = list(dict.fromkeys(f"DENSE{key}_{p.prefix}" for p in params))
        for flag, source in zip(flags, dict.fromkeys(segment.sources)):
            emitter.flags[flag] = (source, key)
        target = emitter.fresh("x")
        strided = " + ".join([f"{picked['ptr']} + {region.zero}"] + [f"{coords[d]} * {picked[d]}" for d in dims])
        load = "{} = tl.load({}, mask={}, other=0.0).to(tl.float32)"
        dense = f"{picked['ptr']} + {region.flat.offsets}"
        region.lines += [f"if {' and '.join(flags)}:", "    " + load.format(target, dense, region.mask),
                         "else:", "    " + load.format(target, strided, region.mask)]
        return picked["start"], target

    # ---- runtime ----------------------------------------------------------------------------------
    def configs(self) -> list[KernelConfig]:
        largest = max(part.numel for part in self.parts)
        if self.hw.interpreted:
            return [KernelConfig.of(BLOCK=min(256, next_power_of_2(largest)), num_warps=1)]
        return [KernelConfig.of(**tile) for tile in POINTWISE]

    def part_channels_last(self, part: Part, tensors: dict[str, torch.Tensor]) -> bool:
        candidates = [tensors[i] for i in part.inputs if i in tensors]
        return bool(candidates) and is_channels_last(max(candidates, key=lambda t: t.numel()))

    def output_channels_last(self, name: str, tensors: dict[str, torch.Tensor]) -> bool:
        part = next(p for p in self.parts if name in p.outputs)
        return self.part_channels_last(part, tensors)

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Outputs (in group.outputs order) of the group for its runtime inputs; `outputs` may be preallocated."""
        config = config or self.configs()[0]
        tensors = self.bind(inputs)
        results = self.outputs_for(tensors, outputs)
        everything = tensors | dict(zip(self.group.outputs, results))
        constexprs: dict[str, bool] = {}
        orders = {}
        for part in self.parts:
            channels_last = part.has_layout_choice and self.part_channels_last(part, tensors)
            if part.has_layout_choice:
                constexprs[f"CL{part.key}"] = channels_last
            orders[part.key] = layout_order(len(part.shape), channels_last)
        for flag, (value, key) in self.flags.items():
            constexprs[flag] = is_dense_in_order(everything[value], orders[key])
        block = config["BLOCK"]
        programs = sum(len(segment.sources) * -(-segment.numel // block) if segment else -(-part.numel // block)
                       for part, segment in self.spaces)
        self.launch((programs,), config, everything, programs * block, **constexprs)
        return results
