"""What opfuse's autotuner measured for every group of a workload, on a GPU: each candidate's time, each rejected
config's reason, the form it kept; with `--profile`, where the cold compile spent its time.

    python -m benchmarks.tuning_report --out DIR --workloads shufflenet_v2_x1_0:64,resnet50:1 [--tune-top 4] [--profile]

Why: run 39's profiles (benchmarks/RESULTS.md) show most of shufflenet_v2's and regnet_y_400mf's convs at batch 64
running unfused through PyTorch (cuDNN, then PyTorch's strided bias add), where torch.compile runs the same convs
with fused epilogues. This says which forms the tuner timed there and why the others lost or were rejected.
Each workload compiles from an empty tuning cache (Triton's cache is whatever TRITON_CACHE_DIR holds), fp16,
channels-last, FusionConfig's defaults but the tuning flags. Writes DIR/tuning.json, and DIR/<workload>.prof
(`python -m pstats`) with `--profile`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import opfuse
from opfuse.bench.cli_bench import add_tuning_arguments, tuning_knobs
from opfuse.bench.harness import prepare, tuning_rows
from opfuse.bench.timing import timed_compile
from opfuse.bench.zoo import load_builtin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="shufflenet_v2_x1_0:64")
    parser.add_argument("--profile", action="store_true", help="write each compile's cProfile statistics")
    add_tuning_arguments(parser)
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for workload in args.workloads.split(","):
        name, batch = workload.split(":")
        model, inputs = load_builtin(name, batch=int(batch))
        model, inputs, _, _ = prepare(model, inputs)
        config = opfuse.FusionConfig(dtype="float16", cache_dir=tempfile.mkdtemp(prefix="opfuse-tuning-"),
                                     **tuning_knobs(args))
        with torch.inference_mode():
            model(*inputs)
            compiled, seconds = timed_compile(model, inputs, config,
                                              str(out / f"{name}-bs{batch}.prof") if args.profile else None)
        results[f"{name}-bs{batch}"] = {"compile_s": seconds, "stages": compiled.seconds,
                                        "groups": tuning_rows(compiled)}
        print(f"== {name} bs{batch}: compiled in {seconds:.1f} s {compiled.seconds}", flush=True)
        for group, row in results[f"{name}-bs{batch}"]["groups"].items():
            print(f"  {group} {' '.join(row['nodes'])[:60]}: {row['chosen']}; {row['timings_us']}; "
                  f"rejected {len(row['rejected'])}", flush=True)
        (out / "tuning.json").write_text(json.dumps(results, indent=1))
        del compiled
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
