"""The squeeze-and-excitation squeeze kernel (global average pool -> GEMM + activation -> GEMM + sigmoid in one
launch, `opfuse.codegen.squeeze`) on Triton's interpreter.

Each test builds the chain by hand, lowers it as one SQUEEZE group, runs every config (the split form with its
atomics and tickets, the plain form) twice on NaN-poisoned outputs and compares with the float32 reference; the
workspace must be zero after each call (what the next call and a CUDA graph replay need), the re-run bit-identical.
With OPFUSE_GPU_TESTS=1 the same tests run on the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from opfuse.codegen.base import FORM_SEPARATE, FORM_UNFUSED
from opfuse.codegen.squeeze import SqueezeKernel, lower_squeeze_group
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.squeeze import MAX_HIDDEN, SqueezeChain, fitting_resources, squeeze_chain
from opfuse.hardware import get_hardware

from tests.kernels.builders import KernelGraph

DEVICE = "cuda" if os.environ.get("OPFUSE_GPU_TESTS") == "1" else "cpu"
H200 = get_hardware("h200")


class Builder(KernelGraph):
    default_kind = GroupKind.SQUEEZE


def se_chain(b: Builder, batch: int, channels: int, hidden: int, size: tuple[int, int], activation: str = "silu",
             channels_last: bool = True, linear: bool = False) -> str:
    """pool -> 1x1 conv (or linear) + bias + activation -> 1x1 conv (or linear) + bias -> sigmoid; its output."""
    value = b.random(batch, channels, *size)
    x = b.input("x", (batch, channels, *size),
                value.to(memory_format=torch.channels_last) if channels_last else value.contiguous())
    if linear:
        pooled = b.op("mean", x, dims=[2, 3], keepdim=False)
        first = b.op("linear", pooled, b.const("w1", b.random(hidden, channels) * 0.5), b.const("b1", b.random(hidden)))
    else:
        pooled = b.op("adaptive_avg_pool2d", x, output_size=(1, 1))
        conv = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
        first = b.op("conv2d", pooled, b.const("w1", b.random(hidden, channels, 1, 1) * 0.5),
                     b.const("b1", b.random(hidden)), **conv)
    hidden_value = b.op(activation, first)
    if linear:
        second = b.op("linear", hidden_value, b.const("w2", b.random(channels, hidden)),
                      b.const("b2", b.random(channels)))
    else:
        second = b.op("conv2d", hidden_value, b.const("w2", b.random(channels, hidden, 1, 1)),
                      b.const("b2", b.random(channels)), **conv)
    return b.op("sigmoid", second)


def run_every_config(b: Builder, output: str) -> SqueezeKernel:
    """Every Triton config twice, then the separate and unfused forms: all checked; the workspace zero after."""
    kernel = lower_squeeze_group(b.graph, b.group([output]), DEVICE, H200)
    kernel.output_fill = float("nan")
    inputs = [b.feeds[name].to(DEVICE) for name in kernel.runtime_inputs]
    assert [c["SPLIT"] for c in kernel.configs()][-1] == 0      # the plain form is one of them
    for config in kernel.configs():
        first = kernel.run(inputs, config)
        b.check([output], first)
        assert not kernel.sums.any() and not kernel.tickets.any(), config
        again = kernel.run(inputs, config)
        assert torch.equal(first[0], again[0]), config              # the second call starts from zero too
    for config in kernel.alternatives():
        b.check([output], kernel.run(inputs, config))
    return kernel


@pytest.mark.parametrize("batch,channels,hidden,size,activation,channels_last", [
    (1, 6, 2, (3, 5), "silu", True),
    (3, 10, 3, (7, 7), "relu", True),
    (1, 10, 3, (7, 7), "silu", False),
    (3, 6, 2, (3, 5), "relu", False),
])
def test_squeeze_matches_the_reference(batch, channels, hidden, size, activation, channels_last):
    b = Builder()
    kernel = run_every_config(b, se_chain(b, batch, channels, hidden, size, activation, channels_last))
    assert kernel.launches() == 1 and kernel.launches(kernel.alternatives()[0]) == 3
    split = kernel.configs()[0]
    assert split["SPLIT"] > 1 and -(-channels // split["BLOCK_C"]) > 1   # several slices and channel blocks


def test_squeeze_of_a_mean_and_linears():
    b = Builder()
    run_every_config(b, se_chain(b, 2, 10, 3, (3, 5), "relu", linear=True))


def test_squeeze_in_float16():
    b = Builder("float16")
    run_every_config(b, se_chain(b, 2, 6, 3, (7, 7), "silu"))


def test_chain_recognised_by_kinds_and_shapes():
    b = Builder()
    output = se_chain(b, 1, 10, 3, (7, 7))
    group = b.group([output])
    chain = squeeze_chain(b.graph, group.nodes, b.graph.users())
    assert isinstance(chain, SqueezeChain)
    assert (chain.batch, chain.channels, chain.hidden, chain.spatial) == (1, 10, 3, 49)
    assert fitting_resources(chain, H200, "float16").fits


def test_an_epilogue_reading_an_activation_is_no_squeeze():
    b = Builder()
    x = b.input("x", (1, 6, 3, 3))
    pooled = b.op("adaptive_avg_pool2d", x, output_size=(1, 1))
    conv = {"stride": (1, 1), "padding": (0, 0), "dilation": (1, 1), "groups": 1}
    first = b.op("relu", b.op("conv2d", pooled, b.const("w1", b.random(2, 6, 1, 1)), **conv))
    second = b.op("conv2d", first, b.const("w2", b.random(6, 2, 1, 1)), **conv)
    other = b.input("other", (1, 6, 1, 1))
    out = b.op("mul", b.op("sigmoid", second), other)
    chain = squeeze_chain(b.graph, b.group([out]).nodes, b.graph.users())
    assert isinstance(chain, Reason) and chain.code is Code.NOT_SQUEEZE


def test_a_hidden_vector_past_the_bound_is_over_budget():
    b = Builder()
    output = se_chain(b, 1, 4, MAX_HIDDEN * 2, (2, 2))
    chain = squeeze_chain(b.graph, b.group([output]).nodes, b.graph.users())
    resources = fitting_resources(chain, H200, "float16")
    assert not resources.fits and "hidden channels" in resources.reason


def test_forms_are_named():
    b = Builder()
    kernel = lower_squeeze_group(b.graph, b.group([se_chain(b, 1, 6, 2, (3, 3))]), DEVICE, H200)
    assert [c.form for c in kernel.alternatives()] == [FORM_SEPARATE, FORM_UNFUSED]
    assert [c.form for c in kernel.alternatives(library=False)] == [FORM_SEPARATE]
    assert kernel.launches(kernel.alternatives()[1]) == 5        # pool, conv, silu, conv, sigmoid through PyTorch
