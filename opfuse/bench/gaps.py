"""Where a CUDA graph replay idles: `idle_gaps(activities)` (pure) and `replay_activities(replay)` (GPU).

The bench table's GPU busy time counts kernels only. A replay that takes longer than its kernels either idles
between them or spends the difference in copies and memsets, which the busy time leaves out. `replay_activities`
records every GPU activity of one replay with torch.profiler; `idle_gaps` lists the holes between them (activities
that overlap count as one stretch of work), each with the activities on both sides, so the largest ones can be
traced to the group that causes them. `summarize` gives the totals that explain replay time = work + idle, and
`by_family` the kernel time per family of kernel (`kernel_family`), so two compilers' replays of one model compare
at a glance: opfuse's fused, flat and split-K kernels, inductor's Triton kernels, the libraries', PyTorch's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

COPY_PREFIXES = ("memcpy", "memset")


@dataclass(frozen=True)
class Activity:
    """One GPU activity of a replay: a kernel, a copy or a memset, in microseconds."""

    name: str
    start: float
    end: float

    @property
    def is_copy(self) -> bool:
        return self.name.lower().startswith(COPY_PREFIXES)


@dataclass(frozen=True)
class Gap:
    """Idle time between the end of all work started before it and the next activity."""

    before: str
    after: str
    microseconds: float


# (family, name prefixes): opfuse names its kernels <prefix>_<ops>_<hash> (`opfuse.codegen.base.load_kernel`),
# inductor triton_<kind>_fused_...; cuBLAS, cuDNN and CUTLASS kernels by their own conventions
FAMILIES = (
    ("copy/memset", ("memcpy", "memset")),
    ("opfuse fused", ("fused_",)),
    ("opfuse flat epilogue", ("flat_",)),
    ("opfuse split-K", ("splitk_",)),
    ("inductor triton", ("triton_",)),
    ("PyTorch ATen", ("void at::", "at::")),
    ("cuBLAS", ("nvjet", "void cublas", "cublas", "gemv", "gemmk", "sm90_xmma_gemm", "sm80_xmma_gemm")),
    ("cuDNN/CUTLASS", ("sm90_xmma", "sm80_xmma", "sm75_xmma", "conv2d_", "void cutlass", "cutlass", "cudnn",
                       "void implicit_convolve", "implicit_convolve", "void cudnn")),
)


def kernel_family(name: str) -> str:
    """Which family a GPU activity of a replay belongs to, by its name (`FAMILIES`); "other" when none."""
    lowered = name.lower()
    for family, prefixes in FAMILIES:
        if lowered.startswith(tuple(prefix.lower() for prefix in prefixes)):
            return family
    return "other"


def by_family(activities: Sequence[Activity]) -> dict[str, dict[str, float]]:
    """{family: {"count", "us"}} over the activities, largest time first."""
    families: dict[str, dict[str, float]] = {}
    for activity in activities:
        entry = families.setdefault(kernel_family(activity.name), {"count": 0, "us": 0.0})
        entry["count"] += 1
        entry["us"] += activity.end - activity.start
    return dict(sorted(families.items(), key=lambda item: -item[1]["us"]))


def idle_gaps(activities: Sequence[Activity]) -> list[Gap]:
    """The idle stretches between activities in start order, largest first (overlapping activities: one stretch)."""
    ordered = sorted(activities, key=lambda a: (a.start, a.end))
    gaps = []
    done = ordered[0] if ordered else None                  # what finished last among those already started
    for activity in ordered[1:]:
        if activity.start > done.end:
            gaps.append(Gap(done.name, activity.name, activity.start - done.end))
        if activity.end > done.end:
            done = activity
    return sorted(gaps, key=lambda g: -g.microseconds)


def summarize(activities: Sequence[Activity]) -> dict[str, float]:
    """Span (first start to last end), kernel time, copy/memset time and count, idle time; microseconds."""
    if not activities:
        return {"span_us": 0.0, "kernels_us": 0.0, "kernels": 0, "copies_us": 0.0, "copies": 0, "idle_us": 0.0}
    kernels = [a for a in activities if not a.is_copy]
    copies = [a for a in activities if a.is_copy]
    return {"span_us": max(a.end for a in activities) - min(a.start for a in activities),
            "kernels_us": sum(a.end - a.start for a in kernels), "kernels": len(kernels),
            "copies_us": sum(a.end - a.start for a in copies), "copies": len(copies),
            "idle_us": sum(g.microseconds for g in idle_gaps(activities))}


def replay_activities(replay: Callable[[], object]) -> list[Activity]:
    """Every GPU activity of one call of `replay` (a CUDA graph replay), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    return [Activity(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]
