"""ZOO.md: the model-zoo benchmark's results as markdown (`render(runs)`), from one or several runs' zoo.json.

The headline is the geometric mean of opfuse's speedup over torch.compile + CUDA graph (opfuse through its module
call, what a user's call costs; and as its bare graph replay, as torch.compile is timed) beside the geometric mean
share of the roofline each batch reaches (`roofline_lines`), and the list of workloads under 1.0x; then the cost
model's median error (|predicted - measured replay| / measured replay); then one row per workload, then what failed
or did not run and why, and which of the zoo's workloads no run has measured.

A row's floor (`opfuse.bench.harness.row_roofline`) is taken when the page is rendered, from the datasheet of the
GPU its run measured on and the workload's work (`opfuse.analysis.roofline.Work`): the one its run recorded, or for
runs before rows recorded it, the count of opfuse's analysis of the built-in model now, on the CPU (`builtin_work`).
"""

from __future__ import annotations

import functools
import statistics
from typing import Callable, Sequence

from opfuse.analysis.roofline import Work, datasheet_ceilings, format_share, hardware_of_gpu
from opfuse.bench.generation_report import generation_lines
from opfuse.bench.harness import (RowRoofline, geometric_mean, pytorch_group_count, row_roofline, speedup,
                                  work_of_row)
from opfuse.bench.timing import spread_of
from opfuse.bench.zoo import ZOO_MODELS
from opfuse.bench.zoo_bench import ZOO_BATCHES, workload_key


def merge(runs: Sequence[dict]) -> tuple[dict[str, dict], list[dict]]:
    """(workloads by key, the runs' headers): a later run's workload replaces an earlier one's when it was
    measured (or when the earlier one was not)."""
    workloads: dict[str, dict] = {}
    headers = []
    for run in runs:
        settings = run.get("settings", {})
        headers.append({"env": run.get("env"), "settings": settings,
                        "tuned_alone": run.get("tuned_alone", settings.get("cold_parallel", 1) <= 1)})
        for key, entry in run.get("workloads", {}).items():
            if key not in workloads or measured(entry) or not measured(workloads[key]):
                workloads[key] = entry | {"run": len(headers)}
    return workloads, headers


def measured(entry: dict) -> bool:
    return "row" in entry.get("measure", {})


def cost_model_error(row: dict) -> float | None:
    """|predicted - measured| / measured for opfuse's bare replay (None when either is missing)."""
    replay = row.get("opfuse_replay", {}).get("median_ms")
    predicted = row.get("predicted_ms")
    if not replay or predicted is None:
        return None
    return abs(predicted - replay) / replay


def _cost_model_line(workloads: dict[str, dict], rows: dict[str, dict], held_out_from: int | None) -> str:
    errors = {key: e for key, e in ((key, cost_model_error(row)) for key, row in rows.items()) if e is not None}
    if not errors:
        return "Cost model: no workload measured."
    line = (f"Cost model: median |predicted - measured| / measured of opfuse's replay over {len(errors)} workloads, "
            f"as predicted when measured: **{statistics.median(errors.values()) * 100:.0f}%**.")
    if held_out_from is not None:
        held_out = [e for key, e in errors.items() if workloads[key]["run"] >= held_out_from]
        if held_out:
            line += (f" Over the {len(held_out)} workloads of runs {held_out_from} on, measured after the cost model "
                     f"was fitted to the runs before them: **{statistics.median(held_out) * 100:.0f}%**.")
    return line


def _launches_line(rows: dict[str, dict]) -> str:
    """Whether what `opfuse analyze` reports after the compile (`analyze_launches`, recorded from runs 40 on) is what
    the profiler counted in a replay, over the rows that record both."""
    checked = {key: (row["analyze_launches"], row["opfuse"]["kernels"]) for key, row in rows.items()
               if row.get("analyze_launches") is not None and (row.get("opfuse") or {}).get("kernels") is not None}
    differ = [f"{key} ({said} against {counted})" for key, (said, counted) in checked.items() if said != counted]
    return (f"Launches: `opfuse analyze`'s count after the compile equals the profiled kernels of a replay in "
            f"**{len(checked) - len(differ)} of {len(checked)}** workloads that record both"
            + (f"; not in {', '.join(differ)}." if differ else "."))


