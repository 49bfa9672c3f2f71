"""Elementwise group kernels (pointwise chains, horizontal groups) on Triton's interpreter.

Each test builds a tiny graph by hand, lowers it as one fusion group, runs the kernel on NaN-poisoned outputs and
compares every group output with the IR reference interpreter run in float32. With OPFUSE_GPU_TESTS=1 the same
tests run compiled on the GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.expr import Unsupported
from opfuse.codegen.pointwise import lower_pointwise_group
from opfuse.fusion.plan import GroupKind
from opfuse.ir.graph import GraphError

from tests.kernels.builders import KernelGraph

DEVICE = "cuda" if os.environ.get("OPFUSE_GPU_TESTS") == "1" else "cpu"
# masked-off lanes of the interpreter may compute inf/NaN that is never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class Builder(KernelGraph):
    default_kind = GroupKind.POINTWISE


def run_group(builder: Builder, outputs: list[str], kind: GroupKind = GroupKind.POINTWISE,
              config: KernelConfig | None = None):
    """Lower, run with NaN-poisoned outputs, check against the float32 reference; returns (kernel, results)."""
    group = builder.group(outputs, kind)
    kernel = lower_pointwise_group(builder.graph, group, DEVICE)
    kernel.output_fill = float("nan")
    results = kernel.run([builder.feeds[name].to(DEVICE) for name in kernel.runtime_inputs], config)
    assert kernel.last_compiled is not None
    builder.check(outputs, results)
    return kernel, results


def test_add_relu_mul_with_channel_constant_on_channels_last_input():
    b = Builder()
    x = b.input("x", (2, 5, 6, 7))                      # 420 elements: not a multiple of the block
    y = b.op("add", x, b.const("shift", b.random(5, 1, 1)))
    y = b.op("relu", y)
    y = b.op("mul", y, b.const("scale", torch.tensor(1.5)))
    kernel, (out,) = run_group(b, [y])
    assert out.is_contiguous(memory_format=torch.channels_last)   # layout of the largest input
    assert len(kernel.args.inputs) == 2                 # the one-element scale is a literal, not a parameter
    run_group(b, [y], config=KernelConfig.of(BLOCK=64, num_warps=1))   # many programs


def test_contiguous_input_gives_contiguous_output():
    b = Builder()
    x = b.input("x", (2, 3, 4, 5), b.random(2, 3, 4, 5))
    _, (out,) = run_group(b, [b.op("relu", x)])
    assert out.is_contiguous()


@pytest.mark.parametrize("op,attrs", [
    ("sigmoid", {}), ("silu", {}), ("gelu", {"approximate": "tanh"}), ("gelu", {"approximate": "none"}),
    ("hardswish", {}), ("clamp", {"min": -0.5, "max": 0.75}), ("tanh", {}), ("hardsigmoid", {}),
])
def test_activation(op, attrs):
    b = Builder()
    x = b.input("x", (3, 7, 11), b.random(3, 7, 11) * 3)
    run_group(b, [b.op(op, x, **attrs)], GroupKind.SINGLE)


def test_exact_gelu_is_close_to_float64_elementwise_tail_included():
    """GELU(x) = x·Φ(x) through the erfc fit (`opfuse.codegen.expr._normal_cdf`): every element within 2e-5 of
    GELU in float64 (as x·erfc(-x/√2)/2), relative, from -9 to 9; float32's 0.5·x·(1 + erf(x/√2)) (eager's formula)
    is 0 below about -5.8, where GELU is not (it is -1e-18 at -9)."""
    b = Builder()
    values = torch.cat([torch.linspace(-9.0, 9.0, 1200), torch.tensor([0.0, -1e-30, 1e-30, -1e-3, 1e-3])])
    x = b.input("x", tuple(values.shape), values)
    _, (out,) = run_group(b, [b.op("gelu", x)], GroupKind.SINGLE)
    exact = values.double() * 0.5 * torch.special.erfc(-values.double() / math.sqrt(2.0))
    assert (exact[:1200] != 0).all() and (torch.nn.functional.gelu(values)[:200] == 0).any()
    relative = (out.double().cpu() - exact).abs() / exact.abs().clamp_min(1e-300)
    assert relative[exact != 0].max() < 2e-5
    assert out[1200] == 0


def test_activation_chain():
    b = Builder()
    y = b.input("x", (4, 6, 5, 3))
    for op, attrs in [("silu", {}), ("gelu", {"approximate": "tanh"}), ("hardswish", {}),
                      ("clamp", {"min": -1.0, "max": 2.0}), ("gelu", {}), ("sigmoid", {})]:
        y = b.op(op, y, **attrs)
    run_group(b, [y])


def test_pow_with_constant_exponents():
    """GELU-tanh's x + 0.044715 x^3 (GPT-2) and RMSNorm's x^2 (T5), negative bases included; x^-1 and x^0.5."""
    b = Builder()
    x = b.input("x", (3, 7, 11), b.random(3, 7, 11) * 2)
    cube = b.op("pow", x, b.const("three", torch.tensor(3.0)))
    gelu_inner = b.op("add", x, b.op("mul", cube, b.const("c", torch.tensor(0.044715))))
    square = b.op("pow", x, b.const("two", torch.tensor(2.0)))
    away = b.op("add", b.op("abs", x), b.const("half", torch.tensor(0.5)))
    inverse = b.op("pow", away, b.const("minus_one", torch.tensor(-1.0)))
    root = b.op("pow", away, b.const("one_half", torch.tensor(0.5)))
    run_group(b, [gelu_inner, square, inverse, root])


def test_pow_special_values_follow_pytorch():
    """Odd and even integer powers of negative bases, a fractional power of one (NaN), zero bases, x^0 = 1 (NaN
    base included), a tensor exponent."""
    base = torch.tensor([-2.0, -2.0, -0.5, 0.0, 0.0, 0.0, 2.0, float("nan"), -3.0, 1.5])
    exponent = torch.tensor([3.0, 2.0, 0.5, 2.0, -1.0, 0.0, -2.5, 0.0, 0.0, 1.25])
    b = Builder()
    y = b.op("pow", b.input("x", (10,), base), b.input("e", (10,), exponent))
    group = b.group([y])
    kernel = lower_pointwise_group(b.graph, group, DEVICE)
    (out,) = kernel.run([b.feeds[name].to(DEVICE) for name in kernel.runtime_inputs])
    torch.testing.assert_close(out.cpu(), torch.pow(base, exponent), equal_nan=True, rtol=1e-5, atol=0)


def test_batch_norm_relu():
    b = Builder()
    x = b.input("x", (2, 6, 5, 5))
    stats = [b.const(name, tensor) for name, tensor in [
        ("weight", b.random(6)), ("bias", b.random(6)), ("mean", b.random(6)), ("var", b.random(6).abs() + 0.5)]]
    y = b.op("batch_norm", x, *stats, eps=1e-5)
    run_group(b, [b.op("relu", y)])


def test_cast_to_float16():
    b = Builder()
    x = b.input("x", (3, 17))
    y = b.op("cast", b.op("relu", x), dtype="float16")
    _, (out,) = run_group(b, [y])
    assert out.dtype == torch.float16


def test_float16_chain():
    b = Builder("float16")
    x = b.input("x", (2, 8, 3, 5))
    y = b.op("add", x, b.input("skip", (2, 8, 3, 5)))
    run_group(b, [b.op("silu", b.op("mul", y, b.const("w", b.random(8, 1, 1))))])


def test_permuted_and_channel_slice_inputs():
    b = Builder()
    transposed = b.input("t", (4, 6, 5), b.random(5, 6, 4).permute(2, 1, 0))
    other = b.input("o", (4, 6, 5))
    run_group(b, [b.op("sub", transposed, other)])

    b = Builder()
    wide = b.random(2, 16, 5, 5).to(memory_format=torch.channels_last)
    x = b.input("x", (2, 8, 5, 5), wide[:, 4:12])      # a channel slice: strided, channels adjacent
    _, (out,) = run_group(b, [b.op("relu", x)])
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_view_nodes_inside_the_group():
    b = Builder()
    x = b.input("x", (2, 3, 4))
    y = b.op("permute", x, dims=[0, 2, 1])              # [2, 4, 3]
    y = b.op("add", y, b.input("y", (2, 4, 3)))
    y = b.op("reshape", y, shape=[2, 12])
    z = b.op("slice", b.input("w", (2, 20)), dim=1, start=2, end=14)
    run_group(b, [b.op("mul", y, z)])


def test_concat_and_channel_shuffle_in_one_kernel():
    """ShuffleNet's unit tail: cat(passthrough, branch) then view, transpose, view; odd channel counts."""
    b = Builder()
    wide = b.random(2, 6, 3, 5).to(memory_format=torch.channels_last)
    passthrough = b.input("x1", (2, 3, 3, 5), wide[:, 3:])           # a channel slice of the previous output
    branch = b.input("x2", (2, 3, 3, 5))
    joined = b.op("cat", passthrough, branch, dim=1)
    grouped = b.op("reshape", joined, shape=[2, 2, 3, 3, 5])
    shuffled = b.op("reshape", b.op("permute", grouped, dims=[0, 2, 1, 3, 4]), shape=[2, 6, 3, 5])
    kernel, (out,) = run_group(b, [shuffled])
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert [s for _, s in kernel.spaces] == [None]     # the shuffle reads the cat elsewhere: walked whole
    run_group(b, [shuffled], config=KernelConfig.of(BLOCK=32, num_warps=1))


