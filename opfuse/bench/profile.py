"""Per-op and per-kernel profile against the cost model: `profile_model(model, inputs, config) -> Profile`.

Two tables, the seed's advice made a command ("profile each operator's compute-to-memory ratio; under 10
FLOPs/Byte it is a fusion candidate"):

- **eager, per op.** Every kernel-launching node of the captured graph (the unfused baseline the cost model
  predicts, one ATen-level op each: conv, batch_norm, relu, add, ...) runs alone through its PyTorch reference on
  its real input values (one run of the whole graph, in the compute dtype, 4-D tensors channels-last as in the
  benchmark protocol). We time ops this way rather than map torch.profiler kernels back to ops because the
  mapping is then exact: each row is one IR node, with the registry's FLOPs and bytes.
- **opfuse, per kernel.** Every group of the compiled model's plan that launches a kernel: its `GroupKernel`
  alone, with its tuned config, on the real intermediate values (`CompiledModel.collect_values`); a group that
  runs through PyTorch (attention, gathers) runs its nodes the same way.

How one row is timed (`cuda_graph_time`): after a warm-up call, `repeats` back-to-back calls are captured into one
CUDA graph and the graph is replayed; the time is the median of CUDA-event-timed replays divided by `repeats`.
That is the kernel's GPU time plus the gap between two launches in a stream (what the cost model's
`launch_overhead` stands for) without Python's dispatch time, which would swamp microsecond kernels. An op that
cannot be captured is timed by events around eager calls instead (its row says so).

Each row carries the FLOPs and bytes of the op registry / fusion plan, so achieved GB/s and TFLOP/s and the
FLOPs/Byte are the counted work over the measured time, next to the cost model's prediction and its relative
error. `Profile.samples()` feeds `opfuse.bench.calibrate` (the rows whose prediction is a plain roofline).

Each row's floor is its counted work on the datasheet of the GPU it ran on (`opfuse.analysis.roofline.floor`: the
roofline's time, and with its one launch); the profile's is the whole workload's (`Profile.workload_floor`), which
the kernels' measured sum is set against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from opfuse.analysis.roofline import Ceilings, Floor, Work, datasheet_ceilings, floor, hardware_of_gpu, share_of_floor
from opfuse.bench.calibrate import Calibration, Sample, calibrate
from opfuse.codegen.forms import is_library, is_library_fused, is_unfused
from opfuse.runtime.clock import recover_rng_after_failed_capture
from opfuse.config import FusionConfig
from opfuse.fusion.cost import estimate_kernel, is_conv, predict_time, tile_efficiency
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.ops import get_op

Timer = Callable[[Callable[[], object]], float]          # seconds per call of a function
Progress = Callable[[str, int, int], None]                # (what is being timed, done, total)


@dataclass
class ProfileRow:
    """One op (eager) or one kernel (opfuse): counted work, predicted and measured time."""

    name: str                       # node name (eager) or group name (opfuse)
    ops: str                        # the op, or the group's ops joined by " + "
    kind: str                       # fusion kind of the op, or group kind
    runs_as: str                    # "pytorch", or the opfuse kernel's name (noting its library form)
    flops: int
    bytes_moved: int
    predicted: float                # seconds, cost model
    matrix: bool                    # the cost model puts it on the tensor cores
    tile_efficiency: float = 1.0
    roofline: bool = True           # the prediction is the plain roofline of the counted work (calibratable)
    measured: float | None = None   # seconds
    timing: str = ""                # "cuda graph" or "events" (could not be captured)
    conv: bool = False              # a convolution (`opfuse.bench.calibrate.Sample.conv`)
    floor: float | None = None      # seconds: the roofline's time of its counted work (`with_floor`)
    launch_floor: float | None = None   # seconds: the same with its launch

    def with_floor(self, ceilings: Ceilings | None) -> "ProfileRow":
        """This row with its floors under `ceilings` (one launch); unchanged without ceilings."""
        if ceilings is not None:
            bound = floor(self.flops, self.bytes_moved, ceilings, launches=1)
            self.floor, self.launch_floor = bound.roofline, bound.launch_and_bandwidth
        return self

    @property
    def share_of_floor(self) -> float | None:
        """floor / measured (`opfuse.analysis.roofline.share_of_floor`)."""
        return share_of_floor(self.floor, self.measured)

    @property
    def share_of_launch_floor(self) -> float | None:
        return share_of_floor(self.launch_floor, self.measured)

    @property
    def density(self) -> float:
        """FLOPs per byte moved (the counted work; the seed's compute-to-memory ratio)."""
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0

    @property
    def achieved_bandwidth(self) -> float | None:
        """Bytes per second, counted bytes over measured time."""
        return self.bytes_moved / self.measured if self.measured else None

    @property
    def achieved_flops(self) -> float | None:
        return self.flops / self.measured if self.measured else None

    @property
    def error(self) -> float | None:
        """Relative error of the cost model: (predicted - measured) / measured."""
        return (self.predicted - self.measured) / self.measured if self.measured else None

    def sample(self) -> Sample:
        return Sample(self.flops, self.bytes_moved, self.matrix, self.measured or 0.0, self.tile_efficiency,
                      self.name, self.conv)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"density": self.density, "achieved_bytes_per_s": self.achieved_bandwidth,
                               "achieved_flops_per_s": self.achieved_flops, "relative_error": self.error,
                               "share_of_floor": self.share_of_floor,
                               "share_of_launch_floor": self.share_of_launch_floor}