WorkOf = Callable[[str, int, str], Work | None]       # (model, batch, dtype) -> its Work, or None


@functools.lru_cache(maxsize=None)
def builtin_work(model: str, batch: int, dtype: str = "float16") -> Work | None:
    """The `opfuse.analysis.roofline.Work` of a built-in zoo model at `batch`, analysed on the CPU in its benchmark
    form (`harness.protocol_form`) with the planning a zoo run uses (FusionConfig's defaults at `dtype`); None for a
    model that is not built in."""
    import torch

    from opfuse.analysis.roofline import workload_work
    from opfuse.api import analyze
    from opfuse.bench.harness import protocol_form
    from opfuse.bench.zoo import BUILTIN_MODELS, load_builtin
    from opfuse.config import FusionConfig

    if model not in BUILTIN_MODELS:
        return None
    built, inputs = load_builtin(model, batch)
    built, inputs = protocol_form(built, inputs, getattr(torch, dtype), "cpu")
    return workload_work(analyze(built, inputs, FusionConfig(dtype=dtype), name=model))


def rooflines(workloads: dict[str, dict], rows: dict[str, dict], headers: list[dict], work_of: WorkOf | None
              ) -> tuple[dict[str, RowRoofline], list[str]]:
    """({workload: its RowRoofline}, the workloads whose work was counted now, not recorded by their run) for the
    measured rows whose run names a GPU with a profile (`hardware_of_gpu`)."""
    found, counted_now = {}, []
    for key, row in rows.items():
        entry = workloads[key]
        hw = hardware_of_gpu((headers[entry["run"] - 1]["env"] or {}).get("gpu"))
        if hw is None:
            continue
        work = work_of_row(row)
        if work is None and work_of is not None:
            work = work_of(entry["model"], entry["batch"], row.get("dtype", "float16"))
            if work is not None:
                counted_now.append(key)
        result = row_roofline(row, hw, work)
        if result is not None:
            found[key] = result
    return found, counted_now


SHORT = {"eager": "eager", "eager_graph": "eager + graph", "inductor": "torch.compile"}


