"""The model-zoo benchmark (issue 14): every zoo model at each batch, eager against torch.compile against opfuse,
by the fair protocol of `opfuse.bench.harness`, each workload in processes of its own.

Entry point: `run_zoo(out, workloads, settings)` (what `benchmarks/zoo.py` and `opfuse bench --zoo` run); ZOO.md is
rendered by `opfuse.bench.zoo_report.render`, from one or several runs' zoo.json.

Workloads (model, batch) go in chunks of `cold_parallel`. For each, two child processes with time caps, sharing the
workload's own cache folders (inductor's, Triton's and opfuse's tuning cache, all empty at the start):
1. cold: torch.compile and opfuse.compile from empty caches, after one eager forward (the process's one-time costs
   fall on neither); their compile seconds are kept, and opfuse's stages, its compile workers' counts
   (`Precompiled`) and their log summed (`summarize_worker_log`), to tell where a slow one went. A chunk's cold
   children run at once: both compilers then share the machine's CPUs and GPU alike (recorded with the results),
   and opfuse tunes into a throwaway cache, since kernel timings on a shared GPU are noise.
2. measure: alone on the machine, `run_workload` with every contender (both compilers compile again: Triton's and
   inductor's caches warm; opfuse's tuning cache warm only where the cold compile ran alone, `cold_parallel` 1).
A chunk is measured before the next one's cold compiles start, so a run with a deadline (`budget_s`) ends with
whole workloads. Results are written (atomically) to OUT/zoo.json and OUT/ZOO.md after every child, so a run
stopped by a time limit keeps what it measured; a workload that failed or ran out of time says so, with the end
of its log in OUT/zoo.log. A child runs in a process group of its own and is killed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

ZOO_BATCHES = (1, 64)
MIN_CHILD_S = 30.0     # a child needs about this long to import torch and build its model: start none with less left


@dataclass(frozen=True)
class ZooSettings:
    """How a zoo run compiles and measures; recorded in zoo.json and ZOO.md."""

    tune_top: int = 4               # opfuse's FusionConfig.tune_top (0: no autotuning)
    cold_parallel: int = 1          # cold-compile children running at once
    cold_timeout_s: float = 420.0
    measure_timeout_s: float = 300.0
    budget_s: float | None = None   # the whole run ends by then (a GPU call's limit): no child starts with less
                                    # than MIN_CHILD_S left, and each is stopped at the deadline at the latest
    rounds: int = 10                # interleaved timing rounds, `per_round` samples of each contender in each
    per_round: int = 5
    device: str = "cuda"            # "cpu" only for the orchestration's own tests, with
    compile_backend: str = "inductor"   # torch.compile's backend ("eager" there: no C++ compile on the CPU)
    enable: tuple[str, ...] = ()    # FusionConfig switches off by default that opfuse compiles with on (an A/B of a
                                    # fusion waiting for its measurement: `enable_switches`)


def enable_switches(names: Sequence[str]) -> tuple[str, ...]:
    """`names`, checked to be FusionConfig's boolean switches that are off by default (ValueError naming the
    others)."""
    from dataclasses import fields

    from opfuse.config import FusionConfig

    off = {f.name for f in fields(FusionConfig) if f.default is False}
    unknown = [n for n in names if n not in off]
    if unknown:
        raise ValueError(f"not a FusionConfig switch that is off by default: {', '.join(unknown)} "
                         f"(those are: {', '.join(sorted(off))})")
    return tuple(names)


def workload_key(model: str, batch: int) -> str:
    return f"{model}-bs{batch}"


def parse_workloads(models: Sequence[str], batches: Sequence[int]) -> list[tuple[str, int]]:
    """Every model at every batch, batch-major within a model (resnet50 bs1, resnet50 bs64, mobilenet_v2 bs1...)."""
    return [(model, batch) for model in models for batch in batches]


# ---- the parent ----------------------------------------------------------------------------------------------

def run_zoo(out: Path, workloads: Sequence[tuple[str, int]], settings: ZooSettings,
            cache_root: Path | None = None, progress: Callable[[str], None] = print) -> dict:
    """Run every workload's cold and measure children (see module docstring); returns what zoo.json holds."""
    out.mkdir(parents=True, exist_ok=True)
    cache_root = Path(cache_root or tempfile.mkdtemp(prefix="opfuse-zoo-"))
    started = time.monotonic()
    # tuned_alone: opfuse's autotuning timed its kernels with the GPU to itself (see the module docstring)
    # "call_inputs": the timed module call passes the tensors its graph was captured with, which it reads in place
    results: dict = {"settings": asdict(settings), "env": None, "tuned_alone": True, "call_inputs": "captured",
                     "workloads": {}}
    for model, batch in workloads:
        results["workloads"][workload_key(model, batch)] = {"model": model, "batch": batch}
    log = out / "zoo.log"
    log.write_text("")

    def left() -> float:
        """Seconds until the run's deadline (infinite without a budget)."""
        if settings.budget_s is None:
            return float("inf")
        return settings.budget_s - (time.monotonic() - started)

    def over_budget() -> bool:
        return left() < MIN_CHILD_S

    def save() -> None:
        from opfuse.bench.zoo_report import render

        write_atomically(out / "zoo.json", json.dumps(results, indent=1, default=str))
        write_atomically(out / "ZOO.md", render([results], work_of=None))     # rows carry their work

    def finished(key: str, stage: str, child: "Child") -> None:
        entry = results["workloads"][key]
        entry[stage] = child.result()
        if results["env"] is None and isinstance(entry[stage].get("env"), dict):
            results["env"] = entry[stage]["env"]
        with log.open("a") as handle:
            handle.write(f"==== {key} {stage}: {child.status()}\n{child.log_tail()}\n")
        progress(f"{key} {stage}: {child.status()}")
        save()

    keys = list(results["workloads"])
    chunk = max(1, settings.cold_parallel)
    running: list[tuple[str, Child]] = []
    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread:     # `timeout`'s SIGTERM raises SystemExit, so the `finally` below stops the children
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        for first in range(0, len(keys), chunk):      # a chunk's cold compiles at once, then each measured alone
            if over_budget():
                break
            for key in keys[first:first + chunk]:
                entry = results["workloads"][key]
                running.append((key, Child("cold", entry["model"], entry["batch"], cache_root / key, settings,
                                           left())))
            while running:
                time.sleep(0.5)
                for key, child in [(k, c) for k, c in running if c.done()]:
                    running.remove((key, child))
                    finished(key, "cold", child)
            for key in keys[first:first + chunk]:
                if over_budget():
                    break
                entry = results["workloads"][key]
                child = Child("measure", entry["model"], entry["batch"], cache_root / key, settings, left())
                running.append((key, child))
                while not child.done():
                    time.sleep(0.5)
                running.remove((key, child))
                finished(key, "measure", child)
    finally:                                          # interrupted: no child may go on holding the GPU
        for _, child in running:
            child.stop()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    for entry in results["workloads"].values():
        for stage in ("cold", "measure"):
            entry.setdefault(stage, {"error": "not run: the run's time budget was spent"})
    save()
    return results


