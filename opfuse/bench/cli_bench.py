"""`opfuse bench` and `opfuse profile`: the GPU commands of the CLI (arguments, handlers and their tables).

    opfuse bench model.opfuse [--recompile] [--json FILE]   (a package: opfuse.cli_package.cmd_bench_package)
    opfuse bench MODEL [--batch N] [--dtype fp16] [--contenders eager,eager_graph,inductor,opfuse] [--tune-top N]
                       [--no-split-k] [--json FILE] [--quiet]
    opfuse bench llama-1.1b --generate [--batch N] [--prompt N] [--new N] [--json FILE]   (opfuse.bench.generation)
    opfuse profile MODEL [--batch N] [--dtype fp16] [--tune-top N] [--no-split-k] [--ops N|all] [--calibrate]
                         [--html FILE] [--json FILE] [--quiet]

bench measures one workload with `opfuse.bench.harness.run_workload` (the code benchmarks/run_all.py runs); profile
times every eager op and every opfuse kernel alone (`opfuse.bench.profile`) and, with --calibrate, fits the
hardware profile to those times (`opfuse.bench.calibrate`). Both set every time against its floor on the datasheet
of the GPU measured on (`opfuse.analysis.roofline`): bench each contender against the workload's, profile each op
and kernel against its own and their sum against the workload's. Both need an NVIDIA GPU: without one they exit with
code 3 (`EXIT_NEEDS_GPU`) before loading anything.
"""

from __future__ import annotations

import argparse
from typing import Any, Sequence

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from opfuse.cli import (EXIT_MODEL_ERROR, EXIT_NEEDS_GPU, EXIT_OK, EXIT_USAGE, _writable, error, human_bytes,
                        human_flops, human_time, load_model, row_limit, write_json)

# ---- shared ------------------------------------------------------------------------------------------------


