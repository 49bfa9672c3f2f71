"""The generator's decode step under FusionConfig switches, A/B in one process (issue 52): one `compile_generator` of
the ~1.1B Llama per variant, each prefilled with the same prompts, then decode steps timed in interleaved rounds
(CUDA events, the median), with the bytes a step reads over its time and its share of the GPU's datasheet
bandwidth, one step's kernels under torch.profiler (count, span from the first kernel's start to the last one's
end, the slowest kernels by name), and the step's logits against eager's. Writes DIR/decode_ab.json.

    python -m benchmarks.decode_ab --out DIR [--batch 1] [--max-seq 384] [--variants default,weight_prefetch=1]
                                   [--sweep 12]

A variant is `default` or comma-free `switch=0|1` settings joined by `+` (`norm_prologue=1+dependent_launch=0`).
--sweep N then times the first variant's step in place with each of the first N candidates (its configs, then its
other forms; a GEMM with a split form each of its tiles in 2, 3 and 4 K slices too, whatever the plan's table says)
of each kind of GEMM and attention kernel, set for every layer's group of that kind at once: what the autotuner,
timing one kernel alone with its weights in L2, cannot see of a step that streams 2 GB of weights.
torch.compile is not among them: it and opfuse in one process hit an illegal memory access (RESULTS.md); `generate`
times it in a process of its own.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from opfuse.bench.harness import variant_switches
from opfuse.bench.timing import time_once

ROUNDS, STEPS_PER_ROUND = 6, 8


def step_profile(step, positions: list[torch.Tensor]) -> dict:
    """One decode step's kernels under torch.profiler (the middle of three): count, span, the slowest by name."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for position in positions:
            step(position)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        events = json.loads(Path(path).read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    count = len(kernels) // len(positions)
    one = kernels[count:2 * count]
    by_name: dict[str, list[float]] = collections.defaultdict(list)
    for event in one:
        by_name[event["name"][:60]].append(event["dur"])
    slowest = sorted(by_name.items(), key=lambda item: -sum(item[1]))[:12]
    return {"kernels": count, "span_us": round(one[-1]["ts"] + one[-1]["dur"] - one[0]["ts"], 1),
            "slowest": [[name, len(times), round(sum(times), 1)] for name, times in slowest]}


def step_ms(step, positions: list[torch.Tensor]) -> float:
    """Median milliseconds of `step` over `positions`, each timed from an idle GPU (`time_once`)."""
    torch.cuda.synchronize()
    return statistics.median([time_once(lambda: step(position), True) for position in positions])


def sweep(generator, step, positions: list[torch.Tensor], top: int) -> dict[str, dict]:
    """{kind: {"chosen": the autotuner's config, "steps": [[config, step ms], ...]}} for each kind of GEMM and
    attention kernel of the decode step (its ops and output shape), every group of the kind set to one candidate
    at a time (`CompiledModel.set_configs`), then back to the tuner's choices."""
    from opfuse.codegen.base import KernelConfig

    compiled = generator.step.compiled
    graph = compiled.plan.graph
    kinds: dict[str, list[str]] = collections.defaultdict(list)
    for group in compiled.plan.groups:
        if group.name in compiled.kernels and group.anchor and graph[group.anchor].op in ("linear", "matmul", "sdpa"):
            ops = "+".join(dict.fromkeys(graph[n].op for n in group.nodes))
            kinds[f"{ops} {list(graph[group.anchor].type.shape)}"].append(group.name)
    chosen = dict(compiled.configs)
    found = {}
    for kind, names in kinds.items():
        kernel = compiled.kernels[names[0]]
        candidates = list(dict.fromkeys(kernel.configs() + kernel.alternatives(library=True)))[:top]
        if getattr(kernel, "split", None) is not None:     # a GEMM with a split form: its tiles in 2-4 K slices too
            candidates += [KernelConfig.of(c.num_warps, c.num_stages, **(dict(c.params) | {"SPLIT_K": slices}))
                           for c in candidates if "SPLIT_K" in dict(c.params) for slices in (2, 3, 4)
                           if dict(c.params)["SPLIT_K"] != slices]
        rows = []
        for config in candidates:
            try:
                compiled.set_configs({name: config for name in names})
                for position in positions[:3]:      # compiles, captures the graph again
                    step(position)
                rows.append([str(config), step_ms(step, positions[:24])])
            except Exception as error:              # a config this GPU refuses: say so, go on
                rows.append([str(config), f"{type(error).__name__}: {error}"[:200]])
        compiled.set_configs({name: chosen[name] for name in names})
        found[kind] = {"groups": len(names), "chosen": str(chosen[names[0]]), "steps": rows}
        print(kind, "chosen", chosen[names[0]], *(f"\n  {row}" for row in rows))
    return found


def main(argv: list[str] | None = None) -> int:
    import opfuse
    from opfuse.analysis.roofline import hardware_of_gpu
    from opfuse.bench.generation import llama
    from opfuse.generate import KVCacheDecoder

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--max-seq", type=int, default=384, help="the cache; the prompt is 256 tokens shorter")
    parser.add_argument("--variants", default="default,weight_prefetch=1,dependent_launch=0")
    parser.add_argument("--tune-top", type=int, default=2)
    parser.add_argument("--sweep", type=int, default=0, metavar="N", help="candidates per kind of kernel (0: none)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    gpu = hardware_of_gpu(torch.cuda.get_device_name())
    model = llama("llama-1.1b", "cuda", torch.float16)
    prompt = args.max_seq - 256
    ids = torch.randint(0, model.config.vocab_size, (args.batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.cuda()
    positions = [torch.tensor([p], device="cuda") for p in range(prompt, prompt + ROUNDS * STEPS_PER_ROUND)]
    embed = model.model.embed_tokens.weight      # read one row a token
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) - embed.numel() * embed.element_size()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "batch": args.batch,
               "max_seq": args.max_seq, "weight_bytes": weights, "variants": {}}
    steps, generators = {}, {}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:      # after each stage: a run cut short still leaves what it measured
        (out / "decode_ab.json").write_text(json.dumps(results, indent=1))

    with torch.inference_mode():
        eager = KVCacheDecoder(model, args.batch, args.max_seq).eval()
        token = eager(ids, torch.arange(prompt, device="cuda"))[:, -1].argmax(-1)[:, None]
        reference = eager(token, positions[0]).float()
        for variant in args.variants.split(","):
            config = opfuse.FusionConfig(dtype="float16", tune_top=args.tune_top,
                                         **({"hardware": gpu.name} if gpu is not None else {}), **variant_switches(variant))
            generator = generators[variant] = opfuse.compile_generator(model, args.batch, args.max_seq, config)
            generator.prefill(ids)
            logits = generator.step(token, positions[0]).float()
            steps[variant] = lambda position, generator=generator: generator.step(token, position)
            for position in positions[:4]:
                steps[variant](position)
            results["variants"][variant] = {
                "launches_planned": generator.step.analysis.fused.kernel_launches,
                "logits_rel_err_vs_eager": ((logits - reference).norm() / reference.norm()).item(),
                "profile": step_profile(steps[variant], positions[10:13])}
            print(variant, json.dumps(results["variants"][variant]), flush=True)
            save()
        times: dict[str, list[float]] = {variant: [] for variant in steps}
        torch.cuda.synchronize()
        for round_ in range(ROUNDS):
            for variant, step in steps.items():
                for position in positions[round_ * STEPS_PER_ROUND:(round_ + 1) * STEPS_PER_ROUND]:
                    times[variant].append(time_once(lambda: step(position), True))
        report_times(results, times, weights, gpu)
        save()
        if args.sweep:
            first = next(iter(steps))
            results["sweep"] = sweep(generators[first], steps[first], positions, args.sweep)
            save()
    return 0


def report_times(results: dict, times: dict[str, list[float]], weights: int, gpu) -> None:
    """Each variant's median step, its weights' bytes over it and their share of the datasheet bandwidth."""
    for variant, samples in times.items():
        ms = statistics.median(samples)
        share = None if gpu is None else weights / (ms / 1e3) / gpu.memory_bandwidth
        results["variants"][variant] |= {"step_ms": ms, "tokens_per_s": results["batch"] * 1e3 / ms,
                                         "weights_gb_per_s": weights / ms / 1e6, "share_of_bandwidth": share}
        print(f"{variant:32s} {ms:.3f} ms  {weights / ms / 1e6:.0f} GB/s"
              + ("" if share is None else f"  {100 * share:.1f}% of the datasheet's"), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
