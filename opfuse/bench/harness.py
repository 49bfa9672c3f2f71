"""Measurement on a GPU, one fair protocol for every contender (issue 14).

Entry points: `run_workload(model, inputs, ...)`: one workload against every contender (eager, eager in a CUDA
graph, torch.compile in a CUDA graph, opfuse), shared by `opfuse bench`, benchmarks/run_all.py and
benchmarks/zoo.py; `measure(fn, inputs)` for one function alone; `torch_compiled(model, inputs)`.

The protocol:
- one set of inputs, one dtype (fp16 unless asked), channels-last image inputs and weights, for every contender
  (`prepare`); eval mode; cuDNN benchmark mode (set by the scripts); fixed-seed random weights, never zeros;
- every contender is compiled, warmed, captured into a CUDA graph and timed inside one `torch.inference_mode()`:
  torch.compile is compiled once, with inductor's freezing on, and never recompiles (warming or capturing it in
  grad mode would recompile it unfrozen, which made every torch.compile figure before issue 14 5-20% slow);
- timing rounds interleaved across contenders (A, B, C, A, B, C, ...: `timing.interleaved_samples`), each sample
  one forward between CUDA events; the median and the 10th-90th percentile spread are reported;
- opfuse is timed twice: through its module call (replay and output copies: what a user's call costs when it
  passes the tensors it first called with, which the graph borrowed; other tensors are copied in, about 13 us more
  at batch 1: benchmarks/call_overhead.py) and as its bare CUDA graph replay (as the other graphed contenders are
  timed);
- kernels per forward are counted by torch.profiler on what is timed (a graph replay is profiled kernel by
  kernel), copies and memsets left out; the relative error of each contender's output is taken against eager in
  the reference precision (float32 for fp16/bf16, float64 for fp32).
A row records opfuse's count of the workload's work (`work`: FLOPs, compulsory and planned bytes,
`opfuse.analysis.roofline.Work`), so its floor can be taken later on any GPU's datasheet: `row_roofline(row, hw)`
puts each contender's time against it (`opfuse bench`, ZOO.md). With measured ceilings (`measure_ceilings`: the
fp16 matrix rate and the copy bandwidth of this GPU), the row also holds the same floor at those rates
(`floor_ms`).

On the CPU (tests) the same code runs without graphs or kernel counts, timed by the host clock.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from opfuse.analysis.roofline import (Ceilings, Floor, Work, datasheet_ceilings, share_of_floor,
                                      workload_work)
from opfuse.bench.contenders import CONTENDER_LABELS, CONTENDERS, TIMED  # noqa: F401
from opfuse.bench.timing import (Forward, cuda_graphed, host_replay, interleaved_samples,  # noqa: F401
                                 kernel_profile, median_ms, summarize, timed_compile)


@dataclass
class Measurement:
    median_ms: float
    kernels: int | None           # CUDA kernels per forward (memcpy/memset excluded)
    gpu_busy_ms: float | None     # sum of kernel durations per forward
    peak_memory_mb: float
    compile_s: float = 0.0
    rel_error: float | None = None


def first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (list, tuple)):
        return first_tensor(out[0])
    if isinstance(out, dict):
        return first_tensor(next(iter(out.values())))
    raise TypeError(f"no tensor in {type(out).__name__}")


def measure(fn: Forward, inputs: Sequence[torch.Tensor], reference: torch.Tensor | None = None,
            compile_s: float = 0.0, profile_fn: Forward | None = None) -> Measurement:
    """Time `fn` alone (under inference mode); count kernels on `profile_fn` (default `fn`). Build and capture
    `fn` under inference mode too: a torch.compile'd function warmed in grad mode has been compiled unfrozen."""
    from opfuse.numerics import relative_error

    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        out = first_tensor(fn(*inputs))
        error = relative_error(out.float(), reference.float()) if reference is not None else None
        ms = median_ms(fn, inputs)
        kernels, busy = kernel_profile(profile_fn if profile_fn is not None else fn, inputs)
    peak = torch.cuda.max_memory_allocated() / 1e6
    return Measurement(ms, kernels, busy, peak, compile_s, error)


