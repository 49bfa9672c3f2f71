"""`opfuse.compile(model, example_inputs, config) -> nn.Module`: the whole pipeline, stage by stage.

capture -> cast + passes -> fusion plan (`opfuse.api.analyze`) -> Triton codegen per group -> autotune
(resource-checked) -> compiled runtime (+ CUDA graph) -> verification against eager

Verification runs on every compile unless `config.verify` is False: each kernel is checked alone against the
reference values of its group (fresh random inputs), a failing kernel is dropped so its group runs through
PyTorch (and the model's `fallbacks` say why), then the whole model is compared with eager. The user's model is
never changed: capture works on a copy, and the eager reference runs on another copy in eval mode.
"""

from __future__ import annotations

import copy
import time
import warnings
from dataclasses import replace
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from opfuse.api import Analysis, analyze
from opfuse.config import FusionConfig, resolve_dtype
from opfuse.ir.graph import GraphError, dtype_name, torch_dtype
from opfuse.numerics import (GroupCheck, check_groups, random_inputs_like, reference_dtype, relative_error,
                             tolerance)


# a compiled model may differ from the high-precision reference by this much more than eager at the same
# precision does, when both are over the tolerance (an ill-conditioned model, not a wrong kernel)
EAGER_ERROR_MARGIN = 1.25


class OpfuseModule(torch.nn.Module):
    """The compiled model the user gets: same call signature and output structure as the original."""

    def __init__(self, compiled: torch.nn.Module, analysis: Analysis, input_dtypes: list[torch.dtype],
                 output_spec: Any, output_dtypes: list[torch.dtype], checks: list[GroupCheck],
                 end_to_end_error: float | None, seconds: dict[str, float]):
        super().__init__()
        self.compiled = compiled
        self.analysis = analysis
        self.checks = checks
        self.end_to_end_error = end_to_end_error
        self.seconds = seconds
        self._compute_dtype = torch_dtype(analysis.config.dtype)
        self._input_dtypes = input_dtypes
        self._output_spec = output_spec
        self._output_dtypes = output_dtypes

    @property
    def plan(self):
        return self.analysis.plan

    @property
    def fallbacks(self) -> dict[str, str]:
        """Groups that run through PyTorch, and why."""
        return dict(self.compiled.fallbacks)

    @property
    def launches(self) -> int:
        return self.compiled.launches

    def forward(self, *inputs: torch.Tensor) -> Any:
        args = [x.to(self._compute_dtype) if x.is_floating_point() else x for x in inputs]
        outputs = self.compiled(*args)
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        flat = [out.to(dtype) if out.dtype != dtype else out for out, dtype in zip(flat, self._output_dtypes)]
        return tree_unflatten(flat, self._output_spec)


class EagerFallback(torch.nn.Module):
    """What `fallback="eager"` returns when compiling failed: the model, run as it is, with the reason."""

    def __init__(self, model: torch.nn.Module, reason: str):
        super().__init__()
        self.model = model
        self.reason = reason
        self.fallbacks = {"<whole model>": reason}

    def forward(self, *inputs: Any) -> Any:
        return self.model(*inputs)


def compile(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
            config: FusionConfig = FusionConfig(), quiet: bool = True) -> torch.nn.Module:
    """A faster model computing what `model` computes, for inputs like `example_inputs` (see module docstring)."""
    if config.fallback not in ("error", "eager"):
        raise ValueError(f"fallback must be 'error' or 'eager', not {config.fallback!r}")
    example_inputs = tuple(example_inputs)
    config = resolve_dtype(config, example_inputs)
    try:
        return _compile(model, example_inputs, config, quiet)
    except Exception as error:
        if config.fallback == "eager":
            return EagerFallback(model, f"{type(error).__name__}: {error}")
        raise


