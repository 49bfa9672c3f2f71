"""A/B one graph pass on one workload: opfuse compiled with the default pipeline and without PASS, same process.

    python benchmarks/ab_pass.py --model gpt2 --batch 1 --without sink_reshapes --out DIR

Both compiles follow the zoo's protocol (fp16, `opfuse.bench.harness.prepare`, inference mode, default
FusionConfig but fp16); their bare CUDA graph replays are timed in interleaved rounds (`interleaved_samples`), and
each replay's kernels are listed by GPU time (torch.profiler, summed over runs), so that a difference can be put on
the kernels that make it. Writes ab.json and prints a table. A diagnostic: results go to RESULTS.md by hand.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--without", required=True, help="the pass left out of B, by name")
    parser.add_argument("--out", default="ab-out")
    parser.add_argument("--tune-top", type=int, default=4)
    args = parser.parse_args()

    import opfuse
    from opfuse.bench.harness import prepare
    from opfuse.bench.timing import interleaved_samples
    from opfuse.cli import load_model
    from opfuse.passes import manager

    model, inputs, _ = load_model(args.model, args.batch)
    model, inputs, _, _ = prepare(model, inputs, torch.float16)
    default = manager.default_pipeline
    results: dict = {"model": args.model, "batch": args.batch, "without": args.without, "variants": {}}
    replays, kept = {}, []     # the compiled modules own the graphs' buffers: they must outlive the replays
    with torch.inference_mode():
        for label, pipeline in (("default", default),
                                (f"without {args.without}",
                                 lambda: [p for p in default() if manager.pass_name(p) != args.without])):
            manager.default_pipeline = pipeline
            compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="fp16", tune_top=args.tune_top),
                                      quiet=True)
            for _ in range(1 + compiled.compiled.cuda_graph_warmup):
                compiled(*inputs)
            kept.append(compiled)
            replays[label] = compiled.compiled._cuda_graph.replay
            results["variants"][label] = {"plan_launches": compiled.plan.kernel_launches,
                                          "library_anchors": len(compiled.compiled.library_anchors)}
        manager.default_pipeline = default
        samples = interleaved_samples(replays, rounds=10, per_round=5)
        for label, replay in replays.items():
            entry = results["variants"][label]
            entry["median_ms"] = statistics.median(samples[label])
            entry["kernels_us"] = dict(sorted(kernel_times(replay).items(), key=lambda kv: -kv[1]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ab.json").write_text(json.dumps(results, indent=1))
    for label, entry in results["variants"].items():
        busy = sum(entry["kernels_us"].values())
        print(f"{label}: {entry['median_ms']:.3f} ms replay, {busy:.0f} us busy, {entry['plan_launches']} launches, "
              f"{entry['library_anchors']} library anchors")
        for name, us in list(entry["kernels_us"].items())[:12]:
            print(f"    {us:8.1f} us  {name[:100]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
