"""One compile for ranges of sizes (`opfuse.compile(..., dynamic_shapes=)`, `opfuse.runtime.dynamic`), through
Triton's interpreter: calls at odd sizes inside the range equal eager; a call between buckets is padded only where
the plan proves padding cannot change a result, and runs at its exact sizes otherwise; bad sizes are one-line
errors naming the input and the range."""

import pytest
import torch
from torch.export import Dim

import opfuse
from opfuse.ir.graph import GraphError
from opfuse.runtime.dynamic import DynamicDim, bucket_of, bucket_sizes

CONFIG = opfuse.FusionConfig(dtype="float32")


class RowWise(torch.nn.Module):
    """Every output row from its own input row: linear, layer norm over the features, an activation."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x):
        return torch.relu(self.norm(self.lin(x)))


class OverBatch(torch.nn.Module):
    """A softmax over the batch: every row reads every other; padding the batch would change the rows kept."""

    def forward(self, x):
        return torch.softmax(x, 0) * 2.0


class Attention(torch.nn.Module):
    """Per-token projections (independent rows along batch and sequence) and attention over the sequence (its keys:
    every query reads every key, so the sequence may not be padded)."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(8, 24)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 4).permute(2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return self.out(y.transpose(1, 2).reshape(b, s, 8)), x.mean(-1)


def make(cls):
    torch.manual_seed(0)
    return cls().eval()


def check(compiled, model, *inputs):
    with torch.no_grad():
        want = model(*inputs)
    got = compiled(*inputs)
    for g, w in zip(torch.utils._pytree.tree_flatten(got)[0], torch.utils._pytree.tree_flatten(want)[0]):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_buckets_are_the_powers_of_two_in_the_range_and_its_max():
    assert bucket_sizes(DynamicDim("b", 1, 64, ())) == [1, 2, 4, 8, 16, 32, 64]
    assert bucket_sizes(DynamicDim("s", 5, 100, ())) == [8, 16, 32, 64, 100]
    assert bucket_sizes(DynamicDim("s", 3, None, ()), up_to=9) == [4, 8, 16]
    assert [bucket_of(DynamicDim("s", 1, 100, ()), n) for n in (1, 3, 64, 65, 100)] == [1, 4, 64, 100, 100]


def test_more_bucket_steps_put_sizes_between_the_powers_of_two_aligned_past_8():
    """Past 8 a bucket is a multiple of 8: 23 keys would be 24, 431 keys 432 (PyTorch's attention takes a path 1.7x
    slower at 431 than at 432 on the H100)."""
    assert bucket_sizes(DynamicDim("s", 1, 64, ()), steps=2) == [1, 2, 3, 4, 6, 8, 16, 24, 32, 48, 64]
    assert bucket_sizes(DynamicDim("s", 5, 100, ()), steps=2) == [6, 8, 16, 24, 32, 48, 64, 96, 100]
    sizes = bucket_sizes(DynamicDim("s", 1, 512, ()), steps=4)
    assert all(b / a <= 1.25 for a, b in zip(sizes[10:], sizes[11:]))   # past 24, a call pads at most 25%
    assert all(size % 8 == 0 for size in sizes if size > 8)
    assert [bucket_of(DynamicDim("s", 1, 512, ()), n, steps=4) for n in (200, 384, 420)] == [216, 432, 432]


def test_a_dynamic_model_with_more_bucket_steps_pads_to_the_nearer_bucket():
    model = make(RowWise)
    config = opfuse.FusionConfig(dtype="float32", bucket_steps=2)
    compiled = opfuse.compile(model, (torch.randn(4, 8),), config, dynamic_shapes=({0: Dim("batch", max=16)},))
    check(compiled, model, torch.randn(5, 8))
    assert sorted(compiled.buckets) == [(4,), (6,)]         # 5 padded to 6, not 8


def test_a_row_wise_model_serves_its_range_padding_within_a_bucket():
    model = make(RowWise)
    compiled = opfuse.compile(model, (torch.randn(4, 8),), CONFIG, dynamic_shapes=({0: Dim("batch", max=16)},))
    assert list(compiled.buckets) == [(4,)]                 # the example's bucket, compiled up front
    for batch in (3, 4, 1, 7, 16, 13):
        check(compiled, model, torch.randn(batch, 8))
    assert sorted(compiled.buckets) == [(1,), (4,), (8,), (16,)]   # 3, 7 and 13 ran padded: no bucket of their own
    assert all(not b.exact and "batch" in b.cuts for s, b in compiled.buckets.items() if s != (1,))