def frozen_inductor() -> contextlib.AbstractContextManager:
    """The setting torch.compile runs under in every benchmark: inductor's freezing on (the weights folded into the
    compiled graph as constants, as inductor does for inference; it takes effect only with grad mode off)."""
    import torch._inductor.config as inductor_config

    return inductor_config.patch(freezing=True)


def torch_compiled(model: torch.nn.Module, inputs: Sequence[torch.Tensor], backend: Any = "inductor",
                   warmup: int = 2) -> tuple[Forward, float]:
    """torch.compile(model), compiled and warmed under inference mode with freezing on; (fn, compile seconds).

    The caller must run (and capture) `fn` under inference mode as well, or dynamo compiles it again."""
    with frozen_inductor(), torch.inference_mode():
        compiled = torch.compile(model, backend=backend)
        start = time.perf_counter()
        compiled(*inputs)
        _synchronize(inputs)
        seconds = time.perf_counter() - start
        for _ in range(warmup):
            compiled(*inputs)
    return compiled, seconds


def _synchronize(inputs: Sequence[Any]) -> None:
    if any(isinstance(x, torch.Tensor) and x.is_cuda for x in inputs):
        torch.cuda.synchronize()


# ---- one workload, every contender -------------------------------------------------------------------------

def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and the fp16 matrix rate, measured on random data."""
    def rate(work: Callable[[], object], amount: float) -> float:
        for _ in range(3):
            work()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            work()
        end.record()
        end.synchronize()
        return amount * 10 / (start.elapsed_time(end) / 1e3)

    def copy_rate() -> float:
        x = torch.randn(1 << 28, device="cuda", dtype=torch.float16)     # 512 MiB
        y = torch.empty_like(x)
        return rate(lambda: y.copy_(x), 2 * x.numel() * x.element_size())

    def matrix_rate() -> float:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
        return rate(lambda: a @ b, 2 * 8192 ** 3)

    ceilings = {"copy_bytes_per_s": copy_rate(), "fp16_matrix_flops": matrix_rate()}
    torch.cuda.empty_cache()
    return ceilings


def prepare(model: torch.nn.Module, inputs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float16,
            device: str = "cuda") -> tuple[torch.nn.Module, tuple, torch.nn.Module, tuple]:
    """(model, inputs, reference model, reference inputs) on `device` by the protocol (`protocol_form`), the
    reference a copy in the reference precision."""
    from opfuse.ir.graph import dtype_name
    from opfuse.numerics import reference_dtype

    reference_type = reference_dtype(dtype_name(dtype))
    reference = copy.deepcopy(model).to(device=device, dtype=reference_type).eval()
    reference_inputs = tuple(x.to(device).to(reference_type) if x.is_floating_point() else x.to(device)
                             for x in inputs)
    return (*protocol_form(model, inputs, dtype, device), reference, reference_inputs)


def protocol_form(model: torch.nn.Module, inputs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float16,
                  device: str = "cuda") -> tuple[torch.nn.Module, tuple]:
    """(model, inputs) as every benchmark compiles them: on `device`, in `dtype`, channels-last when the model
    takes images. `opfuse analyze` of a built-in model captures this form too, so that it plans what bench runs
    (a model's code may depend on its dtype: transformers' T5 clamps its float16 activations).

    Channels-last applies to the 4-D parameters and buffers alone (a 5-D weight, a Conv3d's, has no such layout:
    `Module.to(memory_format=...)` raises on it, naming nothing). An error names the model part that raised it."""
    try:
        model = model.to(device=device, dtype=dtype).eval()
    except Exception as error:
        raise ValueError(f"preparing {type(model).__name__} ({dtype}, {device}): {_failing_part(model, device, dtype)}"
                         f"{type(error).__name__}: {error}") from error
    prepared = []
    images = False
    for x in inputs:
        x = x.to(device)
        if x.is_floating_point():
            x = x.to(dtype)
            if x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
                images = True
        prepared.append(x)
    if images:
        _channels_last(model)
    return model, tuple(prepared)


def _channels_last(model: torch.nn.Module) -> None:
    """Lay the model's 4-D parameters and buffers out channels-last, in place; an error names the tensor."""
    with torch.no_grad():
        for prefix, module in model.named_modules():
            for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
                for name, tensor in tensors.items():
                    if tensor is None or tensor.dim() != 4:
                        continue
                    try:
                        laid_out = tensor.contiguous(memory_format=torch.channels_last)
                    except Exception as error:
                        raise ValueError(f"making {kind} {prefix + '.' if prefix else ''}{name} "
                                         f"{list(tensor.shape)} of {type(module).__name__} channels-last: "
                                         f"{type(error).__name__}: {error}") from error
                    if kind == "parameter":
                        tensor.data = laid_out
                    else:
                        tensors[name] = laid_out


