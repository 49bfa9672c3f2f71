"""What `opfuse.compile` returns: `OpfuseModule` (the compiled model, called like the original) and `EagerFallback`
(the model run eagerly where compiling failed and `fallback="eager"`), and the warnings both give where a compiled
model differs from the model run eagerly (`warn_if_training`, `warn_without_autograd`).

An OpfuseModule takes inputs of exactly the shapes, dtypes and devices it was compiled for (the check every call
pays builds nothing: `_matches`); others are refused with an error naming the input, compiled for
(`config.recompile`, once per signature) or run eagerly (`config.fallback == "eager"`), as `opfuse.compiler`'s
docstring says. Its outputs have the original's structure and dtypes.
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_unflatten

from opfuse.api import Analysis
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import GraphError, dtype_name
from opfuse.numerics import GroupCheck


class OpfuseModule(torch.nn.Module):
    """The compiled model the user gets: same call signature and output structure as the original."""

    def __init__(self, compiled: torch.nn.Module, analysis: Analysis, example_inputs: Sequence[torch.Tensor],
                 output_spec: Any, output_dtypes: list[torch.dtype], checks: list[GroupCheck],
                 end_to_end_error: float | None, seconds: dict[str, float], eager: torch.nn.Module | None = None):
        from opfuse.runtime.gate import CallLock

        super().__init__()
        self.compiled = compiled
        self.analysis = analysis
        self.checks = checks
        self.end_to_end_error = end_to_end_error
        # the compile's stages: analyze, codegen+tune (of it: lower, precompile, tune, and rebuild where a split back
        # built again), verify, measure (`CompiledModel.measure_forward`)
        self.seconds = seconds
        self._signature = [describe_input(x) for x in example_inputs]   # what the user passes, before the cast
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
        if torch.is_grad_enabled() and not self._warned_no_autograd and warn_without_autograd(
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
            got = describe_input(x)
            if x.numel() == 0:
                return (f"input {index} ({name}) is empty ({_format(got)}): opfuse does not run empty batches "
                        f"(compiled for {_format(want)})")
            if got != want:
                return f"input {index} ({name}) is {_format(got)}, but the model was compiled for {_format(want)}"
        return None

    def _other_inputs(self, inputs: Sequence[Any], problem: str) -> Any:
        from opfuse.compiler import compile as opfuse_compile

        """Inputs unlike the compiled ones: compile for them (config.recompile), run them eagerly
        (fallback="eager"), or refuse them."""
        config = self.analysis.config
        eager_fallback = config.fallback == "eager" and self._eager is not None
        recompilable = (len(inputs) == len(self._signature)
                        and all(isinstance(x, torch.Tensor) and x.numel() > 0 for x in inputs))
        if config.recompile and self._eager is not None and recompilable:
            signature = tuple(describe_input(x) for x in inputs)
            with self._lock:     # threads calling with a new signature at once compile it once
                if signature not in self._variants:   # a variant keeps no eager copy of its own: this module has one
                    try:
                        self._variants[signature] = opfuse_compile(self._eager, inputs,
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


def describe_input(x: torch.Tensor) -> tuple:
    return (tuple(x.shape), x.dtype, str(x.device))


def _format(description: tuple) -> str:
    shape, dtype, device = description
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}] on {device}"


def warn_without_autograd(model_name: str, inputs: Sequence[Any], input_names: Sequence[str] = ()) -> bool:
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


def warn_if_training(model: torch.nn.Module) -> None:
    """Warn, naming it, that a model in training mode is compiled in eval mode."""
    training = next((name for name, module in model.named_modules() if module.training), None)
    if training is None:
        return
    where = type(model).__name__ + (f" (its submodule {training})" if training else "")
    warnings.warn(TrainingModeWarning(f"opfuse: {where} is in training mode; it is compiled in eval mode (dropout off, "
                                      "batch norm on its running statistics) and keeps its training flag: call "
                                      "model.eval() before compiling it"), stacklevel=3)


def _call_key(inputs: Sequence[Any]) -> str:
    parts = [_format(describe_input(x)) if isinstance(x, torch.Tensor) else type(x).__name__ for x in inputs]
    return f"<call with ({', '.join(parts)})>"


class EagerFallback(torch.nn.Module):
    """What `fallback="eager"` returns when compiling failed: the model run eagerly (eval mode, no autograd, as the
    compiled model would), on a private copy so running it never touches the user's model; `reason` says why."""

    def __init__(self, model: torch.nn.Module, reason: str):
        super().__init__()
        try:
            private = eager_copy(model)
        except Exception as error:   # a model that cannot be copied is run as it is, and the reason says so
            private = model
            reason += f" (the model could not be copied ({type(error).__name__}), so it is run as it is)"
        self.model = private
        self.reason = reason
        self.fallbacks = {"<whole model>": Reason(Code.NOT_COMPILED, reason)}
        self._warned_no_autograd = False

    def forward(self, *inputs: Any) -> Any:
        if torch.is_grad_enabled() and not self._warned_no_autograd and warn_without_autograd(
                type(self.model).__name__, inputs):
            self._warned_no_autograd = True
        with torch.no_grad():
            return self.model(*inputs)


def eager_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A private eval-mode copy: running it can never touch the user's parameters, buffers or training flag."""
    return copy.deepcopy(model).eval()
