"""The coverage suite on the GPU (issue 54): each model of `opfuse.bench.suite.SUITE` compiled by opfuse and by the
best PyTorch paths, checked against a float32 reference and timed by the fair protocol
(`opfuse.bench.harness.run_workload`: one process, one `torch.inference_mode()`, rounds interleaved), in float16.

    python -m opfuse.bench.suite_gpu [--only REGEX] [--family NAME] [--batch N] [--budget S] [--json FILE]
                                     [--markdown FILE] [--in-process] [--variant SWITCH=0|1[+...]]...

The seeded random weights are made to look trained as the zoo's are (`looks_trained`): a layer initialised to zero
(timm's classification heads) would make every output 0 and leave nothing to check, and a model whose activations
pass float16's range is rescaled (`keep_float16_finite`); where eager float16 still overflows, the model is
unchecked, not matched. Per model: whether opfuse
compiled it, whether its output matches the float32 reference as `opfuse.numerics.acceptable`
rules (within float16's tolerance, or within the margin of eager float16's own error), and its speedup over the best
baseline (eager, eager in a CUDA graph, torch.compile: the fastest of them, not a convenient one). Over the suite
(`summarize`): the share of models compiled and matched, the geometric mean of the speedups, the slowest. Models run
one family at a time in turn (so that a budget cut leaves a spread of families), until `budget` seconds have passed;
the ones not reached are listed as such. Each `--variant` (FusionConfig switches) compiles opfuse once more under
them and times it in the same rounds: its time per model beside the default's (`GpuResult.variants`). The models
run in a child process (`run_isolated`): where it dies (a segmentation fault after a failed CUDA graph capture ended
a whole call in session 42), the model it was running is a failed row and a new child takes the rest.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import multiprocessing
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Sequence

import torch

from opfuse.bench.suite import SEED, SUITE, SuiteModel, at_batch, library_problem, select

CONTENDERS = ("eager", "eager_graph", "inductor", "opfuse")
# what of `run_workload`'s row a GpuResult keeps for the JSON: what opfuse planned and launched, the forms the tuner
# kept (library, unfused, split back) and what it measured per kernel; beside them each contender's kernel count
DETAIL = ("plan_launches", "runtime_launches", "predicted_ms", "library_anchors", "unfused", "split_back", "tuning")


@dataclass
class GpuResult:
    """One model's row: `status` is matched, mismatched, unchecked (eager float16 overflows: `UNCHECKED`), failed
    (opfuse did not compile it: `error`), no-baseline (no PyTorch path ran), skipped (its library is missing) or
    not-reached (the budget ran out)."""

    name: str
    family: str
    status: str
    error: str = ""
    opfuse_ms: float | None = None
    best: str | None = None             # the fastest baseline
    best_ms: float | None = None
    speedup: float | None = None        # best_ms / opfuse_ms
    rel_error: float | None = None      # opfuse's against the float32 reference
    eager_error: float | None = None    # eager float16's
    seconds: float = 0.0
    variants: dict = field(default_factory=dict)    # opfuse under other switches (`--variant`): label -> ms
    replay_ms: float | None = None      # opfuse's bare CUDA graph replay (opfuse_ms is its module call)
    busy_ms: float | None = None        # opfuse's kernels' summed time a call (the profiler's, on a GPU)
    best_busy_ms: float | None = None   # the best baseline's
    detail: dict = field(default_factory=dict)    # the JSON's: opfuse's launches, forms and tuning (`DETAIL`)


def interleave_families(models: Sequence[SuiteModel]) -> list[SuiteModel]:
    """The models one family at a time in turn, each family in suite order."""
    families: dict[str, list[SuiteModel]] = {}
    for m in models:
        families.setdefault(m.family, []).append(m)
    order = []
    while any(families.values()):
        for queue in families.values():
            if queue:
                order.append(queue.pop(0))
    return order


def looks_trained(model: torch.nn.Module, inputs: Sequence[torch.Tensor] | None = None) -> torch.nn.Module:
    """`model` with its zero-initialised layers reset, its norms and layer scales off their initial values
    (`opfuse.bench.zoo_models`), and, given its example `inputs`, its activations kept inside float16's range
    (`keep_float16_finite`)."""
    from opfuse.bench.zoo_models import randomise_layer_norms, reset_zero_layers, set_layer_scales

    with torch.no_grad():
        reset_zero_layers(model)
        randomise_layer_norms(model)
        set_layer_scales(model)
        if inputs is not None:
            keep_float16_finite(model, inputs)
    return model


FLOAT16_HEADROOM = 1e4    # an activation past this (float16's largest is 65504) has the model's layers rescaled


def keep_float16_finite(model: torch.nn.Module, inputs: Sequence[torch.Tensor]) -> bool:
    """Where a float32 forward of `inputs` has an activation past FLOAT16_HEADROOM, rescale the model so that none
    is: a second forward divides each convolution's and linear's weight and bias by its output's root mean square
    where that is over 1 (and its output with them, so the layers after it see the rescaled values). A ReLU network
    without biases computes the same function up to a scale, its float16 rounding unchanged. Returns whether it
    rescaled. As initialised, timm's Inception-V3 reached 1e12 (its convolutions' weights std 0.1): its float16
    output was infinite in eager and opfuse alike, and the suite's check compared two infinities."""
    largest = [0.0]

    def measure(module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel():
            largest[0] = max(largest[0], float(output.detach().abs().amax()))

    def rescale(module, args, output):
        rms = float(output.detach().float().pow(2).mean().sqrt())
        if rms <= 1.0 or not math.isfinite(rms):
            return None
        module.weight.div_(rms)
        if getattr(module, "bias", None) is not None:
            module.bias.div_(rms)
        return output / rms

    _forward_hooked(model, inputs, model.modules(), measure)
    if largest[0] <= FLOAT16_HEADROOM:
        return False
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.modules.conv._ConvNd, torch.nn.Linear))]
    _forward_hooked(model, inputs, layers, rescale)
    return True


