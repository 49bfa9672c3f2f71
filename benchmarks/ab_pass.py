"""A/B one change on some workloads: opfuse compiled with the default pipeline and config (A), and with one graph
pass left out or one off-by-default FusionConfig switch on (B), both in one process.

    python -m benchmarks.ab_pass --workloads gpt2:1,vit_b_16:64 --without sink_reshapes --out DIR
    python -m benchmarks.ab_pass --workloads gpt2:1 --enable norm_prologue --out DIR

Both compiles follow the zoo's protocol (fp16, `opfuse.bench.harness.prepare`, inference mode, default
FusionConfig but fp16); each tunes into a cache of its own, and its compile seconds are recorded (Triton's kernel
cache is shared: where B compiles kernels A compiled, B's seconds are not a cold compile's). Their bare CUDA graph
replays and module calls are timed in interleaved rounds (`interleaved_samples`), B's output is compared with A's,
and each replay's kernels are listed by GPU time (torch.profiler, summed over runs), so that a difference can be
put on the kernels that make it. Writes ab.json after every workload and prints a table. A
diagnostic: results go to RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch


def kernel_times(replay, runs: int = 5) -> dict[str, float]:
    """GPU microseconds per replay of each kernel name."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            replay()
        torch.cuda.synchronize()
    times: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total = getattr(event, "device_time_total", None) or event.cuda_time_total
            times[event.name] += total / runs
    return dict(times)


def ab_workload(name: str, batch: int, args: argparse.Namespace, cache_root: Path) -> dict:
    import opfuse
    from opfuse.bench.harness import first_tensor, prepare
    from opfuse.bench.timing import interleaved_samples
    from opfuse.cli import load_model
    from opfuse.numerics import relative_error
    from opfuse.passes import manager

    model, inputs, _ = load_model(name, batch)
    model, inputs, _, _ = prepare(model, inputs, torch.float16)
    default = manager.default_pipeline
    label_b = f"without {args.without}" if args.without else f"with {args.enable}"
    variants = {"default": (default, {}),
                label_b: ((lambda: [p for p in default() if manager.pass_name(p) != args.without])
                          if args.without else default, {args.enable: True} if args.enable else {})}
    result: dict = {"model": name, "batch": batch, "variants": {}}
    calls, replays, outputs, kept = {}, {}, {}, []   # the compiled modules own the graphs' buffers
    with torch.inference_mode():
        model(*inputs)           # the process's one-time costs paid by neither variant
        for label, (pipeline, switches) in variants.items():
            manager.default_pipeline = pipeline
            config = opfuse.FusionConfig(dtype="fp16", tune_top=args.tune_top,
                                         cache_dir=str(cache_root / f"{name}-{batch}-{len(kept)}"), **switches)
            torch.cuda.synchronize()
            start = time.perf_counter()
            try:
                compiled = opfuse.compile(model, inputs, config, quiet=True)
            finally:
                manager.default_pipeline = default
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - start
            for _ in range(1 + compiled.compiled.cuda_graph_warmup):
                outputs[label] = first_tensor(compiled(*inputs)).float().clone()
            kept.append(compiled)
            calls[f"{label} call"] = lambda compiled=compiled: compiled(*inputs)
            replays[label] = compiled.compiled._cuda_graph.replay
            result["variants"][label] = {"compile_s": round(compile_s, 1),
                                         "plan_launches": compiled.plan.kernel_launches,
                                         "library_anchors": len(compiled.compiled.library_anchors)}
        result["rel_error_b_vs_a"] = float(relative_error(outputs[label_b], outputs["default"]))
        samples = interleaved_samples(replays | calls, rounds=10, per_round=5)
        for label, replay in replays.items():
            entry = result["variants"][label]
            entry["median_ms"] = statistics.median(samples[label])
            entry["call_ms"] = statistics.median(samples[f"{label} call"])
            entry["kernels_us"] = dict(sorted(kernel_times(replay).items(), key=lambda kv: -kv[1]))
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", required=True, help="model:batch,... (built-in names)")
    change = parser.add_mutually_exclusive_group(required=True)
    change.add_argument("--without", help="the graph pass left out of B, by name")
    change.add_argument("--enable", help="the FusionConfig switch B turns on (off by default)")
    parser.add_argument("--out", default="ab-out")
    parser.add_argument("--tune-top", type=int, default=4)
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="start no further workload after this many seconds")
    args = parser.parse_args()
    if args.enable:
        from opfuse.bench.zoo_bench import enable_switches

        enable_switches([args.enable])     # raises on a name that is not an off-by-default switch
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory() as cache_root:
        for spec in args.workloads.split(","):
            if args.budget is not None and time.perf_counter() - started > args.budget:
                results.append({"workload": spec, "error": "not run: the time budget ran out"})
                continue
            name, _, batch = spec.partition(":")
            try:
                results.append(ab_workload(name, int(batch or 1), args, Path(cache_root)))
            except Exception as error:     # one workload's failure is recorded; the others go on
                results.append({"workload": spec, "error": f"{type(error).__name__}: {error}"})
            (out / "ab.json").write_text(json.dumps(results, indent=1))
            report(results[-1])
    return 0


def report(result: dict) -> None:
    if "error" in result:
        print(f"{result['workload']}: {result['error']}", flush=True)
        return
    print(f"{result['model']} bs{result['batch']}: B vs A rel. error {result['rel_error_b_vs_a']:.1e}")
    for label, entry in result["variants"].items():
        busy = sum(entry["kernels_us"].values())
        print(f"  {label}: {entry['median_ms']:.3f} ms replay, {entry['call_ms']:.3f} ms call, {busy:.0f} us busy, "
              f"{entry['plan_launches']} launches, {entry['library_anchors']} library anchors, "
              f"compiled cold in {entry['compile_s']} s")
        for name, us in list(entry["kernels_us"].items())[:8]:
            print(f"      {us:8.1f} us  {name[:100]}")
    sys.stdout.flush()


if __name__ == "__main__":
    raise SystemExit(main())
