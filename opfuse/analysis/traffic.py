"""Traffic analysis: what fusion saves in bytes, launches, intermediate memory and predicted time.

Entry points: `op_table(graph, hw, config)` (per op: FLOPs, bytes, density, the seed's fusion-candidate flag),
`summarize_unfused(graph, hw, config)` (every op its own kernel), `summarize_plan(plan, hw)` (every group one
kernel) and `compare(unfused, fused)`. All numbers come from the cost model (`opfuse.fusion.cost`), which reads
per-op formulas from the op registry; nothing is re-derived here.

Peak intermediate memory walks the kernels in order: a kernel's written values are allocated when it runs and
freed after their last reader ran. Graph inputs and constants are not intermediates, graph outputs stay live to
the end, and views allocate nothing (reading a view keeps the buffer it views alive).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from opfuse.config import FusionConfig, for_graph
from opfuse.fusion.concat_in_place import planned_slots
from opfuse.fusion.cost import estimate_kernel, op_density
from opfuse.fusion.plan import FusionPlan
from opfuse.hardware import HardwareProfile, get_hardware
from opfuse.ir.graph import Graph
from opfuse.ir.ops import get_op, launches_kernel, node_bytes, node_flops


@dataclass(frozen=True)
class OpMetrics:
    """One kernel-launching op run alone."""

    name: str
    op: str
    kind: str               # its FusionKind value
    flops: int
    bytes_read: int
    bytes_written: int
    density: float          # FLOPs per byte moved
    candidate: bool         # density under config.density_threshold: worth fusing (the seed's rule)
    predicted_time: float   # seconds

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class TrafficSummary:
    """Totals over the kernels of a model, fused or not."""

    bytes_read: int
    bytes_written: int
    total_bytes: int
    kernel_launches: int
    peak_intermediate_bytes: int
    flops: int
    density: float
    predicted_time: float


def op_table(graph: Graph, hw: HardwareProfile | None = None, config: FusionConfig | None = None
             ) -> list[OpMetrics]:
    """Metrics of every kernel-launching node in graph order (views and sources launch nothing)."""
    config = for_graph(config, graph)
    hw = hw or get_hardware(config.hardware)
    users = graph.users()
    rows = []
    for node in graph:
        op = get_op(node.op)
        if not launches_kernel(graph, node):
            continue
        read, written = node_bytes(graph, node)
        density = op_density(graph, node)
        rows.append(OpMetrics(node.name, node.op, op.kind.value, node_flops(graph, node), read, written, density,
                              density < config.density_threshold,
                              estimate_kernel(graph, [node.name], users, hw, config.dtype).time))
    return rows


def summarize_unfused(graph: Graph, hw: HardwareProfile | None = None, config: FusionConfig | None = None
                      ) -> TrafficSummary:
    """Every kernel-launching node its own kernel."""
    rows = op_table(graph, hw, config)
    kernels = [(graph[r.name].inputs, [r.name]) for r in rows]
    return _summary(graph, rows, kernels, sum(r.predicted_time for r in rows), len(rows))


def summarize_plan(plan: FusionPlan, hw: HardwareProfile | None = None,
                   through_pytorch: Iterable[str] = ()) -> TrafficSummary:
    """What the compiled model runs: every group of the plan one kernel (views none, split rows two launches),
    except the groups in `through_pytorch`, which get no kernel and run node by node (each launching node its own
    kernel, priced as in `op_table`); times recomputed when a `hw` other than the plan's is given (by the cost
    model's kernel estimates and a launch for each split row reduction's second kernel, without the partials the
    planner prices too)."""
    graph = plan.graph
    config = for_graph(plan.config, graph)
    pytorch = set(through_pytorch)
    kernels = [g for g in plan.groups if g.launches and g.name not in pytorch]
    nodes = {name for g in plan.groups if g.name in pytorch for name in g.nodes}
    profile = get_hardware(config.hardware)
    if hw is None or hw == profile:      # the planner's prices (split partials and row splits' second kernels in)
        time = sum(g.predicted_time for g in kernels)
    else:
        users = graph.users()
        time = sum(estimate_kernel(graph, g.nodes, users, hw, config.dtype).time for g in kernels)
        time += sum(g.launches - 1 for g in kernels) * hw.launch_time     # row splits' second kernels
    rows = [r for r in op_table(graph, hw or profile, config) if r.name in nodes] \
        if nodes else []
    time += sum(r.predicted_time for r in rows)
    launches = sum(g.launches for g in kernels) + len(rows)
    buffers = [(g.inputs, written) for g, written in zip(kernels, _buffers(plan, kernels))]
    return _summary(graph, [*kernels, *rows], buffers + [(graph[r.name].inputs, [r.name]) for r in rows], time,
                    launches)


def _buffers(plan: FusionPlan, kernels: Sequence) -> list[list[str]]:
    """Per kernel group, the buffers it writes: its outputs, but where one is a part of a cat written in place
    (`opfuse.fusion.concat_in_place`) the cat's whole buffer, made by the first of its parts' kernels."""
    slots, made, buffers = planned_slots(plan), set(), []
    for group in kernels:
        written = []
        for output in group.outputs:
            cat = slots[output][0] if output in slots else None
            if cat is None:
                written.append(output)
            elif cat not in made:
                made.add(cat)
                written.append(cat)
        buffers.append(written)
    return buffers


def compare(unfused: TrafficSummary, fused: TrafficSummary) -> dict[str, float]:
    """What fusion saves: bytes, launches, peak intermediate memory, predicted time."""
    def fraction(saved: float, total: float) -> float:
        return saved / total if total else 0.0

    bytes_saved = unfused.total_bytes - fused.total_bytes
    peak_saved = unfused.peak_intermediate_bytes - fused.peak_intermediate_bytes
    time_saved = unfused.predicted_time - fused.predicted_time
    return {
        "bytes_saved": bytes_saved,
        "bytes_saved_fraction": fraction(bytes_saved, unfused.total_bytes),
        "launches_saved": unfused.kernel_launches - fused.kernel_launches,
        "peak_intermediate_saved": peak_saved,
        "peak_intermediate_saved_fraction": fraction(peak_saved, unfused.peak_intermediate_bytes),
        "time_saved": time_saved,
        "speedup": unfused.predicted_time / fused.predicted_time if fused.predicted_time else 0.0,
        "density_unfused": unfused.density,
        "density_fused": fused.density,
    }


def peak_intermediate_bytes(graph: Graph, kernels: Sequence[tuple[Iterable[str], Iterable[str]]]) -> int:
    """Largest sum of live intermediate buffers while a kernel runs; `kernels` are (reads, writes) in order."""
    kernels = [(list(reads), list(writes)) for reads, writes in kernels]
    written = {value for _, writes in kernels for value in writes}

    def buffer(value: str) -> str | None:
        """The intermediate buffer a value lives in: itself, or what the view reads; None for sources."""
        while value not in written:
            node = graph[value]
            if not get_op(node.op).alias:
                return None   # graph input or constant
            value = node.inputs[0]
        return value

    last_reader: dict[str, int] = {}
    for i, (reads, _) in enumerate(kernels):
        for value in reads:
            base = buffer(value)
            if base is not None:
                last_reader[base] = i
    kept = {b for b in (buffer(o) for o in graph.outputs) if b is not None}
    frees: dict[int, list[str]] = {}
    live = peak = 0
    for i, (_, writes) in enumerate(kernels):
        for value in writes:
            live += graph[value].type.nbytes
            if value not in kept:
                frees.setdefault(max(i, last_reader.get(value, i)), []).append(value)
        peak = max(peak, live)
        for value in frees.pop(i, []):
            live -= graph[value].type.nbytes
    return peak


def _summary(graph: Graph, rows: Sequence, kernels: list[tuple[Iterable[str], Iterable[str]]],
             time: float, launches: int) -> TrafficSummary:
    read = sum(r.bytes_read for r in rows)
    written = sum(r.bytes_written for r in rows)
    flops = sum(r.flops for r in rows)
    total = read + written
    return TrafficSummary(read, written, total, launches, peak_intermediate_bytes(graph, kernels), flops,
                          flops / total if total else 0.0, time)
