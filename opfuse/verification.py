"""Verification of a compiled model against eager: `verify` (the compile's last stage) and its parts.

Each kernel is checked alone against the reference values of its group on fresh random inputs
(`opfuse.numerics.check_groups`); a failing kernel is dropped, so its group runs through PyTorch and the model's
`fallbacks` say why (`without_kernels`). Then the whole model is compared with eager run in the reference precision
(`end_to_end_error`): over the tolerance it is an error, unless eager at the compute dtype is as far off (the model
is ill-conditioned at that precision: a warning), by the one rule of `opfuse.numerics.acceptable`, or the model
chooses between near-equal values (`opfuse.numerics.near_ties`: a mixture of experts' router on a near-tie, where
any run at the compute dtype may pick either expert: a warning that names the choice). Where eager at the compute
dtype overflows it (infinite or NaN where the reference is finite), the compiled model must match eager there: the
same positions not finite and the rest within the tolerance (a warning that the model overflows), else an error.
"""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.utils._pytree import tree_flatten

from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import GraphError, torch_dtype
from opfuse.numerics import (GroupCheck, Layout, acceptable, check_groups, near_ties, random_inputs_like,
                             reference_convolutions, reference_dtype, relative_error, scaled_errors, tolerance,
                             without_cudnn_search)


def verify(analysis: Any, compiled: Any, eager: torch.nn.Module, example_inputs: Sequence[torch.Tensor], config: Any,
           device: torch.device, progress: Callable[[int], Any]) -> tuple[Any, list[GroupCheck], float]:
    """(the compiled model, less the kernels that failed their own check; every kernel's check; the model's
    relative error against eager), or GraphError where the model differs from eager (see the module docstring).
    `progress(kernels)` is a context manager yielding on_kernel(name)."""
    compute = torch_dtype(config.dtype)
    fresh = random_inputs_like(example_inputs)
    layouts = layouts_of(compiled, [x.to(compute) if x.is_floating_point() else x for x in fresh])
    with progress(len(compiled.kernels)) as on_kernel:
        checks = check_groups(analysis.prepared, compiled.kernels, fresh, config.dtype, compiled.configs, on_kernel,
                              layouts)
    failed = [c for c in checks if not c.passed]
    if failed:   # un-fuse: the failing groups run through PyTorch, and say why
        reasons = {c.group: Reason(Code.FAILED_VERIFICATION,
                                   f"kernel {c.kernel} failed verification (relative error {c.error:.2e} > "
                                   f"{c.tolerance:.0e}){': ' + c.detail if c.detail else ''}; runs through PyTorch")
                   for c in failed}
        compiled = without_kernels(compiled, reasons)
    compiled.reset_state()       # the checks' runs wrote it: compared from the state eager starts from
    end_to_end, eager_error, scaled_error = end_to_end_error(eager, compiled, fresh, config.dtype)
    bound = tolerance(config.dtype, device)
    if not end_to_end <= bound:
        if eager_error is not None and math.isinf(eager_error):    # judged against eager at the compute dtype
            _overflow_verdict(analysis.name, config.dtype, scaled_error, bound)
            return compiled, checks, end_to_end
        if not acceptable(end_to_end, bound, eager_error, scaled_error):
            ties = near_ties(analysis.prepared, fresh, config.dtype)
            if ties:    # a choice on a near-tie: which element wins is rounding's, in eager's run as in ours
                warnings.warn(f"opfuse: {analysis.name} in {config.dtype} differs from eager by {end_to_end:.2e} "
                              f"(> {bound:.0e}; eager in {config.dtype}: "
                              f"{'-' if eager_error is None else f'{eager_error:.2e}'}) where it chooses between "
                              f"near-equal values: {'; '.join(ties)}, under {config.dtype}'s resolution, so a run "
                              f"in {config.dtype} may choose either; every kernel passed its own check",
                              stacklevel=4)
                return compiled, checks, end_to_end
            raise GraphError(f"compiled {analysis.name} differs from eager: relative error {end_to_end:.2e} > "
                             f"{bound:.0e} (eager in {config.dtype}: "
                             f"{'-' if eager_error is None else f'{eager_error:.2e}'}) although every "
                             "kernel passed its own check; please report this model")
        # the model itself is that sensitive at this precision: opfuse is as close as eager gets
        reference = str(reference_dtype(config.dtype)).removeprefix("torch.")
        warnings.warn(f"opfuse: {analysis.name} in {config.dtype} differs from the {reference} reference "
                      f"by {end_to_end:.2e} (> {bound:.0e}), but eager PyTorch in {config.dtype} differs by "
                      f"{eager_error:.2e} too: the model is ill-conditioned at this precision", stacklevel=4)
    return compiled, checks, end_to_end