def write_atomically(path: Path, text: str) -> None:
    """`path` holds the old text or the new, never half of one (a run stopped mid-write keeps what it had)."""
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


class Child:
    """One child process (`python -m opfuse.bench.zoo_bench child ...`) with its time cap, log and result file.

    It runs in a process group of its own, so stopping it also stops the compile workers it started."""

    def __init__(self, stage: str, model: str, batch: int, cache: Path, settings: ZooSettings,
                 deadline_s: float = float("inf")):
        cache.mkdir(parents=True, exist_ok=True)
        self.stage, self.cache = stage, cache
        self.result_path = cache / f"{stage}.json"
        self.result_path.unlink(missing_ok=True)      # never report an earlier run's result as this one's
        self.log_path = cache / f"{stage}.log"
        cap = settings.cold_timeout_s if stage == "cold" else settings.measure_timeout_s
        self.timeout = min(cap, deadline_s)
        worker_log = cache / f"{stage}-workers.jsonl"     # what opfuse's compile workers did (`child_main`)
        worker_log.unlink(missing_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                   TRITON_CACHE_DIR=str(cache / "triton"), OPFUSE_WORKER_LOG=str(worker_log))
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "opfuse.bench.zoo_bench", "child", stage, model, str(batch), str(cache),
                   json.dumps(asdict(settings))]
        self.started = time.monotonic()
        self.timed_out = False
        with self.log_path.open("w") as handle:
            self.process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)

    def done(self) -> bool:
        if self.process.poll() is not None:
            return True
        if time.monotonic() - self.started > self.timeout:
            self.timed_out = True
            self.stop()
            return True
        return False

    def stop(self) -> None:
        """Kill the child and everything it started (its process group)."""
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def status(self) -> str:
        seconds = time.monotonic() - self.started
        if self.timed_out:
            return f"stopped after its time cap of {self.timeout:.0f} s (the workload's cap, or the run's deadline)"
        code = self.process.returncode
        return f"done in {seconds:.0f} s" if code == 0 else f"failed (exit code {code}) after {seconds:.0f} s"

    def log_tail(self, lines: int = 25) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def result(self) -> dict:
        try:
            data = json.loads(self.result_path.read_text()) if self.result_path.exists() else {}
        except ValueError:                            # written atomically, so only a foreign file gets here
            data = {}
        if self.timed_out or self.process.returncode != 0:
            tail = self.log_tail(3).strip().splitlines()
            data.setdefault("error", f"{self.status()}" + (f": {tail[-1]}" if tail else ""))
        return data


