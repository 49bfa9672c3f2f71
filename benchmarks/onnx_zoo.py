"""opfuse from an .onnx file against opfuse from the same PyTorch model (issue 18, item 4), and both against
onnxruntime, for the zoo's torchvision models, in one process.

    python -m benchmarks.onnx_zoo --out DIR [--models resnet50,mobilenet_v2,...] [--batches 1] [--budget SECONDS]
                                  [--tune-top N] [--exporter auto|dynamo|torchscript] [--device cuda|cpu]

For each model and batch (default: every torchvision model of `opfuse.bench.zoo.ZOO_MODELS` at batch 1):
1. the model is built as the zoo builds it (seeded weights made to look trained) and put in the protocol's form
   (`harness.protocol_form`: fp16, channels-last, on the GPU);
2. that very module is exported with torch.onnx.export: the dynamo exporter (it needs onnxscript), else the
   TorchScript one; the row says which ran and why the other did not;
3. opfuse compiles the module and then the .onnx file, with one FusionConfig and one tuning cache: where both
   frontends give the same kernel, the second compile reuses the first one's tuning, so a difference in time is
   a difference in what was planned, not tuning noise (and the second compile's seconds are warm ones);
4. both are timed as `harness.run_workload` times opfuse, under one `torch.inference_mode()`: their module calls
   and bare CUDA graph replays in interleaved rounds (`timing.interleaved_samples`), median and 10th-90th
   percentile spread; kernels per forward counted by torch.profiler on the replay;
5. each output is compared (`opfuse.numerics.relative_error`) with the float32 PyTorch reference and with
   onnxruntime's output for the exported file (CUDAExecutionProvider where it loads, else the CPU one; a provider
   that cannot run the fp16 file runs the model exported again in float32, from the same fp16 weights), against
   the zoo's tolerance for the dtype (`opfuse.numerics.tolerance`: 1e-2 for fp16).
The issue's bar: the ONNX compile's replay within 5% of the PyTorch compile's, and both within the tolerance of
onnxruntime.

DIR/onnx_zoo.json and DIR/ONNX_ZOO.md are written after every model, so a run stopped by its time limit keeps what
it measured. `--budget S` starts no model with less than MIN_MODEL_S left and stops the one running at S seconds
(a SIGTERM, from `timeout`, stops it too); a model that fails is recorded with its error and the next one runs.
With `--device cpu` (tests, a dry run) nothing is timed: Triton runs in its interpreter there.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import importlib
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Sequence

import torch

from opfuse.bench import harness
from opfuse.bench.timing import interleaved_samples, kernel_profile, spread_of, summarize

MIN_MODEL_S = 60.0      # build, export, two compiles and timing of the smallest zoo model: start none with less left
FRONTENDS = ("pytorch", "onnx")
RATIO_BAR = 1.05        # the "same speed": the ONNX compile's replay at most 5% slower


class OutOfTime(BaseException):
    """The run's time budget ran out (or `timeout` sent SIGTERM) mid-model. A BaseException, so that no
    `except Exception` on the way (a compile's own fallbacks) swallows it."""


def torchvision_zoo_models() -> list[str]:
    from opfuse.bench.zoo import BUILTIN_MODELS, ZOO_MODELS

    return [name for name in ZOO_MODELS if BUILTIN_MODELS[name].input_kind == "image"]


# ---- export and onnxruntime -----------------------------------------------------------------------------------

def export_onnx(model: torch.nn.Module, inputs: tuple, path: Path, exporter: str = "auto") -> dict:
    """Export `model` to `path`; {"exporter": "dynamo" | "torchscript", "export_s", "note"?}. "auto" tries the
    dynamo exporter and falls back to the TorchScript one, saying why in "note"; an exporter asked for by name
    that fails raises."""
    failures = []
    for name in (("dynamo", "torchscript") if exporter == "auto" else (exporter,)):
        start = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")      # the TorchScript exporter's deprecation warning, every call
                torch.onnx.export(model, inputs, str(path), dynamo=name == "dynamo")
        except Exception as error:
            if exporter != "auto":
                raise
            failures.append(f"the {name} exporter failed ({type(error).__name__}: {str(error)[:300]})")
            print(f"  {failures[-1]}", flush=True)
            continue
        # the dynamo exporter writes the weights beside the file (PATH.data): count them in
        size = sum(f.stat().st_size for f in path.parent.glob(path.name + "*"))
        result = {"exporter": name, "export_s": time.perf_counter() - start, "onnx_mb": size / 1e6}
        if failures:
            result["note"] = "; ".join(failures) + f"; exported by the {name} exporter"
        return result
    raise RuntimeError("; ".join(failures))


def onnxruntime_output(model: torch.nn.Module, inputs: tuple, path: Path, exporter: str, device: str) -> dict:
    """onnxruntime's output for the exported file `path`: {"output", "provider", "dtype", "note"?}; where the
    provider cannot run the fp16 file (onnxruntime's CPU provider lacks most fp16 kernels), the model is exported
    again in float32 (same weights, widened) and run on float32 inputs."""
    import onnxruntime

    wanted = ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        wanted.insert(0, "CUDAExecutionProvider")

    def run(file: Path, values: tuple) -> tuple[Any, str]:
        session = onnxruntime.InferenceSession(str(file), providers=wanted)
        feeds = {i.name: x.detach().cpu().contiguous().numpy() for i, x in zip(session.get_inputs(), values)}
        return session.run(None, feeds)[0], session.get_providers()[0]

    dtype = str(inputs[0].dtype).removeprefix("torch.")
    try:
        output, provider = run(path, inputs)
        return {"output": torch.from_numpy(output), "provider": provider, "dtype": dtype}
    except Exception as error:
        if dtype == "float32":
            raise
        note = (f"onnxruntime could not run the {dtype} file ({type(error).__name__}: {str(error)[:200]}); "
                "ran the model exported in float32")
    wide = copy.deepcopy(model).float()
    wide_inputs = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    wide_path = path.with_name(path.stem + "-float32.onnx")
    export_onnx(wide, wide_inputs, wide_path, exporter)
    output, provider = run(wide_path, wide_inputs)
    return {"output": torch.from_numpy(output), "provider": provider, "dtype": "float32", "note": note}


# ---- one model ------------------------------------------------------------------------------------------------

def measure_model(name: str, model: torch.nn.Module, inputs: Sequence[torch.Tensor], config: Any, workdir: Path,
                  *, device: str = "cuda", exporter: str = "auto", timed: bool = True, rounds: int = 10,
                  per_round: int = 5) -> dict:
    """One model (as the zoo builds it, float32 on the CPU) compiled by opfuse from PyTorch and from its export,
    timed (`timed`) and compared with the float32 reference and onnxruntime; the report's row (module docstring).

    `config` is the FusionConfig of both compiles (its dtype is the protocol's); the .onnx file goes to `workdir`."""
    from opfuse.ir.graph import torch_dtype
    from opfuse.numerics import relative_error, tolerance

    cuda = torch.device(device).type == "cuda"
    row: dict = {"model": name, "batch": int(inputs[0].shape[0]), "dtype": config.dtype}
    torch.manual_seed(0)
    model, inputs, reference_model, reference_inputs = harness.prepare(model, inputs, torch_dtype(config.dtype),
                                                                       device)
    with torch.inference_mode():
        reference = harness.first_tensor(reference_model(*reference_inputs)).float()
    del reference_model, reference_inputs

    folder = workdir / f"{name}-bs{row['batch']}"     # the .onnx file, its weights file, a float32 export
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.onnx"
    print(f"{name} batch {row['batch']}: exporting", flush=True)
    row.update(export_onnx(model, inputs, path, exporter))

    built: dict[str, harness.Built] = {}
    with torch.inference_mode():        # compiled, warmed, captured and timed as run_workload does opfuse
        for frontend, source in zip(FRONTENDS, (model, str(path))):
            print(f"  compiling from {frontend}", flush=True)
            try:
                built[frontend] = harness.BUILDERS["opfuse"](source, inputs, cuda, config=config)
            except Exception as error:
                row[frontend] = {"error": f"{type(error).__name__}: {error}"}
                traceback.print_exc()
            gc.collect()
        samples: dict[str, list[float]] = {}
        failed: dict[str, str] = {}
        if timed and built:
            print("  timing", flush=True)
            forwards = {}
            for frontend, contender in built.items():
                forwards[frontend] = contender.forwards["opfuse"]
                if "opfuse_replay" in contender.forwards:
                    forwards[f"{frontend}_replay"] = contender.forwards["opfuse_replay"]
            samples = interleaved_samples(forwards, rounds=rounds, per_round=per_round, cuda=cuda, errors=failed)
        for frontend, contender in built.items():
            entry = dict(contender.row, compile_s=contender.compile_s,
                         groups_through_pytorch=harness.pytorch_group_count(contender.row),
                         rel_error_reference=relative_error(contender.output.float(), reference))
            for key, label in ((frontend, "call"), (f"{frontend}_replay", "replay")):
                if samples.get(key):
                    entry[label] = asdict(summarize(samples[key]))
                elif key in failed:
                    entry[label] = {"error": failed[key]}
            if timed and cuda:
                entry["kernels"], entry["gpu_busy_ms"] = kernel_profile(lambda: contender.profiled(), ())
            row[frontend] = entry

    for label in ("replay", "call"):
        times = [row.get(f, {}).get(label, {}).get("median_ms") for f in FRONTENDS]
        if all(times):
            row[f"ratio_{label}"] = times[1] / times[0]     # ONNX over PyTorch: above 1, the ONNX compile is slower

    print("  onnxruntime", flush=True)
    try:
        runtime = onnxruntime_output(model, inputs, path, row["exporter"], device)
        output = runtime.pop("output").float()
        runtime["tolerance"] = tolerance(config.dtype)
        runtime["rel_error_reference"] = relative_error(output, reference.cpu())
        for frontend, contender in built.items():
            runtime[f"rel_error_{frontend}"] = relative_error(contender.output.float().cpu(), output)
        runtime["passed"] = bool(built) and all(runtime[f"rel_error_{f}"] <= runtime["tolerance"] for f in built)
        row["onnxruntime"] = runtime
    except ImportError as error:
        row["onnxruntime"] = {"error": f"onnxruntime is not installed ({error})"}
    except Exception as error:
        row["onnxruntime"] = {"error": f"{type(error).__name__}: {error}"}
        traceback.print_exc()
    del built
    shutil.rmtree(folder, ignore_errors=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return row


# ---- the run --------------------------------------------------------------------------------------------------

def environment(device: str) -> dict:
    """harness.environment() on the GPU (date, GPU, driver, torch, triton, Python), and the ONNX packages'
    versions."""
    if torch.device(device).type == "cuda":
        env = harness.environment()
    else:
        env = {"date": datetime.date.today().isoformat(), "gpu": "none (CPU)", "driver": "-",
               "torch": torch.__version__, "python": sys.version.split()[0]}
    for package in ("onnx", "onnxscript", "onnxruntime"):
        try:
            env[package] = importlib.import_module(package).__version__
        except Exception:
            env[package] = "not installed"
    return env


@contextlib.contextmanager
def deadline(budget_s: float | None):
    """OutOfTime raised in the main thread at `budget_s` seconds, or on SIGTERM (`timeout`'s signal)."""
    def stop(signum, _frame):
        raise OutOfTime("SIGTERM" if signum == signal.SIGTERM else f"the time budget of {budget_s:.0f} s ran out")

    if threading.current_thread() is not threading.main_thread():     # signals reach the main thread only
        yield
        return
    previous = signal.signal(signal.SIGTERM, stop), signal.signal(signal.SIGALRM, stop)
    if budget_s is not None:
        signal.setitimer(signal.ITIMER_REAL, max(budget_s, 0.001))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGALRM, previous[1])


def run(out: Path, workloads: Sequence[tuple[str, int]], *, device: str = "cuda", tune_top: int = 4,
        exporter: str = "auto", budget_s: float | None = None, rounds: int = 10, per_round: int = 5,
        image_size: int = 224) -> dict:
    """Every (model, batch) by `measure_model`; writes out/onnx_zoo.json and out/ONNX_ZOO.md after each."""
    from opfuse.bench.zoo import BUILTIN_MODELS, build_seeded, image_inputs
    from opfuse.config import FusionConfig

    cuda = torch.device(device).type == "cuda"
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="opfuse-onnx-zoo-"))      # .onnx files and the tuning cache
    config = FusionConfig(dtype="float16" if cuda else "float32", autotune=tune_top > 0, tune_top=tune_top or None,
                          cache_dir=str(workdir / "tuning"))
    results = {"env": environment(device),
               "settings": {"tune_top": tune_top, "exporter": exporter, "budget_s": budget_s, "rounds": rounds,
                            "per_round": per_round, "image_size": image_size, "device": device, "timed": cuda},
               "rows": [{"model": m, "batch": b, "error": "not run: the run's time budget was spent"}
                        for m, b in workloads]}
    started = time.monotonic()

    def save() -> None:
        for name, text in (("onnx_zoo.json", json.dumps(results, indent=1, default=str)),
                           ("ONNX_ZOO.md", render(results))):
            temporary = out / (name + ".tmp")
            temporary.write_text(text)
            os.replace(temporary, out / name)

    save()
    running = None      # the index of the model being measured
    try:
        with deadline(budget_s):
            for index, (name, batch) in enumerate(workloads):
                if budget_s is not None and budget_s - (time.monotonic() - started) < MIN_MODEL_S:
                    break
                running, model_started = index, time.monotonic()
                try:
                    model = build_seeded(BUILTIN_MODELS[name].build)
                    row = measure_model(name, model, image_inputs(batch, image_size), config, workdir,
                                        device=device, exporter=exporter, timed=cuda, rounds=rounds,
                                        per_round=per_round)
                except Exception as error:
                    row = {"model": name, "batch": batch, "error": f"{type(error).__name__}: {error}"}
                    traceback.print_exc()
                row["seconds"] = time.monotonic() - model_started
                results["rows"][index], running = row, None
                print(f"{name} batch {batch}: done in {row['seconds']:.0f} s", flush=True)
                save()
    except OutOfTime as why:
        if running is not None:
            results["rows"][running]["error"] = f"stopped mid-way: {why}"
        print(f"stopped: {why}", flush=True)
    save()
    shutil.rmtree(workdir, ignore_errors=True)
    return results