def test_concat_of_several_inputs_with_an_epilogue_and_a_computed_input():
    """DenseNet: cat of every earlier feature map, then batch norm and relu; one input computed in the group."""
    b = Builder()
    a, c = b.input("a", (1, 4, 2, 3)), b.input("c", (1, 1, 2, 3))
    computed = b.op("sigmoid", b.input("d", (1, 3, 2, 3)))
    joined = b.op("cat", a, c, computed, a, dim=1)                     # 12 channels, one input twice
    params = [b.const(n, b.random(12) if n != "var" else b.random(12).abs() + 0.5) for n in ("w", "b", "mean", "var")]
    out = b.op("relu", b.op("batch_norm", joined, *params, eps=1e-5))
    run_group(b, [out])
    run_group(b, [joined, out])                                        # the cat itself is an output too


def test_a_cat_is_walked_one_input_at_a_time_each_loaded_alone():
    """Each input of the cat gets programs of its own, which load it alone (no load under a slice's mask);
    odd channel counts, a contiguous input among channels-last ones, blocks that straddle no slice."""
    b = Builder()
    inputs = [b.input(f"x{i}", (2, c, 3, 5)) for i, c in enumerate((3, 1, 5, 2))]
    b.feeds["x2"] = b.feeds["x2"].contiguous()                        # another layout than the others
    joined = b.op("cat", *inputs, dim=1)
    params = [b.const(n, b.random(11) if n != "var" else b.random(11).abs() + 0.5) for n in ("w", "b", "mean", "var")]
    out = b.op("relu", b.op("batch_norm", joined, *params, eps=1e-5))
    kernel, _ = run_group(b, [out])
    assert [(s.sources, s.starts) for _, s in kernel.spaces] == [(("x0",), (0,)), (("x1",), (3,)), (("x2",), (4,)),
                                                                 (("x3",), (9,))]
    assert "inside" not in kernel.source                               # no slice masks: each input loaded alone
    run_group(b, [out], config=KernelConfig.of(BLOCK=16, num_warps=1))
    run_group(b, [joined, out])                                        # the cat an output too