def _compile(model: torch.nn.Module, example_inputs: tuple, config: FusionConfig, quiet: bool) -> OpfuseModule:
    from opfuse.runtime.compiled import build_compiled_model

    seconds: dict[str, float] = {}
    device = next((x.device for x in example_inputs if isinstance(x, torch.Tensor)), torch.device("cpu"))
    eager = _eager_copy(model)
    with torch.no_grad():
        eager_out = eager(*example_inputs)
    flat_out, output_spec = tree_flatten(eager_out)
    if not all(isinstance(o, torch.Tensor) for o in flat_out):
        raise GraphError("opfuse.compile supports models whose outputs are tensors (or nested tuples/lists/dicts "
                         "of tensors)")

    start = time.perf_counter()
    analysis = analyze(model, example_inputs, config)
    seconds["analyze"] = time.perf_counter() - start

    compute = torch_dtype(config.dtype)
    examples = [x.to(compute) if x.is_floating_point() else x for x in example_inputs]
    start = time.perf_counter()
    compiled = build_compiled_model(analysis.plan, device, examples, config=config, quiet=quiet)
    seconds["codegen+tune"] = time.perf_counter() - start

    checks: list[GroupCheck] = []
    end_to_end = None
    if config.verify:
        start = time.perf_counter()
        fresh = random_inputs_like(example_inputs)
        checks = check_groups(analysis.prepared, compiled.kernels, fresh, config.dtype, compiled.configs)
        failed = [c for c in checks if not c.passed]
        if failed:   # un-fuse: the failing groups run through PyTorch, and say why
            reasons = {c.group: (f"kernel {c.kernel} failed verification (relative error {c.error:.2e} > "
                                 f"{c.tolerance:.0e}){': ' + c.detail if c.detail else ''}; runs through PyTorch")
                       for c in failed}
            compiled = _without_kernels(compiled, reasons)
        end_to_end, eager_error = _end_to_end_error(eager, compiled, fresh, config.dtype)
        seconds["verify"] = time.perf_counter() - start
        bound = tolerance(config.dtype, device)
        if not end_to_end <= bound:
            if eager_error is not None and end_to_end <= EAGER_ERROR_MARGIN * eager_error:
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
    return OpfuseModule(compiled, analysis, [x.dtype for x in example_inputs], output_spec,
                        [o.dtype for o in flat_out], checks, end_to_end, seconds)


def _eager_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A private eval-mode copy: running it can never touch the user's parameters, buffers or training flag."""
    return copy.deepcopy(model).eval()


def _without_kernels(compiled, reasons: dict[str, str]):
    """The same compiled model with these groups' kernels dropped (they run through PyTorch)."""
    from opfuse.runtime.compiled import CompiledModel

    kernels = {name: kernel for name, kernel in compiled.kernels.items() if name not in reasons}
    fallbacks = dict(compiled.fallbacks) | reasons
    rebuilt = CompiledModel(compiled.plan, kernels, compiled.device, configs={k: v for k, v in
                                                                              compiled.configs.items()
                                                                              if k in kernels},
                            fallbacks=fallbacks, config=compiled.config)
    rebuilt.tuning = compiled.tuning
    return rebuilt


def _end_to_end_error(eager: torch.nn.Module, compiled, inputs: list[torch.Tensor], dtype: str
                      ) -> tuple[float, float | None]:
    """Worst relative error of the compiled model's outputs against eager run in the reference precision; when
    that is over the tolerance, also eager's own error at the compute dtype (None otherwise)."""
    reference_type = reference_dtype(dtype)
    compute = torch_dtype(dtype)

    def run(model, dtype_: torch.dtype) -> list[torch.Tensor]:
        with torch.no_grad():
            out = model(*[x.to(dtype_) if x.is_floating_point() else x for x in inputs])
        return list(out) if isinstance(out, tuple) else tree_flatten(out)[0]

    reference = run(copy.deepcopy(eager).to(reference_type), reference_type)
    outputs = run(compiled, compute)
    error = max(relative_error(o, r) for o, r in zip(outputs, reference))
    if error <= tolerance(dtype, inputs[0].device if inputs else None):
        return error, None
    eager_outputs = run(copy.deepcopy(eager).to(compute), compute)
    return error, max(relative_error(o, r) for o, r in zip(eager_outputs, reference))
