"""Where the module call's time over the bare CUDA graph replay goes (issue 17, item 3), on the GPU.

    python -m benchmarks.call_overhead --workloads resnet50:1,resnext50_32x4d:1 [--out DIR] [--rounds 20]

Each workload is compiled once (fp16, the zoo's protocol form, no autotuning: the call path does not depend on
the configs) and then timed, by the zoo's clock (latency from an idle GPU, rounds interleaved), as a ladder of
forwards that each add one step of the module call to the one before:

    replay        the bare graph replay (what torch.compile + CUDA graph is timed as)
    call          OpfuseModule.__call__ with the tensors the capture borrowed (the zoo's call): no copy in

then, after one call with other tensors has moved the model to private input buffers (a second set of rounds):

    replay        the bare replay of the graph captured again
    +copy in      the input copies into the static buffers, then the replay
    +clone out    ... and the copies of the outputs the caller gets
    run_matching  CompiledModel.run_matching: the same steps as the runtime does them
    call copy     OpfuseModule.__call__ with tensors of the caller's own (copied in)
    call static   the call given the graph's own input buffers (no copy in)

With --with-inductor, torch.compile's model is built in the same process and timed in the same rounds, as the
zoo does (an "inductor" row).

Besides the GPU latency, `host us` is the host time of one forward (perf_counter over 200 calls, the GPU drained
before and after), which is what a call adds when the GPU waits for it. Writes DIR/call_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(name: str, batch: int, rounds: int, with_inductor: bool = False) -> dict:
    import opfuse
    from opfuse.bench.harness import BUILDERS, protocol_form
    from opfuse.bench.timing import interleaved_samples, summarize
    from opfuse.cli import load_model

    model, inputs, _ = load_model(name, batch)
    model, inputs = protocol_form(model, inputs)
    with torch.inference_mode():
        start = time.perf_counter()
        compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(autotune=False))
        compile_s = time.perf_counter() - start
        for _ in range(2 + compiled.compiled.cuda_graph_warmup):
            compiled(*inputs)
        runtime = compiled.compiled
        if runtime._cuda_graph is None:
            return {"workload": f"{name}:{batch}", "error": runtime.cuda_graph_error}
        others = {}
        if with_inductor:   # the zoo's process holds torch.compile's model too, timed in the same rounds
            others = BUILDERS["inductor"](model, inputs, cuda=True).forwards
        borrowing = others | {"replay": runtime._cuda_graph.replay, "call": lambda: compiled(*inputs)}
        samples = {"borrowed": interleaved_samples(borrowing, rounds=rounds, per_round=5)}
        hosts = {"borrowed": {label: host_us(fn) for label, fn in borrowing.items()}}

        mine = [x.clone() for x in inputs]      # the caller's own tensors: the model moves to private buffers
        compiled(*mine)
        graph, statics, outs = runtime._cuda_graph, runtime.static_inputs, runtime._static_outputs

        def copy_in():
            for static, x in zip(statics, mine):
                static.copy_(x)
            graph.replay()

        def copy_clone():
            copy_in()
            return [o.clone() for o in outs]

        private = others | {"replay": graph.replay, "+copy in": copy_in, "+clone out": copy_clone,
                            "run_matching": lambda: runtime.run_matching(mine),
                            "call copy": lambda: compiled(*mine), "call static": lambda: compiled(*statics)}
        samples["private"] = interleaved_samples(private, rounds=rounds, per_round=5)
        hosts["private"] = {label: host_us(fn) for label, fn in private.items()}
    ladder = {}
    for phase, phase_samples in samples.items():
        base = statistics.median(phase_samples["replay"])   # (inductor's row: its bare replay over opfuse's)
        for label, values in phase_samples.items():
            timing = summarize(values)
            ladder[f"{phase}: {label}"] = {"median_ms": timing.median_ms,
                                           "over_replay_us": (timing.median_ms - base) * 1e3,
                                           "spread": timing.spread, "host_us": hosts[phase][label]}
    return {"workload": f"{name}:{batch}", "compile_s": compile_s, "inputs": len(inputs), "outputs": len(outs),
            "ladder": ladder}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="resnet50:1,resnext50_32x4d:1")
    parser.add_argument("--out", default="call-overhead-out")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--with-inductor", action="store_true",
                        help="also build torch.compile's model in the process and time its replay in the rounds")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for spec in args.workloads.split(","):
        name, _, batch = spec.partition(":")
        try:
            result = measure(name, int(batch or 1), args.rounds, args.with_inductor)
        except Exception as error:   # one workload's failure must not lose the others' numbers
            result = {"workload": spec, "error": f"{type(error).__name__}: {error}"}
        results.append(result)
        (out / "call_overhead.json").write_text(json.dumps(results, indent=1))
        print(f"\n{result['workload']}: {result.get('error', '')}")
        for label, row in result.get("ladder", {}).items():
            print(f"  {label:23s} {row['median_ms']:.4f} ms  +{row['over_replay_us']:6.1f} us over replay  "
                  f"spread {row['spread']:.0%}  host {row['host_us']:6.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