def roofline_lines(workloads: dict[str, dict], found: dict[str, RowRoofline], counted_now: Sequence[str],
                   headers: list[dict]) -> list[str]:
    """The headline's roofline paragraph: per batch, the geometric mean share of the roofline (and of the
    launch-and-bandwidth floor) of opfuse's module call, its bare replay and each row's best baseline; then how
    the floors were taken."""
    if not found:
        return ["Roofline: no measured workload has a floor (its run's GPU has no profile, or no work was counted)."]
    parts = []
    for batch in sorted({workloads[key]["batch"] for key in found}):
        keys = [key for key in found if workloads[key]["batch"] == batch]

        def mean(label: str, launch: bool = False) -> str:
            shares = [(found[k].launch_shares if launch else found[k].shares).get(
                found[k].best_baseline if label == "best" else label) for k in keys]
            return format_share(geometric_mean([v for v in shares if v is not None]))

        parts.append(f"batch {batch} ({len(keys)} workloads): **{mean('opfuse')}** of the roofline through opfuse's "
                     f"module call ({mean('opfuse_replay')} as its bare replay), {mean('best')} by the best baseline; "
                     f"of the launch-and-bandwidth floor **{mean('opfuse', True)}**, {mean('opfuse_replay', True)}, "
                     f"{mean('best', True)}")
    gpus = sorted({(headers[workloads[k]["run"] - 1]["env"] or {}).get("gpu", "?") for k in found})
    dates = sorted({(headers[workloads[k]["run"] - 1]["env"] or {}).get("date", "?") for k in found})
    rates = []
    for gpu in gpus:
        hw = hardware_of_gpu(gpu)
        ceilings = datasheet_ceilings(hw, "float16")
        rates.append(f"{hw.name} {ceilings.flops / 1e12:.0f} TFLOP/s float16, {ceilings.bandwidth / 1e12:.2f} TB/s, "
                     f"{ceilings.launch_overhead * 1e6:.1f} us a launch")
    return [
        "Roofline, geometric mean of floor / measured time: " + "; ".join(parts) + ".", "",
        "Floors (`opfuse.analysis.roofline`): the roofline's is max(FLOPs / peak, bytes / bandwidth) of the model's "
        "unfused FLOPs and its compulsory bytes (weights and inputs read once, an embedding table's gathered rows "
        "only, outputs written once), counted by opfuse's analysis; the launch-and-bandwidth floor adds a launch "
        "overhead for each kernel of the fewest any contender launched; the plan's floor takes the bytes opfuse's "
        "kernels move instead (shown where the row's plan is the one counted). Rates: the datasheet's "
        f"({'; '.join(rates)}). Computed offline, when this page was rendered, against the times measured on "
        f"{', '.join(gpus)} ({dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else "") + "); "
        + (f"the work of {len(counted_now)} of the {len(found)} rows counted by the analysis of the current code "
           "(their runs recorded none)." if counted_now else "every row's work recorded by its run.")]


def _roofline_cells(found: RowRoofline | None) -> str:
    """The three roofline cells of a row: floors in ms, % of the roofline, % of the launch-and-bandwidth floor."""
    if found is None:
        return "- | - | -"
    floor, plan, best = found.floor, found.plan_floor, found.best_baseline
    floors = (f"{floor.roofline * 1e3:.4f} ({floor.bound}) / {'-' if plan is None else f'{plan.roofline * 1e3:.4f}'}"
              f" / {floor.launch_and_bandwidth * 1e3:.4f} ({floor.launches})")
    name = f" ({SHORT[best]})" if best else ""
    shares, launch_shares = found.shares, found.launch_shares
    return (f"{floors} | {format_share(shares.get('opfuse'))} / {format_share(shares.get(best))}{name} | "
            f"{format_share(launch_shares.get('opfuse'))} / {format_share(launch_shares.get(best))}")


def _ms(entry: dict) -> str:
    if "error" in entry:
        return "failed"
    return f"{entry['median_ms']:.3f}" if "median_ms" in entry else "-"


def _seconds(stage: dict, label: str) -> str:
    value = stage.get(label, {})
    if "error" in value:
        return "failed"
    return f"{value['compile_s']:.1f}" if "compile_s" in value else "-"


def _spread(entry: dict) -> str:
    value = spread_of(entry)
    return "-" if value is None else f"{value * 100:.0f}%"


