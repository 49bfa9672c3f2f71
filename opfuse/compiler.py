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
import copy
import sys
import time
import warnings
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from opfuse.api import Analysis, analyze
from opfuse.config import FusionConfig, resolve_dtype
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import GraphError, dtype_name, torch_dtype
from opfuse.numerics import (GroupCheck, Layout, acceptable, check_groups, random_inputs_like, reference_convolutions,
                             reference_dtype, relative_error, scaled_errors, tolerance, without_cudnn_search)


class OpfuseModule(torch.nn.Module):
    """The compiled model the user gets: same call signature and output structure as the original."""

    def __init__(self, compiled: torch.nn.Module, analysis: Analysis, example_inputs: Sequence[torch.Tensor],
                 output_spec: Any, output_dtypes: list[torch.dtype], checks: list[GroupCheck],
                 end_to_end_error: float | None, seconds: dict[str, float], eager: torch.nn.Module | None = None):
        from opfuse.runtime.compiled import CallLock

        super().__init__()
        self.compiled = compiled
        self.analysis = analysis
        self.checks = checks
        self.end_to_end_error = end_to_end_error
        # the compile's stages: analyze, codegen+tune (of it: lower, precompile, tune, and rebuild where a split back
        # built again), verify, measure (`CompiledModel.measure_forward`)
        self.seconds = seconds
        self._signature = [_describe(x) for x in example_inputs]   # what the user passes, before the cast
        # the same, as a call compares it: (shape, dtype, torch.device); an empty shape never matches, so an empty
        # input is always described by _mismatch (compile refuses empty examples, so it is only a safeguard)
        self._expected = [(tuple(x.shape) if x.numel() > 0 else None, x.dtype, x.device) for x in example_inputs]
        self._input_names = [spec.name for spec in compiled.signature]
        self._output_spec = output_spec
        self._output_is_leaf = output_spec.is_leaf()
        self._output_dtypes = output_dtypes
        # a private eval-mode copy of the model, kept only for config.recompile or fallback="eager"; a plain
        # attribute (not a submodule) so .to()/.half() on this module and its state_dict never see it
        self.__dict__["_eager"] = eager
        self._variants: dict[tuple, torch.nn.Module | str] = {}   # recompiled per signature, or why that failed
        self.call_fallbacks: dict[str, str] = {}    # calls run eagerly (fallback="eager"), and why
        # guards the two dicts above; a call with the compiled signature never takes it (`compiled` has its own)
        self._lock = CallLock()
        self._warned_no_autograd = False

    @property
    def plan(self):
        return self.analysis.plan

    @property
    def fallbacks(self) -> dict[str, Reason]:
        """What runs through PyTorch, and why: groups without a kernel, and calls run eagerly."""
        calls = {key: Reason(Code.EAGER_CALL, why) for key, why in self.call_fallbacks.items()}
        return dict(self.compiled.fallbacks) | calls

    @property
    def launches(self) -> int:
        return self.compiled.launches

    def forward(self, *inputs: torch.Tensor) -> Any:
        if torch.is_grad_enabled() and not self._warned_no_autograd and _warn_without_autograd(
                self.analysis.name, inputs, self._input_names):
            self._warned_no_autograd = True
        if not self._matches(inputs):
            problem = self._mismatch(inputs)
            if problem is not None:
                return self._other_inputs(inputs, problem)
        try:
            # the inputs match the compiled signature but for the float cast to the compute dtype, which run_matching
            # does as it lays them out (so hooks registered on `.compiled` itself do not run; hooks on this module do);
            # `_modules` is where nn.Module keeps `.compiled`, read without the detour through its __getattr__
            outputs = self._modules["compiled"].run_matching(inputs)
        except Exception as error:
            if self.analysis.config.fallback != "eager" or self._eager is None:   # recompile alone keeps _eager
                raise
            return self._run_eagerly(inputs, f"the compiled model failed ({type(error).__name__}: {error})")
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        flat = [out if out.dtype == dtype else out.to(dtype) for out, dtype in zip(flat, self._output_dtypes)]
        if self._output_is_leaf:
            return flat[0]
        return tree_unflatten(flat, self._output_spec)

    def _matches(self, inputs: Sequence[Any]) -> bool:
        """Whether these inputs are the ones compiled for: the check every call pays, so it builds nothing
        (`_mismatch` says what differs when it is False)."""
        if len(inputs) != len(self._expected):
            return False
        for x, (shape, dtype, device) in zip(inputs, self._expected):
            if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.shape != shape or x.device != device:
                return False
        return True

    def _mismatch(self, inputs: Sequence[Any]) -> str | None:
        """Why these inputs are not the ones compiled for (naming the first offending input), or None."""
        if len(inputs) != len(self._signature):
            return f"the model was compiled for {len(self._signature)} inputs, got {len(inputs)}"
        for index, (x, want) in enumerate(zip(inputs, self._signature)):
            name = self._input_names[index] if index < len(self._input_names) else str(index)
            if not isinstance(x, torch.Tensor):
                return f"input {index} ({name}) must be a tensor, got {type(x).__name__}"
            got = _describe(x)
            if x.numel() == 0:
                return (f"input {index} ({name}) is empty ({_format(got)}): opfuse does not run empty batches "
                        f"(compiled for {_format(want)})")
            if got != want:
                return f"input {index} ({name}) is {_format(got)}, but the model was compiled for {_format(want)}"
        return None

    def _other_inputs(self, inputs: Sequence[Any], problem: str) -> Any:
        """Inputs unlike the compiled ones: compile for them (config.recompile), run them eagerly
        (fallback="eager"), or refuse them."""
        config = self.analysis.config
        eager_fallback = config.fallback == "eager" and self._eager is not None
        recompilable = (len(inputs) == len(self._signature)
                        and all(isinstance(x, torch.Tensor) and x.numel() > 0 for x in inputs))
        if config.recompile and self._eager is not None and recompilable:
            signature = tuple(_describe(x) for x in inputs)
            with self._lock:     # threads calling with a new signature at once compile it once
                if signature not in self._variants:   # a variant keeps no eager copy of its own: this module has one
                    try:
                        self._variants[signature] = compile(self._eager, inputs,
                                                            replace(config, recompile=False, fallback="error"))
                    except Exception as error:
                        if not eager_fallback:
                            raise GraphError(f"{problem}; compiling again for these inputs failed: "
                                             f"{type(error).__name__}: {error}") from error
                        self._variants[signature] = (f"compiling for these inputs failed ({type(error).__name__}: "
                                                     f"{error})")
                variant = self._variants[signature]
            if isinstance(variant, str):
                return self._run_eagerly(inputs, variant)
            try:
                return variant(*inputs)
            except Exception as error:
                if not eager_fallback:
                    raise
                return self._run_eagerly(inputs, f"the compiled model failed ({type(error).__name__}: {error})")
        if eager_fallback:
            return self._run_eagerly(inputs, problem)
        raise GraphError(f"{problem}; compile again for these inputs, or compile with FusionConfig(recompile=True) "
                         "to do so automatically (or fallback='eager' to run them eagerly)")

    def _run_eagerly(self, inputs: Sequence[Any], reason: str) -> Any:
        key = _call_key(inputs)
        with self._lock:     # one warning per kind of call, whichever thread makes it first
            first = key not in self.call_fallbacks
            if first:
                self.call_fallbacks[key] = reason
        if first:
            warnings.warn(f"opfuse: running {self.analysis.name} eagerly for this call: {reason}", stacklevel=3)
        with torch.no_grad():
            return self._eager(*inputs)


