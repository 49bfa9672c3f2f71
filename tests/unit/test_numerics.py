"""The reference runs of verification: convolutions without cuDNN, the setting restored after."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from opfuse.ir import ops
from opfuse.numerics import interpret_all, reference_convolutions

from tests.kernels.test_conv_kernels import Builder


def test_reference_convolutions_turn_cudnn_off_and_restore_it():
    saved = torch.backends.cudnn.enabled
    try:
        for before in (True, False):
            torch.backends.cudnn.enabled = before
            with reference_convolutions():
                assert torch.backends.cudnn.enabled is False
            assert torch.backends.cudnn.enabled is before
        torch.backends.cudnn.enabled = True
        with pytest.raises(RuntimeError), reference_convolutions():
            raise RuntimeError("a reference op failed")
        assert torch.backends.cudnn.enabled is True
    finally:
        torch.backends.cudnn.enabled = saved


def test_interpret_all_runs_convolutions_without_cudnn(monkeypatch):
    """The float32 reference's convolutions see cuDNN off (its first call of a depthwise shape costs seconds on a
    GPU); the values are the convolution's."""
    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    y = b.conv(x, 4, 3, padding=1, groups=4)
    conv = ops.REGISTRY["conv2d"]
    seen = []

    def run(inputs, attrs):
        seen.append(torch.backends.cudnn.enabled)
        return conv.run(inputs, attrs)

    monkeypatch.setitem(ops.REGISTRY, "conv2d", dataclasses.replace(conv, run=run))
    values = interpret_all(b.graph, [b.feeds["x"]], torch.float64)
    assert seen == [False] and torch.backends.cudnn.enabled
    weight, bias = (b.graph.constants[name].double() for name in b.graph[y].inputs[1:])
    expected = torch.nn.functional.conv2d(b.feeds["x"].double(), weight, bias, padding=1, groups=4)
    torch.testing.assert_close(values[y], expected)
