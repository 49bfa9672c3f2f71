"""A model that overflows float16 in eager too: infinities where the float32 reference is finite. The compiled model
must be infinite at eager's positions and within the tolerance elsewhere (a warning that names the overflow);
matching eager's error of inf alone proves nothing (inf is within any margin of inf)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.ir.graph import GraphError
from opfuse.verification import _overflow_verdict


class Overflows(nn.Module):
    """relu(linear(|x| + 1)) with weights of 3e4: every output past 4.8e5, float16's largest 65504."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 8)
        with torch.no_grad():
            self.linear.weight.fill_(3e4)
            self.linear.bias.zero_()

    def forward(self, x):
        return torch.relu(self.linear(x.abs() + 1.0))


def test_a_model_that_overflows_float16_in_eager_compiles_with_a_warning_that_says_so():
    model = Overflows().eval()
    x = torch.randn(4, 16)
    with pytest.warns(UserWarning, match="overflows float16: its output is infinite or NaN where the float32"):
        compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float16"))
    with torch.no_grad():
        assert torch.isinf(model.half()(x.half())).all() and torch.isinf(compiled(x)).all()


def test_outputs_that_overflow_unlike_eagers_are_an_error():
    with pytest.warns(UserWarning, match="overflows float16"):
        _overflow_verdict("m", "float16", 1e-4, 1e-2)
    with pytest.raises(GraphError, match="both overflow float16 .* but not alike: relative error inf"):
        _overflow_verdict("m", "float16", math.inf, 1e-2)
