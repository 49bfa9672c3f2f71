"""Tile and mid-channel-split sweep of the depthwise + pointwise kernel (issue 5), block by block on mobilenet_v2.

For each of mobilenet_v2's 17 blocks at each batch given, fp16, channels-last, autotuning off:

- the block's depthwise + pointwise conv-conv kernel (`FusionConfig(conv_conv_expand=False)` on the H200 profile
  without its conv-conv measurements, so every block is fused but, at batch 64, the last: its row says so) timed
  with each config of a sweep: the kernel's first config (the plan's tile), then tiles whose BLOCK_N covers all
  output channels (no depthwise recompute) and others, each with SPLIT_K mid-channel slices (1, 2, 4, 8: the
  slices' partial tiles are summed inside the kernel by the last slice to arrive);
- the same block's depthwise and pointwise kernels as opfuse runs them without conv-conv fusion (two kernels,
  their default configs).

Each contender is captured with REPEAT calls in one CUDA graph (so the graph's own launch is spread over them) and
timed by the median of CUDA events; each config's output is compared with the unsplit default's.

    python -m benchmarks.conv_conv_sweep --out DIR [--batches 1,64] [--blocks 1-17] [--sweep base|deep]

Writes DIR/conv_conv_sweep.json and DIR/conv_conv_sweep.md after every block.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from typing import Callable

import torch

import opfuse
from opfuse.bench import harness
from opfuse.bench.timing import graphed_call_us
from opfuse.bench.zoo import load_builtin
from opfuse.codegen.base import KernelConfig
from opfuse.fusion.legality_conv import is_depthwise_conv
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.resources import leaves_a_slice_empty
from opfuse.fusion.tiles import next_power_of_2
from opfuse.numerics import relative_error

from benchmarks.mobilenet_blocks import BLOCKS, block_runner, parse_blocks  # registers h200forced

REPEAT = 20
SPLITS = (1, 2, 4, 8)


# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, slices); BLOCK_N 0: all output channels (up to 256), no depthwise recompute
SWEEPS = {
    "base": [(64, 0, 32, 8, 2, (1, 4)), (32, 0, 32, 4, 2, SPLITS), (64, 64, 32, 4, 2, SPLITS), (32, 64, 64, 4, 2, (1, 4))],
    "deep": [(32, 64, 64, 4, 2, (2, 8)), (16, 64, 64, 4, 2, (1, 4, 8)), (32, 64, 128, 4, 2, (1, 2, 4)),
             (32, 0, 64, 4, 2, (1, 2)), (32, 64, 32, 4, 3, (1, 4)), (64, 64, 64, 4, 2, (1, 4)),
             (32, 64, 32, 2, 2, (1, 4)), (32, 32, 64, 4, 2, (1, 4)), (64, 0, 64, 8, 2, (1, 2))],
}


def block_size(n: int) -> int:
    """The power of two a tile dimension of n elements is cut to: the next one up, at least 16 (tl.dot's least)."""
    return max(16, next_power_of_2(n))


def sweep_configs(kernel, sweep: str = "base") -> list[KernelConfig]:
    """The kernel's first config (the plan's tile: what runs untuned), then the sweep's tiles, each with its mid-
    channel slices. (Runs 16 and 17 began with the old default tile instead, 128 x N x 32 unsplit.)"""
    m, n, c_mid = kernel.layout.rows, kernel.layout.channels, kernel.c_mid
    first = kernel.configs()[0]
    tiles = [dict(first.params, num_warps=first.num_warps, num_stages=first.num_stages)]
    for bm, bn, bk, warps, stages, splits in SWEEPS[sweep]:
        for split in splits:
            tiles.append({"BLOCK_M": min(bm, block_size(m)), "BLOCK_N": min(bn or 256, block_size(n)),
                          "BLOCK_K": min(bk, block_size(c_mid)), "num_stages": stages, "num_warps": warps,
                          "SPLIT_K": split})
    configs = []
    for t in tiles:
        if t["SPLIT_K"] > 1 and leaves_a_slice_empty(-(-c_mid // t["BLOCK_K"]), t["SPLIT_K"]):
            continue
        config = KernelConfig.of(t["num_warps"], t["num_stages"], BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
                                 BLOCK_K=t["BLOCK_K"], SPLIT_K=t["SPLIT_K"])
        if config not in configs:
            configs.append(config)
    return configs


def describe(config: KernelConfig) -> str:
    p = dict(config.params)
    stages = "" if config.num_stages == 2 else f"/st{config.num_stages}"
    return f"{p['BLOCK_M']}x{p['BLOCK_N']}x{p['BLOCK_K']}/w{config.num_warps}{stages}/s{p['SPLIT_K']}"


def run_batch(batch: int, blocks: list[int], sweep: str, rows: list[dict], written: Callable[[], None]) -> None:
    model, (x,) = load_builtin("mobilenet_v2", batch=batch)
    model = model.half().cuda().eval().to(memory_format=torch.channels_last)
    x = x.cuda().half().contiguous(memory_format=torch.channels_last)
    common = dict(dtype="float16", autotune=False)
    fused = opfuse.compile(model, (x,), opfuse.FusionConfig(conv_conv_expand=False, hardware="h200forced", **common))
    unfused = opfuse.compile(model, (x,), opfuse.FusionConfig(conv_conv=False, **common))
    values = {"fused": fused.compiled.collect_values(x), "unfused": unfused.compiled.collect_values(x)}
    depthwise = {label: [n.name for n in c.plan.graph if is_depthwise_conv(c.plan.graph, n.name)]
                 for label, c in (("fused", fused), ("unfused", unfused))}
    for index, dw, dw_unfused in zip(BLOCKS, depthwise["fused"], depthwise["unfused"]):
        if index not in blocks:
            continue
        row: dict = {"batch": batch, "block": index}
        try:
            group = fused.plan.group_of(dw)
            if group.kind is not GroupKind.CONV_CONV:
                raise RuntimeError(f"block {index}: depthwise {dw} is not in a conv-conv group")
            kernel = fused.compiled.kernels[group.name]
            inputs = [values["fused"][n] for n in kernel.runtime_inputs]
            row["shape"] = (f"{kernel.c_mid}->{kernel.layout.channels}, {kernel.geometry.height}x"
                            f"{kernel.geometry.width}, stride {kernel.geometry.constexprs()['STRIDE_H']}")
            # the unfused depthwise group and the pointwise group that reads it
            plan = unfused.plan
            own = plan.group_of(dw_unfused)
            after = [g for g in plan.groups if g.anchor is not None and plan.graph[g.anchor].inputs[0] in own.nodes]
            row["unfused_us"] = graphed_call_us(block_runner(unfused, [own, after[0]], values["unfused"]), REPEAT)
            with torch.inference_mode():
                reference = kernel.run(inputs, KernelConfig.of(4, 2, BLOCK_M=64, BLOCK_N=64, BLOCK_K=32,
                                                               SPLIT_K=1))[0].float()
            row["configs"] = []
            for config in sweep_configs(kernel, sweep):
                entry = {"config": describe(config)}
                try:
                    with torch.inference_mode():
                        out = kernel.run(inputs, config)[0].float()
                        entry["rel_err"] = relative_error(out, reference)
                        entry["regs"], entry["spills"] = kernel.last_compiled.registers, kernel.last_compiled.spills
                        entry["us"] = graphed_call_us(lambda: kernel.run(inputs, config), REPEAT)
                except Exception as error:
                    entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
                row["configs"].append(entry)
            timed = [c for c in row["configs"] if "us" in c]
            best = min(timed, key=lambda c: c["us"])
            row["default"] = row["configs"][0]
            row["best"] = best
            row["best_unsplit"] = min((c for c in timed if c["config"].endswith("/s1")), key=lambda c: c["us"])
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        print(json.dumps({k: v for k, v in row.items() if k != "configs"}, default=str), flush=True)
        rows.append(row)
        written()
    del fused, unfused, values
    gc.collect()
    torch.cuda.empty_cache()


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"### depthwise + pointwise kernel sweep, mobilenet_v2, fp16: {env.get('date')}, {env.get('gpu')}, "
             f"torch {env.get('torch')}, triton {env.get('triton')}", "",
             f"µs per call ({REPEAT} calls per CUDA graph, median of 30 replays). Tile BMxBNxBK/warps/slices.", "",
             "| batch | block | mid->out, size, stride | unfused dw + pw µs | first config µs | best unsplit | "
             "best | best vs unfused | max rel. err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['batch']} | {row['block']} | error: {row['error'][:100]} |" + " |" * 6)
            continue
        errors = [c["rel_err"] for c in row["configs"] if "rel_err" in c]
        d, u, b = row["default"], row["best_unsplit"], row["best"]
        lines.append(f"| {row['batch']} | {row['block']} | {row['shape']} | {row['unfused_us']:.1f} | "
                     f"{d.get('us', float('nan')):.1f} ({d['config']}) | {u['us']:.1f} ({u['config']}) | "
                     f"{b['us']:.1f} ({b['config']}) | {row['unfused_us'] / b['us']:.2f}x | {max(errors):.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--blocks", default="1-17")
    parser.add_argument("--sweep", default="base", choices=sorted(SWEEPS))
    args = parser.parse_args()
    out = harness.start_gpu_run("conv_conv_sweep.py", args.out)
    if out is None:
        return 3     # the exit code `opfuse bench` uses for the same case
    env = harness.environment()
    rows: list[dict] = []

    def write() -> None:
        (out / "conv_conv_sweep.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))
        (out / "conv_conv_sweep.md").write_text(markdown(env, rows))

    for batch in [int(b) for b in args.batches.split(",") if b]:
        run_batch(batch, parse_blocks(args.blocks), args.sweep, rows, write)
    write()
    print(markdown(env, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
