"""Property: a random model compiled with dim 1 of its inputs dynamic (a sequence) computes what eager does at a
size between its buckets, whether it ran padded at the end of that dim (`opfuse.ir.seq_padding`, where the rows
analysis refuses: a scan along it, a constant made for its size) or at its exact size. An end-padding analysis
that wrongly let padded positions reach real ones would fail here.

Random models (tests/property/random_models.py) are drawn with dim 1 of their first input at 4, compiled with that
dim dynamic in [1, 4] (shared by every input of that size there), then called at 3 on fresh inputs, through Triton's
interpreter in float32, and compared with eager (float64) by the rule opfuse.compile applies. Drawn models eager
cannot run at 3 (a weight sized by that dim) are discarded."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from torch.export import Dim

from random_models import ModelSpec, build_model, model_inputs, model_specs

EXAMPLES = 25
SIZE = 4

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def at_size(spec: ModelSpec, size: int) -> ModelSpec:
    """`spec` with every input whose dim 1 is the first input's at `size` instead."""
    drawn = spec.input_shapes[0][1]
    shapes = tuple(shape[:1] + (size,) + shape[2:] if len(shape) > 1 and shape[1] == drawn else shape
                   for shape in spec.input_shapes)
    return ModelSpec(shapes, spec.layers, spec.seed)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(drawn=model_specs(max_layers=5))
def test_a_sequence_between_buckets_computes_what_eager_does(drawn):
    import opfuse
    from opfuse.numerics import acceptable, relative_error

    assume(len(drawn.input_shapes[0]) > 1)
    spec, smaller = at_size(drawn, SIZE), at_size(drawn, SIZE - 1)
    examples, fresh = model_inputs(spec, seed=0), model_inputs(smaller, seed=1)
    try:
        model = build_model(spec)
        with torch.no_grad():
            model(*examples)
            reference = copy.deepcopy(model).double()(*(x.double() for x in fresh))
            eager = model(*fresh)
    except (RuntimeError, ValueError, IndexError):
        assume(False)                  # the model bakes the size in: no range of sizes to serve
    seq = Dim("seq", min=1, max=SIZE)
    dynamic_shapes = tuple({1: seq} if x.dim() > 1 and x.shape[1] == SIZE else None for x in examples)
    compiled = opfuse.compile(model, examples, opfuse.FusionConfig(dtype="float32"), dynamic_shapes=dynamic_shapes)
    outputs = compiled(*fresh)
    for index, (out, ref, low) in enumerate(zip(outputs, reference, eager)):
        assert out.shape == ref.shape
        error, eager_error = relative_error(out, ref), relative_error(low, ref)
        assert acceptable(error, 1e-4, eager_error, None), (
            f"output {index}: relative error {error:.2e} (eager {eager_error:.2e}); buckets "
            f"{[b.describe() for b in compiled.buckets.values()]}\n{spec.describe()}")