def _forward_hooked(model: torch.nn.Module, inputs: Sequence[torch.Tensor], modules, hook) -> None:
    """One forward of `model` with `hook` as a forward hook on each of `modules`, removed after."""
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        model(*inputs)
    finally:
        for handle in handles:
            handle.remove()


def judge(entry: SuiteModel, row: dict, dtype: str, seconds: float) -> GpuResult:
    """A result row of `run_workload` as the suite's verdict on the model."""
    from opfuse.bench.harness import INDUCTOR_GRAPH_ERROR, best_baseline
    from opfuse.numerics import acceptable, tolerance

    result = GpuResult(entry.name, entry.family, "failed", seconds=seconds)
    opfuse_row, eager_row = row.get("opfuse", {}), row.get("eager", {})
    if "median_ms" not in opfuse_row:
        result.error = opfuse_row.get("error", "opfuse was not timed")[:400]
        return result
    result.opfuse_ms, result.rel_error = opfuse_row["median_ms"], opfuse_row.get("rel_error")
    result.variants = {label: value["median_ms"] for label, value in row.items()
                       if label.startswith("opfuse:") and isinstance(value, dict) and "median_ms" in value}
    result.eager_error = eager_row.get("rel_error")
    result.replay_ms, result.busy_ms = row.get("opfuse_replay_ms"), opfuse_row.get("gpu_busy_ms")
    result.detail = {key: row[key] for key in DETAIL if key in row} | {
        f"{label}_kernels": row[label].get("kernels") for label in CONTENDERS if isinstance(row.get(label), dict)}
    best = best_baseline(row)
    if best is not None:
        result.best, result.best_ms = best, row[best]["median_ms"]
        result.best_busy_ms = row[best].get("gpu_busy_ms")
        if row.get(INDUCTOR_GRAPH_ERROR) and best == "inductor":
            result.best = "inductor without a CUDA graph"
        result.speedup = result.best_ms / result.opfuse_ms
    if result.eager_error is not None and not math.isfinite(result.eager_error):
        result.status, result.error = "unchecked", UNCHECKED
        return result
    matched = result.rel_error is not None and acceptable(result.rel_error, tolerance(dtype), result.eager_error)
    result.status = "matched" if matched else "mismatched"
    if matched and best is None:
        result.status = "no-baseline"
    return result


# why a model is unchecked: where eager float16 itself overflows, opfuse's output matching it proves nothing
UNCHECKED = "eager float16 is not finite where the float32 reference is: nothing to check against"