@dataclass
class Profile:
    model: str
    dtype: str
    hardware: HardwareProfile
    threshold: float                                  # FLOPs/Byte under which an op is a fusion candidate
    eager: list[ProfileRow] = field(default_factory=list)
    opfuse: list[ProfileRow] = field(default_factory=list)
    calibration: Calibration | None = None
    hardware_key: str = ""                            # the config's name for the profile ("h200")
    compiled: Any = field(default=None, repr=False)   # the opfuse model profiled (the report reads its kernels)
    work: Work | None = None                          # the workload's (`opfuse.analysis.roofline.workload_work`)
    ceilings: Ceilings | None = None                  # the floors' rates: the datasheet of the GPU measured on
    floor_hardware: str = ""                          # whose datasheet that is

    def workload_floor(self) -> Floor | None:
        """The workload's floor, granted the launches of opfuse's plan."""
        if self.work is None or self.ceilings is None:
            return None
        return self.work.floor(self.ceilings, self.work.plan_launches)

    def plan_floor(self) -> Floor | None:
        """The looser floor of the plan's bytes."""
        return None if self.work is None or self.ceilings is None else self.work.plan_floor(self.ceilings)

    def candidate(self, row: ProfileRow) -> bool:
        return row.density < self.threshold

    def samples(self) -> list[Sample]:
        """The measured rows the calibration can fit: those whose prediction is a plain roofline."""
        return [r.sample() for r in self.eager + self.opfuse if r.measured and r.roofline]

    def calibrate(self) -> Calibration:
        """Fit the hardware profile to every measured row (eager ops and opfuse kernels) and keep the result."""
        self.calibration = calibrate(self.samples(), self.hardware, self.dtype)
        return self.calibration

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "dtype": self.dtype, "hardware": self.hardware.name,
                "density_threshold": self.threshold,
                "median_error": {"eager": median_error(self.eager), "opfuse": median_error(self.opfuse),
                                 "all": median_error(self.eager + self.opfuse)},
                "eager": [r.to_dict() | {"candidate": self.candidate(r)} for r in self.eager],
                "opfuse": [r.to_dict() | {"candidate": self.candidate(r)} for r in self.opfuse],
                "calibration": self.calibration.to_dict() if self.calibration else None,
                "floor": None if self.workload_floor() is None else {
                    "hardware": self.floor_hardware, "work": asdict(self.work),
                    "workload": self.workload_floor().to_dict(), "plan": self.plan_floor().to_dict()}}


def median_error(rows: Sequence[ProfileRow]) -> float | None:
    """Median of |predicted - measured| / measured over the measured rows (None when nothing was measured)."""
    errors = [abs(r.error) for r in rows if r.error is not None]
    return statistics.median(errors) if errors else None


# ---- timing ------------------------------------------------------------------------------------------------

def cuda_graph_time(fn: Callable[[], object], repeats: int | None = None, replays: int = 10) -> float:
    """Seconds per call of `fn` on the current CUDA device (see the module docstring)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()                               # warm-up: compiles Triton kernels, lets cuDNN pick its algorithm
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    end.synchronize()
    eager = start.elapsed_time(end) / 1e3
    if repeats is None:                # enough calls per graph that one replay lasts about 200 µs
        repeats = max(3, min(50, math.ceil(2e-4 / max(eager, 1e-6))))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / repeats)
    return statistics.median(times)


def event_time(fn: Callable[[], object], iters: int = 20) -> float:
    """Seconds per call of `fn`: median of CUDA-event-timed eager calls after a warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _time_row(row: ProfileRow, fn: Callable[[], object], timer: Timer | None) -> None:
    if timer is not None:
        row.measured, row.timing = timer(fn), "given timer"
        return
    try:
        row.measured, row.timing = cuda_graph_time(fn), "cuda graph"
    except Exception:      # e.g. an op that syncs with the host: time it eagerly
        recover_rng_after_failed_capture()
        torch.cuda.synchronize()
        row.measured, row.timing = event_time(fn), "events"


