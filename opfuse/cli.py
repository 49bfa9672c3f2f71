"""The `opfuse` command: analyze | report | compile | bench | profile.

    opfuse analyze MODEL [--batch N] [--dtype fp16] [--hw h200] [--json FILE] [--html FILE] [--quiet]
    opfuse analyze llama-1.1b --decode [--batch N] [--max-seq 384]     (a decode step: bytes, launches, floor)
    opfuse report  MODEL -o report.html [--batch N] [--dtype fp16] [--hw h200] [--json FILE] [--quiet]
    opfuse compile MODEL -o model.opfuse [--batch N | --batches 1,8,64] [--dtype fp16] [--tune-top N] [--json FILE]
    opfuse bench   model.opfuse [--recompile] [--sha256 HEX] [--json FILE]
    opfuse bench   MODEL [--batch N] [--dtype fp16] [--contenders eager,...] [--tune-top N] [--no-split-k] [--json FILE]
    opfuse bench   --zoo [--models a,b] [--batches 1,64] [--workloads a:1,b:64] [--cold-parallel N] [--out DIR]
    opfuse bench   llama-1.1b --generate [--batch N] [--prompt 128] [--new 256] [--json FILE]
    opfuse profile MODEL [--batch N] [--dtype fp16] [--tune-top N] [--no-split-k] [--calibrate] [--html FILE] [--json FILE]
    opfuse --version

MODEL is a built-in name (resnet18, bert-base and the zoo's: opfuse.bench.zoo.BUILTIN_MODELS), an .onnx file
(bench and profile run its graph through PyTorch as eager, on seeded inputs; integer inputs are zeros),
``package.module:factory`` (the current directory is on the import path) or
``path/to/file.py:factory``; a factory returns (model, example_inputs) and may take ``batch``. bench and profile live in
opfuse/bench/cli_bench.py, compile and bench of a package (a deployable compiled model) in opfuse/cli_package.py.

Every command takes --json FILE (write its results as JSON) and --quiet (print nothing on stdout; errors still go
to stderr). Progress (capture, compile, tuning, measuring) shows on stderr when it is a terminal.

Exit codes scripts can rely on (EXIT_CODES):
  0  success
  1  the model could not be captured, planned, compiled or run (the message names the node or file), or, for
     bench, a contender failed (its error is in the JSON and on stderr)
  2  bad command-line usage, including an output file that cannot be written
  3  bench or profile on a machine without a usable NVIDIA GPU (CUDA unavailable, or TRITON_INTERPRET=1 set)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from opfuse import __version__
from opfuse.config import FusionConfig
from opfuse.hardware import PROFILES

EXIT_OK, EXIT_MODEL_ERROR, EXIT_USAGE, EXIT_NEEDS_GPU = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_MODEL_ERROR: "the model could not be captured, planned, compiled or run (the message names the node or "
                      "file); for bench, a contender failed",
    EXIT_USAGE: "bad command-line usage (including an output file that cannot be written)",
    EXIT_NEEDS_GPU: "bench or profile on a machine without a usable NVIDIA GPU",
}


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def human_flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("KFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def human_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.1f} µs"


def load_model(spec: str, batch: int):
    """(model, example inputs, display name) of a built-in name, package.module:factory, path/file.py:factory or an
    .onnx file (its graph run through PyTorch, `opfuse.frontend.onnx_module`; seeded example inputs)."""
    from opfuse.bench.zoo import resolve_model

    if spec.endswith(".onnx"):
        from opfuse.frontend.onnx_module import example_inputs_of, onnx_module

        model = onnx_module(spec, batch=batch)
        return model, example_inputs_of(model), Path(spec).stem

    module, _, factory = spec.rpartition(":")
    if module.endswith(".py"):           # a file: import it by its stem from its folder
        path = Path(module)
        if not path.is_file():
            raise FileNotFoundError(f"model file {module} does not exist")
        sys.path.insert(0, str(path.resolve().parent))
        spec = f"{path.stem}:{factory}"
    elif ":" in spec and "" not in sys.path and str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))     # like `python -m`: modules of the current directory import
    return resolve_model(spec, batch=batch)


def load_analysis(args: argparse.Namespace, config: FusionConfig):
    """Analysis of MODEL: a built-in name, a path to an .onnx file, or a factory (see `load_model`)."""
    from opfuse.api import analyze

    if args.model.endswith(".onnx"):
        return analyze(args.model, config=config, batch=args.batch)
    if getattr(args, "decode", False):      # (analyze's option: report has none)
        return decode_analysis(args, config)
    from opfuse.bench.harness import protocol_form
    from opfuse.ir.graph import torch_dtype

    model, inputs, name = load_model(args.model, args.batch)
    model, inputs = protocol_form(model, inputs, torch_dtype(config.dtype), "cpu")   # as `opfuse bench` compiles it
    return analyze(model, inputs, config=config, name=name)


def decode_analysis(args: argparse.Namespace, config: FusionConfig):
    """Analysis of the decode step of built-in decoder MODEL (`opfuse.bench.generation.GENERATION_MODELS`): one token
    a sequence for --batch sequences over a static KV cache of --max-seq positions (`opfuse.generate`)."""
    import torch

    from opfuse.api import analyze
    from opfuse.bench.generation import GENERATION_MODELS, llama
    from opfuse.generate import KVCacheDecoder
    from opfuse.ir.graph import GraphError

    if args.model not in GENERATION_MODELS:
        raise GraphError(f"--decode analyzes a built-in decoder ({', '.join(GENERATION_MODELS)}), not "
                         f"{args.model!r}")
    decoder = KVCacheDecoder(llama(args.model, "cpu", torch.float32), args.batch, args.max_seq).eval()
    ids = torch.zeros(args.batch, 1, dtype=torch.long)
    return analyze(decoder, (ids, torch.zeros(1, dtype=torch.long)), config=config,
                   name=f"{args.model} decode step")


def decode_table(analysis, args: argparse.Namespace) -> tuple[Table, dict]:
    """What a decode step moves and launches, and how near the bandwidth floor it is (`opfuse.generate.decode_report`
    at the last cache position; measured where a compile of this plan on this device recorded its replay)."""
    from opfuse.generate import decode_report

    measured = analysis.as_compiled.forward_ms if analysis.as_compiled is not None else None
    report = decode_report(analysis, args.batch, args.max_seq, measured_ms=measured)
    table = Table(title=f"Decode step at cache position {report['position']} ({report['tokens_per_step']} "
                        f"token(s) a step, {report['hardware']})")
    table.add_column("per step", justify="left")
    table.add_column("value", justify="right")
    rows = [("weights read", human_bytes(report["weight_bytes"])),
            ("cache it must read (up to the position)", human_bytes(report["cache_bytes_needed"])),
            ("cache the plan reads (the whole static cache)", human_bytes(report["cache_bytes_read"])),
            ("bytes the plan moves", human_bytes(report["plan_bytes"])),
            ("kernel launches", str(report["launches"])),
            ("predicted time", human_time(report["predicted_s"])),
            ("bandwidth floor (weights + needed cache)", human_time(report["bandwidth_floor_s"])),
            ("predicted share of the floor", f"{report['bandwidth_floor_s'] / report['predicted_s']:.0%}"),
            ("measured time", "none recorded on this device" if report["measured_s"] is None
             else human_time(report["measured_s"])),
            ("measured share of the floor", "" if report["share_of_bandwidth_floor"] is None
             else f"{report['share_of_bandwidth_floor']:.0%}")]
    for row in rows:
        table.add_row(*row)
    report["by_kind"] = decode_kinds(analysis)
    for kind, figures in report["by_kind"].items():
        table.add_row(f"  {kind}: launches, bytes, predicted",
                      f"{figures['launches']}, {human_bytes(figures['bytes'])}, {human_time(figures['predicted_s'])}")
    return table, report


def decode_kinds(analysis) -> dict[str, dict]:
    """A decode step's plan by kind of kernel: GEMMs (linear and matmul anchors), attention, row reductions (norms,
    softmax) and the rest: launches, bytes moved and predicted seconds of each kind's groups."""
    from opfuse.ir.ops import FusionKind, kind_of

    graph = analysis.plan.graph
    kinds: dict[str, dict] = {}
    for group in analysis.plan.groups:
        if not group.launches:
            continue
        op = graph[group.anchor].op if group.anchor else None
        reduces = any(kind_of(graph[name]) is FusionKind.REDUCTION for name in group.nodes)
        kind = ("GEMMs" if op in ("linear", "matmul") else "attention" if op == "sdpa"
                else "row reductions" if reduces and op is None else "elementwise and other")
        figures = kinds.setdefault(kind, {"launches": 0, "bytes": 0, "predicted_s": 0.0})
        figures["launches"] += group.launches
        figures["bytes"] += group.bytes_moved
        figures["predicted_s"] += group.predicted_time
    return dict(sorted(kinds.items(), key=lambda item: -item[1]["predicted_s"]))


