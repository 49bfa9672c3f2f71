"""Cold-compile seconds of opfuse with and without the parallel compile workers (issue 17), on a GPU.

    python -m benchmarks.compile_time --workloads resnet50:1,efficientnet_b0:1 --workers 1,8 [--out DIR] [--profile]
                                      [--warm]

Each (workload, workers) compiles in a process of its own from empty caches (Triton's and opfuse's tuning cache),
after one eager forward (the process's one-time costs fall on no compile), fp16, channels-last, FusionConfig's
defaults but `compile_workers`; it prints one JSON line per compile (seconds by stage, what the workers compiled)
and writes them to DIR/compile_time.json as it goes, with DIR/compile_time.md pairing each workload's rows
(`--workloads zoo`: every zoo model at batch 1 and 64). `--profile` runs each compile under cProfile and writes its
statistics to DIR/<workload>-w<workers>.prof (read them with `python -m pstats`), to see where a cold compile
spends its time.
`--workers` may say `default` (FusionConfig's: `default_workers()`) or `inductor`: torch.compile (inductor,
freezing on, as the zoo runs it) compiles the workload from empty caches of its own in a process of its own, after
one eager forward, the baseline for issue 17.
`--warm` compiles each once more in a fresh process over the caches the cold one filled (row `"warm": true`,
profile `<workload>-w<workers>-warm.prof`): what a compile costs when nothing is left to build or tune.
Each row says what the compile workers did (`workers_did`, from their log: OPFUSE_WORKER_LOG) and counts the Triton
compiles the compiling process itself ran (`main_compiles`: those the workers did not build first), by the stage of
opfuse's compile they ran in, with the slowest named.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


# the stages of opfuse's compile a Triton compile in the main process is attributed to: the innermost on its stack
# ("build_here": a launch the compiling process built while it waited for the workers, `CompilePool.wait`)
STAGES = ("build_here", "record_launches", "next_configs", "tune_kernel", "check_groups", "end_to_end_error",
          "build_compiled_model", "analyze", "compile")


def counting_compiles() -> list[dict]:
    """Wrap Triton's compile (before any kernel binds it): each call appends {"kernel", "s", "stage"} to the list
    returned; calls that load from Triton's cache count too, and take milliseconds."""
    import triton.compiler

    calls: list[dict] = []
    original = triton.compiler.compile

    def compile(src, *args, **kwargs):
        start = time.perf_counter()
        try:
            return original(src, *args, **kwargs)
        finally:
            frame, stage = sys._getframe(1), "other"
            while frame is not None:
                if frame.f_code.co_name in STAGES:
                    stage = frame.f_code.co_name
                    break
                frame = frame.f_back
            calls.append({"kernel": str(getattr(src, "name", src))[:80], "s": time.perf_counter() - start,
                          "stage": stage})

    triton.compiler.compile = compile
    return calls


def summarize_compiles(calls: list[dict], built_s: float = 0.05) -> dict:
    """Calls over `built_s` (a build, not a cache load): count and seconds by stage, and the ten slowest."""
    built = [c for c in calls if c["s"] > built_s]
    stages: dict[str, list] = {}
    for call in built:
        entry = stages.setdefault(call["stage"], [0, 0.0])
        entry[0] += 1
        entry[1] = round(entry[1] + call["s"], 2)
    return {"calls": len(calls), "built": len(built), "built_s": round(sum(c["s"] for c in built), 2),
            "by_stage": stages, "slowest": sorted(built, key=lambda c: -c["s"])[:10]}


def prepared(model_name: str, batch: int) -> tuple:
    """(model, inputs) of the workload as both compilers get it: fp16, channels-last, on the GPU, after one eager
    forward (the process's one-time costs fall on neither compile)."""
    import torch

    from opfuse.bench import harness
    from opfuse.bench.zoo import resolve_model

    torch.backends.cudnn.benchmark = True
    model, inputs, _ = resolve_model(model_name, batch=batch)
    model, inputs, _, _ = harness.prepare(model, inputs, torch.float16, "cuda")
    with torch.inference_mode():
        model(*inputs)
    return model, inputs


def inductor_child(model_name: str, batch: int) -> dict:
    """torch.compile's cold compile of the workload, as the zoo's cold child times it."""
    from opfuse.bench import harness

    _, seconds = harness.torch_compiled(*prepared(model_name, batch))
    return {"workload": f"{model_name}-bs{batch}", "workers": "inductor", "compile_s": seconds}