def _describe(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, str(x.device))


def _format(description: tuple) -> str:
    shape, dtype, device = description
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}] on {device}"


def _warn_without_autograd(model_name: str, inputs: Sequence[Any], input_names: Sequence[str] = ()) -> bool:
    """Warn, naming the first input that requires grad, that the outputs carry no autograd graph (the caller checks
    that grad mode is on); whether it warned."""
    index = next((i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad), None)
    if index is None:
        return False
    name = f" ({input_names[index]})" if index < len(input_names) else ""
    warnings.warn(f"opfuse: input {index}{name} of {model_name} requires grad, but the compiled model computes "
                  "without autograd (as under torch.no_grad()): its outputs carry no autograd graph",
                  stacklevel=5)     # the caller's line: above forward, nn.Module's __call__ and _call_impl
    return True


class TrainingModeWarning(UserWarning):
    """A model in training mode is compiled in eval mode (see module docstring)."""


def _warn_if_training(model: torch.nn.Module) -> None:
    """Warn, naming it, that a model in training mode is compiled in eval mode."""
    training = next((name for name, module in model.named_modules() if module.training), None)
    if training is None:
        return
    where = type(model).__name__ + (f" (its submodule {training})" if training else "")
    warnings.warn(TrainingModeWarning(f"opfuse: {where} is in training mode; it is compiled in eval mode (dropout off, "
                                      "batch norm on its running statistics) and keeps its training flag: call "
                                      "model.eval() before compiling it"), stacklevel=3)


