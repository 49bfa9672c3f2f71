"""Property: a random model compiled for a range of batch sizes (`dynamic_shapes`) computes what eager does at a
batch between its buckets, whether the plan let it pad the batch or sent it to an exact-size compile. A row
analysis that wrongly called rows independent would pad a model whose rows interact and fail here.

Random models (tests/property/random_models.py) are drawn at batch 4, compiled with the batch dim dynamic in
[1, 4] (bucket 4 compiled up front), then called at batch 3 on fresh inputs, through Triton's interpreter in
float32, and compared with eager (float64) by the rule opfuse.compile applies. Drawn models that eager itself cannot
run at batch 3 (a reshape that bakes the batch in) are discarded."""

import copy

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from torch.export import Dim

from random_models import ModelSpec, build_model, model_inputs, model_specs

EXAMPLES = 40
BATCH = 4

pytestmark = [pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")]


def at_batch(spec: ModelSpec, batch: int) -> ModelSpec:
    """`spec` with every input whose dim 0 is the drawn batch at `batch` instead (broadcast inputs of 1 kept)."""
    drawn = spec.input_shapes[0][0]
    shapes = tuple((batch,) + shape[1:] if shape[0] == drawn and (drawn > 1 or shape == spec.input_shapes[0])
                   else shape for shape in spec.input_shapes)
    return ModelSpec(shapes, spec.layers, spec.seed)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much])
@given(drawn=model_specs(max_layers=6))
def test_a_batch_between_buckets_computes_what_eager_does(drawn):
    import opfuse
    from opfuse.numerics import acceptable, relative_error

    spec, smaller = at_batch(drawn, BATCH), at_batch(drawn, BATCH - 1)
    examples, fresh = model_inputs(spec, seed=0), model_inputs(smaller, seed=1)
    try:
        model = build_model(spec)
        with torch.no_grad():
            model(*examples)
            reference = copy.deepcopy(model).double()(*(x.double() for x in fresh))
            eager = model(*fresh)
    except (RuntimeError, ValueError, IndexError):
        assume(False)                  # the model bakes the batch in: no range of batches to serve
    batch = Dim("batch", min=1, max=BATCH)
    dynamic_shapes = tuple({0: batch} if x.shape[0] == BATCH else None for x in examples)
    compiled = opfuse.compile(model, examples, opfuse.FusionConfig(dtype="float32"), dynamic_shapes=dynamic_shapes)
    outputs = compiled(*fresh)
    for index, (out, ref, low) in enumerate(zip(outputs, reference, eager)):
        assert out.shape == ref.shape
        error, eager_error = relative_error(out, ref), relative_error(low, ref)
        bucket = compiled.buckets.get((BATCH,))
        assert acceptable(error, 1e-4, eager_error, None), (
            f"output {index}: relative error {error:.2e} (eager {eager_error:.2e}); buckets "
            f"{[b.describe() for b in compiled.buckets.values()]}; padded: {bucket is not None and 'batch' in bucket.cuts}"
            f"\n{spec.describe()}")