def gpu_problem() -> str | None:
    """Why kernels cannot be timed on this machine, or None when a CUDA GPU is usable."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    from opfuse.environment import triton_interpreter

    if triton_interpreter():
        return "TRITON_INTERPRET=1 is set: Triton kernels would run in the CPU interpreter, and timing them " \
               "means nothing"
    return None


def preflight(args: argparse.Namespace, *outputs: str | None, analyzable: bool = True) -> int | None:
    """The exit code that stops the command before any work (usage, then GPU), or None to go on; without a GPU the
    error points at `opfuse analyze` where that predicts the same model (`analyzable`)."""
    if not _writable(*outputs):
        return EXIT_USAGE
    problem = gpu_problem()
    if problem is not None:
        hint = f"; `opfuse analyze {args.model}` predicts the same model without one" if analyzable else ""
        error(args.command, f"needs an NVIDIA GPU: {problem} (exit code {EXIT_NEEDS_GPU}){hint}")
        return EXIT_NEEDS_GPU
    return None


def _config(args: argparse.Namespace):
    from opfuse.config import FusionConfig
    from opfuse.ir.graph import dtype_name

    return FusionConfig(dtype=dtype_name(args.dtype), hardware=args.hw, density_threshold=args.threshold,
                        **tuning_knobs(args))


def _progress(args: argparse.Namespace) -> Progress:
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    return Progress(*columns, console=Console(stderr=True), disable=args.quiet, transient=True)


def add_tuning_arguments(parser: argparse.ArgumentParser) -> None:
    """--tune-top, --no-split-k, --no-library: the FusionConfig knobs of `tuning_knobs` (bench, profile, run_all)."""
    parser.add_argument("--tune-top", type=int, default=4, metavar="N",
                        help="autotune opfuse's kernels among their first N configs; 0 turns tuning off (default 4)")
    parser.add_argument("--no-split-k", action="store_true",
                        help="no anchor splits K, however idle its tile grid leaves the SMs (FusionConfig.split_k)")
    parser.add_argument("--no-library", action="store_true",
                        help="autotuning times neither anchors through cuBLAS/cuDNN nor groups unfused "
                             "(FusionConfig.library_anchors)")


def tuning_knobs(args: argparse.Namespace) -> dict:
    """The FusionConfig fields the `add_tuning_arguments` flags set."""
    return dict(autotune=args.tune_top > 0, tune_top=args.tune_top or None, split_k=not args.no_split_k,
                library_anchors=not args.no_library)


def _ms(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


# ---- bench -------------------------------------------------------------------------------------------------

def bench_arguments(parser: argparse.ArgumentParser) -> None:
    from opfuse.bench.contenders import CONTENDERS
    from opfuse.bench.zoo_bench import add_zoo_arguments

    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all)")
    add_tuning_arguments(parser)
    parser.add_argument("--recompile", action="store_true",
                        help="a package (MODEL.opfuse) from another torch, Triton, GPU or opfuse: build its saved plan "
                             "again here instead of refusing it")
    generation = parser.add_argument_group("text generation (--generate: MODEL is llama-1.1b or llama-tiny, "
                                           "opfuse.bench.generation; --batch prompts at once)")
    generation.add_argument("--generate", action="store_true",
                            help="time the prefill and the decode steps of opfuse's generator, torch.compile's "
                                 "(reduce-overhead) and eager's: time to first token, tokens/s, GB/s")
    generation.add_argument("--prompt", type=int, default=128, metavar="N", help="prompt tokens (default 128)")
    generation.add_argument("--new", type=int, default=256, metavar="N", help="new tokens (default 256)")
    zoo = parser.add_argument_group("the model-zoo benchmark (--zoo: no MODEL; each workload in processes of its "
                                    "own; writes zoo.json, ZOO.md and zoo.log)")
    zoo.add_argument("--zoo", action="store_true", help="run the model-zoo benchmark instead of one model")
    zoo.add_argument("--out", default="zoo-out", metavar="DIR", help="the zoo's output folder (default zoo-out)")
    add_zoo_arguments(zoo)


def cmd_bench(args: argparse.Namespace, console: Console) -> int:
    from opfuse.bench.harness import CONTENDER_LABELS, CONTENDERS

    if args.zoo or args.model is None:
        return _bench_zoo(args)
    if args.model.endswith(".opfuse"):
        from opfuse.cli_package import cmd_bench_package

        return cmd_bench_package(args, console)
    if args.generate:
        return _bench_generate(args, console)

    contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown or not contenders:
        error("bench", f"unknown contenders {unknown}; choose among {', '.join(CONTENDERS)}")
        return EXIT_USAGE
    stop = preflight(args, args.json)
    if stop is not None:
        return stop

    import torch

    from opfuse.bench.harness import environment, failed_contenders, measure_ceilings, row_roofline, run_workload

    torch.backends.cudnn.benchmark = True
    workload = f"{args.model} bs{args.batch}"
    with _progress(args) as progress:
        steps = [c for c in CONTENDERS if c in contenders] + ["timing"]
        task = progress.add_task(f"{workload}: loading the model", total=1 + len(steps))
        model, inputs, name = load_model(args.model, args.batch)
        progress.update(task, description="measuring the GPU's copy bandwidth and matrix rate")
        env, ceilings = environment(), measure_ceilings()

        def on_step(label: str) -> None:
            what = "timing every contender in interleaved rounds" if label == "timing" else \
                f"compiling, warming and capturing {CONTENDER_LABELS[label]}"
            progress.update(task, description=f"{workload}: {what}", completed=1 + steps.index(label))

        row = {"workload": workload, "model": name, "batch": args.batch}
        row |= run_workload(model, inputs, workload, ceilings, contenders, _config(args), on_step)
    hardware = floor_hardware(env, args.hw)
    roofline = row_roofline(row, hardware)
    if roofline is not None:
        row["roofline"] = roofline.to_dict()
    write_json(args.json, {"env": env, "ceilings": ceilings, "results": [row], "tune_top": args.tune_top})
    if not args.quiet:
        console.print(bench_table(row, env, ceilings, hardware))
    failed = failed_contenders(row)
    for label, message in failed.items():
        error("bench", f"{CONTENDER_LABELS[label]} failed on {workload}: {message}")
    return EXIT_MODEL_ERROR if failed else EXIT_OK


def _bench_generate(args: argparse.Namespace, console: Console) -> int:
    """`opfuse bench MODEL --generate`: opfuse.bench.generation's contenders on a built-in decoder."""
    from opfuse.bench.generation import CONTENDERS, GENERATION_MODELS

    if args.model not in GENERATION_MODELS:
        error("bench", f"--generate times a built-in decoder: {', '.join(GENERATION_MODELS)}; got {args.model!r}")
        return EXIT_USAGE
    names = {c.strip() for c in args.contenders.split(",")} & set(CONTENDERS) | {"eager"}
    if args.prompt < 1 or args.new < 2:
        error("bench", f"--prompt must be at least 1 and --new at least 2, got {args.prompt} and {args.new}")
        return EXIT_USAGE
    stop = preflight(args, args.json, analyzable=False)
    if stop is not None:
        return stop
    from opfuse.bench.generation import llama, run_generation
    from opfuse.bench.harness import environment
    from opfuse.ir.graph import dtype_name, torch_dtype

    with _progress(args) as progress:
        progress.add_task(f"{args.model}: compiling, warming and timing {', '.join(sorted(names))}", total=None)
        model = llama(args.model, "cuda", torch_dtype(dtype_name(args.dtype)))
        result = run_generation(model, args.batch, args.prompt, args.new, names, args.tune_top)
    write_json(args.json, {"env": environment(), "model": args.model, "results": [result]})
    if not args.quiet:
        console.print(generation_table(args.model, result))
    return EXIT_OK


