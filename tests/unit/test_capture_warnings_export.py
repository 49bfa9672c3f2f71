"""Capture of forwards that write their own state (issue 53, item 9): torch.export lists such writes in its graph
signature once the program is functional. A write to the model's own buffer is refused, naming the buffer and the
node."""

import pytest
import torch
import torch.nn as nn

from opfuse.frontend.torch_export import capture_torch
from opfuse.ir.graph import GraphError


class CallCounter(nn.Module):
    """Counts its calls in a buffer and scales its output by the count: each eager call differs."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count += 1
        return torch.relu(self.linear(x)) * self.count


def test_a_forward_that_writes_its_buffer_is_refused_naming_it_and_its_node():
    with pytest.raises(GraphError, match=r"model CallCounter writes its buffer count \(node add: aten\.add\.Tensor\) "
                                         r"in forward; opfuse compiles stateless forwards") as error:
        capture_torch(CallCounter(), (torch.randn(2, 8),))
    assert "please report" not in str(error.value)