# ---- the rows ----------------------------------------------------------------------------------------------

def graph_values(graph: Graph, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of one run of `graph` through the op references; 4-D floating values channels-last; a state
    node (a KV cache) takes a copy of its initial tensor, so the run leaves the graph's own untouched."""
    device = inputs[0].device if inputs else torch.device("cpu")

    def layout(x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 4 and x.is_floating_point():
            return x.contiguous(memory_format=torch.channels_last)
        return x

    values = {node.name: layout(x) for node, x in zip(graph.input_nodes, inputs)}
    with torch.no_grad():
        for node in graph:
            if node.op == "input":
                continue
            if node.op in ("constant", "state"):
                value = graph.constants[node.name].to(device)
                values[node.name] = layout(value.clone() if node.op == "state" else value)
                continue
            try:
                values[node.name] = get_op(node.op).run([values[i] for i in node.inputs], node.attrs)
            except Exception as error:
                raise GraphError(f"profiling: running node {node.describe()} failed: {error}") from error
    return values


def _prediction(graph: Graph, nodes: Sequence[str], users: Any, hardware: HardwareProfile, dtype: str
                ) -> tuple[float, bool, float, bool, bool]:
    """(predicted seconds, tensor-core kernel?, tile efficiency, plain roofline?, a convolution?) from the cost
    model.

    The calibration needs the roofline terms behind each prediction. Rather than restate the cost model's rule
    for which kernels run on the tensor cores (anchors, except depthwise convolutions), the terms are taken to be
    the ones that reproduce its estimate; an estimate that is not a plain roofline of the kernel's traffic (a
    conv-conv kernel priced with its recomputation) is marked so, and left out of the calibration."""
    estimate = estimate_kernel(graph, nodes, users, hardware, dtype)
    tile = tile_efficiency(estimate.resources)
    flops, moved = estimate.traffic.flops, estimate.traffic.bytes_moved
    likely, conv = estimate.anchor is not None, is_conv(graph, estimate.anchor)
    for matrix in (likely, not likely):
        if math.isclose(predict_time(flops, moved, hardware, dtype, matrix, tile, conv), estimate.time,
                        rel_tol=1e-9):
            return estimate.time, matrix, tile, True, conv
    return estimate.time, likely, tile, False, conv


def eager_rows(analysis: Any, values: dict[str, torch.Tensor], timer: Timer | None = None,
               progress: Progress | None = None, ceilings: Ceilings | None = None) -> list[ProfileRow]:
    """One timed row per kernel-launching op of the captured (unfused) graph (with its floors under `ceilings`)."""
    graph, hardware, dtype = analysis.captured, analysis.hardware, analysis.config.dtype
    users = graph.users()
    rows = []
    for index, metrics in enumerate(analysis.op_rows):
        node = graph[metrics.name]
        predicted, matrix, tile, roofline, conv = _prediction(graph, [node.name], users, hardware, dtype)
        row = ProfileRow(node.name, node.op, metrics.kind, "pytorch", metrics.flops, metrics.bytes_moved,
                         predicted, matrix, tile, roofline, conv=conv).with_floor(ceilings)
        if progress is not None:
            progress(f"eager {node.name}", index, len(analysis.op_rows))
        args = [values[i] for i in node.inputs]
        op = get_op(node.op)
        _time_row(row, lambda: op.run(args, node.attrs), timer)
        rows.append(row)
    return rows


def opfuse_rows(compiled_model: Any, values: dict[str, torch.Tensor], hardware: HardwareProfile, dtype: str,
                timer: Timer | None = None, progress: Progress | None = None, ceilings: Ceilings | None = None
                ) -> list[ProfileRow]:
    """One timed row per kernel-launching group of a CompiledModel's plan (with its floors under `ceilings`: the
    group's FLOPs and bytes as the plan counts them)."""
    plan = compiled_model.plan
    graph = plan.graph
    users = graph.users()
    groups = [g for g in plan.groups if g.launches]
    rows = []
    for index, group in enumerate(groups):
        predicted, matrix, tile, roofline, conv = _prediction(graph, group.nodes, users, hardware, dtype)
        kernel = compiled_model.kernels.get(group.name)
        config = compiled_model.configs.get(group.name)
        ops = " + ".join(graph[n].op for n in group.nodes)
        library = ""
        if is_library_fused(config):
            library = " (cuDNN/cuBLASLt, epilogue fused)"
        elif is_library(config):
            library = " (cuBLAS)" if getattr(kernel, "library_outputs", None) else " (cuBLAS/cuDNN + epilogue)"
        elif is_unfused(config):
            library = " (unfused: PyTorch ops)"
        runs_as = "pytorch" if kernel is None else kernel.name + library
        row = ProfileRow(group.name, ops, group.kind.value, runs_as, group.flops, group.bytes_moved, predicted,
                         matrix, tile, roofline, conv=conv).with_floor(ceilings)
        if progress is not None:
            progress(f"opfuse {group.name}", index, len(groups))
        if kernel is not None:
            args = [values[n] for n in kernel.runtime_inputs]
            _time_row(row, lambda: kernel.run(args, config), timer)
        else:      # runs through PyTorch, node by node, as the runtime does
            nodes = [graph[n] for n in group.nodes if graph[n].op not in ("input", "constant")]

            def run_nodes() -> None:
                for node in nodes:
                    get_op(node.op).run([values[i] for i in node.inputs], node.attrs)
            _time_row(row, run_nodes, timer)
        rows.append(row)
    return rows


def profile_model(model: torch.nn.Module, inputs: Sequence[torch.Tensor], config: FusionConfig,
                  timer: Timer | None = None, progress: Progress | None = None, name: str | None = None,
                  quiet: bool = True, floor_hardware: HardwareProfile | None = None) -> Profile:
    """Compile `model` with opfuse, then time every eager op and every opfuse kernel alone (module docstring).

    `inputs` are the benchmark's inputs (on the GPU, in the compute dtype); `timer` replaces the CUDA-graph timer
    (tests pass a fake one, which makes the whole function run on the CPU through Triton's interpreter). Floors
    take `floor_hardware`'s datasheet, by default the profile of the GPU the inputs are on (`hardware_of_gpu`), or
    the config's where it has none.
    """
    import opfuse
    from opfuse.analysis.roofline import workload_work

    compiled = opfuse.compile(model, inputs, config, quiet=quiet)
    if not hasattr(compiled, "analysis"):        # fallback="eager" gave the model back: nothing to profile
        raise GraphError(f"opfuse could not compile {name or type(model).__name__}: {compiled.reason}")
    analysis = compiled.analysis
    if floor_hardware is None and inputs and inputs[0].is_cuda:
        floor_hardware = hardware_of_gpu(torch.cuda.get_device_name(inputs[0].device))
    floor_hardware = floor_hardware or analysis.hardware
    ceilings = datasheet_ceilings(floor_hardware, analysis.config.dtype)
    profile = Profile(name or analysis.name, analysis.config.dtype, analysis.hardware,
                      analysis.config.density_threshold, hardware_key=analysis.config.hardware, compiled=compiled,
                      work=workload_work(analysis), ceilings=ceilings, floor_hardware=floor_hardware.name)
    compute = [x.to(getattr(torch, analysis.config.dtype)) if x.is_floating_point() else x for x in inputs]
    with torch.no_grad():
        values = graph_values(analysis.captured, compute)
        profile.eager = eager_rows(analysis, values, timer, progress, ceilings)
        del values
        runtime = compiled.compiled
        values = runtime.collect_values(*compute)
        profile.opfuse = opfuse_rows(runtime, values, analysis.hardware, analysis.config.dtype, timer, progress,
                                     ceilings)
        del values
    return profile


def measured_for_report(profile: Profile) -> dict[str, dict[str, Any]]:
    """{group name: {time, registers, spills, shared_memory, config}} of the timed opfuse kernels, in the form
    `opfuse.analysis.report.write_report(analysis, path, measured)` takes."""
    from opfuse.runtime.autotune import format_config

    runtime = profile.compiled.compiled
    measured: dict[str, dict[str, Any]] = {}
    for row in profile.opfuse:
        if row.measured is None:
            continue
        entry: dict[str, Any] = {"time": row.measured}
        kernel = runtime.kernels.get(row.name)
        if kernel is not None:
            info = kernel.last_compiled       # of the last run: the tuned config, just timed
            if info is not None:
                entry |= {"registers": info.registers, "spills": info.spills, "shared_memory": info.shared_bytes}
            if runtime.configs.get(row.name) is not None:
                entry["config"] = format_config(runtime.configs[row.name])
        measured[row.name] = {k: v for k, v in entry.items() if v is not None}
    return measured