# ---- the children ----------------------------------------------------------------------------------------------

def child_main(stage: str, model_name: str, batch: int, cache: Path, settings: ZooSettings) -> int:
    """One workload's cold compiles or its measurement; writes cache/<stage>.json as it goes."""
    import torch

    from opfuse.bench import harness
    from opfuse.bench.zoo import resolve_model
    from opfuse.config import FusionConfig
    from opfuse.environment import worker_log
    from opfuse.runtime.compile_worker import summarize_worker_log

    result_path = cache / f"{stage}.json"
    result: dict = {"model": model_name, "batch": batch}

    def write() -> None:
        write_atomically(result_path, json.dumps(result, indent=1, default=str))

    cuda = settings.device == "cuda"
    if cuda:
        torch.backends.cudnn.benchmark = True
        result["env"] = harness.environment()
    # opfuse's autotuner times kernels: with other cold children sharing the GPU those timings are noise, so a
    # parallel cold compile tunes into a cache of its own and the measuring child tunes again, alone
    tuning_cache = cache / ("opfuse-cold" if stage == "cold" and settings.cold_parallel > 1 else "opfuse")
    config = FusionConfig(dtype="float16" if cuda else "float32", autotune=settings.tune_top > 0,
                          tune_top=settings.tune_top or None, cache_dir=str(tuning_cache),
                          **{name: True for name in settings.enable})
    model, inputs, _ = resolve_model(model_name, batch=batch)
    write()
    if stage == "cold":
        model, inputs, _, _ = harness.prepare(model, inputs, torch.float16 if cuda else torch.float32,
                                              settings.device)
        with torch.inference_mode():
            model(*inputs)    # the process's one-time costs (CUDA context, cuDNN's choices) paid by neither compiler
            for label in ("inductor", "opfuse"):
                try:
                    began = time.time()
                    built = harness.BUILDERS[label](model, inputs, cuda, config=config,
                                                    backend=settings.compile_backend)
                    result[label] = {"compile_s": built.compile_s}
                    if label == "opfuse":   # its stages (OpfuseModule.seconds), what its compile workers did
                        result[label].update(stages=built.row["opfuse_compile_seconds"],
                                             precompiled=built.row["precompiled"],
                                             workers_did=summarize_worker_log(worker_log(), began))
                except Exception as error:
                    result[label] = {"error": f"{type(error).__name__}: {error}"}
                write()
        return 0
    print(f"{model_name} batch {batch}: measuring", flush=True)
    result["row"] = harness.run_workload(model, inputs, workload_key(model_name, batch), {}, harness.CONTENDERS,
                                         config, lambda label: print(f"  {label}", flush=True),
                                         device=settings.device, compile_backend=settings.compile_backend,
                                         rounds=settings.rounds,
                                         per_round=settings.per_round)
    write()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "child":
        _, stage, model, batch, cache, settings = argv
        return child_main(stage, model, int(batch), Path(cache), ZooSettings(**json.loads(settings)))
    parser = argparse.ArgumentParser(prog="python -m opfuse.bench.zoo_bench")
    add_zoo_arguments(parser)
    parser.add_argument("--out", default=os.environ.get("OUT", "zoo-out"))
    parser.add_argument("--tune-top", type=int, default=4, metavar="N",
                        help="opfuse's autotuning among each kernel's first N configs (default 4, as FusionConfig)")
    return run_zoo_command(parser.parse_args(argv))


