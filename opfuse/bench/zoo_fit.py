"""Fit the hardware profile's cost factors to whole-model times across the zoo (`fit_workloads`).

`opfuse profile --calibrate` (`opfuse.bench.calibrate`) fits one model's kernels; this fits the same kind of
factors to the measured CUDA graph replay of many workloads at once, so that no model's kernels decide them
alone. A workload's predicted time is what `opfuse.analysis.traffic.summarize_plan` prices: every kernel the
compiled model launches (`runtime_kernels`: the plan's groups with a kernel, and node by node the groups that run
through PyTorch). Each kernel's time is split, by the cost model itself, into the parts the factors scale:

    t = max(memory / memory_efficiency, matrix / matrix_efficiency, vector / vector_efficiency)
        + floor + launches * launch_overhead

`memory`, `matrix` and `vector` are the kernel's seconds at unit efficiency, read off by pricing it again on
profiles where the other parts are free (infinitely fast memory or arithmetic); `floor` is what remains when both
are free, less its launch (the conv-conv kernels' chain of steps, fitted on its own and kept), and the split-K
reduce's partial tiles as the planner prices them. So no formula of
the cost model is written twice here, and the split reproduces its prediction at the given factors.

The fit minimises the sum of absolute relative errors over the workloads (a median-like fit: one workload far off
cannot drag the factors), by a Nelder-Mead simplex in log space; efficiencies stay in (0, 1] and the launch
overhead positive. `leave_one_out` predicts each workload by the fit of all the others: the error to expect on a model
the fit has not seen.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from opfuse.hardware import HardwareProfile

FACTORS = ("memory_efficiency", "matrix_efficiency", "vector_efficiency", "launch_overhead")
FREE = 1e9              # a rate this many times the profile's: that part of a kernel costs nothing
RESTARTS = 4


@dataclass(frozen=True)
class KernelTerms:
    """One kernel's seconds at unit efficiencies, split as in the module docstring."""

    memory: float
    matrix: float        # 0 for CUDA-core kernels
    vector: float        # 0 for tensor-core kernels
    floor: float         # what neither memory nor arithmetic explains, less the launches
    launches: int


@dataclass(frozen=True)
class Workload:
    """One measured workload: its kernels' terms and its measured replay (seconds)."""

    name: str
    kernels: tuple[KernelTerms, ...]
    measured: float


def kernel_terms(analysis) -> tuple[KernelTerms, ...]:
    """The terms of every kernel the compiled model of `analysis` launches (an `opfuse.api.Analysis`)."""
    from opfuse.analysis.traffic import runtime_kernels
    from opfuse.fusion.cost import estimate_kernel
    from opfuse.ir.ops import launches_kernel

    plan, hw = analysis.plan, analysis.hardware
    graph, dtype = plan.graph, analysis.config.dtype
    users = graph.users()
    groups, nodes = runtime_kernels(plan, analysis.pytorch_groups)
    # (nodes, launches, the planner's price of the group or None): a split-K group's price includes its reduce
    # kernel and partial tiles, which the kernel estimate leaves out
    items = [(g.nodes, g.launches, g.predicted_time) for g in groups]
    items += [([n.name], 1, None) for n in graph if n.name in nodes and launches_kernel(graph, n)]
    fast_memory = replace(hw, memory_bandwidth=hw.memory_bandwidth * FREE)
    fast_matrix = replace(hw, matrix_flops={k: v * FREE for k, v in hw.matrix_flops.items()})
    fast_arithmetic = replace(fast_matrix, vector_flops=hw.vector_flops * FREE)
    fast_all = replace(fast_arithmetic, memory_bandwidth=hw.memory_bandwidth * FREE)
    terms = []
    for kernel_nodes, launches, planned in items:
        def seconds(profile: HardwareProfile) -> float:
            return estimate_kernel(graph, kernel_nodes, users, profile, dtype).time

        # the split-K reduce's partial tiles: priced by the planner, kept as they are
        partials = max(0.0, planned - seconds(hw) - (launches - 1) * hw.launch_overhead) if planned else 0.0
        base = seconds(fast_all)
        memory = max(0.0, seconds(fast_arithmetic) - base) * hw.memory_efficiency
        arithmetic = max(0.0, seconds(fast_memory) - base)
        # which unit the arithmetic runs on: making the CUDA cores free removes it, or it stays (tensor cores)
        on_vector = seconds(replace(fast_memory, vector_flops=hw.vector_flops * FREE)) - base < 0.5 * arithmetic
        matrix = 0.0 if on_vector else arithmetic * hw.matrix_efficiency
        vector = arithmetic * hw.vector_efficiency if on_vector else 0.0
        floor = max(0.0, base - hw.launch_overhead) + partials
        terms.append(KernelTerms(memory, matrix, vector, floor, launches))
    return tuple(terms)


