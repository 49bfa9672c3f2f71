"""Shapes that vary (issue 51): one dynamic opfuse compile against static compiles at each shape, one process.

For a built-in model and a set of points (batch, or batch x sequence for token models), fp16 on the GPU:

  opfuse_dynamic   opfuse.compile(..., dynamic_shapes=) once; a call at each point (its bucket compiled at first use)
  opfuse_static    opfuse.compile at exactly that point (one compile per point)
  inductor_dynamic torch.compile(dynamic=True) once, then one CUDA graph captured per point
  inductor_static  torch.compile (dynamic=False) recompiled per point, one CUDA graph per point
  eager            the model as is (the best PyTorch path for transformers at large batch)

Every contender is warmed and timed under one `torch.inference_mode()`, rounds interleaved at each point
(`opfuse.bench.timing.interleaved_samples`: CUDA-event medians). opfuse is timed as a user calls it (the module
call: inputs copied in, outputs cloned out; padding to the bucket and the cut back for the dynamic one); torch.compile
as a bare graph replay, which favours it. Compile seconds: the dynamic model's per bucket it built, the static ones'
per point, torch.compile's first call (and per recompile for the static one).

    python -m benchmarks.dynamic --out DIR --model resnet50 --dims batch=1:128 --points 1,3,17,64,128
    python -m benchmarks.dynamic --out DIR --model bert --dims batch=1:32,seq=1:512 --points 1x16,8x37,8x128
    python -m benchmarks.dynamic --out DIR --model bert --mask --dims batch=1:64,seq=1:512 --points 8x37,32x200

`--mask` calls a token model with an attention mask of ones beside its ids (as a server calls it), dynamic alike:
the sequence then pads under the mask (zeros mask the padded keys) where the model's own mask would refuse it.

Writes DIR/dynamic-<model>.json and prints one line per point.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def parse_dims(text: str) -> dict[str, tuple[int, int]]:
    dims = {}
    for item in text.split(","):
        name, _, span = item.partition("=")
        low, _, high = span.partition(":")
        dims[name] = (int(low), int(high))
    return dims


def inputs_at(name: str, point: tuple[int, ...], mask: bool = False) -> tuple:
    from opfuse.bench.zoo import load_builtin

    _, inputs = load_builtin(name, batch=point[0], **({"seq_len": point[1]} if len(point) > 1 else {}))
    return (*inputs, torch.ones_like(inputs[0])) if mask else inputs


class DynamicCopy(torch.nn.Module):
    """The model under a class (and a forward code object) of its own, so that dynamo's cache entries of the
    dynamic and the static torch.compile never serve each other."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs)


class StaticCopy(torch.nn.Module):
    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        return self.model(*inputs)


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    import opfuse
    from opfuse.bench.harness import frozen_inductor, protocol_form
    from opfuse.bench.timing import cuda_graphed, interleaved_samples
    from opfuse.bench.zoo import load_builtin
    from opfuse.numerics import relative_error
    from torch._dynamo.utils import counters

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--dims", default="batch=1:128", help="name=min:max per dynamic dim, input dims 0, 1, ...")
    parser.add_argument("--points", default="1,3,17,64,128", help="sizes per point, 'x' between dims")
    parser.add_argument("--tune-top", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--mask", action="store_true", help="call the token model with an attention mask of ones")
    parser.add_argument("--bucket-steps", type=int, default=1,
                        help="FusionConfig.bucket_steps: buckets per power of two")
    args = parser.parse_args(argv)
    dims = parse_dims(args.dims)
    points = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    config = opfuse.FusionConfig(dtype="float16", tune_top=args.tune_top, bucket_steps=args.bucket_steps)
    out = Path(args.out)
    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)

    model, _ = load_builtin(args.model, batch=points[0][0],
                            **({"seq_len": points[0][1]} if len(points[0]) > 1 else {}))
    model, example = protocol_form(model, inputs_at(args.model, points[0], args.mask), torch.float16, "cuda")
    per_input = {i: torch.export.Dim(name, min=low, max=high) for i, (name, (low, high)) in enumerate(dims.items())}
    spec = (per_input,) * len(example)
    result = {"model": args.model, "mask": args.mask, "bucket_steps": args.bucket_steps, "dims": dims,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "points": []}
    with torch.inference_mode():
        dynamic, seconds = timed(lambda: opfuse.compile(model, example, config, dynamic_shapes=spec))
        result["dynamic_setup_s"] = seconds
        with frozen_inductor():
            inductor_dynamic = torch.compile(DynamicCopy(model), dynamic=True)
            inductor_static = torch.compile(StaticCopy(model), dynamic=False)
            for point in points:
                _, inputs = protocol_form(model, inputs_at(args.model, point, args.mask), torch.float16, "cuda")
                row: dict = {"point": point, "compile_s": {}}
                before = set(dynamic.buckets)
                _, row["compile_s"]["opfuse_dynamic"] = timed(dynamic, *inputs)
                row["bucket"] = [b.describe() for key, b in dynamic.buckets.items() if key not in before] or "reused"
                static, row["compile_s"]["opfuse_static"] = timed(opfuse.compile, model, inputs, config)
                graphs = counters["stats"]["unique_graphs"]
                _, row["compile_s"]["inductor_dynamic"] = timed(inductor_dynamic, *inputs)
                row["dynamo_graphs_dynamic"] = counters["stats"]["unique_graphs"] - graphs
                _, row["compile_s"]["inductor_static"] = timed(inductor_static, *inputs)
                row["dynamo_graphs_static"] = counters["stats"]["unique_graphs"] - graphs - row["dynamo_graphs_dynamic"]
                forwards = {"eager": lambda: model(*inputs), "opfuse_dynamic": lambda: dynamic(*inputs),
                            "opfuse_static": lambda: static(*inputs),
                            "inductor_dynamic": cuda_graphed(inductor_dynamic, inputs),
                            "inductor_static": cuda_graphed(inductor_static, inputs)}
                want = model(*inputs).float()
                row["rel_error"] = {name: relative_error(module(*inputs).float(), want)
                                    for name, module in (("opfuse_dynamic", dynamic), ("opfuse_static", static))}
                calls = {name: (lambda f=fn: f(*inputs)) if name.startswith("inductor") else fn
                         for name, fn in forwards.items()}
                errors: dict[str, str] = {}
                samples = interleaved_samples(calls, rounds=args.rounds, errors=errors)
                row["ms"] = {name: statistics.median(s) for name, s in samples.items() if s}
                row["errors"] = errors
                ms = row["ms"]
                if "opfuse_dynamic" in ms:
                    row["dynamic_over_static"] = ms["opfuse_dynamic"] / ms["opfuse_static"]
                    row["speedup_vs_inductor_dynamic"] = ms["inductor_dynamic"] / ms["opfuse_dynamic"]
                    row["speedup_vs_best_pytorch"] = min(ms["eager"], ms["inductor_dynamic"],
                                                         ms["inductor_static"]) / ms["opfuse_dynamic"]
                result["points"].append(row)
                print(json.dumps(row), flush=True)
                out.mkdir(parents=True, exist_ok=True)      # after every point: a run cut short keeps what it measured
                (out / f"dynamic-{args.model}.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
