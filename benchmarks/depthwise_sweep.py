"""Tile and form sweep of the direct depthwise kernel, layer by layer, against cuDNN.

For each depthwise layer of the zoo's convnets (ConvNeXt's 7x7, EfficientNet's 5x5 and 3x3, MobileNetV2's 3x3:
channels, size, filter and stride) at each batch given, fp16, channels-last, with a bias:

- `DepthwiseConvKernel` with each of its pixel tiles (`tiles.DEPTHWISE + SMALL_DEPTHWISE`, the taps
  unrolled or in a row loop as `depthwise_configs` decides), and in its runs form (COLS neighbouring outputs of a
  row share their input columns) with each of `RUN_TILES` at each of `RUN_COLS`, with the registers and local
  memory (spills) ptxas gave each and the seconds its first call took (compiling it);
- cuDNN (`torch.nn.functional.conv2d` on the channels-last input), as the library form runs it.

Each contender is captured with REPEAT calls in one CUDA graph and timed by the median of CUDA events; each output
is compared with cuDNN's in float32.

    python -m benchmarks.depthwise_sweep --out DIR [--batches 1,64] [--budget 480] [--models convnext]
                                         [--row-loop-twins]

Writes DIR/depthwise_sweep.json and DIR/depthwise_sweep.md after every layer; stops starting layers once `--budget`
seconds have passed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from opfuse.bench import harness
from opfuse.bench.timing import graphed_call_us
from opfuse.codegen.base import KernelConfig
from opfuse.codegen.conv import lower_conv_group
from opfuse.fusion.tiles import DEPTHWISE, SMALL_DEPTHWISE, unrolled_tap_registers
from opfuse.fusion.plan import GroupKind
from opfuse.numerics import relative_error
from tests.kernels.test_conv_kernels import Builder

REPEAT = 20

# (model, channels, size, filter, stride): the distinct depthwise layers of convnext_tiny, efficientnet_b0 and
# mobilenet_v2 at 224 px
LAYERS = [("convnext", 96, 56, 7, 1), ("convnext", 192, 28, 7, 1), ("convnext", 384, 14, 7, 1),
          ("convnext", 768, 7, 7, 1),
          ("efficientnet", 144, 56, 5, 2), ("efficientnet", 240, 28, 5, 1), ("efficientnet", 672, 14, 5, 1),
          ("efficientnet", 1152, 7, 5, 1),
          ("mobilenet", 96, 112, 3, 2), ("mobilenet", 144, 56, 3, 1), ("mobilenet", 384, 14, 3, 1),
          ("mobilenet", 960, 7, 3, 1)]


# the runs form's candidates: (BLOCK_M output pixels, BLOCK_N channels, warps), each at each COLS
RUN_TILES = [(64, 32, 4), (128, 32, 4), (64, 64, 4), (128, 64, 4), (256, 32, 4), (256, 64, 8), (32, 64, 4)]
RUN_COLS = (4, 8)
FORMS = ("direct", "runs")


def configs(taps: int, twins: bool = False) -> list[KernelConfig]:
    """The direct form's tiles (taps unrolled or in a row loop as `depthwise_configs` decides; with `twins`, each
    unrolled tile in a row loop too: what an unrolled tile's long compile buys), then the runs form's."""
    direct = []
    for t in DEPTHWISE + SMALL_DEPTHWISE:
        loops = [int(unrolled_tap_registers(t, taps, 2) > 255)]
        loops += [1] if twins and loops == [0] else []
        direct += [KernelConfig.of(num_warps=t["num_warps"], num_stages=t["num_stages"], BLOCK_M=t["BLOCK_M"],
                                   BLOCK_N=t["BLOCK_N"], ROW_LOOP=loop) for loop in loops]
    runs = [KernelConfig.of(num_warps=w, num_stages=1, BLOCK_M=m, BLOCK_N=n, COLS=cols)
            for cols in RUN_COLS for m, n, w in RUN_TILES]
    return direct + runs


def form(config: KernelConfig) -> str:
    return "runs" if "COLS" in dict(config.params) else "direct"


def describe(config: KernelConfig) -> str:
    p = dict(config.params)
    kind = f"cols{p['COLS']}" if "COLS" in p else ("rows" if p["ROW_LOOP"] else "unrolled")
    return f"{p['BLOCK_M']}x{p['BLOCK_N']}/w{config.num_warps}/{kind}"


def run_layer(batch: int, model: str, channels: int, size: int, k: int, stride: int, twins: bool = False) -> dict:
    b = Builder(dtype="float16")
    x = b.input("x", (batch, channels, size, size))
    y = b.conv(x, channels, k, stride=stride, padding=k // 2, groups=channels)
    kernel = lower_conv_group(b.graph, b.group([y], GroupKind.ANCHOR_EPILOGUE), "cuda")
    feeds = [b.feeds[name].cuda().contiguous(memory_format=torch.channels_last) for name in kernel.runtime_inputs]
    conv = b.graph[y]
    weight = b.graph.constants[conv.inputs[1]].cuda()
    bias = b.graph.constants[conv.inputs[2]].cuda()
    row: dict = {"batch": batch, "model": model, "layer": f"{channels}x{size}x{size} k{k} s{stride}", "configs": []}
    with torch.inference_mode():
        library = lambda: F.conv2d(feeds[0], weight, bias, stride, k // 2, 1, channels)  # noqa: E731
        reference = library().float()
        row["cudnn_us"] = graphed_call_us(library, REPEAT)
        for config in configs(k * k, twins):
            entry = {"config": describe(config), "form": form(config)}
            try:
                start = time.perf_counter()
                out = kernel.run(feeds, config)[0]
                torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - start, 2)
                entry["rel_err"] = relative_error(out.float(), reference)
                entry["regs"], entry["spills"] = kernel.last_compiled.registers, kernel.last_compiled.spills
                entry["us"] = graphed_call_us(lambda: kernel.run(feeds, config), REPEAT)
            except Exception as error:
                entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            row["configs"].append(entry)
    for name in FORMS:
        timed = [c for c in row["configs"] if "us" in c and c["form"] == name]
        if timed:
            row[f"best_{name}"] = min(timed, key=lambda c: c["us"])
            row[f"default_{name}"] = timed[0]
    return row


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"### depthwise kernel sweep, fp16 channels-last: {env.get('date')}, {env.get('gpu')}, "
             f"torch {env.get('torch')}, triton {env.get('triton')}", "",
             f"µs per call ({REPEAT} calls per CUDA graph, median of 30 replays); tile BMxBN/warps/form (unrolled "
             "taps, rows in a loop, runs of COLS outputs); first call: its compile, in s; max rel. err against "
             "cuDNN.", "",
             "| batch | model | layer | cuDNN µs | direct: first tile / best | runs: first tile / best | "
             "best vs cuDNN | compile s direct / runs (sum) | max spills direct / runs | max rel. err |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if not all(f"best_{f}" in row for f in FORMS):
            lines.append(f"| {row['batch']} | {row['model']} | {row['layer']} | {row.get('error', 'no timing')} |"
                         + " |" * 6)
            continue
        forms = {f: [c for c in row["configs"] if "us" in c and c["form"] == f] for f in FORMS}
        best = min(row[f"best_{f}"]["us"] for f in FORMS)
        compile_s = " / ".join(f"{sum(c['first_call_s'] for c in forms[f]):.1f}" for f in forms)
        spills = " / ".join(str(max(c["spills"] or 0 for c in forms[f])) for f in forms)
        errors = max(c["rel_err"] for f in forms for c in forms[f])
        cells = [f"{row[f'default_{f}']['us']:.1f} / {row[f'best_{f}']['us']:.1f} ({row[f'best_{f}']['config']})"
                 for f in forms]
        lines.append(f"| {row['batch']} | {row['model']} | {row['layer']} | {row['cudnn_us']:.1f} | {cells[0]} | "
                     f"{cells[1]} | {row['cudnn_us'] / best:.2f}x | {compile_s} | {spills} | {errors:.1e} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--batches", default="64,1")
    parser.add_argument("--budget", type=float, default=480.0)
    parser.add_argument("--models", default="", help="only these models' layers (comma-separated: convnext, ...)")
    parser.add_argument("--row-loop-twins", action="store_true",
                        help="time each unrolled tile in a row loop too (`configs`)")
    args = parser.parse_args()
    models = {m for m in args.models.split(",") if m}
    out = harness.start_gpu_run("depthwise_sweep.py", args.out)
    if out is None:
        return 3     # the exit code `opfuse bench` uses for the same case
    env = harness.environment()
    rows: list[dict] = []
    start = time.perf_counter()
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for layer in [layer for layer in LAYERS if not models or layer[0] in models]:
            if time.perf_counter() - start > args.budget:
                print(f"budget of {args.budget:.0f} s spent: stopping", flush=True)
                break
            try:
                row = run_layer(batch, *layer, twins=args.row_loop_twins)
            except Exception as error:
                row = {"batch": batch, "model": layer[0], "layer": str(layer[1:]),
                       "error": f"{type(error).__name__}: {str(error)[:200]}"}
            print(json.dumps({k: v for k, v in row.items() if k != "configs"}, default=str), flush=True)
            rows.append(row)
            (out / "depthwise_sweep.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))
            (out / "depthwise_sweep.md").write_text(markdown(env, rows))
    print(markdown(env, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