def generation_table(model: str, result: dict) -> Table:
    """One line per contender of a `run_generation` result, and opfuse's decode step: bytes, launches."""
    title = (f"{model}: batch {result['batch']}, prompt {result['prompt']}, {result['new']} new tokens "
             "(greedy; decode steps timed in interleaved rounds)")
    table = Table(title=title)
    for column in ("contender", "time to first token (ms)", "decode step (ms)", "tokens/s", "bytes per step / time",
                   "of the GPU's bandwidth", "tokens equal to eager's"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for name, row in result["contenders"].items():
        table.add_row(name, _ms(row["ttft_ms"]), _ms(row["step_ms"]),
                      "-" if row["tokens_per_s"] is None else f"{row['tokens_per_s']:.1f}",
                      "-" if row["gb_per_s"] is None else f"{row['gb_per_s']:.1f} GB/s",
                      _share(row["share_of_bandwidth"]), f"{row['greedy_equal_eager_tokens']} of {result['new']}")
    report = result.get("decode_report") or {}
    if report:
        table.caption = (f"opfuse's decode step: {human_bytes(report['weight_bytes'])} of weights and "
                         f"{human_bytes(report['cache_bytes_needed'])} of cache to read at position "
                         f"{report['position']}, {report['launches']} launches, predicted "
                         f"{human_time(report['predicted_s'])}")
    return table


def _bench_zoo(args: argparse.Namespace) -> int:
    """`opfuse bench --zoo`: the model-zoo benchmark (opfuse.bench.zoo_bench)."""
    if not args.zoo:
        error("bench", "give a MODEL, or --zoo for the model-zoo benchmark")
        return EXIT_USAGE
    if args.model is not None:
        error("bench", f"--zoo runs the zoo's models (--models to choose), not {args.model!r}")
        return EXIT_USAGE
    from opfuse.bench.contenders import CONTENDERS

    ignored = {"--batch": args.batch != 1, "--dtype": args.dtype != "fp16", "--hw": args.hw != "h200",
               "--threshold": args.threshold != 10.0, "--json": args.json is not None,
               "--contenders": args.contenders != ",".join(CONTENDERS), "--no-split-k": args.no_split_k,
               "--no-library": args.no_library}
    if any(ignored.values()):
        error("bench", f"--zoo measures every contender in fp16 with opfuse's default planning (--batches, --models "
                       f"and --tune-top choose); it does not take {', '.join(f for f, on in ignored.items() if on)}")
        return EXIT_USAGE
    problem = gpu_problem()
    if problem is not None:
        error("bench", f"--zoo needs an NVIDIA GPU: {problem} (exit code {EXIT_NEEDS_GPU})")
        return EXIT_NEEDS_GPU
    from opfuse.bench.zoo_bench import run_zoo_command

    return run_zoo_command(args)


def floor_hardware(env: dict, fallback: str | None = None) -> Any:
    """The profile whose datasheet a measurement's floors take: the GPU's it ran on (`env["gpu"]`), else the
    profile named `fallback` (`--hw`), else None."""
    from opfuse.analysis.roofline import hardware_of_gpu
    from opfuse.hardware import get_hardware

    return hardware_of_gpu(env.get("gpu")) or (get_hardware(fallback) if fallback else None)


def _short_time(seconds: float) -> str:
    """`human_time`, in ns under a microsecond (a small kernel's floor)."""
    return f"{seconds * 1e9:.0f} ns" if seconds < 1e-6 else human_time(seconds)


def _share(value: float | None) -> str:
    from opfuse.analysis.roofline import format_share

    return format_share(value)


def bench_table(row: dict, env: dict, ceilings: dict, hardware: Any = None) -> Table:
    """One workload, one line per contender, plus opfuse's speedup over each, each one's share of the workload's
    floor (on `hardware`'s datasheet, by default the GPU's in `env`: `opfuse.bench.harness.row_roofline`) and the
    floors."""
    from opfuse.bench.harness import TIMED, contender_label, pytorch_group_count, row_roofline, speedup

    hardware = hardware or floor_hardware(env)
    roofline = row_roofline(row, hardware) if hardware is not None else None
    table = Table(title=f"{escape(row['workload'])} ({row.get('dtype', '')}), {escape(env.get('gpu', '?'))}, "
                        f"torch {env.get('torch', '?')}, triton {env.get('triton', '?')}")
    for column in ("contender", "median ms", "p10-p90 ms", "opfuse speedup", "% roofline", "% launch floor",
                   "kernels", "GPU busy ms", "build peak MB", "held MB", "compile s", "rel. error"):
        table.add_column(column, justify="left" if column == "contender" else "right")
    for label in TIMED:
        if label not in row:
            continue
        value = row[label]
        if "error" in value:
            table.add_row(contender_label(row, label), "[red]failed[/]", "", "", "", "", "", "", "", "", "",
                          escape(value["error"][:60]))
            continue
        ratio = speedup(row, label) if not label.startswith("opfuse") else None
        error_value = value.get("rel_error")
        spread = f"{_ms(value['p10_ms'])}-{_ms(value['p90_ms'])}" if "p10_ms" in value else "-"
        shares = ("-", "-") if roofline is None else (_share(roofline.shares.get(label)),
                                                      _share(roofline.launch_shares.get(label)))
        table.add_row(contender_label(row, label), _ms(value["median_ms"]), spread,
                      "-" if ratio is None else f"{ratio:.2f}x", *shares,
                      str(value.get("kernels", "-")), _ms(value.get("gpu_busy_ms")),
                      _ms(value.get("peak_memory_mb"), 0), _ms(value.get("held_memory_mb"), 0),
                      _ms(value.get("compile_s"), 1),
                      "-" if error_value is None else f"{error_value:.1e}")
    notes = ["fair protocol: every contender compiled, warmed, captured and timed under one inference mode, "
             "rounds interleaved; speedups are of opfuse's module call",
             f"ceilings: copy {ceilings['copy_bytes_per_s'] / 1e12:.2f} TB/s, fp16 matrix "
             f"{ceilings['fp16_matrix_flops'] / 1e12:.0f} TFLOP/s"]
    if roofline is not None:
        workload, plan = roofline.floor, roofline.plan_floor
        notes.append(f"floor on the {escape(roofline.hardware)} datasheet: roofline {workload.roofline * 1e3:.4f} ms "
                     f"({workload.bound}-bound: compute {workload.compute * 1e3:.4f} ms, compulsory bytes "
                     f"{workload.memory * 1e3:.4f} ms), with {workload.launches} launches "
                     f"{workload.launch_and_bandwidth * 1e3:.4f} ms"
                     + ("" if plan is None else f", of opfuse's plan's bytes {plan.roofline * 1e3:.4f} ms"))
    if "floor_compute_ms" in row:
        notes.append(f"floor: compute {row['floor_compute_ms']:.3f} ms, memory {row['floor_memory_ms']:.3f} ms at "
                     "the measured ceilings")
    if "plan_launches" in row:
        notes.append(f"opfuse plan: {row['plan_launches']} launches, {pytorch_group_count(row) or 0} groups "
                     "through PyTorch, "
                     f"{len(row.get('library_anchors', {}))} anchors through cuBLAS/cuDNN and "
                     f"{len(row.get('unfused', {}))} groups unfused (measured faster)")
    if "predicted_ms" in row and "median_ms" in row.get("opfuse_replay", {}):
        notes.append(f"opfuse predicted {row['predicted_ms']:.3f} ms, its replay measured "
                     f"{row['opfuse_replay']['median_ms']:.3f} ms")
    table.caption = "; ".join(notes)
    return table


# ---- profile -----------------------------------------------------------------------------------------------

def profile_arguments(parser: argparse.ArgumentParser) -> None:
    add_tuning_arguments(parser)
    parser.add_argument("--ops", default=40, type=row_limit,
                        help="rows per table, slowest first, or 'all' (default 40)")
    parser.add_argument("--calibrate", action="store_true",
                        help="fit the hardware profile's launch overhead and efficiencies to the measured times")
    parser.add_argument("--html", metavar="FILE", help="also write the HTML fusion report with the measured times")


def cmd_profile(args: argparse.Namespace, console: Console) -> int:
    stop = preflight(args, args.json, args.html)
    if stop is not None:
        return stop

    import torch

    from opfuse.bench.harness import prepare
    from opfuse.bench.profile import profile_model
    from opfuse.ir.graph import torch_dtype

    torch.backends.cudnn.benchmark = True
    config = _config(args)
    with _progress(args) as progress:
        task = progress.add_task(f"loading {args.model}", total=None)
        model, inputs, name = load_model(args.model, args.batch)
        model, inputs, _, _ = prepare(model, inputs, torch_dtype(config.dtype))
        progress.update(task, description=f"compiling {name} with opfuse (capture, plan, codegen, tuning)")

        def on_row(what: str, done: int, total: int) -> None:
            progress.update(task, description=f"timing {what}", completed=done, total=total)

        profile = profile_model(model, inputs, config, progress=on_row, name=name)
    if args.calibrate:
        profile.calibrate()
    write_json(args.json, profile.to_dict())
    if args.html:
        from opfuse.analysis.report import write_report
        from opfuse.bench.profile import measured_for_report

        write_report(profile.compiled.analysis, args.html, measured_for_report(profile))
    if not args.quiet:
        print_profile(profile, console, args.ops)
        if args.html:
            console.print(f"report: {escape(args.html)}")
    return EXIT_OK


def profile_table(rows: Sequence[Any], title: str, threshold: float, limit: int | None) -> Table:
    """Rows slowest first: counted work, measured time and rates, the seed's flag, prediction and its error, the
    floor of the counted work and the measured time's share of it (and of the floor with the row's launch)."""
    table = Table(title=title)
    for column in ("name", "ops", "FLOPs", "bytes", "FLOPs/B", "cand.", "measured", "GB/s", "TFLOP/s",
                   "predicted", "error", "floor", "% floor", "% +launch"):
        table.add_column(column, justify="left" if column in ("name", "ops", "cand.") else "right",
                         overflow="fold")
    ordered = sorted(rows, key=lambda r: -(r.measured or 0.0))
    shown = ordered if limit is None else ordered[:limit]
    for r in shown:
        measured = r.measured is not None
        table.add_row(escape(r.name), escape(r.ops if len(r.ops) <= 40 else r.ops[:37] + "..."),
                      human_flops(r.flops), human_bytes(r.bytes_moved), f"{r.density:.1f}",
                      "yes" if r.density < threshold else "",
                      human_time(r.measured) if measured else "-",
                      f"{r.achieved_bandwidth / 1e9:.0f}" if measured else "-",
                      f"{r.achieved_flops / 1e12:.2f}" if measured else "-",
                      human_time(r.predicted), f"{r.error * 100:+.0f}%" if measured else "-",
                      "-" if r.floor is None else _short_time(r.floor), _share(r.share_of_floor),
                      _share(r.share_of_launch_floor))
    measured_total = sum(r.measured or 0.0 for r in rows)
    predicted_total = sum(r.predicted for r in rows)
    caption = f"sum of {len(rows)}: measured {human_time(measured_total)}, predicted {human_time(predicted_total)}"
    floors = [r.floor for r in rows if r.floor is not None]
    if floors:
        caption += f", floors {_short_time(sum(floors))}"
    if len(shown) < len(rows):
        caption += f"; {len(rows) - len(shown)} faster rows not shown (--ops all)"
    table.caption = caption
    return table


def print_profile(profile: Any, console: Console, limit: int | None = 40) -> None:
    """The two tables, the cost model's median error and, when calibrated, the fitted factors."""
    from opfuse.bench.profile import median_error

    name = escape(profile.model)
    console.print(profile_table(profile.eager, f"{name}, eager PyTorch: per op ({profile.dtype}, "
                                               f"candidate: under {profile.threshold:g} FLOPs/Byte)",
                                profile.threshold, limit))
    console.print(profile_table(profile.opfuse, f"{name}, opfuse: per kernel", profile.threshold, limit))

    def percent(value: float | None) -> str:
        return "-" if value is None else f"{value * 100:.0f}%"

    workload = profile.workload_floor()
    if workload is not None:
        from opfuse.analysis.roofline import share_of_floor

        def against(rows: Sequence[Any]) -> str:
            total = sum(r.measured for r in rows if r.measured)
            return (f"{human_time(total)}: {_share(share_of_floor(workload.roofline, total))} of the roofline, "
                    f"{_share(share_of_floor(workload.launch_and_bandwidth, total))} of the launch-and-bandwidth "
                    "floor")

        console.print(f"workload floor on the {escape(profile.floor_hardware)} datasheet: roofline "
                      f"{_short_time(workload.roofline)} ({workload.bound}-bound: {human_flops(profile.work.flops)}, "
                      f"{human_bytes(profile.work.compulsory_bytes)} compulsory), with opfuse's {workload.launches} "
                      f"launches {human_time(workload.launch_and_bandwidth)}, of opfuse's plan's bytes "
                      f"{_short_time(profile.plan_floor().roofline)}; opfuse's kernels alone sum to "
                      f"{against(profile.opfuse)}; the eager ops to {against(profile.eager)}", soft_wrap=True)
    console.print(f"cost model ({escape(profile.hardware.name)}) median relative error: eager ops "
                  f"{percent(median_error(profile.eager))}, opfuse kernels {percent(median_error(profile.opfuse))}, "
                  f"all {percent(median_error(profile.eager + profile.opfuse))}")
    if profile.calibration is not None:
        console.print(calibration_table(profile.calibration))
        factors = ", ".join(f"{k}={v:.3g}" for k, v in profile.calibration.after.items())
        name = profile.hardware_key or profile.hardware.name
        console.print(f"to use it: get_hardware({name!r}).with_calibration({factors})", soft_wrap=True)


def calibration_table(calibration: Any) -> Table:
    table = Table(title=f"Calibrated hardware profile ({calibration.samples} kernels, "
                        f"{len(calibration.outliers)} outliers left out of the fit)")
    for column in ("factor", "before", "after"):
        table.add_column(column, justify="left" if column == "factor" else "right")
    for factor, before in calibration.before.items():
        after = calibration.after[factor]
        fmt = human_time if factor == "launch_overhead" else (lambda v: f"{v:.3f}")
        table.add_row(factor, fmt(before), fmt(after))
    table.add_row("median relative error", f"{calibration.error_before * 100:.0f}%",
                  f"{calibration.error_after * 100:.0f}%")
    return table