def ops_table(analysis, limit: int | None) -> Table:
    table = Table(title=f"Per-op cost, unfused (candidate: under {analysis.config.density_threshold:g} FLOPs/Byte)")
    for column in ("op", "kind", "output", "FLOPs", "read", "written", "FLOPs/B", "cand.", "predicted"):
        table.add_column(column, justify="right" if column in ("FLOPs", "read", "written", "FLOPs/B",
                                                               "predicted") else "left")
    rows = analysis.op_rows if limit is None else analysis.op_rows[:limit]
    for r in rows:
        kind = getattr(r.kind, "value", r.kind)
        label = escape(r.name) if r.name == r.op else f"{escape(r.name)} [dim]{escape(r.op)}[/]"
        table.add_row(label, kind, str(analysis.captured[r.name].type),
                      human_flops(r.flops), human_bytes(r.bytes_read),
                      human_bytes(r.bytes_written), f"{r.density:.1f}", "yes" if r.candidate else "",
                      human_time(r.predicted_time))
    if limit is not None and len(analysis.op_rows) > limit:
        table.caption = f"{len(analysis.op_rows) - limit} more ops not shown (--ops all to show every op)"
    return table


def groups_table(plan) -> Table:
    launches = plan.kernel_launches
    table = Table(title=f"Fusion groups: {launches} kernel launch{'' if launches == 1 else 'es'}")
    for column in ("group", "kind", "ops", "bytes", "FLOPs/B", "predicted", "why"):
        table.add_column(column, justify="right" if column in ("bytes", "FLOPs/B", "predicted") else "left",
                         overflow="fold")
    for g in plan.groups:
        if g.launches == 0:
            continue
        ops = " + ".join(plan.graph[n].op for n in g.nodes)
        table.add_row(g.name, g.kind.value, escape(ops), human_bytes(g.bytes_moved), f"{g.density:.1f}",
                      human_time(g.predicted_time), escape(g.reason))
    return table