def test_a_walked_cat_names_no_value_in_its_source():
    """The cat's parts say which ops they walk, not which values: each layer's rotate-half of a decoder (Llama's 22,
    whose comments named their nodes) is one source, one Triton compile."""
    sources = []
    for names in (("a", "b"), ("p", "q")):
        b = Builder()
        x, y = (b.input(name, (2, c, 3, 5)) for name, c in zip(names, (3, 2)))
        kernel, _ = run_group(b, [b.op("relu", b.op("cat", b.op("neg", x), y, dim=1))])
        assert len(kernel.spaces) > 1 and "neg of cat" in kernel.source
        sources.append(kernel.source)
    assert sources[0] == sources[1]


@pytest.mark.parametrize("layout", ["channels_last", "one_contiguous"])
def test_inputs_of_one_shape_share_a_segment_and_its_code(layout):
    """DenseNet's cat of equal feature maps: one segment, one copy of the code, each program picking its input;
    an input repeated, and one computed in the group (a segment of its own)."""
    b = Builder()
    x, a, c, d = (b.input(n, (2, k, 3, 5)) for n, k in (("x", 3), ("a", 2), ("c", 2), ("d", 2)))
    if layout == "one_contiguous":
        b.feeds["c"] = b.feeds["c"].contiguous()                      # the shared segment loads through strides
    computed = b.op("sigmoid", b.input("e", (2, 2, 3, 5)))
    joined = b.op("cat", x, a, c, x, computed, d, dim=1)               # 14 channels
    params = [b.const(n, b.random(14) if n != "var" else b.random(14).abs() + 0.5) for n in ("w", "b", "mean", "var")]
    out = b.op("relu", b.op("batch_norm", joined, *params, eps=1e-5))
    kernel, _ = run_group(b, [out])
    assert [(s.sources, s.starts) for _, s in kernel.spaces] == [(("x", "x"), (0, 7)), (("a", "c", "d"), (3, 5, 12)),
                                                                 (("sigmoid",), (10,))]
    assert kernel.source.count("tl.load(src") == 4                     # two shared segments, dense and strided
    run_group(b, [out], config=KernelConfig.of(BLOCK=16, num_warps=1))