# ---- the report -----------------------------------------------------------------------------------------------

def _ms(entry: dict, label: str) -> str:
    value = entry.get(label, {})
    return f"{value['median_ms']:.3f}" if "median_ms" in value else ("failed" if "error" in value else "-")


def _pair(row: dict, key: str, fmt: str = "{}") -> str:
    values = [row.get(f, {}).get(key) for f in FRONTENDS]
    return " / ".join("-" if v is None else fmt.format(v) for v in values)


def _spread(entry: dict) -> str:
    value = spread_of(entry.get("replay", {}))
    return "-" if value is None else f"{value * 100:.0f}%"


def render(results: dict) -> str:
    """ONNX_ZOO.md: the header, the issue's two bars as a headline, one row per model, then what failed."""
    env, settings = results["env"], results["settings"]
    rows = results["rows"]
    lines = ["# opfuse from ONNX against opfuse from PyTorch (issue 18, item 4)", "",
             "Generated by `benchmarks/onnx_zoo.py`; do not edit by hand. Each torchvision zoo model built as "
             "`benchmarks/zoo.py` builds it (fp16, channels-last, seeded weights made to look trained), exported "
             "with torch.onnx.export, compiled by opfuse from the module and from the .onnx file (one config, one "
             "tuning cache), both timed by the fair protocol (opfuse/bench/harness.py: one `torch.inference_mode()`, "
             "interleaved rounds, CUDA events). Times are medians in ms per forward, the bare CUDA graph replay and "
             "the module call; ratio is ONNX over PyTorch (above 1: the ONNX compile is slower); spread is "
             "(p90 - p10) / median of the replay's samples. Errors are relative (||a - b|| / ||b||).", "",
             f"- {env.get('date', '?')}, {env.get('gpu', '?')} (driver {env.get('driver', '?')}), torch "
             f"{env.get('torch', '?')}, triton {env.get('triton', '-')}, Python {env.get('python', '?')}, onnx "
             f"{env.get('onnx')}, onnxscript {env.get('onnxscript')}, onnxruntime {env.get('onnxruntime')}; opfuse "
             f"tune_top {settings['tune_top']}, exporter {settings['exporter']}, {settings['rounds']} rounds x "
             f"{settings['per_round']} samples, {settings['image_size']} px" + ("" if settings.get("timed", True)
                                                                                 else "; not timed (CPU)")]
    ratios = [r["ratio_replay"] for r in rows if "ratio_replay" in r]
    compared = [r["onnxruntime"] for r in rows if "passed" in r.get("onnxruntime", {})]
    within = sum(value <= RATIO_BAR for value in ratios)
    lines += ["", "## Headline", "",
              f"ONNX compile's replay within {(RATIO_BAR - 1) * 100:.0f}% of the PyTorch compile's: **{within} of "
              f"{len(ratios)}** models" + (f" (ratios {min(ratios):.3f} to {max(ratios):.3f})" if ratios else "")
              + f". Both compiles within the tolerance of onnxruntime: **{sum(c['passed'] for c in compared)} of "
              f"{len(compared)}**.", "",
              "| model | batch | exporter | opfuse from PyTorch, ms replay / call | opfuse from ONNX, ms replay / call "
              "| ratio ONNX / PyTorch, replay / call | spread PyTorch / ONNX | kernels PyTorch / ONNX | plan launches "
              "PyTorch / ONNX | groups through PyTorch, PyTorch / ONNX | rel. error vs onnxruntime, PyTorch / ONNX "
              "(tolerance) | onnxruntime: provider, dtype, its error vs fp32 PyTorch | rel. error vs fp32 PyTorch, "
              "PyTorch / ONNX |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    problems = []
    for row in rows:
        if "error" in row:
            problems.append(f"- {row['model']} bs{row['batch']}: {row['error'].splitlines()[0][:300]}")
            continue
        runtime = row.get("onnxruntime", {})
        if "error" in runtime:
            problems.append(f"- {row['model']} bs{row['batch']}, onnxruntime: {runtime['error'][:300]}")
            against, provider = "-", "-"
        else:
            against = (" / ".join(f"{runtime[f'rel_error_{f}']:.1e}" if f"rel_error_{f}" in runtime else "-"
                                  for f in FRONTENDS) + f" ({runtime['tolerance']:.0e})")
            provider = (f"{runtime['provider'].removesuffix('ExecutionProvider')}, {runtime['dtype']}, "
                        f"{runtime['rel_error_reference']:.1e}")
        for note in (row.get("note"), runtime.get("note")):
            if note:
                problems.append(f"- {row['model']} bs{row['batch']}, note: {note[:400]}")
        for frontend in FRONTENDS:
            if "error" in row.get(frontend, {}):
                problems.append(f"- {row['model']} bs{row['batch']}, from {frontend}: "
                                f"{row[frontend]['error'].splitlines()[0][:300]}")
        ratio = " / ".join(f"{row[k]:.3f}" if k in row else "-" for k in ("ratio_replay", "ratio_call"))
        timing = [f"{_ms(row.get(f, {}), 'replay')} / {_ms(row.get(f, {}), 'call')}" for f in FRONTENDS]
        lines.append(f"| {row['model']} | {row['batch']} | {row['exporter']} | {timing[0]} | {timing[1]} | {ratio} | "
                     f"{' / '.join(_spread(row.get(f, {})) for f in FRONTENDS)} | {_pair(row, 'kernels')} | "
                     f"{_pair(row, 'plan_launches')} | {_pair(row, 'groups_through_pytorch')} | {against} | "
                     f"{provider} | {_pair(row, 'rel_error_reference', '{:.1e}')} |")
    if problems:
        lines += ["", "## Failed, not run, or worth knowing", "", *problems]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    from opfuse.bench.zoo import BUILTIN_MODELS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "onnx-zoo-out"))
    parser.add_argument("--models", default=",".join(torchvision_zoo_models()),
                        help="comma-separated image models of the zoo (default: its torchvision models)")
    parser.add_argument("--batches", default="1", help="comma-separated (default 1)")
    parser.add_argument("--budget", type=float, default=None, metavar="S",
                        help="start no model after S - %d s and stop the one running at S s" % MIN_MODEL_S)
    parser.add_argument("--tune-top", type=int, default=4, metavar="N",
                        help="opfuse's autotuning among each kernel's first N configs (default 4, as the zoo)")
    parser.add_argument("--exporter", choices=("auto", "dynamo", "torchscript"), default="auto",
                        help="torch.onnx.export's exporter (auto: dynamo, else TorchScript)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--per-round", type=int, default=5)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of export, compile and onnxruntime, nothing timed (Triton interpreted)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if BUILTIN_MODELS.get(m) is None or BUILTIN_MODELS[m].input_kind != "image"]
    try:
        batches = [int(b) for b in args.batches.split(",") if b.strip()]
    except ValueError:
        batches = []
    if unknown or not models or not batches or min(batches) < 1:
        print(f"onnx_zoo: give --models among {', '.join(torchvision_zoo_models())} (unknown: {unknown}) and "
              "--batches as positive integers", file=sys.stderr)
        return 2
    if args.device == "cuda":
        if harness.start_gpu_run("benchmarks/onnx_zoo.py", args.out) is None:
            return 1
    results = run(Path(args.out), [(m, b) for m in models for b in batches], device=args.device,
                  tune_top=args.tune_top, exporter=args.exporter, budget_s=args.budget, rounds=args.rounds,
                  per_round=args.per_round, image_size=args.image_size)
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
