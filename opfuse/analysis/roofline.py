"""The roofline: the least time a workload or a kernel can take (`floor`), and the report's chart data.

Entry points: `floor(flops, bytes_moved, ceilings, launches) -> Floor`, the one function every floor in opfuse
comes from (ZOO.md, `opfuse bench`, `opfuse profile`); `workload_work(analysis) -> Work`, what a model must do at
least, counted by opfuse's analysis; `datasheet_ceilings(hw, dtype)`, the rates a floor divides by; and
`roofline(analysis, measured=None) -> dict` (JSON-ready; the report's script draws it as an SVG).

**The floor.** A kernel or a model cannot run faster than its FLOPs at the compute peak, nor than its bytes at the
memory bandwidth: floor = max(FLOPs / peak, bytes / bandwidth), the roofline's time. Measured time as a share of
it (`share_of_floor`: floor / measured) says how much of the GPU a compiled model uses; 100% is the hardware. For a
whole workload the honest figures are the model's and not a plan's:
- FLOPs: the unfused model's (`Analysis.unfused.flops`: every op of the captured graph once, from the op registry),
  not a plan's (which may recompute);
- bytes: the compulsory traffic (`compulsory_bytes`): every weight and input read once, as far as any kernel must
  read it (a gather reads its rows of an embedding table, not the table), and every output written once. Any plan,
  fused or not, moves at least that much; intermediates are what fusion removes, so they are left out;
- peak: the datasheet's dense tensor-core rate at the precision the model's products run in (`datasheet_ceilings`),
  for every FLOP, including those a real kernel computes on the CUDA cores: a lower bound, so shares are never
  flattered.
A second, looser figure is the plan's floor: the same FLOPs with the bytes the fused plan's kernels move
(`Work.plan_bytes`): how close the kernels come to what this plan could do, leaving fusion aside. At batch 1 a
model is mostly launches and weights: its launch-and-bandwidth floor (`Floor.launch_and_bandwidth`) adds a launch
overhead per kernel to the roofline's time.

**The chart.** A point is one kernel: x = FLOPs per byte it moves, y = FLOP/s it attains, i.e. FLOPs / seconds,
where the seconds are measured on a GPU when `measured` has them and the cost model's prediction (launch overhead
included) otherwise. Before fusion the points are the ops of the captured graph (one kernel each, the unfused
baseline of the summary table); after fusion, the plan's groups. Kernels without FLOPs (copies, casts, gathers) have
no place on a log-log chart; they are counted, not drawn. The roofs are the profile's datasheet peaks: the
memory-bandwidth slope and two compute ceilings (tensor cores at the compute dtype, CUDA cores), so points sit below
them by the efficiency factors the cost model applies.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from opfuse.hardware import PROFILES, HardwareProfile
from opfuse.ir.graph import Graph
from opfuse.ir.ops import get_op, node_bytes
from opfuse.numerics import matrix_dtype


def attainable(density: float, peak_flops: float, hw: HardwareProfile) -> float:
    """The roof at `density` FLOPs/Byte: min(compute peak, bandwidth x density)."""
    return min(peak_flops, hw.memory_bandwidth * density)


def ridge_point(peak_flops: float, hw: HardwareProfile) -> float:
    """FLOPs/Byte where a kernel stops being memory-bound under this compute peak."""
    return peak_flops / hw.memory_bandwidth


def roofline(analysis: Any, measured: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """Roofs, points and log-axis ranges of `analysis` (measured: {group name: {"time": seconds, ...}})."""
    hw: HardwareProfile = analysis.hardware
    dtype = analysis.config.dtype
    measured = measured or {}
    points: list[dict[str, Any]] = []
    skipped = {"op": 0, "group": 0}

    def add(series: str, label: str, detail: str, flops: float, bytes_moved: float, predicted: float,
            group: str | None, measured_time: float | None = None) -> None:
        time = measured_time if measured_time else predicted
        if flops <= 0 or bytes_moved <= 0 or not time or time <= 0:
            skipped[series] += 1
            return
        points.append({"series": series, "label": label, "detail": detail, "group": group,
                       "x": flops / bytes_moved, "y": flops / time, "flops": flops, "bytes": bytes_moved,
                       "time": time, "source": "measured" if measured_time else "predicted"})

    for row in analysis.op_rows:
        add("op", row.name, row.op, row.flops, row.bytes_moved, row.predicted_time, None)
    for group in analysis.plan.groups:
        if not group.launches:
            continue
        ops = " + ".join(analysis.plan.graph[n].op for n in group.nodes)
        add("group", group.name, f"{group.kind.value}: {ops}", group.flops, group.bytes_moved,
            group.predicted_time, group.name, measured.get(group.name, {}).get("time"))

    # the tensor cores at the precision each kind of product runs in (float32: as PyTorch's tf32 settings say)
    ceilings = [{"name": f"tensor cores ({product})", "flops": hw.matrix_peak(product),
                 "ridge": ridge_point(hw.matrix_peak(product), hw)}
                for product in sorted({matrix_dtype(dtype, conv) for conv in (True, False)})
                if hw.matrix_peak(product) > hw.vector_flops]
    ceilings.append({"name": "CUDA cores (vector)", "flops": hw.vector_flops,
                     "ridge": ridge_point(hw.vector_flops, hw)})
    xs = [p["x"] for p in points] + [c["ridge"] for c in ceilings]
    ys = [p["y"] for p in points] + [c["flops"] for c in ceilings]
    return {
        "hardware": hw.name,
        "memory_bandwidth": hw.memory_bandwidth,
        "ceilings": ceilings,
        "points": points,
        "skipped": skipped,       # kernels without FLOPs or bytes: not drawable on log axes
        "x_range": _decades(min(xs) / 2, max(xs) * 4),
        "y_range": _decades(min(ys) / 2, max(ys) * 2),
    }


def _decades(low: float, high: float) -> list[float]:
    """[10^a, 10^b] enclosing low..high, so the log axes get whole-decade ticks."""
    return [10.0 ** math.floor(math.log10(low)), 10.0 ** math.ceil(math.log10(high))]


# ---- the floor ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Ceilings:
    """The rates a floor divides by: FLOP/s, bytes/s of device memory, and seconds per kernel launch."""

    flops: float
    bandwidth: float
    launch_overhead: float = 0.0


def datasheet_ceilings(hw: HardwareProfile, dtype: str) -> Ceilings:
    """`hw`'s datasheet rates for a model computed in `dtype`: the tensor cores' dense peak at the faster of the
    precisions its convolutions and its other products run in (`opfuse.numerics.matrix_dtype`: they differ for
    float32 alone), the memory bandwidth, and the launch overhead as the profile states it (not scaled by
    `time_factor`, which fits the cost model to replays: a floor takes the hardware's numbers, not a fit)."""
    peak = max(hw.matrix_peak(matrix_dtype(dtype, conv)) for conv in (True, False))
    return Ceilings(peak, hw.memory_bandwidth, hw.launch_overhead)


@dataclass(frozen=True)
class Floor:
    """The least seconds some work can take: its compute and memory terms, and the launches it is granted."""

    compute: float          # FLOPs / peak FLOP/s
    memory: float           # bytes / bandwidth
    launches: int = 0
    launch: float = 0.0     # launches x launch overhead

    @property
    def roofline(self) -> float:
        """max(compute, memory): the roofline's time."""
        return max(self.compute, self.memory)

    @property
    def launch_and_bandwidth(self) -> float:
        """The roofline's time plus a launch overhead per kernel: the floor of a batch-1 workload, whose kernels
        are too small to hide their launches."""
        return self.roofline + self.launch

    @property
    def bound(self) -> str:
        """Which term sets the roofline: "compute" or "memory"."""
        return "compute" if self.compute >= self.memory else "memory"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"roofline": self.roofline, "launch_and_bandwidth": self.launch_and_bandwidth,
                               "bound": self.bound}