def child(model_name: str, batch: int, workers: int | None, cache: str, profile_to: str | None = None) -> dict:
    import torch

    import opfuse
    from opfuse.bench.timing import timed_compile
    from opfuse.environment import worker_log

    calls = counting_compiles()
    from opfuse.runtime.compile_worker import summarize_worker_log   # after Triton's compile is wrapped
    from opfuse.runtime.precompile import workers_of
    model, inputs = prepared(model_name, batch)
    config = opfuse.FusionConfig(dtype="float16", compile_workers=workers, cache_dir=cache)
    with torch.inference_mode():
        began = time.time()
        compiled, seconds = timed_compile(model, inputs, config, profile_to)
    precompiled = compiled.compiled.tuning.precompiled
    return {"workload": f"{model_name}-bs{batch}", "workers": workers_of(config), "compile_s": seconds,
            "stages": compiled.seconds, "precompiled": vars(precompiled) if precompiled else None,
            "kernels": len(compiled.compiled.kernels), "main_compiles": summarize_compiles(calls),
            "workers_did": summarize_worker_log(worker_log(), began)}


def run_child(model: str, batch: str, workers: str, cache: str, warm: bool, args) -> dict:
    """One compile in a process of its own over `cache` (and Triton's cache beneath it)."""
    suffix = "-warm" if warm else ""
    env = dict(os.environ, TRITON_CACHE_DIR=os.path.join(cache, "triton"), PYTHONUNBUFFERED="1",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               OPFUSE_WORKER_LOG=os.path.join(cache, f"workers{suffix}.jsonl"))
    profile_to = str(Path(args.out) / f"{model}-bs{batch}-w{workers}{suffix}.prof") if args.profile else ""
    done = subprocess.run([sys.executable, "-m", "benchmarks.compile_time", "--child", model, batch, workers, cache,
                           profile_to], env=env, capture_output=True, text=True)
    line = next((l for l in reversed(done.stdout.splitlines()) if l.startswith("{")), None)
    row = json.loads(line) if line else {"workload": f"{model}-bs{batch}", "workers": workers,
                                         "error": (done.stderr or done.stdout)[-2000:]}
    return dict(row, warm=warm)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="resnet50:1")
    parser.add_argument("--workers", default="1,8")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--profile", action="store_true", help="write each compile's cProfile statistics to --out")
    parser.add_argument("--warm", action="store_true", help="compile each again over the cold compile's caches")
    parser.add_argument("--child", nargs=5, metavar=("MODEL", "BATCH", "WORKERS", "CACHE", "PROFILE"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        model, batch, workers, cache, profile_to = args.child
        row = (inductor_child(model, int(batch)) if workers == "inductor"
               else child(model, int(batch), None if workers == "default" else int(workers), cache,
                          profile_to or None))
        print(json.dumps(row), flush=True)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for workload in workloads(args.workloads):
        model, _, batch = workload.rpartition(":")
        for workers in args.workers.split(","):
            cache = tempfile.mkdtemp(prefix="opfuse-compile-")
            for warm in (False, True) if args.warm else (False,):
                row = run_child(model, batch, workers, cache, warm, args)
                print(json.dumps(row), flush=True)
                rows.append(row)
                # written as it goes: a run cut short by its time limit keeps what it measured
                (out / "compile_time.json").write_text(json.dumps(rows, indent=1))
                (out / "compile_time.md").write_text(markdown(rows))
            shutil.rmtree(cache, ignore_errors=True)
    return 0


def workloads(spec: str) -> list[str]:
    """MODEL:BATCH items, comma-separated; `zoo` is every zoo model (`opfuse.bench.zoo.ZOO_MODELS`) at 1 and 64."""
    if spec == "zoo":
        from opfuse.bench.zoo import ZOO_MODELS

        return [f"{model}:{batch}" for batch in (1, 64) for model in ZOO_MODELS]
    return [w for w in spec.split(",") if w]


def markdown(rows: list[dict]) -> str:
    """A table of the cold compiles, a workload a line: torch.compile's seconds (rows of `inductor` workers) and
    each opfuse row's, with opfuse over torch.compile where both were measured."""
    table: dict[str, dict[str, float | None]] = {}
    for row in rows:
        if not row.get("warm"):
            table.setdefault(row["workload"], {})[str(row.get("workers"))] = row.get("compile_s")
    columns = sorted({c for entry in table.values() for c in entry if c != "inductor"})
    lines = ["| workload | torch.compile s | " + " | ".join(f"opfuse s ({c} workers) / torch.compile"
                                                         for c in columns) + " |",
             "|---|---|" + "---|" * len(columns)]

    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    for workload, entry in table.items():
        baseline = entry.get("inductor")
        cells = [f"{seconds(entry.get(c))} ({entry[c] / baseline:.2f}x)" if entry.get(c) and baseline
                 else seconds(entry.get(c)) for c in columns]
        lines.append(f"| {workload} | {seconds(baseline)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
