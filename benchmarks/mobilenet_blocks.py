"""mobilenet_v2 block by block (issue 5): conv-conv fusion against opfuse's own unfused kernels and torch.compile.

For each of mobilenet_v2's 17 inverted-residual blocks, at one batch (default 64), fp16, channels-last:

- fused: opfuse with conv-conv fusion (the block's depthwise + pointwise in one kernel, or the whole block where
  the planner fused the expansion too);
- dw+pw (only for blocks fused whole): the same without the expansion (`FusionConfig(conv_conv_expand=False)`), to
  check the cost model's halo-recompute verdict;
- unfused: opfuse's own kernels without it (`FusionConfig(conv_conv=False)`: expand, depthwise, pointwise apart,
  each with its fused epilogue);
- torch.compile: the torchvision block (`model.features[i]`) compiled by inductor;
- eager: the same block through cuDNN, for reference.

Every contender runs the block as a CUDA graph (so Python launch cost is out of all of them) and is timed by the
median of CUDA events. The row also has the plan's numbers: predicted times, bytes moved, FLOPs/Byte before and
after, bytes saved, launches. With --whole, the whole model at each batch given (default 1 and 64) against
torch.compile + CUDA graph in the same run.

    python -m benchmarks.mobilenet_blocks --out DIR [--batch 64] [--blocks 1-17] [--whole 1,64] [--tune-top 4]

Writes DIR/mobilenet_blocks.json and DIR/mobilenet_blocks.md (paste the table into benchmarks/RESULTS.md), the
whole model first, then again after every block, so a run stopped by a time limit keeps what it measured.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import sys
import time
import traceback
from dataclasses import asdict
from typing import Callable

import torch

import opfuse
from opfuse import hardware
from opfuse.bench import harness
from opfuse.bench.zoo import load_builtin
from opfuse.fusion.legality_conv import is_depthwise_conv, is_pointwise_conv
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.ir.ops import get_op
from opfuse.numerics import relative_error

BLOCKS = range(1, 18)   # model.features[1..17] are the InvertedResidual blocks


def block_groups(plan, depthwise: str) -> list[FusionGroup]:
    """The groups of the block around `depthwise`: its own group, the expansion's group before it and the
    pointwise conv's group after it where they are kernels of their own."""
    graph = plan.graph
    own = plan.group_of(depthwise)
    groups = [own]
    producer = graph[depthwise].inputs[0]
    if producer not in own.nodes:
        before = plan.group_of(producer)
        if before.anchor is not None and is_pointwise_conv(graph, before.anchor):
            groups.insert(0, before)
    if own.kind is not GroupKind.CONV_CONV:
        groups += [g for g in plan.groups if g.anchor is not None and graph[g.anchor].inputs[0] in own.nodes][:1]
    return groups


def groups_covering(plan, nodes: set[str]) -> list[FusionGroup]:
    """The plan's groups inside `nodes`, in plan order; they must cover `nodes` exactly."""
    groups = [g for g in plan.groups if set(g.nodes) <= nodes and g.launches]
    covered = {n for g in groups for n in g.nodes}
    if covered != nodes:
        raise RuntimeError(f"the plans disagree on a block: {sorted(nodes ^ covered)}")
    return groups


def block_runner(compiled, groups: list[FusionGroup], values: dict[str, torch.Tensor]
                 ) -> Callable[[], torch.Tensor]:
    """A function that runs the block's kernels (or PyTorch for a group without one) and returns its output."""
    model = compiled.compiled
    graph = compiled.plan.graph

    def run() -> torch.Tensor:
        local = dict(values)
        for group in groups:
            kernel = model.kernels.get(group.name)
            if kernel is None:
                for name in group.nodes:
                    node = graph[name]
                    local[name] = get_op(node.op).run([local[i] for i in node.inputs], node.attrs)
                continue
            outputs = kernel.run([local[n] for n in kernel.runtime_inputs], model.configs.get(group.name))
            local.update(zip(group.outputs, outputs))
        return local[groups[-1].outputs[-1]]

    return run


def graphed_ms(fn: Callable[[], object], iters: int) -> float:
    replay = harness.cuda_graphed(lambda: fn(), [])
    return harness.median_ms(replay, [], warmup=10, iters=iters)


def traffic(groups: list[FusionGroup]) -> tuple[int, int, float]:
    flops = sum(g.flops for g in groups)
    moved = sum(g.bytes_moved for g in groups)
    return flops, moved, sum(g.predicted_time for g in groups)


