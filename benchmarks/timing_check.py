"""The autotuner's clock against Triton's: `opfuse.runtime.clock.graph_time` and `do_bench_cudagraph` on the same
kernels (fp16 GEMMs and an elementwise op from a microsecond to a millisecond), and the seconds each spends, on a GPU.

    python -m benchmarks.timing_check [--out DIR]

Why: graph_time (TIMING_METHOD 3) replaced do_bench_cudagraph in the autotuner to cut a cold compile's timing
cost; it must measure the same times. Prints one line per kernel and writes DIR/timing_check.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from opfuse.runtime.clock import graph_time


def main() -> None:
    from triton.testing import do_bench_cudagraph

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = {}
    for m, n, k in ((128, 768, 768), (128, 3072, 768), (8192, 3072, 768), (8192, 8192, 8192)):
        a = torch.randn(m, k, device="cuda", dtype=torch.float16)
        b = torch.randn(k, n, device="cuda", dtype=torch.float16)
        cases[f"matmul {m}x{n}x{k}"] = lambda a=a, b=b: a @ b
    x = torch.randn(64 * 112 * 112 * 24, device="cuda", dtype=torch.float16)
    cases["relu 19M"] = lambda: torch.relu(x)
    rows = []
    for name, fn in cases.items():
        fn()                   # the library's own start-up is neither clock's
        torch.cuda.synchronize()
        start = time.perf_counter()
        ours = graph_time(fn)
        ours_s = time.perf_counter() - start
        start = time.perf_counter()
        triton_s = do_bench_cudagraph(fn, rep=10, return_mode="median") / 1e3
        theirs_s = time.perf_counter() - start
        rows.append({"kernel": name, "graph_time_us": ours * 1e6, "do_bench_cudagraph_us": triton_s * 1e6,
                     "graph_time_cost_s": ours_s, "do_bench_cudagraph_cost_s": theirs_s})
        print(f"{name:24} graph_time {ours * 1e6:9.2f} us ({ours_s:.3f} s)  do_bench_cudagraph "
              f"{triton_s * 1e6:9.2f} us ({theirs_s:.3f} s)", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "timing_check.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