def test_a_model_whose_rows_interact_runs_exact_sizes_and_says_why():
    model = make(OverBatch)
    compiled = opfuse.compile(model, (torch.randn(4, 8),), CONFIG, dynamic_shapes=({0: Dim("batch", max=8)},))
    for batch in (3, 4, 5):
        check(compiled, model, torch.randn(batch, 8))
    assert "softmax" in compiled.buckets[(4,)].refused["batch"]
    assert compiled.buckets[(3,)].exact and compiled.buckets[(5,)].exact


def test_two_dims_pad_the_batch_but_not_the_attended_sequence():
    model = make(Attention)
    batch, seq = Dim("batch", max=8), Dim("seq", min=2, max=16)
    compiled = opfuse.compile(model, (torch.randn(2, 4, 8),), CONFIG, dynamic_shapes=({0: batch, 1: seq},))
    bucket = compiled.buckets[(2, 4)]
    assert "batch" in bucket.cuts and "sdpa" in bucket.refused["seq"]
    check(compiled, model, torch.randn(2, 4, 8))
    check(compiled, model, torch.randn(3, 4, 8))              # batch padded to 4 in bucket (4, 4)
    assert not compiled.buckets[(4, 4)].exact and (3, 4) not in compiled.buckets
    check(compiled, model, torch.randn(2, 3, 8))              # the sequence may not be padded: exact sizes
    assert compiled.buckets[(2, 3)].exact


def test_dynamic_shapes_by_argument_name_and_shared_dims():
    class Pair(torch.nn.Module):
        def forward(self, x, y):
            return x * 2.0 + y

    model = make(Pair)
    batch = Dim("batch", max=8)
    compiled = opfuse.compile(model, (torch.randn(2, 3), torch.randn(2, 3)), CONFIG,
                              dynamic_shapes={"x": {0: batch}, "y": {0: batch}})
    check(compiled, model, torch.randn(5, 3), torch.randn(5, 3))
    with pytest.raises(GraphError, match=r"inputs disagree on dynamic dim batch: input 0 \(x\) dim 0 is 5, input 1 "
                                         r"\(y\) dim 0 is 4"):
        compiled(torch.randn(5, 3), torch.randn(4, 3))


@pytest.mark.parametrize("shape, match", [
    ((17, 8), r"input 0 \(x\) has 17 along dim 0, outside batch in \[1, 16\]"),
    ((3, 9), r"input 0 \(x\) has 9 along dim 1, which is fixed at 8"),
    ((3, 8, 1), "the model takes float32\\[4,8\\]"),
])
def test_sizes_outside_the_declared_ranges_are_refused_naming_input_and_range(shape, match):
    compiled = opfuse.compile(make(RowWise), (torch.randn(4, 8),), CONFIG,
                              dynamic_shapes=({0: Dim("batch", max=16)},))
    with pytest.raises(GraphError, match=match):
        compiled(torch.randn(*shape))


@pytest.mark.parametrize("spec, match", [
    (({0: Dim("b", max=2)},), "example input 0 has 4 along dim 0, outside b in \\[1, 2\\]"),
    (({5: Dim("b")},), "no dim 5 in a 2-d input"),
    (({0: 3},), "expected a torch.export.Dim"),
    ({"y": {0: Dim("b")}}, "'y', which is not one of the forward's first 1 arguments"),
    ((None,), "declares no dynamic dim"),
])
def test_a_dynamic_shapes_it_cannot_read_is_refused(spec, match):
    with pytest.raises(GraphError, match=match):
        opfuse.compile(make(RowWise), (torch.randn(4, 8),), CONFIG, dynamic_shapes=spec)


