"""Where the CUDA graph replays of opfuse and of eager idle: one replay of each under torch.profiler, its time split
into kernels, copies/memsets and idle gaps, and the largest gaps with the activities on both sides.

    python -m benchmarks.graph_gaps --out DIR [--workloads bert-base:64,bert-base:1] [--tune-top 1] [--with-inductor]

Why: in run 12 (benchmarks/RESULTS.md) opfuse's bert-base bs64 graph replayed in 3.491 ms with 3.317 ms of kernels,
eager's in 3.705 ms with 3.705 ms of kernels. Writes DIR/gaps.json (with every activity of each replay, in order,
so that two contenders' kernels can be compared offline) and prints a summary per workload; `--with-inductor` adds
torch.compile's replay, compiled as the benchmarks compile it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

import opfuse
from opfuse.bench.cli_bench import add_tuning_arguments, tuning_knobs
from opfuse.bench.gaps import by_family, idle_gaps, replay_activities, summarize
from opfuse.bench.harness import cuda_graphed, frozen_inductor, prepare, torch_compiled
from opfuse.bench.zoo import load_builtin


def report(label: str, replay) -> dict:
    activities = replay_activities(replay)
    totals = summarize(activities)
    gaps = idle_gaps(activities)
    print(f"  {label}: span {totals['span_us']:.1f} us = kernels {totals['kernels_us']:.1f} ({totals['kernels']}) "
          f"+ copies/memsets {totals['copies_us']:.1f} ({totals['copies']}) + idle {totals['idle_us']:.1f} "
          f"(overlaps make these sum to more)")
    families = by_family(activities)
    print("    by family: " + ", ".join(f"{family} {entry['us']:.1f} us ({entry['count']})"
                                       for family, entry in families.items()))
    for gap in gaps[:8]:
        print(f"    {gap.microseconds:7.1f} us idle after {gap.before[:70]}  before {gap.after[:70]}")
    for activity in sorted(activities, key=lambda a: a.start - a.end)[:12]:
        print(f"    {activity.end - activity.start:7.1f} us  {activity.name[:100]}")
    return {"totals": totals, "families": families, "gaps": [asdict(g) for g in gaps[:40]],
            "copies": sorted({a.name for a in activities if a.is_copy}),
            "activities": [(a.name, round(a.end - a.start, 2)) for a in sorted(activities, key=lambda a: a.start)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="bert-base:64,bert-base:1")
    parser.add_argument("--with-inductor", action="store_true", help="profile torch.compile's replay too")
    add_tuning_arguments(parser)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    results = {}
    for workload in args.workloads.split(","):
        name, batch = workload.split(":")
        model, inputs = load_builtin(name, batch=int(batch))
        model, inputs, _, _ = prepare(model, inputs)
        print(f"== {name} bs{batch}")
        compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float16", **tuning_knobs(args)))
        with torch.inference_mode():
            for _ in range(3):            # warm-up, then the capture
                compiled(*inputs)
            graph = compiled.compiled._cuda_graph
            row = {"opfuse": report("opfuse graph", graph.replay) if graph is not None else
                   {"error": compiled.compiled.cuda_graph_error or "no CUDA graph"}}
            row["eager"] = report("eager graph", cuda_graphed(model, inputs))
            if args.with_inductor:
                torch._dynamo.reset()   # a second workload of one model class would recompile with dynamic shapes
                compiled_tc, _ = torch_compiled(model, inputs)
                with frozen_inductor():
                    row["inductor"] = report("torch.compile graph", cuda_graphed(compiled_tc, inputs))
        results[f"{name} bs{batch}"] = row
        del compiled
        torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gaps.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