# the H200 profile without the conv-conv measurements (`with_ideal_conv_conv`): the plan fuses every block (at
# batch 64 but the last, whose 320 output channels would compute its depthwise 3 times)
hardware.PROFILES["h200forced"] = hardware.PROFILES["h200"].with_ideal_conv_conv()

# opfuse variants of the table: the plan's choice, conv-conv fusion in every block (the planner without its loop
# floor), depthwise + pointwise only, and no conv-conv fusion at all
VARIANTS = {"forced": {"hardware": "h200forced"}, "fused": {},
            "dw_pw": {"conv_conv_expand": False, "hardware": "h200forced"}, "unfused": {"conv_conv": False}}


def run_blocks(batch: int, tune_top: int, iters: int, blocks: list[int], rows: list[dict],
               written: Callable[[], None]) -> None:
    """Appends one row per block to `rows`, calling `written` after each (a time-limited run keeps what it did)."""
    model, (x,) = load_builtin("mobilenet_v2", batch=batch)
    model = model.half().cuda().eval().to(memory_format=torch.channels_last)
    x = x.cuda().half().contiguous(memory_format=torch.channels_last)
    common = dict(dtype="float16", autotune=tune_top > 0, tune_top=tune_top or None)
    compiled = {}
    for label, switches in VARIANTS.items():
        print(f"compiling mobilenet_v2 batch {batch}: {label}", flush=True)
        compiled[label] = opfuse.compile(model, (x,), opfuse.FusionConfig(**common, **switches))
    values = compiled["fused"].compiled.collect_values(x)
    block_inputs: dict[int, torch.Tensor] = {}
    hooks = [model.features[i].register_forward_pre_hook(
        lambda module, args, i=i: block_inputs.__setitem__(i, args[0].detach().clone())) for i in BLOCKS]
    with torch.inference_mode():
        model(x)
    for hook in hooks:
        hook.remove()

    graph = compiled["fused"].plan.graph
    depthwise = [n.name for n in graph if is_depthwise_conv(graph, n.name)]
    if len(depthwise) != len(BLOCKS):
        raise RuntimeError(f"expected 17 depthwise convs, found {len(depthwise)}")
    for index, dw in zip(BLOCKS, depthwise):
        if index not in blocks:
            continue
        row: dict = {"block": index}
        try:
            forced_groups = block_groups(compiled["forced"].plan, dw)    # the block's widest fusion
            nodes = {n for g in forced_groups for n in g.nodes}
            groups = {label: groups_covering(c.plan, nodes) for label, c in compiled.items()}
            fused_groups = groups["fused"]
            node = graph[dw]
            x_shape = graph[graph[fused_groups[0].anchor].inputs[0]].type.shape     # the block's input
            out_name = fused_groups[-1].outputs[-1]
            row.update({
                "shape": f"{x_shape[1]}->{node.type.shape[1]}->{graph[out_name].type.shape[1]}, "
                         f"{x_shape[2]}x{x_shape[3]}, stride {node.attrs['stride'][0]}",
                "fused_kinds": [g.kind.value for g in fused_groups],
                "planned_conv_conv": any(g.kind is GroupKind.CONV_CONV for g in fused_groups),
                "whole_block": any(len([n for n in g.nodes if graph[n].op == "conv2d"]) == 3 for g in forced_groups),
                "launches": {label: len(g) for label, g in groups.items()},
            })
            (f_flops, f_bytes, f_pred) = traffic(groups["forced"])
            (u_flops, u_bytes, u_pred) = traffic(groups["unfused"])
            row.update({"flops": f_flops, "bytes_fused": f_bytes, "bytes_unfused": u_bytes,
                        "bytes_saved": u_bytes - f_bytes, "density_fused": f_flops / f_bytes,
                        "density_unfused": u_flops / u_bytes, "predicted_forced_us": f_pred * 1e6,
                        "predicted_fused_us": traffic(groups["fused"])[2] * 1e6,
                        "predicted_unfused_us": u_pred * 1e6})
            with torch.inference_mode():
                block = model.features[index]
                block_x = block_inputs[index]
                eager_out = block(block_x)
                for label, c in compiled.items():
                    if label == "dw_pw" and not row["whole_block"]:
                        continue   # the same kernels as "forced"
                    run = block_runner(c, groups[label], values)
                    row[f"rel_err_{label}"] = relative_error(run().float(), eager_out.float())
                    row[f"{label}_ms"] = graphed_ms(run, iters)
                row["eager_ms"] = graphed_ms(lambda: block(block_x), iters)
                torch._dynamo.reset()   # 17 instances of one module class: no recompile limit, no dynamic shapes
                compiled_block, seconds = harness.torch_compiled(copy.deepcopy(block), (block_x,))
                row["inductor_ms"] = graphed_ms(lambda: compiled_block(block_x), iters)
                row["inductor_compile_s"] = seconds
            row["forced_tb_per_s"] = f_bytes / (row["forced_ms"] * 1e-3) / 1e12
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
            traceback.print_exc()
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
        written()
        gc.collect()
        torch.cuda.empty_cache()