def _failing_part(model: torch.nn.Module, device: str, dtype: torch.dtype) -> str:
    """'parameter NAME [shape] (Module): ' of the first tensor that cannot move to `device` and `dtype`, or ''."""
    for prefix, module in model.named_modules():
        for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
            for name, tensor in tensors.items():
                if tensor is None:
                    continue
                try:
                    tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else tensor.dtype)
                except Exception:   # noqa: BLE001 - this tensor is the part to name
                    return f"{kind} {prefix + '.' if prefix else ''}{name} {list(tensor.shape)} of " \
                           f"{type(module).__name__}: "
    return ""


def floor_ms(analysis: Any, ceilings: dict[str, float]) -> tuple[float, float]:
    """(compute floor, memory floor) in ms of the workload's floor (`opfuse.analysis.roofline.Work.floor`) at the
    measured matrix rate and copy bandwidth instead of the datasheet's."""
    measured = workload_work(analysis).floor(Ceilings(ceilings["fp16_matrix_flops"], ceilings["copy_bytes_per_s"]))
    return measured.compute * 1e3, measured.memory * 1e3


@dataclass
class Built:
    """A contender ready to time: its timed forwards (label -> call), what to profile for its kernel count, its
    output (for the error), compile seconds, the extra memory it took, and facts for the result row."""

    forwards: dict[str, Callable[[], object]]
    profiled: Callable[[], object]
    output: torch.Tensor
    compile_s: float = 0.0
    memory_mb: float = 0.0          # the most memory it took at once while built (verification, tuning)
    held_mb: float = 0.0            # what it holds once built (its weights' copies, buffers, a CUDA graph's pool)
    row: dict = field(default_factory=dict)


def _build_eager(model, inputs, cuda: bool, **_: Any) -> Built:
    forward = lambda: model(*inputs)    # noqa: E731
    return Built({"eager": forward}, forward, first_tensor(forward()))


def _build_eager_graph(model, inputs, cuda: bool, **_: Any) -> Built:
    if not cuda:
        raise RuntimeError("a CUDA graph needs a CUDA device")
    replay = cuda_graphed(model, inputs)
    forward = lambda: replay()    # noqa: E731
    return Built({"eager_graph": forward}, forward, first_tensor(forward()))


def _build_inductor(model, inputs, cuda: bool, backend: Any = "inductor", **_: Any) -> Built:
    """torch.compile in a CUDA graph; where the graph cannot be captured (a model that reads a value back to the
    host, as transformers' grouped-GEMM fallback does), torch.compile without one, the best PyTorch path left
    beside eager, and the row says so (`INDUCTOR_GRAPH_ERROR`)."""
    compiled, seconds = torch_compiled(model, inputs, backend)
    row = {}
    with frozen_inductor():   # a recompile (there should be none) would be frozen too
        try:
            replay = (cuda_graphed if cuda else host_replay)(compiled, inputs)
        except RuntimeError as error:     # torch.AcceleratorError is one
            if not cuda:
                raise
            row[INDUCTOR_GRAPH_ERROR] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
            replay = lambda: compiled(*inputs)      # noqa: E731
    forward = lambda: replay()    # noqa: E731
    return Built({"inductor": forward}, forward, first_tensor(forward()), compile_s=seconds, row=row)