def test_a_cat_read_through_a_view_is_walked_whole():
    """A cat whose shape is not the iteration's (reshaped to the output) keeps the masked loads."""
    b = Builder()
    joined = b.op("cat", b.input("x", (2, 3, 4)), b.input("y", (2, 5, 4)), dim=1)
    flat = b.op("reshape", b.op("sigmoid", joined), shape=[2, 32])
    kernel, _ = run_group(b, [flat])
    assert [s for _, s in kernel.spaces] == [None] and "inside" in kernel.source


def test_two_outputs_and_a_flattened_one():
    b = Builder()
    x = b.input("x", (2, 4, 3, 3))
    h = b.op("add", x, b.input("skip", (2, 4, 3, 3)))
    y = b.op("relu", h)
    flat = b.op("reshape", y, shape=[2, 36])            # row-major order, though the kernel walks NHWC
    kernel, (first, _, third) = run_group(b, [h, y, flat])
    assert len(kernel.args.outputs) == 3
    assert first.is_contiguous(memory_format=torch.channels_last) and third.is_contiguous()


def test_horizontal_group_of_independent_chains():
    b = Builder()
    a = b.op("relu", b.op("add", b.input("x", (2, 8, 5, 5)), b.const("c", b.random(8, 1, 1))))
    c = b.op("sigmoid", b.op("mul", b.input("y", (3, 10)), b.input("z", (3, 10))))
    kernel, (first, second) = run_group(b, [a, c], GroupKind.HORIZONTAL_POINTWISE)
    assert len(kernel.parts) == 2
    assert first.is_contiguous(memory_format=torch.channels_last) and second.is_contiguous()
    run_group(b, [a, c], GroupKind.HORIZONTAL_POINTWISE, KernelConfig.of(BLOCK=32, num_warps=1))


