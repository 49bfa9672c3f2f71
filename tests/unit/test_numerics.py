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


class _Recording:
    """A stand-in kernel for `check_groups`: returns its group's reference output, recording its arguments."""

    def __init__(self, graph, output: str, inputs: list[str]):
        self.name, self.runtime_inputs, self.graph = "recording", inputs, graph
        self.group = type("Group", (), {"outputs": [output], "nodes": [output]})()
        self.args: list[torch.Tensor] = []

    def run(self, args, config=None):
        self.args = list(args)
        return [interpret_all(self.graph, [a.float() for a in args], torch.float32)[self.group.outputs[0]]]


def test_check_groups_lays_each_input_out_as_the_model_does():
    """A kernel is checked on its inputs in the compiled model's layout (strides, storage offset): ConvNeXt's
    permuted image, [N, H, W, C] dense, which made channels-last would be another layout, another Triton
    specialisation compiled during verification and checked instead of the one that runs."""
    from opfuse.numerics import Layout, check_groups

    b = Builder()
    x = b.input("x", (2, 5, 5, 8), value=torch.randn(2, 8, 5, 5).permute(0, 2, 3, 1))
    y = b.op("relu", x)
    kernel = _Recording(b.graph, y, [x])
    storage = torch.empty(2 * 5 * 5 * 8 + 8)[8:].as_strided((2, 5, 5, 8), (200, 40, 8, 1))   # offset 8 elements
    layouts = {x: Layout.of(storage)}
    (check,) = check_groups(b.graph, {"g": kernel}, [b.feeds[x]], "float32", layouts=layouts)
    assert check.passed
    (arg,) = kernel.args
    assert arg.stride() == (200, 40, 8, 1) and arg.storage_offset() == 8
    torch.testing.assert_close(arg, b.feeds[x])
    check_groups(b.graph, {"g": kernel}, [b.feeds[x]], "float32")     # no layouts: 4-D values channels-last
    assert kernel.args[0].is_contiguous(memory_format=torch.channels_last)
    broadcast = Layout.of(torch.zeros(8).expand(2, 5, 5, 8))      # overlapping elements: channels-last instead
    check_groups(b.graph, {"g": kernel}, [b.feeds[x]], "float32", layouts={x: broadcast})
    assert kernel.args[0].is_contiguous(memory_format=torch.channels_last)


def test_the_compile_reads_its_values_layouts_from_the_model():
    """The layouts verification hands `check_groups` are those of the values the compiled model runs on."""
    import torch.nn as nn

    import opfuse
    from opfuse.compiler import _layouts
    from opfuse.numerics import Layout

    class Permuted(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(self.conv(x).permute(0, 2, 3, 1))

    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    compiled = opfuse.compile(Permuted().eval(), (x,), opfuse.FusionConfig(dtype="float32", verify=False))
    inner = compiled.compiled
    layouts = _layouts(inner, [x])
    values = inner.collect_values(x)
    read = {name for kernel in inner.kernels.values() for name in kernel.runtime_inputs}
    assert read and all(layouts[name] == Layout.of(values[name]) for name in read)