INDUCTOR_GRAPH_ERROR = "inductor_graph_error"     # a row's key: why torch.compile ran without a CUDA graph


def contender_label(row: dict, label: str) -> str:
    """How a result row's contender is named in a table: torch.compile says where it ran without a CUDA graph."""
    if label == "inductor" and row.get(INDUCTOR_GRAPH_ERROR):
        return "torch.compile (no CUDA graph: capture failed)"
    return CONTENDER_LABELS[label]


def _build_opfuse(model, inputs, cuda: bool, config: Any = None, ceilings: dict | None = None, **_: Any) -> Built:
    from opfuse.fusion.reasons import Code

    compiled, seconds = timed_compile(model, inputs, config)
    call = lambda: compiled(*inputs)    # noqa: E731
    for _ in range(1 + compiled.compiled.cuda_graph_warmup):    # the warm-up call(s), then the capture
        call()
    forwards = {"opfuse": call}
    graph = compiled.compiled._cuda_graph
    if graph is not None:
        forwards["opfuse_replay"] = graph.replay
    recorded = compiled.analysis.as_compiled      # what `opfuse.analyze` reports for this plan now
    row = {"plan_launches": compiled.plan.kernel_launches, "runtime_launches": compiled.launches,
           "analyze_launches": None if recorded is None else recorded.launches,
           "analyze_forward_ms": None if recorded is None else recorded.forward_ms,
           "fallbacks": {group: str(why) for group, why in compiled.fallbacks.items()},     # text, as earlier runs recorded it
           "library_anchors": compiled.compiled.library_anchors,
           "unfused": compiled.compiled.unfused, "opfuse_compile_seconds": compiled.seconds,
           "predicted_ms": compiled.analysis.fused.predicted_time * 1e3,
           "cuda_graph_error": compiled.compiled.cuda_graph_error,
           # fusions planned, then kept apart: every config of their kernel spilled, or it lost to its ops unfused
           "split_back": [d.reason for d in compiled.plan.decisions if d.code is Code.SPLIT_BACK],
           "replan": compiled.compiled.replan_note,      # the split back's measured kernels, and what was kept
           "tuning": tuning_rows(compiled), "precompiled": precompiled_counts(compiled),
           "work": asdict(workload_work(compiled.analysis))}      # the floor's counts (`row_roofline`)
    if ceilings:
        row["floor_compute_ms"], row["floor_memory_ms"] = floor_ms(compiled.analysis, ceilings)
    profiled = graph.replay if graph is not None else call
    return Built(forwards, profiled, first_tensor(call()), compile_s=seconds, row=row)


def precompiled_counts(compiled: Any) -> dict[str, int] | None:
    """What the compile workers did in an `opfuse.compile` result's tuning (`Precompiled`: launches, compiled,
    failed, built by the compiling process), or None where they did not run (no tuning, or everything cached)."""
    tuning = compiled.compiled.tuning
    return None if tuning is None or tuning.precompiled is None else dict(vars(tuning.precompiled))