def floor(flops: float, bytes_moved: float, ceilings: Ceilings, launches: int = 0) -> Floor:
    """The floor of `flops` and `bytes_moved` under `ceilings`, with `launches` kernel launches: the one place a
    floor is computed (module docstring)."""
    return Floor(flops / ceilings.flops, bytes_moved / ceilings.bandwidth, launches,
                 launches * ceilings.launch_overhead)


def share_of_floor(floor_seconds: float | None, measured_seconds: float | None) -> float | None:
    """floor / measured: the share of the hardware a measured time reaches (1.0 = at the floor); None when either
    is missing or not positive."""
    if not floor_seconds or not measured_seconds or floor_seconds <= 0 or measured_seconds <= 0:
        return None
    return floor_seconds / measured_seconds


def format_share(share: float | None) -> str:
    """A share of a floor as the reports print it: a whole percentage, one decimal under 10%, "<0.1%" under that,
    "-" for none."""
    if share is None:
        return "-"
    if share < 0.001:
        return "<0.1%"
    return f"{share * 100:.1f}%" if share < 0.1 else f"{share * 100:.0f}%"


@dataclass(frozen=True)
class Work:
    """What a workload must do at least, counted by opfuse's analysis (JSON-ready through `asdict`)."""

    flops: int              # the unfused model's FLOPs
    compulsory_bytes: int   # `compulsory_bytes` of the prepared graph
    plan_bytes: int         # what the compiled model's kernels read and write (`Analysis.fused.total_bytes`)
    plan_launches: int      # the kernels the plan launches (`FusionPlan.kernel_launches`): which plan plan_bytes is of

    def floor(self, ceilings: Ceilings, launches: int = 0) -> Floor:
        """The workload's floor: the model's FLOPs and the compulsory bytes."""
        return floor(self.flops, self.compulsory_bytes, ceilings, launches)

    def plan_floor(self, ceilings: Ceilings) -> Floor:
        """The looser floor of the plan: the model's FLOPs and the plan's bytes."""
        return floor(self.flops, self.plan_bytes, ceilings)


