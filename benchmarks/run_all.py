"""opfuse against eager, eager in a CUDA graph, and torch.compile on one GPU, in one process.

Protocol (issue 4): fp16, channels-last image inputs, cudnn.benchmark, eval, inference mode, fixed-seed random
weights, never zeros. For each contender: median latency of CUDA-event-timed forwards after warm-up, kernels per
forward and GPU busy time (torch.profiler), peak memory, compile time, relative error against eager in float32.
The floor of each workload is measured too: FLOPs over the measured fp16 matrix rate, and the fewest bytes
(weights, inputs and outputs once) over the measured copy bandwidth.

    python benchmarks/run_all.py --out DIR [--workloads resnet50:1,resnet50:64,...] [--results benchmarks/RESULTS.md]

Writes DIR/results.json and DIR/RESULTS.md (the table, with date, GPU, driver, torch and triton versions).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import opfuse  # noqa: E402
from opfuse.bench.harness import cuda_graphed, measure, torch_compiled  # noqa: E402
from opfuse.bench.zoo import load_builtin  # noqa: E402

DEFAULT_WORKLOADS = ("resnet50:1,resnet50:64,mobilenet_v2:1,mobilenet_v2:64,bert-base:1,bert-base:64")


def measure_ceilings() -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and the fp16 matrix rate, on random data."""
    x = torch.randn(1 << 28, device="cuda", dtype=torch.float16)     # 512 MiB
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        y.copy_(x)
    end.record()
    end.synchronize()
    bandwidth = 2 * x.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start.record()
    for _ in range(10):
        a @ b
    end.record()
    end.synchronize()
    matrix = 2 * 8192 ** 3 * 10 / (start.elapsed_time(end) / 1e3)
    del x, y, a, b
    return {"copy_bytes_per_s": bandwidth, "fp16_matrix_flops": matrix}


def prepare(name: str, batch: int) -> tuple[torch.nn.Module, tuple, torch.nn.Module, tuple]:
    """(fp16 model, fp16 inputs, fp32 reference model, fp32 inputs) on the GPU, channels-last for images."""
    model, inputs = load_builtin(name, batch=batch)
    reference = copy.deepcopy(model).float().cuda().eval()
    ref_inputs = tuple(x.cuda() for x in inputs)
    model = model.half().cuda().eval()
    fp16_inputs = []
    for x in inputs:
        x = x.cuda()
        if x.is_floating_point():
            x = x.half()
            if x.dim() == 4:
                x = x.contiguous(memory_format=torch.channels_last)
                model = model.to(memory_format=torch.channels_last)
        fp16_inputs.append(x)
    return model, tuple(fp16_inputs), reference, ref_inputs


def floor_ms(compiled, inputs, ceilings) -> tuple[float, float]:
    """(compute floor, memory floor) in ms from the analysis' FLOPs and the minimal bytes."""
    analysis = compiled.analysis
    flops = analysis.unfused.flops
    graph = analysis.prepared
    minimal = sum(graph.constants[n.name].numel() * n.type.itemsize for n in graph if n.op == "constant")
    minimal += sum(n.type.nbytes for n in graph.input_nodes) + sum(graph[o].type.nbytes for o in graph.outputs)
    return flops / ceilings["fp16_matrix_flops"] * 1e3, minimal / ceilings["copy_bytes_per_s"] * 1e3


def run_workload(name: str, batch: int, ceilings: dict, contenders: set[str], config: "opfuse.FusionConfig") -> dict:
    torch.manual_seed(0)
    model, inputs, reference_model, reference_inputs = prepare(name, batch)
    with torch.inference_mode():
        reference = reference_model(*reference_inputs).float()
    del reference_model
    row: dict = {"workload": f"{name} bs{batch}", "model": name, "batch": batch}

    def record(label: str, fn) -> None:
        try:
            row[label] = asdict(fn())
        except Exception as error:
            row[label] = {"error": f"{type(error).__name__}: {error}"}
            traceback.print_exc()
        gc.collect()
        torch.cuda.empty_cache()

    if "eager" in contenders:
        record("eager", lambda: measure(model, inputs, reference))
    if "eager_graph" in contenders:
        record("eager_graph", lambda: measure(cuda_graphed(model, inputs), inputs, reference, profile_fn=model))
    if "inductor" in contenders:
        def inductor():
            compiled, seconds = torch_compiled(model, inputs)
            graphed = cuda_graphed(compiled, inputs)
            return measure(graphed, inputs, reference, compile_s=seconds, profile_fn=compiled)
        record("inductor", inductor)
    if "opfuse" in contenders:
        def run_opfuse():
            start = time.perf_counter()
            compiled = opfuse.compile(model, inputs, config)
            seconds = time.perf_counter() - start
            row["plan_launches"] = compiled.plan.kernel_launches
            row["runtime_launches"] = compiled.launches
            row["fallbacks"] = compiled.fallbacks
            row["opfuse_compile_seconds"] = compiled.seconds
            row["floor_compute_ms"], row["floor_memory_ms"] = floor_ms(compiled, inputs, ceilings)
            result = measure(compiled, inputs, reference, compile_s=seconds)
            compiled.compiled.set_cuda_graph(False)     # count kernels on the un-graphed forward
            with torch.inference_mode():
                from opfuse.bench.harness import kernel_profile
                result.kernels, result.gpu_busy_ms = kernel_profile(compiled, inputs)
            row["cuda_graph_error"] = compiled.compiled.cuda_graph_error
            return result
        record("opfuse", run_opfuse)
    return row