def tuning_rows(compiled: Any) -> dict[str, dict]:
    """{group: kind, nodes, its anchor's op and shapes (inputs, output), planned time, the chosen form, every
    candidate's time in us, the rejected configs and why} of an `opfuse.compile` result's kernels: what the tuner
    measured, for tile and form rules to be read off whole runs."""
    from opfuse.runtime.autotune import TuningResult, format_config

    runtime, graph = compiled.compiled, compiled.plan.graph
    tuning = runtime.tuning if runtime.tuning is not None else TuningResult()
    rows = {}
    for group in compiled.plan.groups:
        if group.name not in runtime.kernels:
            continue
        chosen = runtime.configs.get(group.name)
        anchor = graph[group.anchor] if group.anchor else None
        rows[group.name] = {
            "kind": group.kind.value, "nodes": group.nodes, "planned_us": round(group.predicted_time * 1e6, 2),
            "anchor": None if anchor is None else {"op": anchor.op, "out": list(anchor.type.shape),
                                                   "inputs": [list(graph[i].type.shape) for i in anchor.inputs]},
            "chosen": format_config(chosen) if chosen is not None else None,
            "timings_us": {format_config(c): round(t * 1e6, 2)
                           for c, t in tuning.timings.get(group.name, {}).items()},
            "rejected": {format_config(c): r
                         for c, r in tuning.rejected.get(group.name, {}).items()},
            "over_budget": tuning.over_budget.get(group.name)}
    return rows


BUILDERS = {"eager": _build_eager, "eager_graph": _build_eager_graph, "inductor": _build_inductor,
            "opfuse": _build_opfuse}


def _build_contenders(model, inputs, contenders, config, ceilings, compile_backend, cuda, row, on_step,
                      variants) -> dict[str, Built]:
    """Build each contender (and each opfuse variant) in the table's order; one that fails records its error in
    `row` and the others go on."""
    built: dict[str, Built] = {}
    for label in CONTENDERS:          # always in this order: the table reads left to right
        if label not in contenders:
            continue
        if on_step is not None:
            on_step(label)
        before = torch.cuda.memory_allocated() if cuda else 0
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        try:
            built[label] = BUILDERS[label](model, inputs, cuda, config=config, ceilings=ceilings,
                                           backend=compile_backend)
            if cuda:
                built[label].memory_mb = (torch.cuda.max_memory_allocated() - before) / 1e6
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
        gc.collect()
        if cuda and label in built:
            built[label].held_mb = (torch.cuda.memory_allocated() - before) / 1e6
    for label, variant in variants.items():
        if on_step is not None:
            on_step(label)
        try:
            opfuse_built = _build_opfuse(model, inputs, cuda, config=variant)
            built[label] = Built({label: opfuse_built.forwards["opfuse"]}, opfuse_built.profiled,
                                 opfuse_built.output, compile_s=opfuse_built.compile_s,
                                 row={f"{label}_launches": opfuse_built.row["runtime_launches"]})
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
    return built


def _record_contenders(row, built, samples, failed, reference, cuda) -> None:
    """Write each built contender's timing summary, kernels, memory, compile time and error against the reference
    into `row` (its error where it failed while timed or profiled)."""
    from opfuse.numerics import relative_error

    for label, contender in built.items():
        row.update(contender.row)
        try:
            if label in failed:
                raise RuntimeError(f"failed while timed: {failed[label]}")
            kernels, busy = kernel_profile(lambda: contender.profiled(), ()) if cuda else (None, None)
            row[label] = asdict(summarize(samples[label])) | {
                "kernels": kernels, "gpu_busy_ms": busy, "peak_memory_mb": contender.memory_mb,
                "held_memory_mb": contender.held_mb, "compile_s": contender.compile_s,
                "rel_error": relative_error(contender.output.float(), reference)}
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()