def predict(workload: Workload, factors: dict[str, float]) -> float:
    """Seconds the split model predicts for `workload` with `factors` (FACTORS' names)."""
    return _predict_arrays(_arrays(workload), factors)


def relative_error(workload: Workload, factors: dict[str, float]) -> float:
    return abs(predict(workload, factors) - workload.measured) / workload.measured


def median_error(workloads: Sequence[Workload], factors: dict[str, float]) -> float:
    return statistics.median(relative_error(w, factors) for w in workloads)


def factors_of(hw: HardwareProfile) -> dict[str, float]:
    return {name: getattr(hw, name) for name in FACTORS}


def fit_workloads(workloads: Sequence[Workload], start: dict[str, float]) -> dict[str, float]:
    """The factors minimising the sum of |relative error| over `workloads` (module docstring), from `start`."""
    arrays = [_arrays(w) for w in workloads]
    measured = np.array([w.measured for w in workloads])

    def cost(point: np.ndarray) -> float:
        factors = _factors(point)
        predicted = np.array([_predict_arrays(a, factors) for a in arrays])
        return float(np.sum(np.abs(predicted - measured) / measured))

    best = _point(start)
    for _ in range(RESTARTS):       # a simplex can stall on the kinks of a sum of absolute values: start again
        best = _nelder_mead(cost, best)
    return _factors(best)


def _point(factors: dict[str, float]) -> np.ndarray:
    """Search coordinates: the logs of the efficiencies and of the launch overhead in microseconds."""
    return np.array([math.log(factors[n]) for n in FACTORS[:3]]
                    + [math.log(max(factors["launch_overhead"], 1e-9) * 1e6)])


def _factors(point: np.ndarray) -> dict[str, float]:
    """The factors of a search point, efficiencies capped at 1 (a roofline factor over 1 is not the hardware's)."""
    values = {n: min(1.0, math.exp(v)) for n, v in zip(FACTORS[:3], point[:3])}
    return values | {"launch_overhead": math.exp(point[3]) * 1e-6}


def _nelder_mead(cost, start: np.ndarray, step: float = 0.5, rounds: int = 400) -> np.ndarray:
    """Minimise `cost` by the Nelder-Mead simplex from `start` (steps of `step` in each coordinate)."""
    simplex = [start] + [start + step * np.eye(len(start))[i] for i in range(len(start))]
    values = [cost(p) for p in simplex]
    for _ in range(rounds):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if values[-1] - values[0] < 1e-9 * max(1.0, abs(values[0])):
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        value = cost(reflected)
        if value < values[0]:
            expanded = centroid + 2 * (centroid - simplex[-1])
            expanded_value = cost(expanded)
            simplex[-1], values[-1] = (expanded, expanded_value) if expanded_value < value else (reflected, value)
        elif value < values[-2]:
            simplex[-1], values[-1] = reflected, value
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            contracted_value = cost(contracted)
            if contracted_value < values[-1]:
                simplex[-1], values[-1] = contracted, contracted_value
            else:                   # shrink towards the best point
                simplex = [simplex[0]] + [simplex[0] + 0.5 * (p - simplex[0]) for p in simplex[1:]]
                values = [values[0]] + [cost(p) for p in simplex[1:]]
    return simplex[int(np.argmin(values))]


def leave_one_out(workloads: Sequence[Workload], start: dict[str, float]) -> dict[str, float]:
    """{workload name: its relative error under the fit of all the other workloads}."""
    errors = {}
    for i, held_out in enumerate(workloads):
        rest = [w for j, w in enumerate(workloads) if j != i]
        errors[held_out.name] = relative_error(held_out, fit_workloads(rest, start))
    return errors


