"""The reference runs of verification: convolutions without cuDNN, the setting restored after."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from opfuse.numerics import interpret_all, reference_convolutions

from tests.kernels.test_conv_kernels import Builder


class CudnnSeen(TorchFunctionMode):
    """Records (input dtype, groups, whether cuDNN is on) of each convolution call that reaches it: entered before
    `reference_convolutions`, it sees each call after that has set cuDNN for it."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.dtype, int, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.conv2d:
            groups = kwargs.get("groups", args[6] if len(args) > 6 else 1)
            self.calls.append((args[0].dtype, groups, torch.backends.cudnn.enabled))
        return func(*args, **kwargs)


def test_reference_convolutions_turn_cudnn_off_but_for_grouped_ones():
    """Dense and depthwise convolutions run without cuDNN, grouped ones (PyTorch's own kernels would loop over the
    groups) with it; every setting is back after, an exception too."""
    x = torch.randn(1, 8, 5, 5)
    saved = torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark
    try:
        torch.backends.cudnn.enabled = torch.backends.cudnn.benchmark = True
        with CudnnSeen() as seen, reference_convolutions():
            assert torch.backends.cudnn.benchmark is False
            for groups in (1, 8, 2):
                torch.nn.functional.conv2d(x, torch.randn(8, 8 // groups, 3, 3), groups=groups)
        assert [(groups, on) for _, groups, on in seen.calls] == [(1, False), (8, False), (2, True)]
        assert torch.backends.cudnn.enabled is True and torch.backends.cudnn.benchmark is True
        with pytest.raises(RuntimeError), reference_convolutions():
            raise RuntimeError("a reference op failed")
        assert torch.backends.cudnn.enabled is True and torch.backends.cudnn.benchmark is True
    finally:
        torch.backends.cudnn.enabled, torch.backends.cudnn.benchmark = saved


def test_reference_convolutions_take_their_operands_by_keyword():
    """transformers' causal conv1d fallback (Mamba) names its input and weight: the mode reads them so."""
    x, weight = torch.randn(1, 6, 9), torch.randn(6, 1, 4)
    with reference_convolutions():
        got = torch.nn.functional.conv1d(input=x, weight=weight, bias=None, padding=3, groups=6)
        grouped = torch.nn.functional.conv1d(input=x, weight=torch.randn(6, 3, 4), groups=2)
    torch.testing.assert_close(got, torch.nn.functional.conv1d(x, weight, None, 1, 3, 1, 6))
    assert grouped.shape == (1, 6, 6)


def test_interpret_all_runs_convolutions_without_cudnn():
    """The float32 reference's depthwise convolutions see cuDNN off (its first call of such a shape costs seconds
    on a GPU); the values are the convolution's."""
    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    y = b.conv(x, 4, 3, padding=1, groups=4)
    with CudnnSeen() as seen:
        values = interpret_all(b.graph, [b.feeds["x"]], torch.float64)
    assert seen.calls == [(torch.float64, 4, False)] and torch.backends.cudnn.enabled
    weight, bias = (b.graph.constants[name].double() for name in b.graph[y].inputs[1:])
    expected = torch.nn.functional.conv2d(b.feeds["x"].double(), weight, bias, padding=1, groups=4)
    torch.testing.assert_close(values[y], expected)


def test_the_reference_loop_calls_after_node_once_a_node_is_computed():
    """`_interpret_all`'s hook (benchmarks/reference_time.py times ops with it) sees every node but the inputs, in
    graph order, and the values are interpret_all's."""
    from opfuse.numerics import _interpret_all

    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    y = b.op("relu", b.conv(x, 4, 3, padding=1))
    seen: list[str] = []
    values = _interpret_all(b.graph, [b.feeds["x"]], torch.float64, lambda node: seen.append(node.name))
    assert seen == [node.name for node in b.graph if node.op != "input"] and seen[-1] == y
    torch.testing.assert_close(values[y], interpret_all(b.graph, [b.feeds["x"]], torch.float64)[y])


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
    windows = torch.arange(2.0 * 5 * 5 * 8 + 8).unfold(0, 400, 8)[:1].as_strided((2, 5, 5, 8), (8, 40, 8, 1))
    for overlapping in (torch.zeros(8).expand(2, 5, 5, 8), windows):    # some elements twice: channels-last
        assert Layout.of(overlapping).overlaps()
        check_groups(b.graph, {"g": kernel}, [b.feeds[x]], "float32", layouts={x: Layout.of(overlapping)})
        assert kernel.args[0].is_contiguous(memory_format=torch.channels_last)
        torch.testing.assert_close(kernel.args[0], b.feeds[x])
    assert not Layout.of(storage).overlaps() and not Layout.of(torch.empty(2, 8, 5, 5).permute(0, 2, 3, 1)).overlaps()


def test_the_compile_reads_its_values_layouts_from_the_model():
    """The layouts verification hands `check_groups` are those of the values the compiled model runs on."""
    import torch.nn as nn

    import opfuse
    from opfuse.verification import layouts_of
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
    layouts = layouts_of(inner, [x])
    values = inner.collect_values(x)
    read = {name for kernel in inner.kernels.values() for name in kernel.runtime_inputs}
    assert read and all(layouts[name] == Layout.of(values[name]) for name in read)


def test_the_check_rule_weighs_pytorchs_error_then_the_operands_scale():
    """`acceptable`: within the tolerance; else within EAGER_ERROR_MARGIN of PyTorch's own error; else, only where
    PyTorch is over the tolerance too (an ill-conditioned output), within it against the operands' scale."""
    from opfuse.numerics import EAGER_ERROR_MARGIN, acceptable

    assert acceptable(1e-5, 1e-4)
    assert not acceptable(1e-3, 1e-4)                                   # nothing to weigh it against
    assert acceptable(EAGER_ERROR_MARGIN * 1e-2, 1e-4, eager_error=1e-2)
    assert not acceptable(3e-2, 1e-4, eager_error=1e-2, scaled_error=1e-3)
    assert acceptable(3e-2, 1e-4, eager_error=1e-2, scaled_error=1e-6)
    assert not acceptable(3e-4, 1e-4, eager_error=5e-5, scaled_error=1e-6)   # PyTorch gets it right: so must we
    assert not acceptable(float("inf"), 1e-2, eager_error=float("inf"))        # both overflow: judged elsewhere


def test_the_operand_scale_is_that_of_the_values_an_output_is_computed_from():
    """The mean of a normalised row is rounding noise around 0, computed from values of root mean square 1: its
    scale is theirs at its own size, found through the view after it; an input has none."""
    import math

    from opfuse.numerics import operand_scale, relative_error
    from tests.kernels.builders import KernelGraph

    k = KernelGraph()
    x = k.input("x", (4, 6, 8))
    norm = k.op("layer_norm", x, normalized_shape=(8,), eps=1e-5)
    mean = k.op("mean", norm, dims=(-1,), keepdim=False)
    flat = k.op("reshape", mean, shape=(24,))
    values = interpret_all(k.graph, [k.feeds["x"]], torch.float64)
    assert float(values[flat].abs().max()) < 1e-12
    scale = operand_scale(k.graph, values, flat)
    assert scale == pytest.approx(math.sqrt(24), rel=1e-3)
    assert operand_scale(k.graph, values, x) == 0.0
    noise = values[flat] + 1e-7      # float32's rounding, about
    assert relative_error(noise, values[flat]) > 1e4 and relative_error(noise, values[flat], scale) < 1e-6


def test_the_checks_keep_a_reference_value_only_while_something_reads_it():
    """A chain of four relus, each its own kernel: each check runs once its input and output are computed, each value
    goes once the next node and check have read it, so at most two values live at once (not all five); the checks
    come back in the kernels' order, each against the right reference."""
    from opfuse.numerics import check_groups, check_needs, reference_peak, reference_schedule

    b = Builder()
    chain = [b.input("x", (1, 4, 5, 5))]
    for _ in range(4):
        chain.append(b.op("relu", b.op("neg", chain[-1])))
    kernels = {}
    for k in range(4, 0, -1):       # the kernels' order is not the graph's
        kernels[f"g{k}"] = _Recording(b.graph, chain[k], [chain[k - 1]])
        kernels[f"g{k}"].group.nodes = [b.graph[chain[k]].inputs[0], chain[k]]
    needs = {name: check_needs(b.graph, kernel.group) | set(kernel.runtime_inputs) for name, kernel in kernels.items()}
    position = {node.name: i for i, node in enumerate(b.graph)}
    schedule = reference_schedule(b.graph, needs)
    assert schedule.ready == {position[chain[k]]: [f"g{k}"] for k in range(4, 0, -1)}
    # x and the first neg go once g1 has checked relu 1
    assert sorted(schedule.free[position[chain[1]]]) == sorted([chain[0], b.graph[chain[1]].inputs[0]])
    assert reference_peak(b.graph, needs, lambda node: 1) == 3      # a relu's input, its neg and the relu
    checks = check_groups(b.graph, kernels, [b.feeds["x"]], "float32")
    assert [c.group for c in checks] == ["g4", "g3", "g2", "g1"] and all(c.passed for c in checks)
    reference = interpret_all(b.graph, [b.feeds["x"]], torch.float32)
    assert all(torch.equal(kernels[f"g{k}"].args[0], reference[chain[k - 1]]) for k in range(1, 5))