def run_workload(model: torch.nn.Module, inputs: Sequence[torch.Tensor], workload: str, ceilings: dict[str, float],
                 contenders: Sequence[str], config: Any, on_step: Callable[[str], None] | None = None, *,
                 device: str = "cuda", compile_backend: Any = "inductor", rounds: int = 20, per_round: int = 5,
                 variants: Mapping[str, Any] | None = None) -> dict:
    """Measure one workload against each contender (`CONTENDERS`) by the protocol of the module docstring; a
    contender that fails records its error and the others go on.

    `config` is the opfuse FusionConfig (its dtype is the protocol's dtype); `on_step(label)` is called before each
    contender is built and with "timing" before the interleaved rounds (progress display); `compile_backend` is
    torch.compile's backend (tests pass a counting one). Returns the row run_all.py, zoo.py and `opfuse bench`
    write as JSON: per contender median_ms, p10_ms, p90_ms, samples, kernels, gpu_busy_ms, peak_memory_mb (the
    most extra memory it took at once while built), held_memory_mb (the extra memory it holds once built),
    compile_s, rel_error; "opfuse_replay" the bare replay's timing. `variants` (label -> FusionConfig): opfuse
    compiled again under each config, timed in the same rounds through its module call, its row under its label
    (`switched_configs` makes them from switch settings: A/B of a switch across models in one process).
    """
    from opfuse.ir.graph import torch_dtype

    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contenders {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    cuda = torch.device(device).type == "cuda"
    torch.manual_seed(0)
    # each workload starts from a fresh dynamo: an earlier workload's torch.compile of the same model class must
    # not leave it recompiling with dynamic shapes (run 3 on the H200: bert-base bs64 after bs1 exported a SymInt)
    torch._dynamo.reset()
    model, inputs, reference_model, reference_inputs = prepare(model, inputs, torch_dtype(config.dtype), device)
    row: dict = {"workload": workload, "dtype": config.dtype, "protocol": "fair (issue 14)"}
    with torch.inference_mode():
        reference = first_tensor(reference_model(*reference_inputs)).float()
        del reference_model
        built = _build_contenders(model, inputs, contenders, config, ceilings, compile_backend, cuda, row, on_step,
                                  variants or {})
        if on_step is not None:
            on_step("timing")
        forwards = {name: fn for label in built for name, fn in built[label].forwards.items()}
        failed: dict[str, str] = {}
        samples = interleaved_samples(forwards, rounds=rounds, per_round=per_round, cuda=cuda, errors=failed)
        _record_contenders(row, built, samples, failed, reference, cuda)
        if samples.get("opfuse_replay"):
            row["opfuse_replay"] = asdict(summarize(samples["opfuse_replay"]))
            row["opfuse_replay_ms"] = row["opfuse_replay"]["median_ms"]
        elif "opfuse_replay" in failed:
            row["opfuse_replay"] = {"error": failed["opfuse_replay"]}
    del built, forwards
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


def variant_switches(variant: str) -> dict[str, bool]:
    """The FusionConfig switches of a variant written as `switch=0|1` settings joined by "+" (`dependent_launch=0`,
    `norm_prologue=1+split_k=0`); `default` is none."""
    if variant == "default":
        return {}
    return {key: bool(int(value)) for key, value in (part.split("=") for part in variant.split("+"))}


def switched_configs(config: Any, variants: Sequence[str]) -> dict[str, Any]:
    """{"opfuse:" + variant: `config` with the variant's switches (`variant_switches`)}."""
    from dataclasses import replace

    return {f"opfuse:{variant}": replace(config, **variant_switches(variant)) for variant in variants}


def pytorch_group_count(row: dict) -> int | None:
    """How many of opfuse's groups ran through PyTorch in a result row (views, which launch nothing, not counted);
    None when opfuse did not compile."""
    if "fallbacks" not in row:
        return None
    return sum(1 for reason in row["fallbacks"].values() if not reason.startswith("view"))


def failed_contenders(row: dict) -> dict[str, str]:
    """{contender: error} for the contenders of a result row that failed."""
    return {label: row[label]["error"] for label in CONTENDERS if "error" in row.get(label, {})}


def speedup(row: dict, baseline: str, contender: str = "opfuse") -> float | None:
    """How many times faster `contender` ran than `baseline` in one result row (None when either failed)."""
    base, other = row.get(baseline, {}), row.get(contender, {})
    if "median_ms" not in base or "median_ms" not in other or not other["median_ms"]:
        return None
    return base["median_ms"] / other["median_ms"]


BASELINES = ("eager", "eager_graph", "inductor")     # the contenders that are not opfuse


def best_baseline(row: dict) -> str | None:
    """The fastest baseline of a result row (lowest median), or None when none was measured."""
    timed = [label for label in BASELINES if "median_ms" in row.get(label, {})]
    return min(timed, key=lambda label: row[label]["median_ms"]) if timed else None


def fewest_launches(row: dict) -> int | None:
    """The fewest kernels per forward any contender of a result row was counted launching (the profiler's count;
    the plan's launches where nothing was counted): the launches a workload's launch-and-bandwidth floor grants,
    a count some compiler reached on it."""
    counts = [row[label]["kernels"] for label in CONTENDERS if (row.get(label) or {}).get("kernels")]
    return min(counts) if counts else row.get("plan_launches")


@dataclass(frozen=True)
class RowRoofline:
    """A result row against its workload's floor on one GPU's datasheet (`row_roofline`)."""

    hardware: str                     # the profile's name
    floor: Floor                      # the workload's, `fewest_launches` granted
    plan_floor: Floor | None          # of the fused plan's bytes; None where the row ran another plan
    shares: dict[str, float]          # contender (TIMED) -> floor.roofline / its median
    launch_shares: dict[str, float]   # contender -> floor.launch_and_bandwidth / its median
    best_baseline: str | None

    def to_dict(self) -> dict[str, Any]:
        return {"hardware": self.hardware, "floor": self.floor.to_dict(),
                "plan_floor": None if self.plan_floor is None else self.plan_floor.to_dict(),
                "share_of_roofline": self.shares, "share_of_launch_and_bandwidth": self.launch_shares,
                "best_baseline": self.best_baseline}


def work_of_row(row: dict) -> Work | None:
    """The `opfuse.analysis.roofline.Work` a result row recorded, or None (rows before it was recorded)."""
    return Work(**row["work"]) if isinstance(row.get("work"), dict) else None


def row_roofline(row: dict, hw: Any, work: Work | None = None) -> RowRoofline | None:
    """Every timed contender of a result row as a share of the workload's floor on `hw`'s datasheet
    (`opfuse.analysis.roofline`) at the row's dtype: the roofline's, and the launch-and-bandwidth floor's with
    the `fewest_launches` of the row. `work` (the workload's `Work`) defaults to the row's own; None without one.
    The plan's floor is given only where the row's plan is the one counted (same launches)."""
    work = work if work is not None else work_of_row(row)
    if work is None:
        return None
    ceilings = datasheet_ceilings(hw, row.get("dtype", "float16"))
    workload = work.floor(ceilings, fewest_launches(row) or 0)
    plan = work.plan_floor(ceilings) if row.get("plan_launches") == work.plan_launches else None
    shares, launch_shares = {}, {}
    for label in TIMED:
        seconds = (row.get(label) or {}).get("median_ms")
        seconds = None if seconds is None else seconds / 1e3
        for into, figure in ((shares, workload.roofline), (launch_shares, workload.launch_and_bandwidth)):
            value = share_of_floor(figure, seconds)
            if value is not None:
                into[label] = value
    return RowRoofline(hw.name, workload, plan, shares, launch_shares, best_baseline(row))


def geometric_mean(values: Sequence[float]) -> float | None:
    values = [v for v in values if v is not None and v > 0]
    return statistics.geometric_mean(values) if values else None


def start_gpu_run(script: str, out: str) -> Path | None:
    """A benchmark script's start on the GPU: None (after saying so on stderr) without CUDA, else cuDNN's benchmark
    mode on and the output folder `out` made and returned."""
    if not torch.cuda.is_available():
        print(f"{script} needs an NVIDIA GPU (CUDA): torch.cuda.is_available() is False", file=sys.stderr)
        return None
    torch.backends.cudnn.benchmark = True
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment() -> dict[str, str]:
    """Date, GPU, driver, torch, triton and Python versions, for the results' header."""
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        driver = "?"
    import triton

    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "driver": driver, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}