def test_odd_sizes_and_broadcasts():
    b = Builder()
    x = b.input("x", (1, 3, 1, 7))                      # batch 1 and a size-1 spatial dim
    y = b.op("add", x, b.input("row", (7,)))
    run_group(b, [b.op("maximum", y, b.const("floor", b.random(3, 1, 1)))])

    b = Builder()
    outer = b.op("mul", b.input("col", (5, 1, 7)), b.input("row", (1, 4, 1)))    # both sides broadcast
    run_group(b, [outer], config=KernelConfig.of(BLOCK=16, num_warps=1))


def test_preallocated_outputs_in_another_layout():
    b = Builder()
    x = b.input("x", (2, 4, 3, 5))
    y = b.op("relu", x)
    group = b.group([y])
    kernel = lower_pointwise_group(b.graph, group, DEVICE)
    out = torch.full((2, 4, 3, 5), float("nan"), device=DEVICE)   # contiguous, though the input is NHWC
    kernel.run([b.feeds["x"].to(DEVICE)], outputs=[out])
    assert torch.equal(out.cpu(), torch.relu(b.feeds["x"]))


def test_unsupported_and_bad_inputs():
    b = Builder()
    x = b.input("x", (2, 5))
    s = b.op("softmax", x, dim=-1)
    with pytest.raises(Unsupported):
        lower_pointwise_group(b.graph, b.group([s]), DEVICE)

    b = Builder()
    y = b.op("relu", b.input("x", (2, 5)))
    kernel = lower_pointwise_group(b.graph, b.group([y]), DEVICE)
    with pytest.raises(GraphError, match="x"):
        kernel.run([torch.zeros(3, 5, device=DEVICE)])
    with pytest.raises(GraphError):
        kernel.run([])


def test_a_float16_value_is_rounded_before_a_discrete_op_decides_on_it():
    """isinf(a + b) and (a + b) > 65504 on float16: the kernel sums in float32 (120000, finite), eager in float16
    (inf). The bools must be eager's."""
    b = Builder("float16")
    values = torch.tensor([[60000.0, 1.0, -60000.0, 2.0]])
    total = b.op("add", b.input("a", (1, 4), values), b.input("b", (1, 4), values))
    flags = [b.op("isinf", total), b.op("gt", total, b.const("bound", torch.tensor(65504.0)))]
    kernel = lower_pointwise_group(b.graph, b.group(flags), DEVICE)
    results = kernel.run([b.feeds[name].to(DEVICE) for name in kernel.runtime_inputs])
    eager_total = values.half() + values.half()
    assert results[0].cpu().tolist() == torch.isinf(eager_total).tolist() == [[True, False, True, False]]
    assert results[1].cpu().tolist() == (eager_total > 65504).tolist() == [[True, False, False, False]]


@pytest.mark.parametrize("shifts, dims", [((-1, 2), (1, 2)), ((7,), (3,)), ((-4, 0), (0, 1)),
                                          ((1, 2), (3, -1)), ((2, 4), (2, 2))])    # one dim twice: shifts add up
def test_roll_is_an_index_map_on_the_load(shifts, dims):
    b = Builder()
    x = b.input("x", (2, 3, 5, 4))                                   # channels-last, odd sizes
    rolled = b.op("roll", b.op("sigmoid", x), shifts=list(shifts), dims=list(dims))
    run_group(b, [b.op("mul", rolled, b.const("s", b.random(3, 1, 1)))])


def test_a_lone_cat_and_a_lone_roll_are_kernels_of_their_own():
    """Nothing elementwise around them (Inception's cat of branch outputs, Swin's roll after a layer norm): the
    template copies through the index map, a kernel of ours rather than PyTorch's cat or roll."""
    b = Builder()
    joined = b.op("cat", b.input("a", (1, 3, 2, 5)), b.input("c", (1, 2, 2, 5)), dim=1)
    kernel, _ = run_group(b, [joined])
    assert kernel.name.startswith("fused_cat_")
    b = Builder()
    rolled = b.op("roll", b.input("x", (2, 5, 4, 3)), shifts=[-2, 1], dims=[1, 2])
    kernel, _ = run_group(b, [rolled])
    assert kernel.name.startswith("fused_roll_")

