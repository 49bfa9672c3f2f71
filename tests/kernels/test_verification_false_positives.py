"""Verification never refuses a correct model (issue 53, item 9): explicit float casts inside the model (ONNX Cast,
torch's `.float()`), a lone cast to float16/bfloat16, and integer division whose divisor the example never lets
be zero. Each compiles on Triton's interpreter, tiny shapes, and matches eager."""

from __future__ import annotations

import onnx
import pytest
import torch
from onnx import TensorProto, helper

import opfuse
from opfuse.frontend.onnx_module import onnx_module
from opfuse.ir.graph import GraphError

FLOAT32 = opfuse.FusionConfig(dtype="float32")


def onnx_model(nodes, inputs, outputs) -> onnx.ModelProto:
    """A one-graph opset-17 model of `nodes`; inputs and outputs as (name, element type, shape)."""
    graph = helper.make_graph(nodes, "m", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("source", [TensorProto.INT64, TensorProto.FLOAT16, TensorProto.FLOAT])
def test_onnx_matmul_of_an_explicit_cast_to_float(source):
    """The float64 reference ran Cast(to=FLOAT) as written, so MatMul met float32 and float64 operands."""
    model = onnx_model([helper.make_node("Cast", ["a"], ["a_float"], to=TensorProto.FLOAT),
                        helper.make_node("MatMul", ["a_float", "b"], ["y"])],
                       [("a", source, [2, 4]), ("b", TensorProto.FLOAT, [4, 3])], [("y", TensorProto.FLOAT, [2, 3])])
    a = torch.randint(-3, 4, (2, 4)) if source == TensorProto.INT64 else torch.randn(2, 4)
    a = a.half() if source == TensorProto.FLOAT16 else a
    b = torch.randn(4, 3)
    compiled = opfuse.compile(model, (a, b), FLOAT32, quiet=True)
    torch.testing.assert_close(compiled(a, b), onnx_module(model, (a, b))(a, b))


class FloatInside(torch.nn.Module):
    """forward casts its input with .float() and .to(torch.float32) before a Linear."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.linear(x.float()) + self.linear(x.to(torch.float32))


def test_torch_module_that_casts_to_float32_inside():
    """The float64 reference ran x.float(), so the Linear met a float32 input and float64 weights."""
    model, x = FloatInside(), torch.randn(2, 4)
    compiled = opfuse.compile(model, (x,), FLOAT32, quiet=True)
    torch.testing.assert_close(compiled(x), model(x))


class UnregisteredWeight(torch.nn.Module):
    """A float32 weight held as a plain attribute: .to(torch.float64) leaves it float32, so no float64 run exists."""

    def __init__(self):
        super().__init__()
        self.weight = torch.randn(4, 3)

    def forward(self, x):
        return torch.relu(x @ self.weight)


def test_a_model_that_cannot_run_in_float64_is_verified_in_float32_and_says_so():
    model, x = UnregisteredWeight(), torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"verified against eager in float32, not float64: .*same dtype"):
        compiled = opfuse.compile(model, (x,), FLOAT32, quiet=True)
    torch.testing.assert_close(compiled(x), model(x))


@pytest.mark.parametrize("to, dtype", [(TensorProto.FLOAT16, torch.float16), (TensorProto.BFLOAT16, torch.bfloat16)])
def test_a_lone_cast_to_half_precision(to, dtype):
    """A float32 compile computes the cast in float32 (the outputs take eager's dtype at the end); the reference
    rounded to float16 while the compiled model's float32 outputs were compared with it."""
    model = onnx_model([helper.make_node("Cast", ["x"], ["y"], to=to)], [("x", TensorProto.FLOAT, [2, 8])],
                       [("y", to, [2, 8])])
    x = torch.randn(2, 8)
    compiled = opfuse.compile(model, (x,), quiet=True)          # the default config: float32, from the input
    out = compiled(x)
    assert out.dtype == dtype
    assert torch.equal(out, x.to(dtype))


def test_integer_division_whose_divisor_is_never_zero():
    """The divisor's example holds -3 and 2, never 0; random verification inputs drew 0 from [-3, 2]."""
    model = onnx_model([helper.make_node("Div", ["x", "y"], ["z"])],
                       [("x", TensorProto.INT64, [2, 8]), ("y", TensorProto.INT64, [2, 8])],
                       [("z", TensorProto.INT64, [2, 8])])
    x, y = torch.arange(-8, 8).reshape(2, 8), torch.tensor([-3, 2] * 8).reshape(2, 8)
    compiled = opfuse.compile(model, (x, y), FLOAT32, quiet=True)
    assert torch.equal(compiled(x, y), torch.div(x, y, rounding_mode="trunc"))


class FloorDivide(torch.nn.Module):
    def forward(self, x, y):
        return x // y


def test_torch_floor_division_whose_divisor_is_never_zero():
    x, y = torch.arange(-8, 8).reshape(2, 8), torch.tensor([-3, 2] * 8).reshape(2, 8)
    compiled = opfuse.compile(FloorDivide(), (x, y), FLOAT32, quiet=True)
    assert torch.equal(compiled(x, y), x // y)


class Choose(torch.nn.Module):
    """A router's choice: the top two of each row, and the values there (rounded first where `ties`: equal values
    at the cut, as a float16 router's near-equal probabilities are)."""

    def __init__(self, ties: bool):
        super().__init__()
        self.ties = ties

    def forward(self, x):
        scores = (x * 2).round() if self.ties else x
        values, index = torch.topk(scores.softmax(-1), 2, -1)
        return values * 3, index


@pytest.mark.parametrize("ties", [True, False])
def test_a_choice_on_a_near_tie_is_a_warning_not_an_error(ties, monkeypatch):
    """Over the tolerance end to end while eager is not: an error, unless a topk's reference input holds a near-tie
    at its cut (`numerics.near_ties`), where any float16 run may pick either element: then a warning naming it."""
    from opfuse import verification

    monkeypatch.setattr(verification, "end_to_end_error", lambda *args: (0.5, 1e-3, None))
    x = torch.randn(4, 16)
    if ties:
        with pytest.warns(UserWarning, match=r"chooses between near-equal values: .*topk"):
            opfuse.compile(Choose(True).eval(), (x,), opfuse.FusionConfig(dtype="float16"), quiet=True)
    else:
        with pytest.raises(GraphError, match="differs from eager"):
            opfuse.compile(Choose(False).eval(), (x,), opfuse.FusionConfig(dtype="float16"), quiet=True)
