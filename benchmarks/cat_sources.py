"""What a concatenation's number of inputs costs a pointwise kernel that reads it (DenseNet's cat + BN + ReLU).

    python -m benchmarks.cat_sources [--out DIR] [--sources 1,2,4,8,16,32]

For each n: relu(batch_norm(cat(x_1..x_n, dim=1))) on n channels-last fp16 inputs that split C=512 channels
equally (batch 64, 28x28: the same bytes for every n), compiled by opfuse (one pointwise kernel: each input loaded
under the mask of its slice) and by torch.compile (inductor's default mode); opfuse's time is the bare replay its
compile measures (`forward_ms`), torch.compile's the median of its CUDA-graphed calls (`opfuse.bench.timing`).
Prints one JSON line per n (ms and GB/s of each, the bytes being one read and one write of the tensor) and writes
them to DIR/cat_sources.json. Run on a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

import opfuse
from opfuse.bench.timing import cuda_graphed, median_ms

CHANNELS, BATCH, SIZE = 512, 64, 28


class CatNormRelu(torch.nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.norm = torch.nn.BatchNorm2d(channels)
        with torch.no_grad():
            self.norm.running_mean.uniform_(-0.5, 0.5)
            self.norm.running_var.uniform_(0.5, 1.5)
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(torch.cat(xs, dim=1)))


def row(sources: int) -> dict:
    torch.manual_seed(0)
    model = CatNormRelu(CHANNELS).cuda().half().eval()
    inputs = [torch.randn(BATCH, CHANNELS // sources, SIZE, SIZE, device="cuda", dtype=torch.float16)
              .to(memory_format=torch.channels_last) for _ in range(sources)]
    megabytes = 2 * BATCH * CHANNELS * SIZE * SIZE * 2 / 1e6      # one read, one write, fp16
    with torch.inference_mode():
        compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float16"))
        opfuse_ms = compiled.compiled.forward_ms
        inductor = torch.compile(model)
        inductor_ms = median_ms(cuda_graphed(inductor, inputs), inputs)
    return {"sources": sources, "channels_each": CHANNELS // sources, "launches": compiled.compiled.launches,
            "opfuse_ms": opfuse_ms, "torch_compile_ms": inductor_ms,
            "opfuse_gbs": megabytes / opfuse_ms if opfuse_ms else None, "torch_compile_gbs": megabytes / inductor_ms}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--sources", default="1,2,4,8,16,32")
    args = parser.parse_args()
    rows = []
    for sources in (int(n) for n in args.sources.split(",")):
        rows.append(row(sources))
        print(json.dumps(rows[-1]), flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cat_sources.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
