"""A forward that writes its own state, refused by opfuse.compile and run as dynamo gave it by
torch.compile(backend="opfuse") (issue 53, item 9), on the CPU (Triton interpreter, tiny shapes)."""

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse import backend
from opfuse.ir.graph import GraphError

from tests.unit.test_capture_warnings_export import CallCounter


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


def test_a_forward_that_writes_its_buffer_is_refused_at_compile_not_reported_as_a_bug():
    with pytest.raises(GraphError, match=r"writes its buffer count \(node add: aten\.add\.Tensor\) in forward; "
                                         r"opfuse compiles stateless forwards"):
        opfuse.compile(CallCounter().eval(), (torch.randn(2, 8),), opfuse.FusionConfig(dtype="float32"))


# ---- torch.compile(backend="opfuse"): dynamo's graph holds the model's mode

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

