"""Tile sweep of a model's short-reduction GEMM and 1x1-conv kernels: where the output store is the whole cost.

For each workload (fp16, channels-last, the zoo's built-in models), the anchor groups whose reduction is at most
--max-k (EfficientNet's and MobileNet's expansions: K 16-96, N up to 1152, M = N x H x W pixels), the --top
slowest as the plan predicts them, one of each distinct kernel and shape: each is timed with every config its
kernel offers (its own tiles and other forms: the library call with the epilogue after it, the ops unfused), then
with a grid of further tiles (BLOCK_M 32-256, BLOCK_N 32-128, BLOCK_K 16-64, 4 or 8 warps, 1-3 stages), each
compiled by the compile workers first, checked against the kernel's first config and timed by the autotuner's
clock (`graph_time`). Also the bytes each must move (inputs read once, outputs written once) over the measured time.
With --groups, those groups of every workload are swept instead (any anchor kernel of a conv or linear, whatever its
reduction: a stem conv that gathers its taps, a linear + GELU), e.g. the groups whose measured time exceeds the cost
model's prediction most (RESULTS.md, 2026-12-05 offline).

    python -m benchmarks.gemm_tile_sweep --out DIR [--workloads efficientnet_b0:64,mobilenet_v2:64] [--top 6]
    python -m benchmarks.gemm_tile_sweep --out DIR --workloads resnet50:64,convnext_tiny:64 --groups g0,g7

Writes DIR/gemm_tile_sweep.json and prints a table per kernel.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

import opfuse
from opfuse.bench.harness import prepare
from opfuse.bench.zoo import load_builtin
from opfuse.codegen.base import KernelConfig
from opfuse.codegen.forms import EpilogueKernel
from opfuse.codegen.lower import lower_plan
from opfuse.numerics import relative_error
from opfuse.runtime.autotune import graph_time
from opfuse.runtime.compiled import CompiledModel
from opfuse.runtime.precompile import default_workers, precompile


def reduction_of(graph, anchor: str) -> int | None:
    """K of a conv's or linear's GEMM, or None for other anchors."""
    node = graph[anchor]
    weight = graph[node.inputs[1]].type.shape if len(node.inputs) > 1 else None
    if node.op == "conv2d" and weight is not None and len(weight) == 4:
        return weight[1] * weight[2] * weight[3]
    if node.op == "linear" and weight is not None:
        return weight[-1]
    return None


def grid_configs(first: KernelConfig, k: int, n: int) -> list[KernelConfig]:
    base = {key: value for key, value in first.params if key not in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K")}
    configs = []
    for bm, bn, bk, warps, stages in itertools.product((32, 64, 128, 256), (32, 64, 128), (16, 32, 64), (4, 8),
                                                       (1, 3)):
        if bn > max(32, 1 << (n - 1).bit_length()) or bk > max(16, 1 << (k - 1).bit_length()):
            continue
        if bm * bn > 128 * 128 and warps == 4:
            continue
        configs.append(KernelConfig.of(warps, stages, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **base))
    return configs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--workloads", default="efficientnet_b0:64,mobilenet_v2:64")
    parser.add_argument("--max-k", type=int, default=256)
    parser.add_argument("--top", type=int, default=6)
    parser.add_argument("--groups", default="", help="sweep these groups of each workload (comma-separated names, "
                        "as `opfuse analyze` gives them) in place of the --top slowest short reductions")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    wanted = {name for name in args.groups.split(",") if name}
    for workload in args.workloads.split(","):
        name, batch = workload.split(":")
        model, inputs = load_builtin(name, batch=int(batch))
        model, inputs, _, _ = prepare(model, inputs)
        analysis = opfuse.analyze(model, inputs, opfuse.FusionConfig(dtype="float16"))
        plan = analysis.plan
        kernels, _ = lower_plan(plan, "cuda")
        with torch.inference_mode():
            values = CompiledModel(plan, kernels, "cuda").collect_values(*inputs)
        chosen, seen = [], set()
        for group in sorted(plan.groups, key=lambda g: -g.predicted_time):
            kernel = kernels.get(group.name)
            if not isinstance(kernel, EpilogueKernel) or group.anchor is None:
                continue
            k = reduction_of(plan.graph, group.anchor)
            key = (kernel.name, plan.graph[group.anchor].type.shape, k)
            if k is None or key in seen or (group.name not in wanted if wanted else k > args.max_k):
                continue
            seen.add(key)
            chosen.append((group, kernel, k))
            if len(chosen) == (len(wanted) if wanted else args.top):
                break
        jobs = []
        for group, kernel, k in chosen:
            inputs_k = [values[v] for v in kernel.runtime_inputs]
            n = plan.graph[group.anchor].type.shape[1 if plan.graph[group.anchor].op == "conv2d" else -1]
            first = kernel.configs()[0]
            configs = list(dict.fromkeys(kernel.configs() + kernel.alternatives(True) + grid_configs(first, k, n)))
            jobs.append((group, kernel, inputs_k, configs, k, n))
        precompile([(kernel, inputs_k, configs) for _, kernel, inputs_k, configs, _, _ in jobs],
                   default_workers(), torch.cuda.current_device())
        for group, kernel, inputs_k, configs, k, n in jobs:
            moved = sum(t.numel() * t.element_size() for t in inputs_k) + sum(
                plan.graph[o].type.numel * 2 for o in group.outputs)
            with torch.inference_mode():
                reference = [t.float() for t in kernel.run(inputs_k, configs[0])]
                rows = []
                for config in configs:
                    try:
                        got = kernel.run(inputs_k, config)
                        error = max(relative_error(g.float(), r) for g, r in zip(got, reference))
                        seconds = graph_time(lambda: kernel.run(inputs_k, config))
                    except Exception as exc:   # out of resources, or a config the template refuses
                        rows.append({"config": config.as_dict(), "error": f"{type(exc).__name__}: {exc}"[:200]})
                        continue
                    rows.append({"config": config.as_dict(), "us": seconds * 1e6, "rel_error": error,
                                 "tb_per_s": moved / seconds / 1e12})
                kernel.keep_default()
            timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
            anchor = plan.graph[group.anchor]
            print(f"== {name} bs{batch} {group.name} {anchor.op} {anchor.type.shape} K={k} N={n} "
                  f"({kernel.name}; {moved / 1e6:.1f} MB moved; predicted {group.predicted_time * 1e6:.1f} us)")
            print(f"   first config {configs[0].as_dict()}: "
                  + next((f"{r['us']:.1f} us" for r in rows if r["config"] == configs[0].as_dict() and "us" in r),
                         "failed"))
            for r in timed[:8]:
                print(f"   {r['us']:7.1f} us {r['tb_per_s']:.2f} TB/s err {r['rel_error']:.1e}  {r['config']}")
            results.append({"workload": workload, "group": group.name, "kernel": kernel.name,
                            "shape": list(anchor.type.shape), "k": k, "n": n, "bytes": moved,
                            "predicted_us": group.predicted_time * 1e6, "first": configs[0].as_dict(), "rows": rows})
            (out / "gemm_tile_sweep.json").write_text(json.dumps(results, indent=1))
        del kernels, values
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