def workload_work(analysis: Any) -> Work:
    """The `Work` of an `opfuse.analyze` result."""
    return Work(analysis.unfused.flops, compulsory_bytes(analysis.prepared), analysis.fused.total_bytes,
                analysis.plan.kernel_launches)


def compulsory_bytes(graph: Graph) -> int:
    """Bytes any implementation of `graph` moves at least: every source (graph input, constant) read once and
    every graph output written once.

    A source counts what the kernel reading the most of it reads (seen through views, which read nothing), at
    most its size. A kernel reads each input whole unless its registry bytes (`node_bytes`) fall short of its
    inputs' sizes: then its largest input is the one read in part, by the shortfall (a gather's table, of which it
    reads the rows its indices pick: the registry's `embedding_bytes`), and the others whole. So an embedding table
    counts the rows gathered and a weight read by a GEMM counts whole. Taking the largest reader rather than the sum
    keeps it a lower bound (two gathers may read the same rows); an output that is a source itself is written by no
    kernel."""
    users = graph.users()
    sources = {node.name for node in graph if node.op in ("input", "constant")}

    def share(reader: Any, value: str) -> int:
        """Bytes of `value` a kernel `reader` reads."""
        sizes = {name: graph[name].type.nbytes for name in dict.fromkeys(reader.inputs)}
        shortfall = sum(sizes.values()) - node_bytes(graph, reader)[0]
        if shortfall <= 0 or value != max(sizes, key=sizes.__getitem__):
            return sizes[value]
        return max(0, sizes[value] - shortfall)

    def read_of(value: str, size: int) -> int:
        most = 0
        for reader in users.get(value, []):
            if get_op(reader.op).alias:         # a view: what its own readers read of it
                read = read_of(reader.name, size)
            else:
                read = share(reader, value)
            most = max(most, min(size, read))
        return most

    reads = sum(read_of(name, graph[name].type.nbytes) for name in sources)
    writes = sum(graph[name].type.nbytes for name in dict.fromkeys(graph.outputs) if name not in sources)
    return reads + writes


def hardware_of_gpu(name: str | None) -> HardwareProfile | None:
    """The profile of a GPU as torch names it ("NVIDIA H200", "NVIDIA H100 80GB HBM3"): the one whose key its name
    contains, spaces and dashes aside; None for a GPU without a profile (or no name). A PCIe card is none of the
    SXM profiles (other clocks and memory): None too."""
    if not name:
        return None
    plain = name.lower().replace(" ", "").replace("-", "").replace("_", "")
    if "pcie" in plain:
        return None
    matches = [key for key in PROFILES if key in plain]
    return PROFILES[matches[0]] if len(matches) == 1 else None