def refused_table(plan, limit: int | None = None) -> Table:
    table = Table(title=f"Fusions refused: {len(plan.refused)}")
    for column in ("producer", "consumer", "fusion", "verdict", "code", "reason"):
        table.add_column(column, overflow="fold")
    rows = plan.refused if limit is None else plan.refused[:limit]
    for d in rows:
        table.add_row(escape(", ".join(d.producer)), escape(", ".join(d.consumer)), d.fusion.value, d.verdict.value,
                      d.code.value, escape(d.reason))
    if len(rows) < len(plan.refused):
        table.caption = (f"{len(plan.refused) - len(rows)} more refusals not shown (--refused all to show every "
                         "one; --json and the HTML report have them all)")
    return table


def summary_table(analysis) -> Table:
    unfused, fused = analysis.unfused, analysis.fused
    table = Table(title=f"{escape(analysis.name)}: unfused vs fused ({analysis.hardware.name}, "
                        f"{analysis.config.dtype})")
    for column, justify in (("metric", "left"), ("unfused", "right"), ("fused", "right"), ("change", "right")):
        table.add_column(column, justify=justify)

    def change(before: float, after: float) -> str:
        return f"{(after - before) / before * 100:+.1f}%" if before else "-"

    rows = [
        ("bytes read", unfused.bytes_read, fused.bytes_read, human_bytes),
        ("bytes written", unfused.bytes_written, fused.bytes_written, human_bytes),
        ("total traffic", unfused.total_bytes, fused.total_bytes, human_bytes),
        ("kernel launches", unfused.kernel_launches, fused.kernel_launches, str),
        ("peak intermediate memory", unfused.peak_intermediate_bytes, fused.peak_intermediate_bytes, human_bytes),
        ("compute density (FLOPs/Byte)", unfused.density, fused.density, lambda v: f"{v:.1f}"),
        ("predicted time", unfused.predicted_time, fused.predicted_time, human_time),
    ]
    for label, before, after, fmt in rows:
        table.add_row(label, fmt(before), fmt(after), change(before, after))
    return table