def run_gpu_suite(models: Sequence[SuiteModel], batch: int = 1, budget: float = float("inf"),
                  device: str = "cuda", contenders: Sequence[str] = CONTENDERS, dtype: str = "float16",
                  on_result=None, on_start=None, variants: Sequence[str] = ()) -> list[GpuResult]:
    """Compile, check and time every model (`judge`), until `budget` seconds have passed."""
    from opfuse.bench.harness import measure_ceilings, run_workload, switched_configs
    from opfuse.config import FusionConfig

    ceilings = measure_ceilings() if torch.device(device).type == "cuda" else {}
    start, results = time.monotonic(), []
    for entry in models:
        problem = library_problem(entry.library)
        if problem is not None or time.monotonic() - start > budget:
            results.append(GpuResult(entry.name, entry.family, "skipped" if problem else "not-reached",
                                     error=problem or ""))
            continue
        began = time.monotonic()
        if on_start:
            on_start(entry)
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(SEED)
                model, inputs = entry.build()
                looks_trained(model, inputs)
            inputs = at_batch(inputs, batch)
            config = FusionConfig(dtype=dtype)
            row = run_workload(model, inputs, f"{entry.name}:{batch}", ceilings, contenders, config, device=device,
                               variants=switched_configs(config, variants))
            result = judge(entry, row, dtype, time.monotonic() - began)
        except Exception as error:      # a model that cannot even be built is a result, not the suite's end
            traceback.print_exc()
            result = GpuResult(entry.name, entry.family, "failed", error=f"{type(error).__name__}: {error}"[:400],
                               seconds=time.monotonic() - began)
        results.append(result)
        if on_result:
            on_result(result)
    return results


def run_isolated(names: Sequence[str], batch: int = 1, budget: float = float("inf"), device: str = "cuda",
                 contenders: Sequence[str] = CONTENDERS, dtype: str = "float16", on_result=None,
                 source: str = "opfuse.bench.suite:SUITE", variants: Sequence[str] = ()) -> list[GpuResult]:
    """`run_gpu_suite` over the models `names` of `source` (module:list) in a spawned child process; where the child
    dies, the model it was running is a failed row (the exit code says how) and a new child takes the models after
    it, within what is left of `budget`. Results in `names` order."""
    context = multiprocessing.get_context("spawn")
    start, results, families = time.monotonic(), {}, {}
    while pending := [n for n in names if n not in results]:
        left = budget - (time.monotonic() - start)
        if left <= 0:
            results |= {n: GpuResult(n, families.get(n, "?"), "not-reached") for n in pending}
            break
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_isolated_child, daemon=True,
                                args=(source, pending, batch, left, device, tuple(contenders), dtype, tuple(variants),
                                      send))
        child.start()
        send.close()
        running = None
        while True:
            try:
                message = receive.recv()
            except EOFError:        # the child is gone: done, or its last model crashed it
                child.join()
                if running is None and pending[0] not in results:   # it died before any model: none will run
                    results |= {n: GpuResult(n, "?", "failed", error=f"the suite's process died before its first "
                                             f"model (exit code {child.exitcode})") for n in pending}
                elif running is not None and running not in results:
                    results[running] = GpuResult(running, families[running], "failed",
                                                 error=f"the process died (exit code {child.exitcode})")
                    if on_result:
                        on_result(results[running])
                break
            if message[0] == "start":
                running, families[message[1]] = message[1], message[2]
            else:
                result = GpuResult(**message[1])
                results[result.name] = result
                if on_result:
                    on_result(result)
        receive.close()
    return [results[n] for n in names]


def _isolated_child(source: str, names: Sequence[str], batch: int, budget: float, device: str,
                    contenders: Sequence[str], dtype: str, variants: Sequence[str], connection) -> None:
    module, attribute = source.split(":")
    models = {m.name: m for m in getattr(importlib.import_module(module), attribute)}
    run_gpu_suite([models[n] for n in names], batch, budget, device, contenders, dtype,
                  on_result=lambda r: connection.send(("result", asdict(r))),
                  on_start=lambda entry: connection.send(("start", entry.name, entry.family)), variants=variants)
    connection.close()