def add_zoo_arguments(parser: argparse.ArgumentParser) -> None:
    """The zoo run's options (benchmarks/zoo.py and `opfuse bench --zoo`)."""
    parser.add_argument("--models", default=None,
                        help="comma-separated built-in names or package.module:factory (default: the whole zoo, "
                             "opfuse.bench.zoo.ZOO_MODELS)")
    parser.add_argument("--batches", default=",".join(map(str, ZOO_BATCHES)), help="comma-separated (default 1,64)")
    parser.add_argument("--workloads", default=None, metavar="MODEL:BATCH,...",
                        help="exactly these workloads (e.g. gpt2:1,swin_t:64) instead of every model at every batch")
    parser.add_argument("--cold-parallel", type=int, default=1, metavar="N",
                        help="cold-compile children running at once (default 1: each compile alone)")
    parser.add_argument("--cold-timeout", type=float, default=ZooSettings.cold_timeout_s, metavar="S",
                        help=f"a cold child's time cap (default {ZooSettings.cold_timeout_s:.0f} s; the measuring "
                             f"one's is {ZooSettings.measure_timeout_s:.0f} s)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="start no child after S seconds (to fit one call of a lent GPU machine)")
    parser.add_argument("--enable", default="", metavar="SWITCH,...",
                        help="FusionConfig switches that are off by default to compile opfuse with on (e.g. "
                             "norm_prologue: a fusion waiting for its measurement)")


def run_zoo_command(args: argparse.Namespace) -> int:
    from opfuse.bench.zoo import BUILTIN_MODELS, ZOO_MODELS

    try:
        if args.workloads:
            workloads = [(m.strip(), int(b)) for m, _, b in (w.rpartition(":") for w in args.workloads.split(","))]
        else:
            models = [m.strip() for m in (args.models or ",".join(ZOO_MODELS)).split(",") if m.strip()]
            workloads = parse_workloads(models, [int(b) for b in args.batches.split(",") if b.strip()])
    except ValueError:
        workloads = []
    try:
        enable = enable_switches([n.strip() for n in getattr(args, "enable", "").split(",") if n.strip()])
    except ValueError as error:
        print(f"zoo: --enable: {error}", file=sys.stderr)
        return 2
    unknown = sorted({m for m, _ in workloads if m not in BUILTIN_MODELS and ":" not in m})
    if unknown or not workloads or min(b for _, b in workloads) < 1:
        print(f"zoo: give --models among {', '.join(BUILTIN_MODELS)} (unknown: {unknown}) and --batches as "
              "positive integers, or --workloads MODEL:BATCH,...", file=sys.stderr)
        return 2
    settings = ZooSettings(tune_top=args.tune_top, cold_parallel=args.cold_parallel, budget_s=args.budget,
                           cold_timeout_s=args.cold_timeout, enable=enable)
    results = run_zoo(Path(args.out), workloads, settings)
    if not getattr(args, "quiet", False):
        from opfuse.bench.zoo_report import render

        print(render([results], work_of=None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