def analysis_config(args: argparse.Namespace) -> FusionConfig:
    """The config `analyze` and `report` plan with: the model flags, and the tuning flags, which select the record
    of a compile made with the same ones (`opfuse bench --tune-top 8` is found by `opfuse analyze --tune-top 8`)."""
    from opfuse.bench.cli_bench import tuning_knobs
    from opfuse.ir.graph import dtype_name

    return FusionConfig(dtype=dtype_name(args.dtype), hardware=args.hw, density_threshold=args.threshold,
                        **tuning_knobs(args))


def cmd_analyze(args: argparse.Namespace, console: Console) -> int:
    if not _writable(args.json, args.html):
        return EXIT_USAGE
    config = analysis_config(args)
    with status(args, f"capturing and planning {escape(args.model)}"):
        analysis = load_analysis(args, config)
    buckets = None
    if args.dynamic:
        with status(args, f"planning every bucket of {escape(args.model)}"):
            buckets = dynamic_analyses(args, config)
        if buckets is None:
            return EXIT_USAGE
    decode = decode_table(analysis, args) if args.decode else None
    write_json(args.json, analysis.to_dict() | ({"buckets": buckets} if buckets is not None else {})
               | ({"decode": decode[1]} if decode is not None else {}))
    if args.html:
        from opfuse.analysis.report import write_report

        write_report(analysis, args.html)
    if not args.quiet:
        console.print(ops_table(analysis, args.ops))
        console.print(groups_table(analysis.plan))
        if analysis.plan.refused:
            console.print(refused_table(analysis.plan, args.refused))
        else:
            console.print("Fusions refused: none")
        if analysis.pytorch_groups:
            console.print(f"[bold]Runs through PyTorch (no opfuse kernel), {len(analysis.pytorch_groups)} groups, "
                          "node by node:[/]")
            groups = {g.name: g for g in analysis.plan.groups}
            for group, why in analysis.pytorch_groups.items():
                ops = " + ".join(analysis.plan.graph[n].op for n in groups[group].nodes)
                console.print(f"  {escape(group)} ({escape(ops)}): {escape(why.text)} [dim]({why.code.value})[/]")
        console.print(summary_table(analysis))
        console.print(f"unfused: {analysis.unfused.kernel_launches} kernel launches (one per op) -> fused: "
                      f"{analysis.fused.kernel_launches}; capture {analysis.seconds['capture']:.1f} s, passes "
                      f"{analysis.seconds['passes']:.1f} s, plan {analysis.seconds['plan']:.2f} s")
        if analysis.as_compiled is not None:
            console.print(f"[bold]{escape(analysis.as_compiled.summary())}[/]")
        else:
            console.print("[dim]fused launches count every kernel in its generated form, as an untuned compile "
                          "runs it; on a GPU the autotuner keeps a library (cuBLAS/cuDNN) or unfused form where it "
                          "measures faster, which may launch more. No compile of this plan with these settings "
                          "(the tuning flags) is recorded on this device: once one is, analyze reports what it "
                          "runs[/]")
        if buckets is not None:
            console.print(buckets_table(buckets, args.dynamic))
        if decode is not None:
            console.print(decode[0])
        if args.html:
            console.print(f"report: {escape(args.html)}")
    return EXIT_OK


def dynamic_analyses(args: argparse.Namespace, config: FusionConfig) -> list[dict] | None:
    """`opfuse.runtime.dynamic.bucket_analyses` of MODEL over --dynamic's ranges, or None (the error said why)."""
    from opfuse.bench.harness import protocol_form
    from opfuse.cli_package import dynamic_dims
    from opfuse.ir.graph import GraphError, torch_dtype
    from opfuse.runtime.dynamic import bucket_analyses

    if args.model.endswith(".onnx"):
        error("analyze", "--dynamic takes a built-in model or a factory; an ONNX file is imported at one shape")
        return None
    model, inputs, _ = load_model(args.model, args.batch)
    model, inputs = protocol_form(model, inputs, torch_dtype(config.dtype), "cpu")
    try:
        return bucket_analyses(model, list(inputs), config, dynamic_dims(args.dynamic, list(inputs)))
    except GraphError as problem:
        error("analyze", str(problem))
        return None