def test_compile_buckets_compiles_every_bucket_up_front():
    model = make(RowWise)
    compiled = opfuse.compile(model, (torch.randn(3, 8),), CONFIG, dynamic_shapes=({0: Dim("batch", max=8)},))
    assert list(compiled.buckets) == [(4,)]                  # the example's bucket, at the bucket's size
    assert compiled.buckets[(4,)].model.compiled.signature[0].type.shape == (4, 8)
    compiled.compile_buckets()
    assert sorted(compiled.buckets) == [(1,), (2,), (4,), (8,)]
    check(compiled, model, torch.randn(6, 8))
    assert sorted(compiled.buckets) == [(1,), (2,), (4,), (8,)]    # nothing compiled at the call


def test_a_dynamic_model_saves_its_buckets_and_loads_serving_its_range(tmp_path):
    model = make(Attention)
    batch, seq = Dim("batch", max=4), Dim("seq", min=2, max=8)
    compiled = opfuse.compile(model, (torch.randn(2, 4, 8),), CONFIG, dynamic_shapes=({0: batch, 1: seq},))
    compiled.compile_buckets({"batch": [4], "seq": [4, 8]})
    compiled(torch.randn(2, 3, 8))                           # an exact-size model, saved too
    path = opfuse.save(compiled, tmp_path / "dynamic.opfuse")
    loaded = opfuse.load(path, "cpu")
    assert [d.name for d in loaded.dims] == ["batch", "seq"]
    assert loaded.sizes_held == sorted(compiled.buckets, key=lambda s: (s[0] * s[1], s))
    for shape in ((2, 4, 8), (3, 4, 8), (1, 8, 8), (2, 3, 8)):
        x = torch.randn(*shape)
        torch.testing.assert_close(loaded(x), compiled(x), rtol=0, atol=0)
    with pytest.raises(GraphError, match=r"sizes \(2, 5\): .* never padded: .*sdpa"):
        loaded(torch.randn(2, 5, 8))                          # no bucket holds seq 5 exactly, and seq is not padded
    with pytest.raises(GraphError, match=r"outside seq in \[2, 8\]"):
        loaded(torch.randn(2, 9, 8))


# ---- torch.compile(backend="opfuse", dynamic=True) and mark_dynamic -------------------------------------------------

@pytest.fixture
def dynamic_models(monkeypatch):
    """Every DynamicModel the backend builds, and dynamo reset before and after (a fresh cache of graphs)."""
    from opfuse.runtime import dynamic

    built = []
    original = dynamic.DynamicModel.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        built.append(self)
    monkeypatch.setattr(dynamic.DynamicModel, "__init__", record)
    torch._dynamo.reset()
    yield built
    torch._dynamo.reset()


def test_the_backend_compiles_dynamos_dynamic_graph_once_into_buckets(dynamic_models):
    from opfuse import backend

    model = make(RowWise)
    backend.last_fallback_reasons.clear()
    fast = torch.compile(model, backend="opfuse", dynamic=True)
    with torch.no_grad():
        for batch in (3, 5, 7, 4):
            x = torch.randn(batch, 8)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert backend.last_fallback_reasons == []
    (compiled,) = dynamic_models                     # one graph for every batch: dynamo did not recompile
    assert [d.uses for d in compiled.dims] == [((0, 0),)]
    assert sorted(compiled.buckets) == [(4,), (8,)]


def test_mark_dynamic_gives_the_range(dynamic_models):
    model = make(RowWise)
    x = torch.randn(6, 8)
    torch._dynamo.mark_dynamic(x, 0, min=2, max=12)
    fast = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    (compiled,) = dynamic_models
    assert (compiled.dims[0].min, compiled.dims[0].max) == (2, 12)


def test_a_float_attribute_dynamo_lifts_is_bound_and_its_change_noticed(dynamic_models):
    """With dynamic=True dynamo passes a norm's eps as a 0-d tensor input: opfuse binds its value (verification's
    random inputs would otherwise draw a negative eps), and a later change of it is never run stale (dynamo
    compiles again, or the backend runs dynamo's graph, warning)."""
    from opfuse import backend

    model = make(RowWise)
    backend.last_fallback_reasons.clear()
    fast = torch.compile(model, backend="opfuse", dynamic=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
        assert backend.last_fallback_reasons == [] and len(dynamic_models) == 1
        model.norm.eps = 0.5
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
