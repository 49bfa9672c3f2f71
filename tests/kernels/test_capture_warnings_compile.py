"""What a compiled model does not do as eager does, said at compile or call (issue 53, items 7 and 9), through
opfuse.compile and torch.compile(backend="opfuse"), on the CPU (Triton interpreter, tiny shapes)."""

import warnings

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse import backend
from opfuse.frontend.torch_translate import InputWrittenWarning
from opfuse.ir.graph import GraphError

from tests.unit.test_capture_warnings_export import CallCounter


class AddsOneToItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x):
        x.add_(1)
        return torch.relu(self.linear(x))


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test's torch.compile sees no graph of another test's, nor leaves one behind: dynamo would take a model
    class called again at another shape for a dynamic one."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch_norm_mlp() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, 4))
    with torch.no_grad():
        model[1].running_mean.normal_(0, 0.5)
        model[1].running_var.uniform_(0.5, 2.0)
    return model


def messages(caught) -> list[str]:
    return [str(w.message) for w in caught]


def test_a_model_in_training_mode_compiles_as_in_eval_with_one_warning():
    model = batch_norm_mlp().train()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert messages(caught) == [
        "opfuse: Sequential is in training mode; it is compiled in eval mode (dropout off, batch norm on its running "
        "statistics) and keeps its training flag: call model.eval() before compiling it"]
    assert caught[0].filename == __file__             # the warning points at the compile call
    assert model.training and all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model.eval()(x), rtol=1e-5, atol=1e-5)


def test_a_forward_that_writes_into_its_input_warns_and_the_compile_leaves_the_example_as_it_was():
    torch.manual_seed(0)
    model = AddsOneToItsInput().eval()
    x = torch.randn(2, 8)
    example = x.clone()
    with pytest.warns(InputWrittenWarning, match=r"AddsOneToItsInput writes into its input x in place \(node add: "
                                                 r"aten\.add\.Tensor\); the compiled model computes the same outputs "
                                                 r"but leaves x as it was"):
        compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert torch.equal(x, example)                    # the compile's eager run wrote into a copy
    out = compiled(x)
    assert torch.equal(x, example)                    # as the warning says
    with torch.no_grad():
        torch.testing.assert_close(out, model(x.clone()), rtol=1e-5, atol=1e-5)


def test_a_call_with_an_input_that_requires_grad_warns_once_that_outputs_carry_no_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    compiled = opfuse.compile(model, (torch.randn(2, 8),), opfuse.FusionConfig(dtype="float32"))
    x = torch.randn(2, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            compiled(x)                               # no graph wanted: nothing to say
        compiled(torch.randn(2, 8))                   # nothing requires grad
        assert caught == []
        out = compiled(x)
        compiled(x)
    assert messages(caught) == [
        "opfuse: input 0 (input) of Sequential requires grad, but the compiled model computes without autograd (as "
        "under torch.no_grad()): its outputs carry no autograd graph"]
    assert caught[0].filename == __file__ and not out.requires_grad


def test_a_forward_that_writes_its_buffer_is_refused_at_compile_not_reported_as_a_bug():
    with pytest.raises(GraphError, match=r"writes its buffer count \(node add: aten\.add\.Tensor\) in forward; "
                                         r"opfuse compiles stateless forwards"):
        opfuse.compile(CallCounter().eval(), (torch.randn(2, 8),), opfuse.FusionConfig(dtype="float32"))


# ---- torch.compile(backend="opfuse"): dynamo's graph holds the model's mode, and eager's semantics are the promise

def test_the_backend_runs_a_graph_that_writes_into_its_input_as_dynamo_gave_it():
    torch.manual_seed(0)
    model = AddsOneToItsInput().eval()
    reference = AddsOneToItsInput().eval()
    reference.load_state_dict(model.state_dict())
    fast = torch.compile(model, backend="opfuse")
    with torch.no_grad(), pytest.warns(UserWarning, match=r"input 0 \(L_x_\) in place"):
        for seed in range(2):
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(seed))
            mine = x.clone()
            torch.testing.assert_close(fast(x), reference(mine))
            assert torch.equal(x, mine)               # written into, as eager writes into it
    assert any("writes into its input 0 (L_x_)" in reason for reason in backend.last_fallback_reasons)


def test_the_backend_runs_a_batch_norm_in_training_mode_as_dynamo_gave_it_updating_its_statistics():
    model, reference = batch_norm_mlp().train(), batch_norm_mlp().train()
    model[3].p = reference[3].p = 0.0                 # dropout off: the outputs are comparable
    fast = torch.compile(model, backend="opfuse")
    with torch.no_grad(), pytest.warns(UserWarning, match=r"writes its buffer .*running_mean"):
        for seed in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(fast(x), reference(x))
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(model.get_buffer(name), buffer)


def test_the_backend_warns_in_grad_mode_that_outputs_carry_no_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval()
    fast = torch.compile(model, backend="opfuse")
    x = torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fast(x)
        fast(x)
    assert messages(caught) == [
        "opfuse backend: L_fn_modules_0_parameters_weight_ requires grad and grad mode is on, but the compiled graph "
        "computes without autograd: its outputs carry no autograd graph (call the model under torch.no_grad() or "
        "torch.inference_mode())"]
    assert not out.requires_grad