def _arrays(workload: Workload) -> tuple[np.ndarray, ...]:
    k = workload.kernels
    return (np.array([t.memory for t in k]), np.array([t.matrix for t in k]), np.array([t.vector for t in k]),
            float(sum(t.floor for t in k)), float(sum(t.launches for t in k)))


def _predict_arrays(arrays: tuple, f: dict[str, float]) -> float:
    memory, matrix, vector, floor, launches = arrays
    parts = np.maximum(np.maximum(memory / f["memory_efficiency"], matrix / f["matrix_efficiency"]),
                       vector / f["vector_efficiency"])
    return float(parts.sum()) + floor + launches * f["launch_overhead"]


def geometric_ratio(workloads: Sequence[Workload], factors: dict[str, float]) -> float:
    """Geometric mean of measured / predicted (1 where the model is unbiased)."""
    logs = [math.log(w.measured / predict(w, factors)) for w in workloads]
    return math.exp(sum(logs) / len(logs))


# ---- from zoo runs -----------------------------------------------------------------------------------------

def workloads_of_runs(runs: Sequence[dict], progress=print) -> tuple[list[Workload], dict[str, str]]:
    """The measured workloads of zoo runs (`opfuse.bench.zoo_report.merge`: a later run's replaces an earlier
    one's), each planned again on this machine with the current code and the H200 profile as the run planned it
    (fp16); (workloads, {workload: why it was left out}): a workload whose plan no longer launches what was
    measured (the code changed since) is left out, since its measurement is not of this plan."""
    from opfuse.api import analyze
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
        analysis = analyze(model, inputs, FusionConfig(dtype="float16", hardware="h200"))
        if analysis.plan.kernel_launches != row.get("plan_launches"):
            left_out[key] = (f"the plan launches {analysis.plan.kernel_launches} kernels now, "
                             f"{row.get('plan_launches')} when measured")
            continue
        workloads.append(Workload(key, kernel_terms(analysis), replay / 1e3))
        progress(f"{key}: measured {replay:.3f} ms, predicted now {analysis.fused.predicted_time * 1e3:.3f} ms")
    return workloads, left_out


def fit_report(workloads: Sequence[Workload], start: dict[str, float]) -> dict:
    """The fit over `workloads` and how well the given and the fitted factors predict them (as JSON)."""
    fitted = fit_workloads(workloads, start)
    held_out = leave_one_out(workloads, start)
    rows = {w.name: {"measured_ms": w.measured * 1e3, "predicted_ms_given": predict(w, start) * 1e3,
                     "predicted_ms_fitted": predict(w, fitted) * 1e3, "error_fitted": relative_error(w, fitted),
                     "error_left_out": held_out[w.name]} for w in workloads}
    return {"given": start, "fitted": fitted, "workloads": rows,
            "median_error_given": median_error(workloads, start),
            "median_error_fitted": median_error(workloads, fitted),
            "median_error_left_out": statistics.median(held_out.values())}


def format_report(report: dict, left_out: dict[str, str]) -> str:
    lines = ["| workload | measured ms | predicted, given | predicted, fitted | error, fitted | error, left out |",
             "|---|---|---|---|---|---|"]
    for name, row in report["workloads"].items():
        lines.append(f"| {name} | {row['measured_ms']:.3f} | {row['predicted_ms_given']:.3f} | "
                     f"{row['predicted_ms_fitted']:.3f} | {row['error_fitted']:.0%} | {row['error_left_out']:.0%} |")
    factors = lambda f: ", ".join(f"{k} {v:.3g}" for k, v in f.items())   # noqa: E731
    lines += ["", f"given: {factors(report['given'])}: median error {report['median_error_given']:.0%}",
              f"fitted: {factors(report['fitted'])}: median error {report['median_error_fitted']:.0%}, "
              f"{report['median_error_left_out']:.0%} with each workload left out of its own fit"]
    lines += [f"left out: {name}: {why}" for name, why in left_out.items()]
    return "\n".join(lines)
