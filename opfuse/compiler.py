"""`opfuse.compile(model, example_inputs, config) -> nn.Module`: the whole pipeline, stage by stage.

capture -> cast + passes -> fusion plan (`opfuse.api.analyze`) -> memory pre-flight -> Triton codegen per group
-> autotune (resource-checked) -> compiled runtime (+ CUDA graph) -> verification against eager

`model` is an nn.Module or an ONNX model (a path, the file's bytes or an onnx.ModelProto): that one is imported
(`opfuse.frontend.onnx_module`), and its eager reference is the imported graph run op by op through PyTorch.

Verification runs on every compile unless `config.verify` is False: each kernel is checked alone against the
reference values of its group (fresh random inputs), a failing kernel is dropped so its group runs through
PyTorch (and the model's `fallbacks` say why), then the whole model is compared with eager. The user's model is
never changed: capture works on a copy, and the eager reference runs on another copy in eval mode.

Before any kernel is built, the plan's memory need (weights, grouped convs' packed weights, inputs, peak
intermediates, verification's reference values) is compared with what the device has (`opfuse.runtime.memory`):
a model that would not fit is refused with the breakdown instead of crashing out of memory half-way.

Inputs: the compiled model runs inputs of exactly the shapes, dtypes and devices it was compiled for. Others are
refused with an error naming the input, unless `config.recompile` (compile again for them, once per signature) or
`config.fallback == "eager"` (run them eagerly, the reason recorded in `fallbacks`). An empty batch (a zero-size
dimension) is never compiled: compiling one is an error, and calling with one is refused like any other shape
(with fallback="eager" it runs eagerly and gives eager's empty result).

`config.fallback == "eager"` returns a model that always runs: a failed compile gives `EagerFallback` (the model
run eagerly, in eval mode, on a private copy); a compiled model runs eagerly any call it cannot run. Every such
fallback is recorded with its reason in `.fallbacks`.

A compiled model is an inference model, and says so where that differs from the model run eagerly: a model in
training mode is compiled in eval mode (dropout off, batch norm on its running statistics; the model keeps its
training flag), with a warning; a call with an input that requires grad (grad mode on) warns, once, that the outputs
carry no autograd graph; a forward that writes into an input in place warns at capture, naming the input (the
outputs are the same, but the compiled model leaves the input as it was, and the compile never writes into the
example inputs); a forward that writes its own buffers or parameters is refused at capture, naming them: opfuse
compiles stateless forwards (`opfuse.frontend.torch_export`). Calls from several threads serialise
(`opfuse.runtime.compiled`).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten

from opfuse.api import Analysis, analyze
from opfuse.config import FusionConfig, resolve_dtype
from opfuse.ir.graph import GraphError, torch_dtype
from opfuse.module import EagerFallback, OpfuseModule, eager_copy, warn_if_training
from opfuse.numerics import GroupCheck
from opfuse.replan import replan
from opfuse.verification import verify


def compile(model: Any, example_inputs: Sequence[torch.Tensor],
            config: FusionConfig = FusionConfig(), quiet: bool = True, *, dynamic_shapes: Any = None
            ) -> torch.nn.Module:
    """A faster model computing what `model` computes, for inputs like `example_inputs` (see module docstring);
    `model` is an nn.Module or an ONNX model (a path to an .onnx file, its bytes, or an onnx.ModelProto).
    `dynamic_shapes` (as torch.export takes it: per input, {dim: torch.export.Dim(name, min=, max=)}) makes one
    model for those ranges of sizes (`opfuse.runtime.dynamic.DynamicModel`). An ONNX model's symbolic input dims
    are dynamic by default, each over [1, inf) (`onnx_compile.symbolic_shapes`); `dynamic_shapes` by input name
    gives them ranges, and `dynamic_shapes={}` pins them to the examples' sizes."""
    if config.fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', not {config.fallback!r}")
    example_inputs = tuple(example_inputs)
    if isinstance(model, torch.nn.Module):
        warn_if_training(model)
    else:   # an ONNX model: its symbolic dims dynamic (each bucket imported at its sizes) unless pinned
        from opfuse.frontend.onnx_compile import compile_onnx, symbolic_shapes
        from opfuse.frontend.onnx_import import _read_model, runtime_inputs
        from opfuse.runtime.dynamic import DynamicModel, parse_dynamic_shapes

        dims = []
        if dynamic_shapes != {}:      # read once for its inputs' names and symbolic dims
            proto = _read_model(model)
            names = [v.name for v in runtime_inputs(proto)]
            declared = symbolic_shapes(proto) if dynamic_shapes is None else dynamic_shapes
            dims = parse_dynamic_shapes(declared, example_inputs, names=names) if declared else []
        if dims:
            return DynamicModel(model, example_inputs, resolve_dtype(config, example_inputs), dims, quiet,
                                names=names)
        # fixed shapes, or pinned (dynamic_shapes={}): inputs that fix a shape are read as constants from the
        # examples, checked at each call
        return compile_onnx(model, example_inputs, config, quiet)
    config = resolve_dtype(config, example_inputs)
    if dynamic_shapes is not None:
        from opfuse.runtime.dynamic import DynamicModel, parse_dynamic_shapes

        return DynamicModel(model, example_inputs, config,
                            parse_dynamic_shapes(dynamic_shapes, example_inputs, model.forward), quiet)
    try:
        return _compile(model, example_inputs, config, quiet)
    except Exception as error:
        if config.fallback == "eager":
            return EagerFallback(model, f"{type(error).__name__}: {error}")
        raise


