"""Fit the hardware profile's `time_factor` to whole-model times across the zoo (`fit_report`).

`opfuse profile --calibrate` (`opfuse.bench.calibrate`) fits one model's kernels; this fits the factor that turns
the cost model's kernel times into what the kernels take in a CUDA graph replay, on the measured replays of many
workloads at once, so that no model decides it alone. A workload's predicted time is what the analysis prints
(`opfuse.analysis.traffic.summarize_plan`: every kernel the compiled model launches), which is proportional to
`time_factor`: the fitted factor is the given one times the k minimising sum |k * predicted / measured - 1| over
the workloads (a weighted median of measured / predicted: one workload far off cannot drag it). The factor scales
every kernel time the planner compares alike, so refitting it changes no plan.

`leave_one_out` predicts each workload with the factor fitted to all the others: the error to expect on a model
the fit has not seen.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Workload:
    """One measured workload: the analysis's predicted time with the given profile and the measured replay (s)."""

    name: str
    predicted: float
    measured: float


def fit_multiplier(workloads: Sequence[Workload]) -> float:
    """The k minimising sum |k * predicted / measured - 1|: the weighted median of measured / predicted, each
    workload weighing predicted / measured (the slope of its term)."""
    points = sorted((w.measured / w.predicted, w.predicted / w.measured) for w in workloads)
    half = sum(weight for _, weight in points) / 2
    running = 0.0
    for ratio, weight in points:
        running += weight
        if running >= half:
            return ratio
    raise ValueError("fit_multiplier needs at least one workload")


def relative_error(workload: Workload, multiplier: float = 1.0) -> float:
    return abs(multiplier * workload.predicted - workload.measured) / workload.measured


def leave_one_out(workloads: Sequence[Workload]) -> dict[str, float]:
    """{workload name: its relative error with the multiplier fitted to all the other workloads}."""
    return {w.name: relative_error(w, fit_multiplier([o for o in workloads if o is not w])) for w in workloads}


def fit_report(workloads: Sequence[Workload], given_factor: float) -> dict:
    """The fit over `workloads` (at least two) and how well the given and the fitted factor predict them."""
    multiplier = fit_multiplier(workloads)
    held_out = leave_one_out(workloads)
    rows = {w.name: {"measured_ms": w.measured * 1e3, "predicted_ms_given": w.predicted * 1e3,
                     "predicted_ms_fitted": multiplier * w.predicted * 1e3,
                     "error_given": relative_error(w), "error_fitted": relative_error(w, multiplier),
                     "error_left_out": held_out[w.name]} for w in workloads}
    return {"time_factor_given": given_factor, "time_factor_fitted": given_factor * multiplier, "workloads": rows,
            "median_error_given": statistics.median(r["error_given"] for r in rows.values()),
            "median_error_fitted": statistics.median(r["error_fitted"] for r in rows.values()),
            "median_error_left_out": statistics.median(held_out.values())}


def format_report(report: dict, left_out: dict[str, str]) -> str:
    lines = ["| workload | measured ms | predicted, given | predicted, fitted | error, fitted | error, left out |",
             "|---|---|---|---|---|---|"]
    for name, row in report["workloads"].items():
        lines.append(f"| {name} | {row['measured_ms']:.3f} | {row['predicted_ms_given']:.3f} | "
                     f"{row['predicted_ms_fitted']:.3f} | {row['error_fitted']:.0%} | {row['error_left_out']:.0%} |")
    lines += ["", f"time_factor given {report['time_factor_given']:.3g}: median error "
                  f"{report['median_error_given']:.0%}",
              f"time_factor fitted {report['time_factor_fitted']:.3g}: median error "
              f"{report['median_error_fitted']:.0%}, {report['median_error_left_out']:.0%} with each workload left "
              "out of its own fit"]
    lines += [f"left out: {name}: {why}" for name, why in left_out.items()]
    return "\n".join(lines)


# ---- from zoo runs -----------------------------------------------------------------------------------------

def workloads_of_runs(runs: Sequence[dict], hardware: str = "h200", progress: Callable[[str], None] = print
                      ) -> tuple[list[Workload], dict[str, str]]:
    """The measured workloads of zoo runs (`opfuse.bench.zoo_report.merge`: a later run's replaces an earlier
    one's), each planned again on this machine with the current code (fp16, as the runs plan); (workloads,
    {workload: why it was left out}). A workload whose plan no longer launches what was measured, or sends
    another number of groups through PyTorch (the code changed since), is left out: its measurement is not of
    this plan."""
    from opfuse.api import analyze
    from opfuse.bench.harness import pytorch_group_count
    from opfuse.bench.zoo import load_builtin
    from opfuse.bench.zoo_report import merge
    from opfuse.config import FusionConfig

    merged, _ = merge(runs)
    workloads, left_out = [], {}
    for key, entry in merged.items():
        row = entry.get("measure", {}).get("row")
        replay = (row or {}).get("opfuse_replay", {}).get("median_ms")
        if not replay:
            left_out[key] = "not measured"
            continue
        model, inputs = load_builtin(entry["model"], entry["batch"])
        analysis = analyze(model, inputs, FusionConfig(dtype="float16", hardware=hardware))
        through = {group: str(why) for group, why in analysis.pytorch_groups.items()}     # as a row holds them
        now = (analysis.plan.kernel_launches, pytorch_group_count({"fallbacks": through}))
        then = (row.get("plan_launches"), pytorch_group_count(row))
        if now != then:
            left_out[key] = (f"the plan launches {now[0]} kernels and runs {now[1]} groups through PyTorch now, "
                             f"{then[0]} and {then[1]} when measured")
            continue
        workloads.append(Workload(key, analysis.fused.predicted_time, replay / 1e3))
        progress(f"{key}: measured {replay:.3f} ms, predicted now {analysis.fused.predicted_time * 1e3:.3f} ms")
    return workloads, left_out