def _count(entry: dict) -> str:
    return "-" if entry.get("kernels") is None else str(entry["kernels"])


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def render(runs: Sequence[dict], held_out_from: int | None = None, work_of: WorkOf | None = builtin_work,
           generation: dict | None = None) -> str:
    """ZOO.md of `runs`; with `held_out_from` N, the cost model's error is also given over the workloads of runs N
    on alone (the runs measured after the cost model was last fitted, on the runs before them: its error out of
    sample). `work_of` counts the work of a row that recorded none (None: such rows get no floor). `generation`: a
    `benchmarks/generate.py` result, rendered as the text-generation table (`generation_report`)."""
    workloads, headers = merge(runs)
    rows = {key: entry["measure"]["row"] for key, entry in workloads.items() if measured(entry)}
    found, counted_now = rooflines(workloads, rows, headers, work_of)
    lines = ["# Model zoo benchmark", "",
             "Generated by `benchmarks/zoo.py` (`opfuse bench --zoo`); do not edit by hand. Protocol "
             "(opfuse/bench/harness.py): fp16, channels-last images (224 px), token ids (seq 128), seeded random "
             "weights made to look trained; every contender compiled, warmed, captured into a CUDA graph and timed "
             "under one `torch.inference_mode()` (torch.compile: inductor's default mode, freezing on), timing rounds "
             "interleaved across contenders, each model in processes of its own. Times are medians in ms per "
             "forward; a spread is (p90 - p10) / median of one contender's samples. Each row names the run it comes "
             f"from ({len(headers)} runs merged, a later run's row replacing an earlier one's; where and how each ran: "
             "Runs, at the end)."]
    calls = {key: speedup(row, "inductor", "opfuse") for key, row in rows.items()}
    replays = {key: speedup(row, "inductor", "opfuse_replay") for key, row in rows.items()}
    mean_call, mean_replay = geometric_mean(list(calls.values())), geometric_mean(list(replays.values()))
    under = [f"{key} ({value:.2f}x)" for key, value in calls.items() if value is not None and value < 1.0]
    counted_calls = sum(v is not None for v in calls.values())
    counted_replays = sum(v is not None for v in replays.values())
    lines += ["", "## Headline", "",
              f"Geometric mean of opfuse over torch.compile + CUDA graph: **{_times(mean_call)}** through opfuse's "
              f"module call (its output copies included, its input copies where the run says so; {counted_calls} "
              f"workloads), "
              f"{_times(mean_replay)} as its bare graph replay, as torch.compile is timed ({counted_replays} "
              "workloads).", "",
              *roofline_lines(workloads, found, counted_now, headers), "",
              f"Under 1.0x (module call): {', '.join(under) if under else 'none'}.", "",
              _launches_line(rows), "",
              _cost_model_line(workloads, rows, held_out_from),
              "", "## Per workload", "",
              "| workload | run | eager | eager + graph | torch.compile + graph | opfuse call | opfuse replay | speedup "
              "(call / replay) | spread: torch.compile / call / replay | compile s, torch.compile cold / warm | compile s, opfuse cold / warm | "
              "opfuse launches: plan / as compiled (analyze) / measured | torch.compile kernels | rel. error opfuse / "
              "torch.compile | predicted / measured ms | groups through PyTorch | floor ms: roofline (bound) / "
              "plan's bytes / with launches (launches) | % of roofline: opfuse call / best baseline | % of "
              "launch-and-bandwidth floor: opfuse call / best baseline |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, entry in workloads.items():
        if not measured(entry):
            continue
        row, cold = rows[key], entry.get("cold", {})
        spread = " / ".join(_spread(row.get(k, {})) for k in ("inductor", "opfuse", "opfuse_replay"))
        opfuse, inductor = row.get("opfuse", {}), row.get("inductor", {})
        error = cost_model_error(row)
        through = pytorch_group_count(row)

        def rel(entry_: dict) -> str:
            return f"{entry_['rel_error']:.1e}" if entry_.get("rel_error") is not None else "-"

        def warm(entry_: dict) -> str:
            return f"{entry_['compile_s']:.1f}" if "compile_s" in entry_ else "failed"

        lines.append(
            f"| {key} | {entry['run']} | {_ms(row.get('eager', {}))} | {_ms(row.get('eager_graph', {}))} | {_ms(inductor)} | "
            f"{_ms(opfuse)} | {_ms(row.get('opfuse_replay', {}))} | {_times(calls[key])} / {_times(replays[key])} | "
            f"{spread} | {_seconds(cold, 'inductor')} / {warm(inductor)} | "
            f"{_seconds(cold, 'opfuse')} / {warm(opfuse)} | {row.get('plan_launches', '-')} / "
            f"{row.get('analyze_launches') or row.get('runtime_launches', '-')} / {_count(opfuse)} | "
            f"{_count(inductor)} | "
            f"{rel(opfuse)} / {rel(inductor)} | "
            + (f"{row['predicted_ms']:.3f} / {row['opfuse_replay']['median_ms']:.3f} ({error * 100:.0f}%)"
               if error is not None else "-")
            + f" | {'-' if through is None else through} | {_roofline_cells(found.get(key))} |")
    if generation is not None:
        lines += ["", *generation_lines(generation)]
    problems = problem_lines(workloads, rows)
    if problems:
        lines += ["", "## Failed or not run", "", *problems]
    lines += ["", "## Runs", "", *run_lines(headers)]
    return "\n".join(lines) + "\n"


def problem_lines(workloads: dict, rows: dict) -> list[str]:
    """ZOO.md's "Failed or not run": each stage or contender that failed, with its error's first line, then the
    zoo's workloads no run measured."""
    problems = []
    for key, entry in workloads.items():
        row = rows.get(key, {})
        for stage in ("cold", "measure"):
            if "error" in entry.get(stage, {}):
                problems.append(f"- {key}, {stage}: {entry[stage]['error']}")
        for stage, values in (("cold", entry.get("cold", {})), ("measure", row)):
            for label in ("eager", "eager_graph", "inductor", "opfuse"):
                if "error" in values.get(label, {}):
                    problems.append(f"- {key}, {stage}, {label}: {values[label]['error'].splitlines()[0][:300]}")
    missing = [workload_key(model, batch) for model in ZOO_MODELS for batch in ZOO_BATCHES
               if workload_key(model, batch) not in rows]
    if missing:
        problems.append(f"- not measured in any run yet ({len(missing)} of the zoo's {len(ZOO_MODELS) * len(ZOO_BATCHES)} "
                        f"workloads): {', '.join(missing)}")
    return problems


def run_lines(headers: Sequence[dict]) -> list[str]:
    """Where and how the merged runs ran: what every run shares, then one line for the runs (by number) that ran
    alike in the rest."""
    described = [_run_facts(header) for header in headers]
    shared = [fact for fact in described[0] if all(fact in facts for facts in described)] if described else []
    alike: dict[str, list[int]] = {}
    for index, facts in enumerate(described, 1):
        alike.setdefault("; ".join(f for f in facts if f not in shared) or "as above", []).append(index)
    lead = [f"- every run: {'; '.join(shared)}"] if shared else []
    return lead + [f"- {'run' if len(numbers) == 1 else 'runs'} {_number_ranges(numbers)}: {text}"
                   for text, numbers in alike.items()]


def _run_facts(header: dict) -> list[str]:
    env, settings = header["env"] or {}, header["settings"]
    facts = [f"{env.get('date', '?')}",
             f"{env.get('gpu', '?')} (driver {env.get('driver', '?')}), torch {env.get('torch', '?')}, triton "
             f"{env.get('triton', '?')}, Python {env.get('python', '?')}",
             f"opfuse tune_top {settings.get('tune_top')}",
             f"cold compiles {settings.get('cold_parallel')} at a time",
             f"{settings.get('rounds')} rounds x {settings.get('per_round')} samples"]
    if settings.get("enable"):
        facts.append(f"opfuse with {', '.join(settings['enable'])} on (off by default)")
    facts.append("the module call reads the tensors its graph captured (no input copy)"
                 if header.get("call_inputs") == "captured" else
                 "the module call copies its inputs in, unless the commit measured reads the captured tensors in "
                 "place (715ce9d on: run 29 of RESULTS.md)")
    if header.get("tuned_alone") is False:
        facts.append("opfuse's kernels were tuned in the cold compiles, several at once on one GPU (only opfuse can "
                     "have lost by it)")
    return facts


def _number_ranges(numbers: Sequence[int]) -> str:
    """'1-3, 5, 7-8' of increasing numbers."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][1] + 1:
            spans[-1][1] = number
        else:
            spans.append([number, number])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)
