"""Seconds of verification's float32 reference, op by op, with cuDNN on and off (issue 17: verification that does not
dominate a compile).

    python -m benchmarks.reference_time --out DIR [--workloads convnext_tiny:64,mobilenet_v2:64,resnet50:1]

For each workload (fp16, channels-last, the prepared graph `opfuse.analyze` plans): the graph's reference values
computed op by op in float32 as `opfuse.numerics.interpret_all` does, three times in one process (cuDNN on, on
again, then off), each op synchronised and timed and summed by op (depthwise convolutions apart: `conv2d-dw`); then
eager PyTorch deep-copied to float32, twice, as the end-to-end check runs it. Prints a JSON line per pass and writes
DIR/reference_time.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from collections import defaultdict

import torch

import opfuse
from opfuse.bench import harness
from opfuse.bench.zoo import load_builtin
from opfuse.config import FusionConfig
from opfuse.numerics import (_interpret_all, cudnn_setting, random_inputs_like,
                             without_cudnn_search)


def reference_pass(graph, inputs: list[torch.Tensor], cudnn: bool) -> tuple[float, dict[str, float]]:
    """(seconds, seconds by op) of one float32 reference pass over `graph` (`opfuse.numerics`' own loop) with cuDNN
    on or off, each op timed to its end on the GPU."""
    per_op: dict[str, float] = defaultdict(float)
    last = [0.0]

    def after(node) -> None:
        torch.cuda.synchronize()
        now = time.perf_counter()
        depthwise = node.op == "conv2d" and node.attrs.get("groups", 1) > 1
        per_op["conv2d-dw" if depthwise else node.op] += now - last[0]
        last[0] = now

    with cudnn_setting("enabled", cudnn), without_cudnn_search():
        torch.cuda.synchronize()
        start = last[0] = time.perf_counter()
        _interpret_all(graph, inputs, torch.float32, after)
        return time.perf_counter() - start, per_op


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--workloads", default="convnext_tiny:64,mobilenet_v2:64,resnet50:1,convnext_tiny:1")
    args = parser.parse_args()
    out = harness.start_gpu_run("reference_time.py", args.out)
    if out is None:
        return 3
    rows = []
    for workload in args.workloads.split(","):
        name, batch = workload.split(":")
        model, inputs = load_builtin(name, int(batch))
        model, inputs, _, _ = harness.prepare(model, inputs, torch.float16, "cuda")
        graph = opfuse.analyze(model, inputs, FusionConfig(dtype="float16")).prepared
        fresh = random_inputs_like(list(inputs))
        for trial, cudnn in enumerate((True, True, False)):
            seconds, per_op = reference_pass(graph, fresh, cudnn)
            top = sorted(per_op.items(), key=lambda kv: -kv[1])[:6]
            rows.append({"workload": f"{name}-bs{batch}", "trial": trial, "cudnn": cudnn, "total_s": round(seconds, 3),
                         "top": [(op, round(s, 3)) for op, s in top]})
            print(json.dumps(rows[-1]), flush=True)
        for trial in range(2):
            torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                copy.deepcopy(model).to(torch.float32)(*[x.to(torch.float32) for x in fresh])
            torch.cuda.synchronize()
            rows.append({"workload": f"{name}-bs{batch}", "eager_fp32_trial": trial,
                         "s": round(time.perf_counter() - start, 3)})
            print(json.dumps(rows[-1]), flush=True)
    (out / "reference_time.json").write_text(json.dumps({"env": harness.environment(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
