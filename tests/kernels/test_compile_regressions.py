"""Regressions found in review: nested outputs in verification, fallback="error" with recompile, kernels returning
too few outputs, and dynamo weights changed after compiling. CPU only (Triton interpreter), tiny models."""

import warnings

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse import backend
from opfuse.numerics import check_groups, random_inputs_like, relative_error

F32 = opfuse.FusionConfig(dtype="float32")


class NestedOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return torch.relu(y), (y * 2.0, {"shifted": y + 1.0})


def small_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).eval()


def test_nested_outputs_are_verified_and_returned_in_the_same_structure():
    torch.manual_seed(0)
    model = NestedOutputs().eval()
    x = torch.randn(2, 4)
    compiled = opfuse.compile(model, (x,), F32)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert isinstance(got, tuple) and isinstance(got[1], tuple) and set(got[1][1]) == {"shifted"}
    assert relative_error(got[1][1]["shifted"], want[1][1]["shifted"]) < 1e-5
    assert relative_error(got[1][0], want[1][0]) < 1e-5
    assert compiled.end_to_end_error is not None and compiled.end_to_end_error < 1e-4


def test_recompile_without_fallback_eager_raises_when_the_compiled_model_fails():
    x = torch.randn(2, 4)
    compiled = opfuse.compile(small_mlp(), (x,), opfuse.FusionConfig(dtype="float32", recompile=True))

    class Broken(nn.Module):
        signature = compiled.compiled.signature
        fallbacks: dict = {}

        def run_matching(self, inputs):     # what OpfuseModule calls for inputs it has checked
            raise RuntimeError("kernel exploded")

    compiled.compiled = Broken()
    with pytest.raises(RuntimeError, match="kernel exploded"):
        compiled(x)
    assert not compiled.call_fallbacks


def test_a_kernel_returning_the_wrong_number_of_outputs_fails_its_check():
    x = torch.randn(2, 4)
    compiled = opfuse.compile(small_mlp(), (x,), opfuse.FusionConfig(dtype="float32", verify=False))
    name, kernel = next(iter(compiled.compiled.kernels.items()))
    original = kernel.run
    kernel.run = lambda inputs, config=None: list(original(inputs, config)) + [torch.zeros(1)]   # one extra
    checks = check_groups(compiled.analysis.prepared, {name: kernel}, random_inputs_like([x]), "float32")
    assert not checks[0].passed and "outputs" in checks[0].detail
    kernel.run = lambda inputs, config=None: []                                                  # none at all
    checks = check_groups(compiled.analysis.prepared, {name: kernel}, random_inputs_like([x]), "float32")
    assert not checks[0].passed and "outputs" in checks[0].detail


def test_torch_compile_backend_never_runs_stale_weights():
    torch._dynamo.reset()
    model = small_mlp()
    x = torch.randn(2, 4)
    fn = torch.compile(model, backend="opfuse")
    with torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error")   # unchanged weights: the compiled graph runs, no fallback warning
            assert relative_error(fn(x), model(x)) < 1e-5
        model[0].weight.mul_(2.0)           # in place: dynamo does not recompile for it
        with pytest.warns(UserWarning, match="changed since compiling"):
            out = fn(x)
        assert relative_error(out, model(x)) < 1e-5
        model.load_state_dict(small_mlp().state_dict() | {"2.bias": torch.ones(3)})
        assert relative_error(fn(x), model(x)) < 1e-5
    assert any("changed since compiling" in reason for reason in backend.last_fallback_reasons)
    torch._dynamo.reset()
