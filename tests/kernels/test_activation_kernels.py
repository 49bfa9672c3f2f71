"""The activations and other elementwise ops beyond the first set (leaky_relu, softplus, ELU/SELU/CELU, mish,
log_sigmoid, square, sin, cos, tan, the hyperbolic functions and their inverses, log1p, expm1, floor, ceil, sign,
logical_not, bitwise and/or/xor/not) on Triton's interpreter: alone, as a GEMM anchor's epilogue, and mapped from
ATen by the PyTorch frontend.

Each kernel test feeds odd shapes with values across the ops' regimes (tiny, around 0, large, past the overflow of
exp), NaN-poisons the outputs and compares with the float32 reference (`tests.kernels.builders`), and the special
values with PyTorch element by element.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opfuse.codegen.pointwise import lower_pointwise_group
from opfuse.fusion.plan import GroupKind
from opfuse.frontend.torch_export import capture_torch
from opfuse.ir.interpret import interpret
from tests.kernels.builders import KernelGraph
from tests.kernels.test_gemm_kernels import linear, run_gemm
from tests.kernels.test_conv_kernels import Builder as AnchorBuilder

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

UNARY = [
    ("leaky_relu", {"negative_slope": 0.1}), ("leaky_relu", {"negative_slope": -0.3}),
    ("softplus", {"beta": 1.0, "threshold": 20.0}), ("softplus", {"beta": 2.5, "threshold": 3.0}),
    ("elu", {"alpha": 1.0, "scale": 1.0, "input_scale": 1.0}),
    ("elu", {"alpha": 1.6732632423543772, "scale": 1.0507009873554805, "input_scale": 1.0}),     # SELU
    ("elu", {"alpha": 0.5, "scale": 1.0, "input_scale": 2.0}),                                   # CELU(0.5)
    ("mish", {}), ("log_sigmoid", {}), ("square", {}), ("sin", {}), ("cos", {}), ("log1p", {}), ("expm1", {}),
    ("floor", {}), ("ceil", {}), ("sign", {}), ("tan", {}), ("sinh", {}), ("cosh", {}), ("asinh", {}),
    ("acosh", {}), ("atanh", {}), ("atan", {}), ("asin", {}), ("acos", {}),
]

# values across every regime: tiny (log1p/expm1 cancel there), around 0, large, past exp's overflow, and NaN
SPECIAL = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-7, -1e-7, 1e-4, -1e-4, 0.3, -0.3, 1.0, -1.0, 2.5, -2.5, 19.9,
                        20.1, -20.0, 50.0, -50.0, 88.0, 89.0, 100.0, -100.0, float("nan")])


def run_alone(b: KernelGraph, outputs: list[str]):
    group = b.group(outputs, GroupKind.SINGLE)
    kernel = lower_pointwise_group(b.graph, group, "cpu")
    kernel.output_fill = float("nan")
    results = kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    return kernel, results


@pytest.mark.parametrize("op,attrs", UNARY)
def test_activation_alone_on_an_odd_shape(op, attrs):
    b = KernelGraph()
    values = b.random(3, 7, 13) * 3
    if op == "log1p":       # its domain: x > -1
        values = values.abs() - 0.99
    domains = {"acosh": lambda v: v.abs() + 1, "atanh": lambda v: torch.tanh(v) * 0.99,
               "asin": lambda v: torch.tanh(v), "acos": lambda v: torch.tanh(v),
               "tan": lambda v: v.clamp(-1.3, 1.3)}                  # (away from tan's poles)
    values = domains.get(op, lambda v: v)(values)
    x = b.input("x", (3, 7, 13), values)
    y = b.op(op, x, **attrs)
    _, results = run_alone(b, [y])
    b.check([y], results)


@pytest.mark.parametrize("op,attrs", UNARY)
def test_activation_matches_pytorch_at_special_values(op, attrs):
    """Element by element against PyTorch in float32, relative 1e-5 (or 1e-30 absolute), NaN where it is NaN: the
    cancellation-free log1p and expm1 keep tiny inputs' digits, large ones do not overflow to NaN."""
    b = KernelGraph()
    x = b.input("x", tuple(SPECIAL.shape), SPECIAL)
    y = b.op(op, x, **attrs)
    _, (got,) = run_alone(b, [y])
    want = interpret(b.graph, [SPECIAL])[0]
    same_nan = torch.isnan(got) == torch.isnan(want)
    assert bool(same_nan.all()), (SPECIAL[~same_nan], got[~same_nan], want[~same_nan])
    finite = ~torch.isnan(want)
    close = torch.isclose(got[finite].double(), want[finite].double(), rtol=1e-5, atol=1e-30)
    assert bool(close.all()), (SPECIAL[finite][~close], got[finite][~close], want[finite][~close])


@pytest.mark.parametrize("op, values", [
    ("asin", torch.linspace(-1, 1, 4001)), ("acos", torch.linspace(-1, 1, 4001)),
    ("atan", torch.cat([torch.linspace(-10, 10, 4001), torch.logspace(-30, 30, 121), -torch.logspace(-30, 30, 121)])),
])
def test_inverse_trigonometric_functions_are_within_a_few_float32_ulps(op, values):
    """Over a dense grid (asin and acos over their whole domain, atan over 60 decades), each within 4e-7 relative of
    float64's: about 3 float32 ulps, no cancellation near 1 or past the reduction's bounds."""
    b = KernelGraph()
    y = b.op(op, b.input("x", tuple(values.shape), values))
    _, (got,) = run_alone(b, [y])
    want = getattr(torch, op)(values.double())
    assert float(((got.double() - want).abs() / want.abs().clamp_min(1e-38)).max()) < 4e-7