def summarize(results: Sequence[GpuResult]) -> dict:
    """Over the models tried (not skipped or unreached): how many compiled, how many matched, the geometric mean
    of the speedups over the best baseline (matched models), the slowest and how many fell under 0.9x."""
    tried = [r for r in results if r.status not in ("skipped", "not-reached")]
    matched = [r for r in tried if r.status in ("matched", "no-baseline")]
    speedups = [r.speedup for r in matched if r.speedup]
    geomean = float(torch.tensor(speedups).log().mean().exp()) if speedups else None
    slowest = min((r for r in matched if r.speedup), key=lambda r: r.speedup, default=None)
    return {"tried": len(tried), "compiled": sum(r.opfuse_ms is not None for r in tried), "matched": len(matched),
            "matched_percent": round(100.0 * len(matched) / len(tried), 1) if tried else 0.0,
            "geomean_speedup": geomean, "below_0_9": sum(s < 0.9 for s in speedups),
            "slowest": f"{slowest.name} {slowest.speedup:.2f}x" if slowest else None,
            "not_reached": sum(r.status == "not-reached" for r in results)}


def markdown(results: Sequence[GpuResult], batch: int) -> str:
    s = summarize(results)
    geomean = f"{s['geomean_speedup']:.2f}x" if s["geomean_speedup"] else "-"
    labels = list(dict.fromkeys(label for r in results for label in r.variants))
    lines = [f"Batch {batch}: {s['matched']} of {s['tried']} models ({s['matched_percent']}%) compiled and matched "
             f"eager; geometric mean {geomean} over the best PyTorch path, {s['below_0_9']} under 0.9x (slowest: "
             f"{s['slowest']}); {s['not_reached']} not reached.", "",
             "| model | family | status | opfuse ms | best baseline | ms | speedup | rel. error (eager fp16) | opfuse "
             "replay ms | kernels busy ms (best's) |" + "".join(f" {label} ms |" for label in labels),
             "| --- | --- | --- | ---: | --- | ---: | ---: | --- | ---: | ---: |" + " ---: |" * len(labels)]
    for r in results:
        if r.status == "not-reached":
            continue
        error = f"{r.rel_error:.1e} ({r.eager_error:.1e})" if r.rel_error is not None and r.eager_error is not None \
            else r.error.replace("|", "/")[:120]
        lines.append(f"| {r.name} | {r.family} | {r.status} | {_ms(r.opfuse_ms)} | {r.best or '-'} | "
                     f"{_ms(r.best_ms)} | {f'{r.speedup:.2f}x' if r.speedup else '-'} | {error} | {_ms(r.replay_ms)} | "
                     f"{_ms(r.busy_ms)} ({_ms(r.best_busy_ms)}) |"
                     + "".join(f" {_ms(r.variants.get(label))} |" for label in labels))
    return "\n".join(lines) + "\n"


def _ms(value: float | None) -> str:
    return f"{value:.3f}" if value is not None else "-"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opfuse.bench.suite_gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="the models whose name matches this regular expression")
    parser.add_argument("--family", help="the models of this family")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds; models past it are not run")
    parser.add_argument("--json", metavar="FILE")
    parser.add_argument("--markdown", metavar="FILE")
    parser.add_argument("--variant", action="append", default=[], metavar="SWITCH=0|1[+...]",
                        help="also time opfuse under these FusionConfig switches (dependent_launch=0), in the same "
                             "rounds")
    parser.add_argument("--in-process", action="store_true", help="run the models in this process (a crash ends the "
                                                                    "run) instead of a child process")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the GPU suite needs a CUDA GPU (the CPU analysis is python -m opfuse.bench.suite)", file=sys.stderr)
        return 2
    models = interleave_families(select(SUITE, args.only, args.family))

    def progress(r: GpuResult) -> None:
        speed = f"{r.speedup:.2f}x over {r.best}" if r.speedup else r.error[:100]
        others = "".join(f"; {label} {ms / r.opfuse_ms:.2f}x the default's time" for label, ms in r.variants.items())
        print(f"{r.name:28} {r.status:10} {r.seconds:6.1f} s  {speed}{others}", flush=True)

    if args.in_process:
        results = run_gpu_suite(models, args.batch, args.budget, on_result=progress, variants=args.variant)
    else:
        results = run_isolated([m.name for m in models], args.batch, args.budget, on_result=progress,
                               variants=args.variant)
    print("\n" + markdown(results, args.batch).split("\n")[0])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summarize(results), "models": [asdict(r) for r in results]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results, args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