def _overflow_verdict(name: str, dtype: str, against_eager: float, bound: float) -> None:
    """Eager PyTorch in `dtype` itself returns infinities or NaN where the reference is finite (the model passes the
    dtype's range): a warning where the compiled model matches eager in `dtype` (`against_eager`: the same positions
    not finite, the rest within `bound`), else a GraphError. An error of inf against the reference is within any
    margin of eager's inf, so the rule of `acceptable` alone would pass any output."""
    reference = str(reference_dtype(dtype)).removeprefix("torch.")
    if not against_eager <= bound:
        raise GraphError(f"compiled {name} differs from eager: both overflow {dtype} (infinite or NaN where the "
                         f"{reference} reference is finite), but not alike: relative error {against_eager:.2e} "
                         f"against eager in {dtype} (> {bound:.0e}); please report this model")
    warnings.warn(f"opfuse: {name} overflows {dtype}: its output is infinite or NaN where the {reference} reference "
                  f"is finite, in eager PyTorch in {dtype} as in opfuse (the same positions, the rest within "
                  f"{bound:.0e}); scale the model's weights or inputs, or compile it in {reference}", stacklevel=5)


def without_kernels(compiled, reasons: dict[str, Reason]):
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


def layouts_of(compiled, inputs: list[torch.Tensor]) -> dict[str, Layout] | None:
    """The layout of every value the compiled model hands its kernels on `inputs`, from its stand-in values (no
    kernel runs, none compiles; the tensors are dropped at once), or None where those cannot be made (the check
    then lays its inputs out as it did before)."""
    from opfuse.runtime.compiled import stand_ins_of

    values = stand_ins_of(compiled, inputs)
    if values is None:
        return None
    return {name: Layout.of(value) for name, value in values.items() if isinstance(value, torch.Tensor)}


def end_to_end_error(eager: torch.nn.Module, compiled, inputs: list[torch.Tensor], dtype: str
                      ) -> tuple[float, float | None, float | None]:
    """Worst relative error of the compiled model's outputs against eager run in the reference precision; when
    that is over the tolerance, also eager's own error at the compute dtype, and when that is over it too, the
    compiled outputs' worst error against their operands' scale (`scaled_errors`; None where not computed), or,
    where eager's own is inf (it overflows the compute dtype), their worst error against eager's at that dtype.
    Eager computes its float casts in the precision it runs in, as the compiled model does (`_eager_outputs`). A
    model that cannot run in the reference precision (a float32 tensor held as a plain attribute, which `.to`
    leaves float32), or whose outputs take other shapes there (a view of float bits as another dtype), is compared
    with eager at the compute dtype instead, with a warning that says so."""
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
    reshaped = next((i for i, (o, r) in enumerate(zip(outputs, reference)) if o.shape != r.shape), None)
    if reshaped is not None:     # (a view as another dtype of a float64 tensor: twice the elements of float32's)
        return _error_against_compute_dtype(eager, compiled, inputs, dtype, GraphError(
            f"its output {reshaped} is {list(reference[reshaped].shape)} there, {list(outputs[reshaped].shape)} "
            "compiled"))
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
    if math.isinf(eager_error):     # eager overflows the compute dtype: how near the compiled outputs are to its
        return error, eager_error, max(relative_error(o, e) for o, e in zip(outputs, eager_outputs))
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
    """`end_to_end_error` where eager failed in the reference precision (`problem`): against eager at the compute
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
