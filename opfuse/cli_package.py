"""`opfuse compile` and `opfuse bench PACKAGE`: the command line of deployable packages (`opfuse.runtime.package`).

    opfuse compile MODEL -o model.opfuse [--batches 1,8,64 | --dynamic batch=1:64,seq=1:512] [--dtype fp16]
                   [--tune-top N] [--json FILE] [--quiet]
    opfuse bench model.opfuse [--recompile] [--sha256 HEX] [--json FILE] [--quiet]

compile compiles MODEL (a built-in name, an .onnx file or a factory, as every command takes) once per batch size
(--batches, else --batch), or for ranges of sizes with every bucket compiled (--dynamic: `opfuse.runtime.dynamic`),
on the GPU, or through Triton's interpreter where TRITON_INTERPRET=1, and writes them as one package. bench (a GPU
command) loads a package and times it at each size it holds: the load, the first call, and the median call after
warm-up; --sha256 pins the package it loads (`opfuse.load(path, sha256=...)`).
"""

from __future__ import annotations

import argparse
import string
import time

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from opfuse.cli import EXIT_OK, EXIT_USAGE, _writable, error, human_bytes, load_model, write_json


def batch_list(text: str) -> list[int]:
    """--batches: comma-separated whole numbers of at least 1, e.g. 1,8,64."""
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected batch sizes like 1,8,64, got {text!r}") from None
    if not values or min(values) < 1 or len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"expected distinct batch sizes of at least 1, got {text!r}")
    return sorted(values)


# the dims --dynamic names without saying where they lie: the batch is dim 0 of every input, the sequence dim 1
CONVENTIONAL_DIMS = {"batch": 0, "seq": 1}


def dynamic_list(text: str) -> list[tuple[str, int, int, list[tuple[int, int]] | None]]:
    """--dynamic: comma-separated NAME=MIN:MAX[@INPUT.DIM+INPUT.DIM...], e.g. batch=1:64,seq=1:512 (batch is dim 0 of
    every input, seq dim 1 of every input of two dims or more; any other name says where it lies: len=1:80@0.2)."""
    dims = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        try:
            name, _, rest = part.partition("=")
            span, _, where = rest.partition("@")
            low, high = (int(v) for v in span.split(":"))
            uses = [tuple(int(v) for v in use.split(".")) for use in where.split("+")] if where else None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected NAME=MIN:MAX[@INPUT.DIM+...], got {part!r}") from None
        if not name.isidentifier() or not 1 <= low <= high or (uses is None and name not in CONVENTIONAL_DIMS) \
                or any(len(use) != 2 for use in uses or []):
            raise argparse.ArgumentTypeError(f"{part!r}: a name, 1 <= MIN <= MAX, and @INPUT.DIM for a name other "
                                             f"than {' or '.join(CONVENTIONAL_DIMS)}")
        dims.append((name, low, high, uses))
    if not dims or len({d[0] for d in dims}) != len(dims):
        raise argparse.ArgumentTypeError(f"expected distinct dims like batch=1:64,seq=1:512, got {text!r}")
    return dims


def dynamic_dims(spec: list[tuple[str, int, int, list[tuple[int, int]] | None]], inputs: list) -> list:
    """The DynamicDims of --dynamic for these example inputs (where a conventional dim lies: every input that has
    it); a GraphError naming the dim where it lies in no input."""
    from opfuse.ir.graph import GraphError
    from opfuse.runtime.dynamic import DynamicDim

    dims = []
    for name, low, high, uses in spec:
        if uses is None:
            axis = CONVENTIONAL_DIMS[name]
            uses = [(i, axis) for i, x in enumerate(inputs) if x.dim() > axis]
        if not uses or any(not 0 <= i < len(inputs) or not 0 <= d < inputs[i].dim() for i, d in uses):
            raise GraphError(f"--dynamic {name}: no such dim among the model's inputs "
                             f"({', '.join(str(list(x.shape)) for x in inputs)})")
        dims.append(DynamicDim(name, low, high, tuple(uses)))
    return dims


def sha256_digest(text: str) -> str:
    """--sha256: a file's sha256 as 64 hex digits (either case; lower-cased)."""
    if len(text) != 64 or not set(text) <= set(string.hexdigits):
        raise argparse.ArgumentTypeError(f"expected a sha256 of 64 hex digits, got {text!r}")
    return text.lower()


