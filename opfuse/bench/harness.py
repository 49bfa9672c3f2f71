"""Measurement on a GPU, one protocol for every contender: CUDA-event medians after warm-up, kernels per forward
and GPU busy time from torch.profiler, peak memory, and the relative error against an eager reference.

Entry points: `measure(fn, inputs) -> Measurement`, `cuda_graphed(fn, inputs)`, `torch_compiled(model, inputs)`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

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
