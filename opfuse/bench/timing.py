"""Timing primitives shared by every benchmark: one clock, CUDA graphs, interleaved rounds, kernel counts.

Entry points: `interleaved_samples(forwards, rounds, per_round) -> {name: [ms, ...]}` (contenders timed in turns,
A, B, C, A, B, C, ..., so that clock drift, thermal state and other tenants weigh on all of them alike),
`summarize(samples) -> Timing` (median and spread), `cuda_graphed(fn, inputs)`, `kernel_profile(fn, inputs)` and
`median_ms(fn, inputs)` for one function alone, `graphed_call_us(fn, repeat)` for one kernel's call;
`timed_compile(model, inputs, config)` for opfuse's compile.

A sample is one forward between two CUDA events, the GPU idle before it (the previous sample synchronised): it
measures latency as a caller sees it, host work before the launches included. On the CPU (tests) the clock is
`time.perf_counter` around the call and nothing is captured into a graph.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import torch

Forward = Callable[..., object]


@dataclass(frozen=True)
class Timing:
    """Milliseconds per forward over all samples: median, 10th and 90th percentiles, and how many samples."""

    median_ms: float
    p10_ms: float
    p90_ms: float
    samples: int

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: 0.05 means the middle 80% of samples lie within 5% of the median's size."""
        return spread_of(self.__dict__) or 0.0


def spread_of(entry: Mapping[str, float]) -> float | None:
    """`Timing.spread` of a result row's entry (its JSON: median_ms, p10_ms, p90_ms); None without them."""
    if "p10_ms" not in entry or not entry.get("median_ms"):
        return None
    return (entry["p90_ms"] - entry["p10_ms"]) / entry["median_ms"]


def summarize(samples: Sequence[float]) -> Timing:
    if not samples:
        raise ValueError("no samples to summarize")
    ordered = sorted(samples)

    def percentile(q: float) -> float:       # nearest rank: a value that was measured, never an interpolation
        return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]

    return Timing(statistics.median(ordered), percentile(0.1), percentile(0.9), len(ordered))


def time_once(fn: Callable[[], object], cuda: bool) -> float:
    """Milliseconds of one call of `fn`, starting from an idle device."""
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def interleaved_samples(forwards: Mapping[str, Callable[[], object]], rounds: int = 20, per_round: int = 5,
                        warmup_rounds: int = 1, cuda: bool | None = None,
                        errors: dict[str, str] | None = None) -> dict[str, list[float]]:
    """Milliseconds per call of each forward, timed in turns: each round calls every forward once untimed (its
    weights back into L2 after the other contenders' turns: each contender holds its own copy of them), then times
    `per_round` calls of it, in the mapping's order; the first `warmup_rounds` rounds are thrown away.

    A forward that raises is dropped from the rounds and has no samples; with `errors` given, its error is recorded
    there (name -> "Type: message") and the others go on, else the exception propagates."""
    if cuda is None:
        cuda = torch.cuda.is_available()
    samples: dict[str, list[float]] = {name: [] for name in forwards}
    failed: dict[str, str] = {}
    for round_index in range(warmup_rounds + rounds):
        for name, fn in forwards.items():
            if name in failed:
                continue
            try:
                fn()
                if cuda:
                    torch.cuda.synchronize()
                times = [time_once(fn, cuda) for _ in range(per_round)]
            except Exception as error:
                if errors is None:
                    raise
                failed[name] = f"{type(error).__name__}: {error}"
                samples[name] = []
                continue
            if round_index >= warmup_rounds:
                samples[name].extend(times)
    if errors is not None:
        errors.update(failed)
    return samples


def host_replay(fn: Forward, inputs: Sequence[torch.Tensor], warmup: int = 3) -> Forward:
    """What `cuda_graphed` does, on the CPU (tests): `fn` called `warmup` times, as a capture warms it, then a
    callable that runs it again on `inputs`."""
    for _ in range(warmup):
        fn(*inputs)
    return lambda *_: fn(*inputs)


def median_ms(fn: Forward, inputs: Sequence[torch.Tensor], warmup: int = 10, iters: int = 50) -> float:
    """Median of event-timed forwards of one function after warm-up (for a contender alone; comparisons between
    contenders use `interleaved_samples`)."""
    for _ in range(warmup):
        fn(*inputs)
    samples = interleaved_samples({"fn": lambda: fn(*inputs)}, rounds=1, per_round=iters, warmup_rounds=0)
    return statistics.median(samples["fn"])


def graphed_call_us(fn: Callable[[], object], repeat: int) -> float:
    """Microseconds per call of `fn` (no arguments): `repeat` calls captured in one CUDA graph, so that the graph's
    own launch is spread over them, timed by `median_ms` of 30 replays after 5."""
    def repeated() -> object:
        for _ in range(repeat):
            out = fn()
        return out

    replay = cuda_graphed(repeated, [])
    return median_ms(replay, [], warmup=5, iters=30) * 1e3 / repeat


def cuda_graphed(fn: Forward, inputs: Sequence[torch.Tensor], warmup: int = 3) -> Forward:
    """`fn` captured once into a CUDA graph over `inputs`; the returned callable replays it (same input buffers)
    and returns the graph's static output. Capture under the grad mode the forward will be timed in: a
    torch.compile'd `fn` warmed in another mode recompiles (issue 14)."""
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


def kernel_profile(fn: Forward, inputs: Sequence[torch.Tensor], runs: int = 3) -> tuple[int, float]:
    """(kernels per call, GPU busy ms per call) of `fn` from torch.profiler; copies and memsets are not kernels.
    A CUDA graph replay is profiled kernel by kernel, so this counts what a replay really launches."""
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


def timed_compile(model: torch.nn.Module, inputs: Sequence[torch.Tensor], config: object,
                  profile_to: str | None = None) -> tuple[object, float]:
    """(`opfuse.compile(model, inputs, config)`, its seconds); with `profile_to`, the compile runs under cProfile
    and its statistics are written there (`python -m pstats`), after the seconds are taken."""
    import cProfile

    import opfuse

    profiler = cProfile.Profile() if profile_to else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    compiled = opfuse.compile(model, inputs, config)
    seconds = time.perf_counter() - start
    if profiler:
        profiler.disable()
        profiler.dump_stats(profile_to)
    return compiled, seconds
