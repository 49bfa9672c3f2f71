"""How the autotuner times a kernel: `cuda_median_time` (a CUDA graph of back-to-back calls, `graph_time`), and
`ColdClock` for the kernels that stream their weights (`cold_groups`, FusionConfig.tune_cold): each call after L2
is scrubbed, as a forward whose weights outgrow L2 finds them. `timing_available` says where anything is timed."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from opfuse.codegen.base import GroupKernel
from opfuse.config import FusionConfig
from opfuse.environment import triton_interpreter
from opfuse.runtime.gate import CAPTURE_GATE


def timing_available(device: torch.device | str) -> bool:
    """Whether kernels on `device` can be timed: a real GPU, not Triton's interpreter."""
    return torch.device(device).type == "cuda" and torch.cuda.is_available() and not triton_interpreter()


def recover_rng_after_failed_capture(device_index: int | None = None) -> None:
    """Undo what a CUDA graph capture that raised leaves behind in PyTorch (seen with torch 2.11):
    CUDAGraph.capture_end throws before its epilogue, so the device's default RNG stays marked as capturing (every
    later torch.randn on the device then fails); give it a fresh copy of its own state (same seed and offset)."""
    try:
        index = device_index if device_index is not None else torch.cuda.current_device()
        generator = torch.cuda.default_generators[index]
        generator.graphsafe_set_state(generator.clone_state())
    except Exception:   # other torch versions may not need it, or spell it differently
        pass


GRAPH_WINDOW_S = 1e-3     # GPU time one timed graph replay aims at: calls of fn per graph = this / a call's time
GRAPH_MAX_CALLS = 100     # at most this many calls per graph (a microsecond kernel, whose estimate is the host's)
GRAPH_REPLAYS = 5         # timed replays; their median is the time


def cuda_median_time(fn: Callable[[], Any]) -> float:
    """Median seconds per call of fn, replayed in a CUDA graph as the compiled model runs it (`graph_time`): timed
    by plain launches, a microsecond kernel measures the host's launch cost, which would favour one-launch forms
    over two-launch ones (split-K, library) that the graph runs just as fast; where fn cannot be captured, plain
    launches (do_bench)."""
    from triton.testing import do_bench

    torch.cuda.synchronize()    # the side stream the graph is captured on must see the inputs finished
    try:
        return graph_time(fn)
    except Exception:   # not capturable: plain launches (this kernel's other candidates may be graph-timed)
        recover_rng_after_failed_capture()
        torch.cuda.synchronize()
        return do_bench(fn, warmup=5, rep=20, return_mode="median") / 1e3


class ColdClock:
    """Median seconds per call of fn with nothing of its previous call left in L2 (FusionConfig.tune_cold): each call
    of the graph `graph_time` replays follows a read of a buffer twice the device's L2, whose own time (measured
    once) is taken off. Where fn cannot be captured, `cuda_median_time` (warm L2)."""

    def __init__(self, device: torch.device):
        size = 2 * torch.cuda.get_device_properties(device).L2_cache_size
        self.scrub = torch.empty(size // 2, dtype=torch.float16, device=device).normal_()
        self.read_s = graph_time(self.read)

    def read(self) -> None:
        self.scrub.sum()

    def __call__(self, fn: Callable[[], Any]) -> float:
        def cold() -> None:
            self.read()
            fn()

        torch.cuda.synchronize()
        try:
            return max(graph_time(cold) - self.read_s, 0.0)
        except Exception:
            recover_rng_after_failed_capture()
            return cuda_median_time(fn)


def cold_groups(kernels: Sequence[GroupKernel], l2_bytes: int) -> set[str]:
    """The groups the tuner times cold (`ColdClock`): none where the kernels' constant inputs fit in L2 together
    (a forward may find them there again), else those whose constants are at least half the bytes they read
    (a GEMM of a few rows streams its weights: warm, a weight of 12 MB times as if read from L2)."""
    def constant_bytes(kernel: GroupKernel) -> int:
        return sum(kernel.graph[v].type.nbytes for v in kernel.group.inputs if kernel.graph.is_constant(v))

    if sum(map(constant_bytes, kernels)) <= l2_bytes:
        return set()
    return {k.group.name for k in kernels if 2 * constant_bytes(k) >= max(k.group.bytes_read, 1)}


def cold_set(kernels: Sequence[GroupKernel], config: FusionConfig, gpu: torch.device | None) -> set[str]:
    """`cold_groups` on `gpu`'s L2 where FusionConfig.tune_cold asks for it and the GPU times, else none."""
    if not config.tune_cold or gpu is None or not timing_available(gpu):
        return set()
    return cold_groups(kernels, torch.cuda.get_device_properties(gpu).L2_cache_size)


def graph_time(fn: Callable[[], Any]) -> float:
    """Seconds per call of fn: a CUDA graph of n calls (n from three plain calls' time, so that a replay runs about
    GRAPH_WINDOW_S, at most GRAPH_MAX_CALLS), then the median over GRAPH_REPLAYS of one replay's time over n, each
    timed replay queued behind an untimed one (timed from an idle GPU, a replay would include its launch latency,
    which weighs more on forms with fewer calls per graph). A model has a hundred kernels of microseconds to tune:
    Triton's do_bench_cudagraph spends 100 ms of replays and a graph of up to a thousand calls on each."""
    import statistics

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            fn()
        end.record()
        end.synchronize()
        estimate_s = max(start.elapsed_time(end) / 3 / 1e3, 1e-7)
        calls = max(1, min(GRAPH_MAX_CALLS, int(GRAPH_WINDOW_S / estimate_s)))
        graph = torch.cuda.CUDAGraph()
        with CAPTURE_GATE.exclusive(), torch.cuda.graph(graph, stream=stream):   # no model's call meanwhile
            for _ in range(calls):
                fn()
        times = []
        for _ in range(GRAPH_REPLAYS):
            graph.replay()      # queued ahead of the timed one, so its launch latency is not timed
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
    torch.cuda.current_stream().wait_stream(stream)
    return statistics.median(times)