def _compile(model: torch.nn.Module, example_inputs: tuple, config: FusionConfig, quiet: bool) -> OpfuseModule:
    from opfuse.analysis import as_compiled
    from opfuse.runtime.gate import interpreter_alone
    from opfuse.runtime.precompile import prefetch_triton_hash

    for index, x in enumerate(example_inputs):
        if isinstance(x, torch.Tensor) and x.numel() == 0:
            raise GraphError(f"example input {index} is empty (shape {list(x.shape)}): opfuse compiles non-empty "
                             "inputs only; compile with a batch of at least 1 (fallback='eager' runs empty batches "
                             "eagerly)")
    seconds: dict[str, float] = {}
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    check_kernels_can_run(device)
    if device.type == "cuda":
        prefetch_triton_hash()      # hashed while the model is captured, not when the first kernel is looked up

    say = _stage_printer(quiet)
    with _compile_workers(config, device):    # started now: they get ready while the model is captured
        say("capturing the model and planning its fusions")
        start = time.perf_counter()
        analysis = analyze(model, example_inputs, config)   # on fake tensors: allocates nothing the size of the model
        seconds["analyze"] = time.perf_counter() - start
        where = as_compiled.target(example_inputs, analysis.config)
        record_key = as_compiled.plan_key(analysis.plan, analysis.config, where)
        try:
            with interpreter_alone():   # tuning and verification run kernels outside any model's call
                module = _build(model, example_inputs, config, quiet, analysis, seconds, device)
        except Exception as error:  # the record says so: analyze reports no outcome of an earlier compile instead
            as_compiled.store(record_key, analysis.config, as_compiled.failure(analysis, where.device, error))
            raise
    # the record of the plan analyze makes (its launches, before any split_back) and of what the build ran
    outcome = as_compiled.record(module.compiled, module.analysis, analysis.fused.kernel_launches, where.device)
    module.analysis = replace(module.analysis, as_compiled=outcome)
    as_compiled.store(record_key, analysis.config, outcome)
    return module