def environment() -> dict[str, str]:
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:
        driver = "?"
    import triton

    return {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
            "driver": driver, "torch": torch.__version__, "triton": triton.__version__,
            "python": sys.version.split()[0]}


def markdown(results: list[dict], env: dict, ceilings: dict) -> str:
    def ms(row: dict, key: str) -> str:
        value = row.get(key, {})
        return f"{value['median_ms']:.3f}" if "median_ms" in value else ("error" if "error" in value else "-")

    def kernels(row: dict, key: str) -> str:
        value = row.get(key, {})
        return str(value.get("kernels", "-"))

    lines = [f"### {env['date']}, {env['gpu']} (driver {env['driver']}), torch {env['torch']}, "
             f"triton {env['triton']}",
             "",
             f"Measured ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s (read + write), fp16 matrix "
             f"{ceilings['fp16_matrix_flops'] / 1e12:.0f} TFLOP/s. Median ms per forward (kernels per forward).",
             "",
             "| workload | eager | eager + graph | torch.compile + graph | opfuse | opfuse / torch.compile | "
             "floor (compute / memory) | opfuse rel. err | plan launches |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in results:
        ratio = "-"
        if "median_ms" in row.get("inductor", {}) and "median_ms" in row.get("opfuse", {}):
            ratio = f"{row['inductor']['median_ms'] / row['opfuse']['median_ms']:.2f}x"
        floor = (f"{row['floor_compute_ms']:.3f} / {row['floor_memory_ms']:.3f}" if "floor_compute_ms" in row
                 else "-")
        error = row.get("opfuse", {}).get("rel_error")
        lines.append(f"| {row['workload']} | {ms(row, 'eager')} ({kernels(row, 'eager')}) | "
                     f"{ms(row, 'eager_graph')} | {ms(row, 'inductor')} ({kernels(row, 'inductor')}) | "
                     f"{ms(row, 'opfuse')} ({kernels(row, 'opfuse')}) | {ratio} | {floor} | "
                     f"{'-' if error is None else f'{error:.1e}'} | {row.get('plan_launches', '-')} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS)
    parser.add_argument("--contenders", default="eager,eager_graph,inductor,opfuse")
    parser.add_argument("--results", help="also write the table into this markdown file (replacing it)")
    parser.add_argument("--tune-top", type=int, default=4,
                        help="autotune among each kernel's first N configs; 0 turns autotuning off")
    args = parser.parse_args()
    torch.backends.cudnn.benchmark = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = environment()
    ceilings = measure_ceilings()
    contenders = set(args.contenders.split(","))
    config = opfuse.FusionConfig(dtype="float16", autotune=args.tune_top > 0, tune_top=args.tune_top or None)
    results = []
    for spec in args.workloads.split(","):
        name, batch = spec.rsplit(":", 1)
        print(f"== {name} batch {batch}", flush=True)
        results.append(run_workload(name, int(batch), ceilings, contenders, config))
        (out / "results.json").write_text(json.dumps({"env": env, "ceilings": ceilings, "results": results,
                                                      "tune_top": args.tune_top}, indent=1, default=str))
        (out / "RESULTS.md").write_text(markdown(results, env, ceilings))
        print(markdown(results[-1:], env, ceilings), flush=True)
    table = markdown(results, env, ceilings)
    (out / "RESULTS.md").write_text(table)
    if args.results:
        Path(args.results).write_text("# Benchmark results\n\nGenerated by `benchmarks/run_all.py`.\n\n" + table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