def test_float16_values_and_logical_not_of_a_comparison():
    b = KernelGraph("float16")
    x = b.input("x", (5, 9), b.random(5, 9) * 4)
    soft = b.op("softplus", x, beta=1.0, threshold=20.0)
    flag = b.op("logical_not", b.op("gt", x, b.const("zero", torch.tensor(0.0))))
    picked = b.op("where", flag, b.op("leaky_relu", x, negative_slope=0.2), soft)
    _, results = run_alone(b, [picked])
    b.check([picked], results)


@pytest.mark.parametrize("op,attrs", [("leaky_relu", {"negative_slope": 0.1}), ("mish", {}),
                                      ("softplus", {"beta": 1.0, "threshold": 20.0})])
def test_a_gemm_takes_the_activation_as_its_epilogue(op, attrs):
    b = AnchorBuilder()
    x = b.input("x", (5, 19))
    kernel, _ = run_gemm(b, [b.op(op, linear(b, x, 11), **attrs)])
    assert op in kernel.name


class Activations(nn.Module):
    def __init__(self):
        super().__init__()
        self.prelu = nn.PReLU(3)

    def forward(self, x):
        ys = [F.leaky_relu(x, 0.1), F.softplus(x, 2.0, 10.0), torch.square(x), F.elu(x, 0.7), F.selu(x),
              F.celu(x, 0.5), F.mish(x), F.logsigmoid(x), torch.sin(x), torch.cos(x), torch.log1p(x.abs()),
              torch.expm1(x), torch.floor(x), torch.ceil(x), torch.sign(x), self.prelu(x), F.threshold(x, 0.1, 2.0),
              torch.logical_not(x > 0).to(x.dtype), torch.tan(x.clamp(-1, 1)), torch.sinh(x), torch.cosh(x),
              torch.asinh(x), torch.acosh(x.abs() + 1), torch.atanh(x.tanh() * 0.5), torch.atan(x),
              torch.asin(x.tanh()), torch.acos(x.tanh())]
        return torch.stack([y.sum() for y in ys])


def test_each_activation_is_mapped_from_aten_and_the_graph_matches_eager():
    model = Activations().eval()
    with torch.no_grad():
        model.prelu.weight.copy_(torch.tensor([0.1, -0.2, 0.3]))
    x = torch.randn(2, 3, 4, 5)
    graph = capture_torch(model, (x,))
    mapped = {n.op for n in graph}
    assert not [n.attrs["target"] for n in graph if n.op == "opaque" and "sum" not in n.attrs["target"]
                and "stack" not in n.attrs["target"]]
    assert {"leaky_relu", "softplus", "square", "elu", "mish", "log_sigmoid", "sin", "cos", "log1p", "expm1",
            "floor", "ceil", "sign", "logical_not", "where", "tan", "sinh", "cosh", "asinh", "acosh", "atanh", "atan",
            "asin", "acos"} <= mapped
    (got,) = interpret(graph, [x])
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-5)
    assert math.isfinite(float(got.sum()))


# ---- bitwise ops --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["int64", "int32", "int16", "int8", "uint8", "bool"])
def test_bitwise_ops_are_exact_on_every_integer_dtype(dtype):
    """and, or, xor (and not, on the wide integers' exact int64 path) against PyTorch, element by element: negative
    values, the dtype's extremes, broadcast scalars."""
    torch_type = getattr(torch, dtype)
    info = torch.iinfo(torch_type) if dtype != "bool" else None
    low, high = (0, 2) if info is None else (max(info.min, -(1 << 40)), min(info.max, 1 << 40))
    generator = torch.Generator().manual_seed(0)
    a = torch.randint(low, high, (3, 37), generator=generator).to(torch_type)
    c = torch.randint(low, high, (3, 37), generator=generator).to(torch_type)
    if info is not None:
        a[0, :2] = torch.tensor([info.min, info.max], dtype=torch_type)
    b = KernelGraph(dtype)
    x, y = b.input("a", (3, 37), a), b.input("c", (3, 37), c)
    outputs = [b.op(op, x, y) for op in ("bitwise_and", "bitwise_or", "bitwise_xor")]
    wants = [a & c, a | c, a ^ c]
    if dtype in ("int64", "int32"):
        outputs.append(b.op("bitwise_not", x))
        wants.append(~a)
    kernel = lower_pointwise_group(b.graph, b.group(outputs, GroupKind.SINGLE), "cpu")
    results = kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    for got, want in zip(results, wants):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_bitwise_ops_map_from_aten_and_python_operators():
    class Bits(nn.Module):
        def forward(self, i, j, p, q):
            return i & j, i | 6, i ^ j, ~i, torch.bitwise_and(i, 5), p & q, p | q, p ^ q, ~p

    i, j = torch.tensor([-7, 3, 12, 0]), torch.tensor([5, -2, 10, 1])
    p, q = torch.tensor([True, False, True, False]), torch.tensor([True, True, False, False])
    model = Bits().eval()
    graph = capture_torch(model, (i, j, p, q))
    assert not [n for n in graph if n.op == "opaque"]
    assert {"bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "logical_not", "ne", "where"} <= \
        {n.op for n in graph}
    for got, want in zip(interpret(graph, [i, j, p, q]), model(i, j, p, q)):
        assert torch.equal(got, want)
