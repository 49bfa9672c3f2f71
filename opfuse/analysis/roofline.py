"""Roofline data for the report: every op before fusion and every kernel after, against the hardware's roofs.

Entry point: `roofline(analysis, measured=None) -> dict` (JSON-ready; the report's script draws it as an SVG).

A point is one kernel: x = FLOPs per byte it moves, y = FLOP/s it attains, i.e. FLOPs / seconds, where the seconds
are measured on a GPU when `measured` has them and the cost model's prediction (launch overhead included)
otherwise. Before fusion the points are the ops of the captured graph (one kernel each, the unfused baseline of
the summary table); after fusion, the plan's groups. Kernels without FLOPs (copies, casts, gathers) have no place on
a log-log chart; they are counted, not drawn. The roofs are the profile's datasheet peaks: the memory-bandwidth
slope and two compute ceilings (tensor cores at the compute dtype, CUDA cores), so points sit below them by the
efficiency factors the cost model applies.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from opfuse.hardware import HardwareProfile
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