def run_whole(batch: int, tune_top: int) -> dict:
    """Whole mobilenet_v2: opfuse with and without conv-conv fusion, and torch.compile, each with a CUDA graph."""
    model, (x,) = load_builtin("mobilenet_v2", batch=batch)
    reference_model = copy.deepcopy(model).float().cuda().eval()
    with torch.inference_mode():
        reference = reference_model(x.cuda()).float()
    del reference_model
    model = model.half().cuda().eval().to(memory_format=torch.channels_last)
    x = x.cuda().half().contiguous(memory_format=torch.channels_last)
    row: dict = {"batch": batch}
    common = dict(dtype="float16", autotune=tune_top > 0, tune_top=tune_top or None)
    for label, config in (("opfuse", opfuse.FusionConfig(**common)),
                          ("opfuse_forced", opfuse.FusionConfig(hardware="h200forced", **common)),
                          ("opfuse_no_conv_conv", opfuse.FusionConfig(conv_conv=False, **common))):
        try:
            start = time.perf_counter()
            compiled = opfuse.compile(model, (x,), config)
            seconds = time.perf_counter() - start
            result = harness.measure(compiled, (x,), reference, compile_s=seconds)
            compiled.compiled.set_cuda_graph(False)     # count kernels on the un-graphed forward
            with torch.inference_mode():
                result.kernels, result.gpu_busy_ms = harness.kernel_profile(compiled, (x,))
            row[label] = asdict(result) | {"plan_launches": compiled.plan.kernel_launches,
                                           "predicted_ms": compiled.analysis.fused.predicted_time * 1e3,
                                           "fallbacks": {g: str(why) for g, why in compiled.fallbacks.items()}}
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()
    try:
        compiled, seconds = harness.torch_compiled(model, (x,))
        with torch.inference_mode(), harness.frozen_inductor():    # captured in the mode it was compiled in
            replay = harness.cuda_graphed(compiled, (x,))
        row["inductor"] = asdict(harness.measure(replay, (x,), reference, compile_s=seconds, profile_fn=compiled))
    except Exception as error:
        row["inductor"] = {"error": f"{type(error).__name__}: {error}"}
        traceback.print_exc()
    print(json.dumps(row, default=str), flush=True)
    return row