def bench_package_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `opfuse bench model.opfuse` that a model's bench has not (--recompile is `cli_bench`'s)."""
    parser.add_argument("--sha256", type=sha256_digest, metavar="HEX",
                        help="a package (MODEL.opfuse): load it only if its sha256 is HEX, as pip's hash-checking "
                             "mode pins a download (`sha256sum model.opfuse` where it was compiled)")


def compile_arguments(parser: argparse.ArgumentParser) -> None:
    from opfuse.bench.cli_bench import add_tuning_arguments

    parser.add_argument("-o", "--output", default="model.opfuse", metavar="FILE",
                        help="where to write the package (default model.opfuse)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--batches", type=batch_list, metavar="N,N,...",
                       help="compile one model per batch size into the package (a call pads its batch to the "
                            "smallest that holds it); default: --batch")
    sizes.add_argument("--dynamic", type=dynamic_list, metavar="NAME=MIN:MAX,...",
                       help="compile for ranges of sizes, every bucket into the package: batch=1:64,seq=1:512 (batch: "
                            "dim 0 of every input, seq: dim 1; other names @INPUT.DIM, e.g. len=1:80@0.2); the "
                            "example is built at --batch")
    add_tuning_arguments(parser)


def cmd_compile(args: argparse.Namespace, console: Console) -> int:
    if not _writable(args.output, args.json):
        return EXIT_USAGE
    import torch

    import opfuse
    from opfuse.bench.cli_bench import tuning_knobs
    from opfuse.bench.harness import protocol_form
    from opfuse.config import FusionConfig
    from opfuse.environment import triton_interpreter
    from opfuse.ir.graph import dtype_name, torch_dtype

    config = FusionConfig(dtype=dtype_name(args.dtype), hardware=args.hw, density_threshold=args.threshold,
                          **tuning_knobs(args))
    device = "cuda" if torch.cuda.is_available() and not triton_interpreter() else "cpu"
    start = time.perf_counter()
    compiled, name = [], args.model
    if args.dynamic:
        from opfuse.ir.graph import GraphError

        model, inputs, name = load_model(args.model, args.batch)
        model, inputs = protocol_form(model, inputs, torch_dtype(config.dtype), device)
        try:
            dims = dynamic_dims(args.dynamic, list(inputs))
        except GraphError as problem:
            error("compile", str(problem))
            return EXIT_USAGE
        dynamic = opfuse.compile(model, inputs, config, quiet=args.quiet, dynamic_shapes=dims)
        dynamic.compile_buckets()
        models, sizes = [b.model for b in dynamic.buckets.values()], [list(s) for s in dynamic.buckets]
        path = opfuse.save(dynamic, args.output)
    else:
        for batch in args.batches or [args.batch]:
            model, inputs, name = load_model(args.model, batch)
            model, inputs = protocol_form(model, inputs, torch_dtype(config.dtype), device)
            compiled.append(opfuse.compile(model, inputs, config, quiet=args.quiet))
        models, sizes = compiled, [[b] for b in args.batches or [args.batch]]
        path = opfuse.save(compiled, args.output)
    from opfuse.runtime.package import file_sha256

    info = {"package": str(path), "sha256": file_sha256(path), "model": name, "bytes": path.stat().st_size,
            "device": device, "sizes": sizes, "batch_sizes": [s[0] for s in sizes] if not args.dynamic else None,
            "kernels": [len(m.compiled.kernels) for m in models], "seconds": time.perf_counter() - start}
    write_json(args.json, info)
    if not args.quiet:
        held = (f"batch sizes {', '.join(str(s[0]) for s in sizes)}" if not args.dynamic else
                f"{len(sizes)} buckets of {', '.join(f'{n}={lo}:{hi}' for n, lo, hi, _ in args.dynamic)}")
        console.print(f"wrote {escape(str(path))} ({human_bytes(info['bytes'])}): {escape(name)} on {device}, {held}, "
                      f"{sum(info['kernels'])} kernels, compiled in {info['seconds']:.1f} s; run it with "
                      f"opfuse.load({str(path)!r}, sha256={info['sha256']!r}), which refuses any other file")
    return EXIT_OK


def cmd_bench_package(args: argparse.Namespace, console: Console) -> int:
    """`opfuse bench model.opfuse`: load time, first call and median call at each batch size held."""
    from opfuse.bench.cli_bench import preflight

    stop = preflight(args, args.json, analyzable=False)
    if stop is not None:
        return stop
    import torch

    import opfuse
    from opfuse.bench.timing import interleaved_samples, summarize, time_once

    torch.cuda.synchronize()
    start = time.perf_counter()
    model = opfuse.load(args.model, recompile=args.recompile, sha256=args.sha256)
    torch.cuda.synchronize()
    load_s = time.perf_counter() - start
    rows = []
    with torch.inference_mode():
        for sizes in model.sizes_held:
            inputs = model.example_inputs(*sizes)
            first_ms = time_once(lambda: model(*inputs), cuda=True)
            samples = interleaved_samples({"call": lambda: model(*inputs)}, rounds=10, per_round=10)["call"]
            timing = summarize(samples)
            rows.append({"sizes": list(sizes), "first_call_ms": first_ms, "median_ms": timing.median_ms,
                         "p10_ms": timing.p10_ms, "p90_ms": timing.p90_ms})
    write_json(args.json, {"package": args.model, "load_s": load_s, "rebuilt_because": model.rebuilt_because,
                           "results": rows})
    if not args.quiet:
        table = Table(title=f"{escape(args.model)} ({escape(model.name)}): loaded in {load_s:.2f} s"
                            + (" (rebuilt: " + escape(model.rebuilt_because) + ")" if model.rebuilt_because else ""))
        for column in (", ".join(d.name for d in model.dims) or "shape", "first call ms", "median ms", "p10-p90 ms"):
            table.add_column(column, justify="right")
        for row in rows:
            table.add_row(", ".join(map(str, row["sizes"])) or "fixed", f"{row['first_call_ms']:.3f}",
                          f"{row['median_ms']:.3f}",
                          f"{row['p10_ms']:.3f}-{row['p90_ms']:.3f}")
        console.print(table)
    return EXIT_OK
