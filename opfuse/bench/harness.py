"""Measurement on a GPU, one protocol for every contender: CUDA-event medians after warm-up, kernels per forward
and GPU busy time from torch.profiler, peak memory, and the relative error against an eager reference.

Entry points: `measure(fn, inputs) -> Measurement`, `cuda_graphed(fn, inputs)`, `torch_compiled(model, inputs)`,
and `run_workload(model, inputs, ...)`: one workload against every contender (eager, eager in a CUDA graph,
torch.compile in a CUDA graph, opfuse), shared by `opfuse bench` and benchmarks/run_all.py.

Protocol (issue 4): fp16 (or the dtype asked for), channels-last image inputs, cudnn.benchmark, eval, inference
mode, fixed-seed random weights (never zeros), relative error against eager in the reference precision (float32
for fp16/bf16, float64 for fp32). The floor of a workload is its FLOPs over the measured fp16 matrix rate and its
fewest bytes (weights, inputs and outputs once) over the measured copy bandwidth (`measure_ceilings`).
"""

from __future__ import annotations

import copy
import datetime
import gc
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

Forward = Callable[..., object]


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


def median_ms(fn: Forward, inputs: Sequence[torch.Tensor], warmup: int = 10, iters: int = 50) -> float:
    """Median of event-timed forwards after warm-up."""
    for _ in range(warmup):
        fn(*inputs)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*inputs)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_profile(fn: Forward, inputs: Sequence[torch.Tensor], runs: int = 3) -> tuple[int, float]:
    """(kernels per forward, GPU busy ms per forward) from torch.profiler; copies and memsets are not kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn(*inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            fn(*inputs)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.lower().startswith(("memcpy", "memset"))]
    busy_us = sum(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
                  for e in kernels)
    return round(len(kernels) / runs), busy_us / runs / 1e3


def measure(fn: Forward, inputs: Sequence[torch.Tensor], reference: torch.Tensor | None = None,
            compile_s: float = 0.0, profile_fn: Forward | None = None) -> Measurement:
    """Time `fn`; count kernels on `profile_fn` (default `fn`; pass the un-graphed forward for graph-replayed fns)."""
    from opfuse.numerics import relative_error

    torch.cuda.reset_peak_memory_stats()
    with torch.inference_mode():
        out = first_tensor(fn(*inputs))
        error = relative_error(out.float(), reference.float()) if reference is not None else None
        ms = median_ms(fn, inputs)
        kernels, busy = kernel_profile(profile_fn if profile_fn is not None else fn, inputs)
    peak = torch.cuda.max_memory_allocated() / 1e6
    return Measurement(ms, kernels, busy, peak, compile_s, error)


def cuda_graphed(fn: Forward, inputs: Sequence[torch.Tensor], warmup: int = 3) -> Forward:
    """`fn` captured once into a CUDA graph over `inputs`; the returned callable replays it (same input buffers)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn(*inputs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fn(*inputs)

    def replay(*_: torch.Tensor) -> object:
        graph.replay()
        return static_out

    return replay


def torch_compiled(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> tuple[Forward, float]:
    """torch.compile (inductor, freezing on), warmed up; returns (fn, compile seconds)."""
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    compiled = torch.compile(model)
    start = time.perf_counter()
    with torch.inference_mode():
        compiled(*inputs)
        torch.cuda.synchronize()
    return compiled, time.perf_counter() - start


# ---- one workload, every contender -------------------------------------------------------------------------

CONTENDERS = ("eager", "eager_graph", "inductor", "opfuse")
CONTENDER_LABELS = {"eager": "eager", "eager_graph": "eager + CUDA graph",
                    "inductor": "torch.compile + CUDA graph", "opfuse": "opfuse"}


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


def prepare(model: torch.nn.Module, inputs: Sequence[torch.Tensor], dtype: torch.dtype = torch.float16
            ) -> tuple[torch.nn.Module, tuple, torch.nn.Module, tuple]:
    """(model, inputs, reference model, reference inputs) on the GPU by the protocol: the model in `dtype` and
    channels-last when it takes images, the reference a copy in the reference precision."""
    from opfuse.ir.graph import dtype_name
    from opfuse.numerics import reference_dtype

    reference_type = reference_dtype(dtype_name(dtype))
    reference = copy.deepcopy(model).to(device="cuda", dtype=reference_type).eval()
    reference_inputs = tuple(x.cuda().to(reference_type) if x.is_floating_point() else x.cuda() for x in inputs)
    model = model.to(device="cuda", dtype=dtype).eval()
    prepared = []
    for x in inputs:
        x = x.cuda()
        if x.is_floating_point():
            x = x.to(dtype)
            if x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
                model = model.to(memory_format=torch.channels_last)
        prepared.append(x)
    return model, tuple(prepared), reference, reference_inputs


def floor_ms(analysis: Any, ceilings: dict[str, float]) -> tuple[float, float]:
    """(compute floor, memory floor) in ms: the model's FLOPs over the measured matrix rate, and the fewest bytes
    (every weight, input and output once) over the measured copy bandwidth."""
    graph = analysis.prepared
    minimal = sum(n.type.nbytes for n in graph if n.op in ("constant", "input"))
    minimal += sum(graph[o].type.nbytes for o in graph.outputs)
    return (analysis.unfused.flops / ceilings["fp16_matrix_flops"] * 1e3,
            minimal / ceilings["copy_bytes_per_s"] * 1e3)


def run_workload(model: torch.nn.Module, inputs: Sequence[torch.Tensor], workload: str, ceilings: dict[str, float],
                 contenders: Sequence[str], config: Any, on_step: Callable[[str], None] | None = None) -> dict:
    """Measure one workload against each contender (`CONTENDERS`); a contender that fails records its error.

    `config` is the opfuse FusionConfig (its dtype is the protocol's dtype); `on_step(contender)` is called before
    each contender runs (progress display). Returns the row run_all.py and `opfuse bench` write as JSON.
    """
    import opfuse
    from opfuse.ir.graph import torch_dtype

    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contenders {sorted(unknown)}; known: {', '.join(CONTENDERS)}")
    torch.manual_seed(0)
    # each workload starts from a fresh dynamo: an earlier workload's torch.compile of the same model class must
    # not leave it recompiling with dynamic shapes (run 3 on the H200: bert-base bs64 after bs1 exported a SymInt)
    torch._dynamo.reset()
    model, inputs, reference_model, reference_inputs = prepare(model, inputs, torch_dtype(config.dtype))
    with torch.inference_mode():
        reference = first_tensor(reference_model(*reference_inputs)).float()
    del reference_model
    row: dict = {"workload": workload, "dtype": config.dtype}

    def record(label: str, fn: Callable[[], Measurement]) -> None:
        if on_step is not None:
            on_step(label)
        try:
            row[label] = asdict(fn())
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()

    def inductor() -> Measurement:
        compiled, seconds = torch_compiled(model, inputs)
        return measure(cuda_graphed(compiled, inputs), inputs, reference, compile_s=seconds, profile_fn=compiled)

    def run_opfuse() -> Measurement:
        start = time.perf_counter()
        compiled = opfuse.compile(model, inputs, config)
        seconds = time.perf_counter() - start
        row["plan_launches"] = compiled.plan.kernel_launches
        row["runtime_launches"] = compiled.launches
        row["fallbacks"] = compiled.fallbacks
        row["library_anchors"] = compiled.compiled.library_anchors
        row["unfused"] = compiled.compiled.unfused
        row["opfuse_compile_seconds"] = compiled.seconds
        row["floor_compute_ms"], row["floor_memory_ms"] = floor_ms(compiled.analysis, ceilings)
        result = measure(compiled, inputs, reference, compile_s=seconds)
        graph = compiled.compiled._cuda_graph
        if graph is not None:   # the replay alone, as the other graphed contenders are timed: the rest is host work
            row["opfuse_replay_ms"] = median_ms(lambda *_: graph.replay(), inputs)
        compiled.compiled.set_cuda_graph(False)     # count kernels on the un-graphed forward
        with torch.inference_mode():
            result.kernels, result.gpu_busy_ms = kernel_profile(compiled, inputs)
        row["cuda_graph_error"] = compiled.compiled.cuda_graph_error
        return result

    runs = {"eager": lambda: measure(model, inputs, reference),
            "eager_graph": lambda: measure(cuda_graphed(model, inputs), inputs, reference, profile_fn=model),
            "inductor": inductor, "opfuse": run_opfuse}
    for label in CONTENDERS:          # always in this order: the table reads left to right
        if label in contenders:
            record(label, runs[label])
    return row


def failed_contenders(row: dict) -> dict[str, str]:
    """{contender: error} for the contenders of a result row that failed."""
    return {label: row[label]["error"] for label in CONTENDERS if "error" in row.get(label, {})}


def speedup(row: dict, baseline: str, contender: str = "opfuse") -> float | None:
    """How many times faster `contender` ran than `baseline` in one result row (None when either failed)."""
    base, other = row.get(baseline, {}), row.get(contender, {})
    if "median_ms" not in base or "median_ms" not in other or not other["median_ms"]:
        return None
    return base["median_ms"] / other["median_ms"]


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
