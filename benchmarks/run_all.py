"""opfuse against eager, eager in a CUDA graph, and torch.compile on one GPU, in one process.

Protocol (opfuse/bench/harness.py, issue 14): fp16, channels-last image inputs, cudnn.benchmark, eval, fixed-seed
random weights, never zeros; every contender compiled, warmed, captured into a CUDA graph and timed under one
inference mode, timing rounds interleaved across contenders. For each contender: median and spread of CUDA-event-
timed forwards, kernels per forward and GPU busy time (torch.profiler), extra memory, compile time, relative error
against eager in float32; opfuse both through its module call and as its bare graph replay.
The floor of each workload is measured too: FLOPs over the measured fp16 matrix rate, and the fewest bytes
(weights, inputs and outputs once) over the measured copy bandwidth.

    python -m benchmarks.run_all --out DIR [--workloads resnet50:1,resnet50:64,...] [--results benchmarks/RESULTS.md]

Writes DIR/results.json and DIR/RESULTS.md (the table, with date, GPU, driver, torch and triton versions). The
measuring itself lives in opfuse/bench/harness.py (`run_workload`), which `opfuse bench MODEL` runs too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import opfuse
from opfuse.bench.cli_bench import add_tuning_arguments, tuning_knobs
from opfuse.bench.harness import (CONTENDERS, TIMED, environment, geometric_mean, measure_ceilings,
                                  run_workload, speedup, start_gpu_run)
from opfuse.bench.timing import spread_of
from opfuse.bench.zoo import load_builtin

DEFAULT_WORKLOADS = ("resnet50:1,resnet50:64,mobilenet_v2:1,mobilenet_v2:64,bert-base:1,bert-base:64")


def run_builtin(name: str, batch: int, ceilings: dict, contenders: set[str], config: "opfuse.FusionConfig") -> dict:
    """One built-in workload against the contenders (the shared implementation of `opfuse bench`)."""
    model, inputs = load_builtin(name, batch=batch)
    row = {"workload": f"{name} bs{batch}", "model": name, "batch": batch}
    return row | run_workload(model, inputs, row["workload"], ceilings, sorted(contenders), config)


def markdown(results: list[dict], env: dict, ceilings: dict) -> str:
    def ms(row: dict, key: str) -> str:
        value = row.get(key, {})
        return f"{value['median_ms']:.3f}" if "median_ms" in value else ("error" if "error" in value else "-")

    def kernels(row: dict, key: str) -> str:
        value = row.get(key, {})
        return str(value.get("kernels", "-"))

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    def spread(row: dict) -> str:
        worst = max((s for s in (spread_of(row.get(k, {})) for k in TIMED) if s is not None), default=None)
        return "-" if worst is None else f"{worst * 100:.0f}%"

    lines = [f"### {env['date']}, {env['gpu']} (driver {env['driver']}), torch {env['torch']}, "
             f"triton {env['triton']}",
             "",
             f"Measured ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), fp16 matrix "
             f"{ceilings['fp16_matrix_flops'] / 1e12:.0f} TFLOP/s. Fair protocol (opfuse/bench/harness.py): every "
             "contender compiled, warmed, captured and timed under one inference mode, rounds interleaved. Median ms "
             "per forward (kernels per forward, profiled on what is timed); spread is the largest (p90 - p10) / "
             "median among the contenders; speedups are how many times faster opfuse's module call ran.",
             "",
             "| workload | eager | eager + graph | torch.compile + graph | opfuse call | opfuse replay | "
             "speedup vs torch.compile (call / replay) | speedup vs eager + graph | spread | "
             "floor (compute / memory) | opfuse rel. err | plan launches | library anchors / unfused |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        floor = (f"{row['floor_compute_ms']:.3f} / {row['floor_memory_ms']:.3f}" if "floor_compute_ms" in row
                 else "-")
        error = row.get("opfuse", {}).get("rel_error")
        lines.append(f"| {row['workload']} | {ms(row, 'eager')} ({kernels(row, 'eager')}) | "
                     f"{ms(row, 'eager_graph')} | {ms(row, 'inductor')} ({kernels(row, 'inductor')}) | "
                     f"{ms(row, 'opfuse')} | {ms(row, 'opfuse_replay')} ({kernels(row, 'opfuse')}) | "
                     f"{times(speedup(row, 'inductor'))} / {times(speedup(row, 'inductor', 'opfuse_replay'))} | "
                     f"{times(speedup(row, 'eager_graph'))} | {spread(row)} | {floor} | "
                     f"{'-' if error is None else f'{error:.1e}'} | {row.get('plan_launches', '-')} | "
                     f"{len(row.get('library_anchors', ())) if 'library_anchors' in row else '-'} / "
                     f"{len(row['unfused']) if 'unfused' in row else '-'} |")
    mean = geometric_mean([speedup(row, "inductor") for row in results])
    if mean is not None and len(results) > 1:
        lines += ["", f"Geometric mean speedup of opfuse over torch.compile + graph: {mean:.2f}x "
                      f"({sum(speedup(r, 'inductor') is not None for r in results)} workloads)."]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--results", help="also write the table into this markdown file (replacing it)")
    add_tuning_arguments(parser)
    args = parser.parse_args()
    out = start_gpu_run("run_all.py", args.out)
    if out is None:
        return 3     # the exit code `opfuse bench` uses for the same case
    env = environment()
    ceilings = measure_ceilings()
    contenders = set(args.contenders.split(","))
    knobs = tuning_knobs(args)
    config = opfuse.FusionConfig(dtype="float16", **knobs)
    results = []
    for spec in args.workloads.split(","):
        name, batch = spec.rsplit(":", 1)
        print(f"== {name} batch {batch}", flush=True)
        results.append(run_builtin(name, int(batch), ceilings, contenders, config))
        (out / "results.json").write_text(json.dumps({"env": env, "ceilings": ceilings, "results": results,
                                                      "tune_top": args.tune_top, "split_k": knobs["split_k"],
                                                      "library_anchors": knobs["library_anchors"]},
                                                     indent=1, default=str))
        (out / "RESULTS.md").write_text(markdown(results, env, ceilings))
        print(markdown(results[-1:], env, ceilings), flush=True)
    table = markdown(results, env, ceilings)
    (out / "RESULTS.md").write_text(table)
    if args.results:
        Path(args.results).write_text("# Benchmark results\n\nGenerated by `benchmarks/run_all.py`.\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