def markdown(env: dict, batch: int, rows: list[dict], whole: list[dict]) -> str:
    def ms(value) -> str:
        return "-" if value is None else f"{value * 1e3:.1f}"

    lines = [f"### mobilenet_v2 blocks, batch {batch}, fp16: {env.get('date')}, {env.get('gpu')}, torch "
             f"{env.get('torch')}, triton {env.get('triton')}", "",
             "Median µs per block (each contender replayed as a CUDA graph). conv-conv: the block's depthwise + "
             "pointwise (or the whole block, where the planner without its loop floor fuses the expansion too) in "
             "one kernel; planned: what opfuse's planner chooses (conv-conv or not); dw+pw: conv-conv without the "
             "expansion (whole-block rows only); unfused: opfuse's own kernels without conv-conv fusion. Traffic, "
             "FLOPs/B and predicted µs from the plans.", "",
             "| block | channels, size, stride | conv-conv kind (launches) | planned | conv-conv µs | planned µs | "
             "dw+pw µs | unfused µs | torch.compile µs | eager µs | conv-conv vs unfused | planned vs torch.compile "
             "| predicted conv-conv / planned / unfused µs | FLOPs/B unfused -> conv-conv | MB saved | "
             "conv-conv TB/s | rel. err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['block']} | {row.get('shape', '-')} | error: {row['error'][:80]} |"
                         + " |" * 14)
            continue
        kinds = "whole block" if row["whole_block"] else "dw+pw"
        launches = row["launches"]
        lines.append(
            f"| {row['block']} | {row['shape']} | {kinds} ({launches['forced']} vs {launches['unfused']}) | "
            f"{'conv-conv' if row['planned_conv_conv'] else 'unfused'} | "
            f"{ms(row['forced_ms'])} | {ms(row['fused_ms'])} | {ms(row.get('dw_pw_ms'))} | {ms(row['unfused_ms'])} | "
            f"{ms(row['inductor_ms'])} | {ms(row['eager_ms'])} | "
            f"{row['unfused_ms'] / row['forced_ms']:.2f}x | {row['inductor_ms'] / row['fused_ms']:.2f}x | "
            f"{row['predicted_forced_us']:.1f} / {row['predicted_fused_us']:.1f} / {row['predicted_unfused_us']:.1f} | "
            f"{row['density_unfused']:.1f} -> {row['density_fused']:.1f} | {row['bytes_saved'] / 1e6:.1f} | "
            f"{row['forced_tb_per_s']:.2f} | {row['rel_err_forced']:.1e} |")
    good = [r for r in rows if "error" not in r]
    if good:
        lines += ["", f"Sum over the blocks: conv-conv {sum(r['forced_ms'] for r in good):.3f} ms, planned "
                      f"{sum(r['fused_ms'] for r in good):.3f} ms, unfused "
                      f"{sum(r['unfused_ms'] for r in good):.3f} ms, torch.compile "
                      f"{sum(r['inductor_ms'] for r in good):.3f} ms."]
    if whole:
        lines += ["", "Whole mobilenet_v2, fp16, median ms per forward (kernels per forward):", "",
                  "| batch | opfuse (planned) | opfuse, conv-conv in every block | opfuse without conv-conv | "
                  "torch.compile + graph | opfuse vs torch.compile | plan launches | rel. err |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in whole:
            def cell(label: str) -> str:
                entry = row.get(label, {})
                if "median_ms" not in entry:
                    return f"error: {entry.get('error', '-')[:60]}"
                return f"{entry['median_ms']:.3f} ({entry.get('kernels')})"
            ours, theirs = row.get("opfuse", {}), row.get("inductor", {})
            speed = (f"{theirs['median_ms'] / ours['median_ms']:.2f}x"
                     if "median_ms" in ours and "median_ms" in theirs else "-")
            error = ours.get("rel_error")
            lines.append(f"| {row['batch']} | {cell('opfuse')} | {cell('opfuse_forced')} | "
                         f"{cell('opfuse_no_conv_conv')} | {cell('inductor')} | "
                         f"{speed} | {ours.get('plan_launches', '-')} | "
                         f"{'-' if error is None else f'{error:.1e}'} |")
    return "\n".join(lines) + "\n"


def parse_blocks(spec: str) -> list[int]:
    """'1-17' -> [1, ..., 17]; '2,5' -> [2, 5]."""
    blocks: list[int] = []
    for part in filter(None, spec.split(",")):
        first, _, last = part.partition("-")
        blocks += list(range(int(first), int(last or first) + 1))
    return blocks


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--whole", default="1,64", help="batches of the whole-model comparison ('' for none)")
    parser.add_argument("--tune-top", type=int, default=4, help="autotune among each kernel's first N configs")
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--blocks", default="1-17", help="which blocks: '1-17', '1,3,5' ('' for none)")
    args = parser.parse_args()
    out = harness.start_gpu_run("mobilenet_blocks.py", args.out)
    if out is None:
        return 3     # the exit code `opfuse bench` uses for the same case
    env = harness.environment()
    blocks = parse_blocks(args.blocks)
    rows: list[dict] = []
    whole: list[dict] = []

    def write() -> None:
        (out / "mobilenet_blocks.json").write_text(json.dumps(
            {"env": env, "batch": args.batch, "blocks": rows, "whole": whole}, indent=1, default=str))
        (out / "mobilenet_blocks.md").write_text(markdown(env, args.batch, rows, whole))

    for batch in [int(b) for b in args.whole.split(",") if b]:   # the whole model first: it is the headline
        whole.append(run_whole(batch, args.tune_top))
        write()
    if blocks:
        run_blocks(args.batch, args.tune_top, args.iters, blocks, rows, write)
    write()
    print(markdown(env, args.batch, rows, whole))
    return 0


if __name__ == "__main__":
    sys.exit(main())
