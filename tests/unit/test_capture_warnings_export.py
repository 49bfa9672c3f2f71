"""Capture of forwards that write state or inputs in place (issue 53, items 7 and 9): torch.export lists such writes
in its graph signature once the program is functional. A write to the model's own buffer is refused, naming the
buffer and the node; a write into an input warns, naming the input and the node."""

import warnings

import pytest
import torch
import torch.nn as nn

from opfuse.frontend.torch_export import capture_torch
from opfuse.frontend.torch_translate import InputWrittenWarning
from opfuse.ir.graph import GraphError
from opfuse.ir.interpret import interpret


class CallCounter(nn.Module):
    """Counts its calls in a buffer and scales its output by the count: each eager call differs."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return torch.relu(self.linear(x)) * self.count


class WritesItsSecondInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)

    def forward(self, x, y):
        y.mul_(2)
        return torch.relu(self.linear(x + y))


def test_a_forward_that_writes_its_buffer_is_refused_naming_it_and_its_node():
    with pytest.raises(GraphError, match=r"model CallCounter writes its buffer count \(node add: aten\.add\.Tensor\) "
                                         r"in forward; opfuse compiles stateless forwards") as error:
        capture_torch(CallCounter(), (torch.randn(2, 8),))
    assert "please report" not in str(error.value)


def test_a_forward_that_writes_into_an_input_warns_naming_it_and_computes_the_same_outputs():
    torch.manual_seed(0)
    model = WritesItsSecondInput().eval()
    x, y = torch.randn(2, 8), torch.randn(2, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = capture_torch(model, (x, y))
    written = [w.message for w in caught if issubclass(w.category, InputWrittenWarning)]
    assert [str(w) for w in written] == [
        "opfuse: WritesItsSecondInput writes into its input y in place (node mul: aten.mul.Tensor); the compiled "
        "model computes the same outputs but leaves y as it was"]
    assert written[0].index == 1                        # y is the second input in call order
    (out,) = interpret(graph, [x, y])
    with torch.no_grad():
        expected = model(x, y.clone())
    torch.testing.assert_close(out, expected)