def _call_key(inputs: Sequence[Any]) -> str:
    parts = [_format(_describe(x)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]
    return f"<call with ({', '.join(parts)})>"


class EagerFallback(torch.nn.Module):
    """What `fallback="eager"` returns when compiling failed: the model run eagerly (eval mode, no autograd, as the
    compiled model would), on a private copy so running it never touches the user's model; `reason` says why."""

    def __init__(self, model: torch.nn.Module, reason: str):
        super().__init__()
        try:
            private = _eager_copy(model)
        except Exception as error:   # a model that cannot be copied is run as it is, and the reason says so
            private = model
            reason += f" (the model could not be copied ({type(error).__name__}), so it is run as it is)"
        self.model = private
        self.reason = reason
        self.fallbacks = {"<whole model>": Reason(Code.NOT_COMPILED, reason)}
        self._warned_no_autograd = False

    def forward(self, *inputs: Any) -> Any:
        if torch.is_grad_enabled() and not self._warned_no_autograd and _warn_without_autograd(
                type(self.model).__name__, inputs):
            self._warned_no_autograd = True
        with torch.no_grad():
            return self.model(*inputs)


def compile(model: Any, example_inputs: Sequence[torch.Tensor],
            config: FusionConfig = FusionConfig(), quiet: bool = True, *, dynamic_shapes: Any = None
            ) -> torch.nn.Module:
    """A faster model computing what `model` computes, for inputs like `example_inputs` (see module docstring);
    `model` is an nn.Module or an ONNX model (a path to an .onnx file, its bytes, or an onnx.ModelProto).
    `dynamic_shapes` (as torch.export takes it: per input, {dim: torch.export.Dim(name, min=, max=)}) makes one
    model for those ranges of sizes (`opfuse.runtime.dynamic.DynamicModel`)."""
    if config.fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', not {config.fallback!r}")
    example_inputs = tuple(example_inputs)
    if isinstance(model, torch.nn.Module):
        _warn_if_training(model)
    elif dynamic_shapes is not None:
        raise GraphError("dynamic_shapes takes an nn.Module; an ONNX model is imported at one shape")
    else:
        from opfuse.frontend.onnx_module import onnx_module

        model = onnx_module(model, example_inputs)
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
    from opfuse.runtime.compiled import interpreter_alone
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

    eager = _eager_copy(model)
    with torch.no_grad():       # on copies: a forward that writes into its input must not write into the user's
        eager_out = eager(*[x.clone() if isinstance(x, torch.Tensor) else x for x in example_inputs])
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
    over_budget = dict(getattr(compiled.tuning, "over_budget", None) or {})
    apart = dict(getattr(compiled.tuning, "slower_fused", None) or {})
    if config.split_epilogues:
        apart |= getattr(compiled.tuning, "epilogue_apart", None) or {}
    if over_budget or kept_apart(analysis, apart):   # kernels that spilled or lost to their ops: plan again
        replanned, notes = split_back(analysis, over_budget, apart), []
        if not over_budget and (joining := splits_that_join(analysis, replanned, apart)) != apart:
            # a split that only splits gains nothing the first build did not measure: split only the others
            replanned = split_back(analysis, {}, joining) if kept_apart(analysis, joining) else analysis
            notes.append(f"{len(apart) - len(joining)} of the {len(apart)} groups measured fastest apart only "
                         "split (the first build runs their parts apart already): not built again")
        # and build again where that changed the groups (a one-op group has nothing to split: it keeps the other
        # form the tuner chose for it); kept unless its kernels measure slower than those they replace
        if [g.nodes for g in replanned.plan.groups] != [g.nodes for g in analysis.plan.groups]:
            rebuild = time.perf_counter()
            rebuilt = build_compiled_model(replanned.plan, device, examples, config=config, quiet=quiet)
            seconds["rebuild"] = time.perf_counter() - rebuild
            keep = not measured_slower(rebuilt, compiled)
            notes.insert(0, replan_note(rebuilt, compiled, keep).removeprefix("split back: "))
            if keep:
                analysis, compiled = replanned, rebuilt
        if notes:
            compiled.replan_note = "split back: " + "; ".join(notes)
            say(compiled.replan_note)
    seconds["codegen+tune"] = time.perf_counter() - start

    checks: list[GroupCheck] = []
    end_to_end = None
    if config.verify:
        start = time.perf_counter()
        fresh = random_inputs_like(example_inputs)
        say(f"verifying {len(compiled.kernels)} kernels, then the whole model, against the reference"
            + (" (Triton's CPU interpreter: slow)" if device.type == "cpu" else ""))
        layouts = _layouts(compiled, [x.to(compute) if x.is_floating_point() else x for x in fresh])
        with _kernel_progress(quiet, len(compiled.kernels)) as on_kernel:
            checks = check_groups(analysis.prepared, compiled.kernels, fresh, config.dtype, compiled.configs,
                                  on_kernel, layouts)
        failed = [c for c in checks if not c.passed]
        if failed:   # un-fuse: the failing groups run through PyTorch, and say why
            reasons = {c.group: Reason(Code.FAILED_VERIFICATION,
                                       f"kernel {c.kernel} failed verification (relative error {c.error:.2e} > "
                                       f"{c.tolerance:.0e}){': ' + c.detail if c.detail else ''}; runs through PyTorch")
                       for c in failed}
            compiled = _without_kernels(compiled, reasons)
        end_to_end, eager_error, scaled_error = _end_to_end_error(eager, compiled, fresh, config.dtype)
        seconds["verify"] = time.perf_counter() - start
        bound = tolerance(config.dtype, device)
        if not end_to_end <= bound:
            if acceptable(end_to_end, bound, eager_error, scaled_error):
                # the model itself is that sensitive at this precision: opfuse is as close as eager gets
                reference = str(reference_dtype(config.dtype)).removeprefix("torch.")
                warnings.warn(f"opfuse: {analysis.name} in {config.dtype} differs from the {reference} reference "
                              f"by {end_to_end:.2e} (> {bound:.0e}), but eager PyTorch in {config.dtype} differs by "
                              f"{eager_error:.2e} too: the model is ill-conditioned at this precision", stacklevel=3)
            else:
                raise GraphError(f"compiled {analysis.name} differs from eager: relative error {end_to_end:.2e} > "
                                 f"{bound:.0e} (eager in {config.dtype}: "
                                 f"{'-' if eager_error is None else f'{eager_error:.2e}'}) although every "
                                 "kernel passed its own check; please report this model")
    # what a replay launches and how long it takes, on a capture of the example inputs: the record analyze reads
    start = time.perf_counter()
    compiled.measure_forward(examples)
    seconds["measure"] = time.perf_counter() - start
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


def split_back(analysis: Analysis, over_budget: dict[str, str], slower: dict[str, str] | None = None) -> Analysis:
    """The analysis re-planned so that no kernel brings together again the nodes of a group whose every config
    failed the resource check (`over_budget`: group name -> why), nor the anchors of a group that measured slower
    than its ops through PyTorch (`slower`: group name -> why), nor (with `config.split_epilogues`) the anchor of
    such a group of one anchor with any of its other nodes; the plan's decisions say which and why."""
    from dataclasses import replace as replace_field

    from opfuse.analysis.traffic import summarize_plan
    from opfuse.codegen.lower import groups_through_pytorch
    from opfuse.fusion.planner import plan_fusion

    groups = {g.name: g for g in analysis.plan.groups}
    measured = {frozenset(groups[name].nodes): why for name, why in over_budget.items()}
    plan = plan_fusion(analysis.prepared, analysis.config, analysis.hardware, measured,
                       kept_apart(analysis, slower or {}))
    pytorch_groups = groups_through_pytorch(plan)
    return replace_field(analysis, plan=plan, fused=summarize_plan(plan, analysis.hardware, pytorch_groups),
                         pytorch_groups=pytorch_groups)


def splits_that_join(analysis: Analysis, replanned: Analysis, apart: dict[str, str]) -> dict[str, str]:
    """Of the groups `apart` (name -> why) that `replanned` splits back, those worth building again: a group of
    several anchors (its anchors each fused on their own were never timed), and a group one of whose nodes joins a
    node of another group in `replanned` (a fusion the first build did not time). Not a group of one anchor that
    only splits: the first build runs it in the form the tuner measured fastest, which runs its anchor apart from
    its other ops already (RESULTS.md, run 104: such rebuilds were all slower)."""
    groups = {g.name: g for g in analysis.plan.groups}
    owner = {n: g.name for g in analysis.plan.groups for n in g.nodes}
    joined = set()
    for group in replanned.plan.groups:
        owners = {owner.get(n, n) for n in group.nodes}
        if len(owners) > 1:
            joined |= owners
    return {name: why for name, why in apart.items()
            if name in joined or len(_anchors(analysis.prepared, groups[name].nodes)) > 1}


def changed_seconds(model, than) -> tuple[int, float | None]:
    """(how many, seconds in sum) of the groups of compiled `model` that `than` lacks (groups of other nodes; views,
    which launch nothing, left out), by the autotuner's times of their chosen forms; None seconds where one of them
    has no measured time (untuned, or run through PyTorch without a kernel of opfuse's: the tuner times kernels
    only)."""
    others = {frozenset(g.nodes) for g in than.plan.groups}
    seconds = getattr(model.tuning, "seconds", None) or {}
    changed = [g.name for g in model.plan.groups if frozenset(g.nodes) not in others and g.kind is not GroupKind.VIEW]
    return len(changed), sum(seconds[name] for name in changed) if all(name in seconds for name in changed) else None


def measured_slower(model, than) -> bool:
    """Whether the kernels of compiled `model` that `than` lacks measured slower in sum than those of `than` it lacks
    (`changed_seconds`); False where either side has no measured time."""
    (_, new), (_, old) = changed_seconds(model, than), changed_seconds(than, model)
    return new is not None and old is not None and new > old


def replan_note(rebuilt, first, kept_new: bool) -> str:
    """What a compile planned again after a split back did, in words: the groups each build has that the other lacks,
    their measured kernel time, and which build it kept (`kept_new`: the rebuilt one, by `measured_slower`)."""
    (count, new), (replaced, old) = changed_seconds(rebuilt, first), changed_seconds(first, rebuilt)
    kept = "kept the new plan" if kept_new else "kept the first build"
    if new is None or old is None:
        return f"split back: {count} groups in place of {replaced}, not all timed; {kept}"
    return (f"split back: {count} groups in place of {replaced}, their kernels {new * 1e6:.1f} us against "
            f"{old * 1e6:.1f} us; {kept}")


def kept_apart(analysis: Analysis, slower: dict[str, str]) -> dict[frozenset[str], str]:
    """The node sets `split_back` keeps apart for the groups whose fastest form ran their anchors apart (group name
    -> why; `TuningResult.slower_fused`, and with `config.split_epilogues` `TuningResult.epilogue_apart`): each pair
    of anchors of a group of several (a horizontal group is merged a sibling at a time); with
    `config.split_epilogues`, the anchor of a group of one with each of its other nodes, and each of those with the
    first anchors after it: split from its own anchor, an op may join a reduction or pointwise kernel (a residual
    add the next layer norm), not another anchor's kernel as a prologue, which only a Triton form can take and
    which it computes again for every tile of output columns (RESULTS.md, run 104: no rebuild with such a
    prologue was kept, in convnext_tiny at batch 1 and 64 and resnet50 at 64)."""
    from itertools import combinations

    graph = analysis.prepared
    groups = {g.name: g for g in analysis.plan.groups}
    users = graph.users()
    apart: dict[frozenset[str], str] = {}
    for name, why in slower.items():
        nodes = groups[name].nodes
        anchors = _anchors(graph, nodes)
        if len(anchors) > 1:
            apart.update({frozenset(pair): why for pair in combinations(anchors, 2)})
        elif len(anchors) == 1 and analysis.config.split_epilogues:
            apart.update({frozenset((anchors[0], n)): why for n in nodes if n != anchors[0]})
            apart.update({frozenset((n, later)): f"{why}, with {anchors[0]} (a prologue of a later anchor is not "
                          "tried)" for n in nodes if n != anchors[0] for later in _anchors_after(graph, n, users)})
    return apart


def _anchors(graph, nodes) -> list[str]:
    """The anchors (convs, GEMMs) among `nodes`, in their order."""
    from opfuse.ir.ops import FusionKind, kind_of

    return [n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR]


def _anchors_after(graph, name: str, users) -> set[str]:
    """The anchors that read node `name`'s value, directly or through nodes other than anchors."""
    found, seen, stack = set(), set(), [u.name for u in users.get(name, [])]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _anchors(graph, [node]):
            found.add(node)
        else:
            stack.extend(u.name for u in users.get(node, []))
    return found


def _eager_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A private eval-mode copy: running it can never touch the user's parameters, buffers or training flag."""
    return copy.deepcopy(model).eval()


def _without_kernels(compiled, reasons: dict[str, Reason]):
    """The same compiled model with these groups' kernels dropped (they run through PyTorch)."""
    from opfuse.runtime.compiled import CompiledModel

    kernels = {name: kernel for name, kernel in compiled.kernels.items() if name not in reasons}
    fallbacks = dict(compiled.fallbacks) | reasons
    rebuilt = CompiledModel(compiled.plan, kernels, compiled.device, configs={k: v for k, v in
                                                                              compiled.configs.items()
                                                                              if k in kernels},
                            fallbacks=fallbacks, config=compiled.config)
    rebuilt.tuning, rebuilt.build_seconds, rebuilt.replan_note = compiled.tuning, compiled.build_seconds, \
        compiled.replan_note
    return rebuilt


def _layouts(compiled, inputs: list[torch.Tensor]) -> dict[str, Layout] | None:
    """The layout of every value the compiled model hands its kernels on `inputs`, from its stand-in values (no
    kernel runs, none compiles; the tensors are dropped at once), or None where those cannot be made (the check
    then lays its inputs out as it did before)."""
    from opfuse.runtime.compiled import stand_ins_of

    values = stand_ins_of(compiled, inputs)
    if values is None:
        return None
    return {name: Layout.of(value) for name, value in values.items() if isinstance(value, torch.Tensor)}


def _end_to_end_error(eager: torch.nn.Module, compiled, inputs: list[torch.Tensor], dtype: str
                      ) -> tuple[float, float | None, float | None]:
    """Worst relative error of the compiled model's outputs against eager run in the reference precision; when
    that is over the tolerance, also eager's own error at the compute dtype, and when that is over it too, the
    compiled outputs' worst error against their operands' scale (`scaled_errors`; None where not computed).
    Eager computes its float casts in the precision it runs in, as the compiled model does (`_eager_outputs`). A
    model that cannot run in the reference precision (a float32 tensor held as a plain attribute, which `.to`
    leaves float32) is compared with eager at the compute dtype instead, with a warning that says so."""
    reference_type = reference_dtype(dtype)
    compute = torch_dtype(dtype)
    try:
        with reference_convolutions():     # the compiled model's own convolutions keep the user's setting
            reference = _eager_outputs(eager, inputs, reference_type)
    except (RuntimeError, TypeError, GraphError) as problem:
        return _error_against_compute_dtype(eager, compiled, inputs, dtype, problem)
    outputs = _flat_outputs(compiled, inputs, compute)
    if len(outputs) != len(reference):   # zip would compare only the first few and pass
        raise GraphError(f"compiled {compiled.graph.name} has {len(outputs)} outputs, eager has {len(reference)}")
    error = max(relative_error(o, r) for o, r in zip(outputs, reference))
    bound = tolerance(dtype, inputs[0].device if inputs else None)
    if error <= bound:
        return error, None, None
    try:
        with without_cudnn_search():     # PyTorch at the compute dtype, as a user runs it
            eager_outputs = _eager_outputs(eager, inputs, compute)
    except (RuntimeError, TypeError, GraphError):   # no PyTorch figure to compare with: the error stands as measured
        return error, None, None
    eager_error = max(relative_error(o, r) for o, r in zip(eager_outputs, reference))
    if eager_error <= bound:
        return error, eager_error, None
    return error, eager_error, max(scaled_errors(compiled.graph, inputs, outputs, dtype))


def _flat_outputs(model, inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """`model`'s outputs on `inputs` (floating ones in `dtype`), flat: nested tuples/dicts too, as the compiled
    model's are."""
    with torch.no_grad():
        out = model(*[x.to(dtype) if x.is_floating_point() else x for x in inputs])
    return tree_flatten(out)[0]


def _eager_outputs(eager: torch.nn.Module, inputs: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """Eager's outputs with everything in `dtype`: a copy's weights, the floating inputs, and every float cast of
    its forward (`numerics.float_casts_to`: the compiled model computes those in its compute dtype)."""
    from opfuse.numerics import float_casts_to

    model = copy.deepcopy(eager).to(dtype)     # outside the casts: a deep copy must keep each tensor's own dtype
    with float_casts_to(dtype):
        return _flat_outputs(model, inputs, dtype)


def _error_against_compute_dtype(eager: torch.nn.Module, compiled, inputs: list[torch.Tensor], dtype: str,
                                 problem: Exception) -> tuple[float, None, None]:
    """`_end_to_end_error` where eager failed in the reference precision (`problem`): against eager at the compute
    dtype, which is then the only PyTorch figure (no eager error of its own); a GraphError if that fails too."""
    name, reference = compiled.graph.name, str(reference_dtype(dtype)).removeprefix("torch.")
    try:
        with reference_convolutions():
            expected = _eager_outputs(eager, inputs, torch_dtype(dtype))
    except (RuntimeError, TypeError, GraphError) as again:
        raise GraphError(f"verification cannot run eager {name}: in {reference}: {type(problem).__name__}: "
                         f"{problem}; in {dtype}: {type(again).__name__}: {again} (FusionConfig(verify=False) "
                         "compiles without verifying)") from again
    warnings.warn(f"opfuse: {name} verified against eager in {dtype}, not {reference}: eager fails in {reference} "
                  f"({type(problem).__name__}: {problem})", stacklevel=6)
    outputs = _flat_outputs(compiled, inputs, torch_dtype(dtype))
    if len(outputs) != len(expected):
        raise GraphError(f"compiled {name} has {len(outputs)} outputs, eager has {len(expected)}")
    return max(relative_error(o, e) for o, e in zip(outputs, expected)), None, None