def buckets_table(buckets: list[dict], spec: list) -> Table:
    names = [name for name, *_ in spec]
    table = Table(title=f"Buckets of {', '.join(f'{n}={lo}:{hi}' for n, lo, hi, _ in spec)}: one compiled model "
                        "each (opfuse.runtime.dynamic)")
    for column in names + ["launches", "traffic", "predicted", "a call below it"]:
        table.add_column(column, justify="left" if column == "a call below it" else "right")
    for bucket in buckets:
        padding = "; ".join(f"{name} {'padded' if why == 'pads' else 'exact: ' + _short(why)}"
                            for name, why in bucket["padding"].items()) or "-"
        table.add_row(*map(str, bucket["sizes"]), str(bucket["launches"]), human_bytes(bucket["bytes"]),
                      f"{bucket['predicted_s'] * 1e6:.1f} us", escape(padding))
    return table


def _short(text: str, limit: int = 90) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def cmd_report(args: argparse.Namespace, console: Console) -> int:
    from opfuse.analysis.report import write_report

    if not _writable(args.output, args.json):
        return EXIT_USAGE
    config = analysis_config(args)
    with status(args, f"capturing and planning {escape(args.model)}") as spinner:
        analysis = load_analysis(args, config)
        if spinner is not None:
            spinner.update("writing the report")
        path = write_report(analysis, args.output)
    write_json(args.json, analysis.to_dict())
    if not args.quiet:
        savings = analysis.to_dict()["savings"]
        console.print(f"wrote {escape(str(path))} ({path.stat().st_size / 1e3:.0f} KB): "
                      f"{analysis.unfused.kernel_launches} -> {analysis.fused.kernel_launches} kernel launches, "
                      f"traffic -{savings['bytes_saved_fraction'] * 100:.1f}%, predicted "
                      f"{savings['speedup']:.2f}x faster; open it in a browser")
    return EXIT_OK


def write_json(path: str | None, data: object) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1, default=str)


def error(command: str, message: str) -> None:
    """Print an error on stderr, as every command does."""
    Console(stderr=True, soft_wrap=True).print(f"[bold red]opfuse {command}: error:[/] {escape(message)}")


def status(args: argparse.Namespace, text: str):
    """A spinner with `text` on stderr (shown only on a terminal), or nothing with --quiet."""
    return _null() if args.quiet else Console(stderr=True).status(text, spinner="dots")


def _writable(*paths: str | None) -> bool:
    """Whether each output file given (None: not asked for) can be written, checked before any work so that a long
    compile never ends in a path it cannot write (`_unwritable`); says why not on stderr, one line naming it."""
    for path in paths:
        problem = None if path is None else _unwritable(path)
        if problem is not None:
            Console(stderr=True, soft_wrap=True).print(f"[bold red]opfuse: error:[/] cannot write {escape(repr(path))}:"
                                                       f" {escape(problem)}")
            return False
    return True


def _unwritable(path: str) -> str | None:
    """Why `path` cannot be written as an output file, or None where it can: it must be a non-empty name that is
    not a folder, in a folder that exists and takes a new file (one is created there and removed: permissions,
    read-only mounts and the like all answer), and writable itself where it exists."""
    if not path:
        return "the path is empty"
    target = Path(path)
    if target.is_dir():
        return "it is a folder; name a file in it"
    folder = target.resolve().parent
    if not folder.is_dir():
        return f"folder {folder} does not exist"
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".opfuse-write-check-"):
            pass
    except OSError as problem:
        return f"folder {folder} takes no new file ({problem.strerror or problem})"
    if target.exists() and not os.access(target, os.W_OK):
        return "it is not writable"
    return None


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


class Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (the command, the problem, where help is) and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """An option's help ends with its default, unless it has none (None, off) or the help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False) or "default" in text:
            return action.help
        return super()._get_help_string(action)


def positive_int(text: str) -> int:
    """--batch: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The whole command line; builds without importing torch, so --help, --version and usage errors are quick."""
    parser = Parser(
        prog="opfuse", description="Operator-fusion compiler for DL inference.", formatter_class=HelpFormatter,
        epilog="exit codes: " + "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODES.items()))
    parser.add_argument("--version", action="version", version=f"opfuse {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    from opfuse import cli_package
    from opfuse.bench import cli_bench

    analyze = sub.add_parser("analyze", help="where the model wastes traffic and launches, and what opfuse fuses",
                             formatter_class=HelpFormatter)
    _model_arguments(analyze)
    analyze.add_argument("--ops", default=40, type=row_limit, help="how many per-op rows to print, or 'all'")
    analyze.add_argument("--refused", default=30, type=row_limit,
                         help="how many refused fusions to print, or 'all'")
    analyze.add_argument("--html", metavar="FILE", help="also write the HTML fusion report")
    analyze.add_argument("--dynamic", type=cli_package.dynamic_list, metavar="NAME=MIN:MAX,...",
                         help="also plan every bucket of these ranges (as opfuse compile --dynamic takes them) and "
                              "show each one's launches, traffic and predicted time, and what a call below it pads")
    analyze.add_argument("--decode", action="store_true",
                         help="analyze the decode step of a built-in decoder (llama-1.1b, llama-tiny): one token for "
                              "each of --batch sequences over a KV cache of --max-seq positions, with the bytes, "
                              "launches and bandwidth floor of a step")
    analyze.add_argument("--max-seq", type=positive_int, default=384, metavar="N",
                         help="the KV cache's positions with --decode (default 384)")
    cli_bench.add_tuning_arguments(analyze)
    analyze.set_defaults(handler=cmd_analyze)

    report = sub.add_parser("report", help="one self-contained HTML page: what was fused, why, what it bought",
                            formatter_class=HelpFormatter)
    _model_arguments(report)
    report.add_argument("-o", "--output", default="report.html", metavar="FILE",
                        help="where to write the report (default report.html)")
    cli_bench.add_tuning_arguments(report)
    report.set_defaults(handler=cmd_report)

    compile_ = sub.add_parser("compile", help="compile MODEL into one package file that opfuse.load runs without "
                                              "compiling again (several batch sizes with --batches)",
                              formatter_class=HelpFormatter)
    _model_arguments(compile_)
    cli_package.compile_arguments(compile_)
    compile_.set_defaults(handler=cli_package.cmd_compile)

    bench = sub.add_parser("bench", help="on a GPU: eager, eager + CUDA graph, torch.compile and opfuse, side by "
                                         "side (exit code 3 without one); --zoo: the model-zoo benchmark",
                           formatter_class=HelpFormatter)
    _model_arguments(bench, model_optional=True)
    cli_bench.bench_arguments(bench)
    cli_package.bench_package_arguments(bench)
    bench.set_defaults(handler=cli_bench.cmd_bench)

    profile = sub.add_parser("profile", help="on a GPU: time per eager op and per opfuse kernel against the cost "
                                             "model, and calibrate it (exit code 3 without one)",
                             formatter_class=HelpFormatter)
    _model_arguments(profile)
    cli_bench.profile_arguments(profile)
    profile.set_defaults(handler=cli_bench.cmd_profile)
    return parser


def row_limit(text: str) -> int | None:
    """--ops, --refused: a row count, or 'all' (None)."""
    if text == "all":
        return None
    try:
        return max(0, int(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of rows or 'all', got {text!r}") from None


def _model_arguments(parser: argparse.ArgumentParser, model_optional: bool = False) -> None:
    """The model and planning arguments every command shares, plus --json and --quiet."""
    parser.add_argument("model", nargs="?" if model_optional else None,
                        help="built-in name (resnet18, resnet50, mobilenet_v2, bert-base, and the zoo's: "
                             "`opfuse bench --zoo --help`), a .onnx file, package.module:factory or "
                             "path/file.py:factory returning (model, example_inputs)")
    parser.add_argument("--batch", type=positive_int, default=1, metavar="N",
                        help="batch size of the built-in model's example inputs (an .onnx file's dynamic batch)")
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16", "fp32"],
                        help="compute dtype of activations and weights")
    parser.add_argument("--hw", default="h200", choices=sorted(PROFILES), help="hardware profile of the cost model")
    parser.add_argument("--threshold", type=float, default=10.0,
                        help="FLOPs/Byte under which an op is a fusion candidate (default 10, the seed's rule)")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--quiet", action="store_true", help="print nothing on stdout (use with --json)")


# the width of the tables when stdout is a file or a pipe: rich would otherwise wrap them at 80 columns, one
# character per line in the profile's eleven columns (COLUMNS, where set, still wins)
PIPED_WIDTH = 200


def stdout_console() -> Console:
    piped = not sys.stdout.isatty() and not os.environ.get("COLUMNS")
    return Console(stderr=False, width=PIPED_WIDTH if piped else None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    console = stdout_console()
    from opfuse.ir.graph import GraphError     # torch: only once a command runs, never for --help or a usage error

    try:
        return args.handler(args, console)
    except (GraphError, FileNotFoundError, ValueError, ImportError, RuntimeError) as problem:
        error(args.command, str(problem))
        return EXIT_MODEL_ERROR


if __name__ == "__main__":
    sys.exit(main())