def _build(model: torch.nn.Module, example_inputs: tuple, config: FusionConfig, quiet: bool, analysis: Analysis,
           seconds: dict[str, float], device: torch.device) -> OpfuseModule:
    """The compile after analyze: memory pre-flight, kernels, tuning, verification, a replay measured."""
    from opfuse.runtime.compiled import build_compiled_model
    from opfuse.runtime.memory import check_memory

    say = _stage_printer(quiet)
    check_memory(analysis, example_inputs, device, config)

    eager = eager_copy(model)
    probe = eager_copy(model) if analysis.captured.state else eager     # a run writes the state: not eager's
    with torch.no_grad():       # on copies: a forward that writes into its input must not write into the user's
        eager_out = probe(*[x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs])
    flat_out, output_spec = tree_flatten(eager_out)
    if not all(isinstance(o, torch.Tensor) for o in flat_out):
        raise GraphError("opfuse.compile supports models whose outputs are tensors (or nested tuples/lists/dicts "
                         "of tensors)")
    output_dtypes = [o.dtype for o in flat_out]
    del eager_out, flat_out

    compute = torch_dtype(config.dtype)
    examples = [x.to(compute) if x.is_floating_point() else x for x in example_inputs]
    say(f"{analysis.name}: {analysis.plan.kernel_launches} launches planned; generating the kernels"
        + (" and autotuning them" if config.autotune and device.type == "cuda" else ""))
    start = time.perf_counter()
    compiled = build_compiled_model(analysis.plan, device, examples, config=config, quiet=quiet)
    seconds.update(compiled.build_seconds)
    analysis, compiled = replan(analysis, compiled, device, examples, config, quiet, seconds, say)
    seconds["codegen+tune"] = time.perf_counter() - start

    checks: list[GroupCheck] = []
    end_to_end = None
    if config.verify:
        start = time.perf_counter()
        say(f"verifying {len(compiled.kernels)} kernels, then the whole model, against the reference"
            + (" (Triton's CPU interpreter: slow)" if device.type == "cpu" else ""))
        compiled, checks, end_to_end = verify(analysis, compiled, eager, example_inputs, config, device,
                                              lambda total: _kernel_progress(quiet, total))
        seconds["verify"] = time.perf_counter() - start
    # what a replay launches and how long it takes, on a capture of the example inputs: the record analyze reads
    start = time.perf_counter()
    compiled.measure_forward(examples)
    seconds["measure"] = time.perf_counter() - start
    compiled.reset_state()       # verification and the measure wrote it: the model starts as eager does
    keep_eager = config.recompile or config.fallback == "eager"
    return OpfuseModule(compiled, analysis, example_inputs, output_spec, output_dtypes, checks, end_to_end, seconds,
                        eager if keep_eager else None)


def _compile_workers(config: FusionConfig, device: torch.device):
    """The compile's pool of Triton compile workers (`opfuse.runtime.precompile.compile_pool`), where it tunes."""
    from opfuse.runtime.autotune import tunes
    from opfuse.runtime.precompile import compile_pool, workers_of

    return compile_pool(workers_of(config) if tunes(config, device) else 0, device)


def _stage_printer(quiet: bool):
    """say(text): one line on stderr per stage of a compile, unless quiet (long compiles show where they are)."""
    def say(text: str) -> None:
        if not quiet:
            print(f"opfuse: {text}", file=sys.stderr, flush=True)
    return say


@contextlib.contextmanager
def _kernel_progress(quiet: bool, total: int):
    """A progress bar over the kernels being verified (a terminal only); yields on_kernel(name)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]verifying[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), disable=quiet, transient=True) as progress:
        task = progress.add_task("", total=total)
        started = []

        def on_kernel(name: str) -> None:     # called as each kernel starts: the ones before it are done
            progress.update(task, description=name, completed=len(started))
            started.append(name)
        yield on_kernel


def check_kernels_can_run(device: torch.device) -> None:
    """Refuse, naming the fix, a compile whose Triton kernels could not run: inputs on the CPU without Triton's
    interpreter (every kernel would fail with Triton's "0 active drivers" and the model would run through PyTorch,
    which a compile must not do silently)."""
    from opfuse.environment import triton_interpreter

    if device.type == "cpu" and not triton_interpreter():
        raise GraphError("opfuse.compile generates Triton kernels for NVIDIA GPUs and the example inputs are on the "
                         "CPU: move the model and its inputs to a CUDA device, or set TRITON_INTERPRET=1 before "
                         "triton is first imported to run the kernels through Triton's CPU interpreter (slow: for "
                         "tests and small models). opfuse.analyze plans and predicts without either.")
