"""The model-zoo benchmark (issue 14): every zoo model at batch 1 and 64, eager, torch.compile and opfuse, each
workload in processes of its own, by the fair protocol of opfuse/bench/harness.py.

    python -m benchmarks.zoo --out DIR [--models resnet50,gpt2,...] [--batches 1,64] [--cold-parallel N]
                             [--budget SECONDS] [--tune-top N]
    python -m benchmarks.zoo --report RUN.json [RUN.json ...] -o benchmarks/ZOO.md [--held-out-from N]
                             [--generation generate.json]
    python -m benchmarks.zoo --fit RUN.json [RUN.json ...] [--json FIT.json]

The first form runs the workloads and writes DIR/zoo.json, DIR/ZOO.md and DIR/zoo.log after every child process
(`--budget` stops starting children after that many seconds, to fit one call of a lent GPU machine); the second
writes ZOO.md from the zoo.json of one or several runs (a later run's workload replaces an earlier one's); the
third fits the H200 profile's time factor to the runs' measured replays (opfuse/bench/zoo_fit.py; no GPU needed:
each workload is planned again here) and prints how well the given and the fitted factor predict them. The
work itself is in opfuse/bench/zoo_bench.py, which `opfuse bench --zoo` runs too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from opfuse.bench.zoo_bench import main as run_main
from opfuse.bench.zoo_report import render


def report(paths: list[str], output: str, held_out_from: int | None = None, generation: str | None = None) -> int:
    runs = [json.loads(Path(p).read_text()) for p in paths]
    generated = json.loads(Path(generation).read_text()) if generation else None
    Path(output).write_text(render(runs, held_out_from, generation=generated))
    print(f"wrote {output} from {len(runs)} run(s)")
    return 0


def fit(paths: list[str], output: str | None) -> int:
    from opfuse.bench.zoo_fit import fit_report, format_report, workloads_of_runs
    from opfuse.hardware import get_hardware

    runs = [json.loads(Path(p).read_text()) for p in paths]
    workloads, left_out = workloads_of_runs(runs)
    if len(workloads) < 2:
        print(f"error: {len(workloads)} workload(s) to fit, at least 2 needed", file=sys.stderr)
        return 1
    result = fit_report(workloads, get_hardware("h200").time_factor)
    print(format_report(result, left_out))
    if output:
        Path(output).write_text(json.dumps(result | {"left_out": left_out}, indent=1))
    return 0


if __name__ == "__main__":
    if "--fit" in sys.argv[1:]:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--fit", nargs="+", required=True, metavar="ZOO_JSON")
        parser.add_argument("--json", default=None, metavar="FILE", help="also write the fit as JSON")
        args = parser.parse_args()
        sys.exit(fit(args.fit, args.json))
    if "--report" in sys.argv[1:]:
        parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        parser.add_argument("--report", nargs="+", required=True, metavar="ZOO_JSON")
        parser.add_argument("-o", "--output", default="benchmarks/ZOO.md")
        parser.add_argument("--held-out-from", type=int, default=None, metavar="N",
                            help="also give the cost model's error over runs N on (numbered as given), measured "
                                 "after it was fitted to the runs before them")
        parser.add_argument("--generation", default=None, metavar="GENERATE_JSON",
                            help="also the text-generation table, from a benchmarks/generate.py run's generate.json")
        args = parser.parse_args()
        sys.exit(report(args.report, args.output, args.held_out_from, args.generation))
    sys.exit(run_main(sys.argv[1:]))
