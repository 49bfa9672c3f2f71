"""ONNX's linear quantisation operators (`opfuse.frontend.onnx_quantize`) against onnx.reference: per-tensor,
per-axis and blocked scales, ties rounded to even, saturation at the type's range."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto

from onnx_cases import node, run_node as run

rng = np.random.default_rng(0)


@pytest.mark.parametrize("zero_point", [np.array(3, np.uint8), np.array(-4, np.int8), np.array(100, np.int16)])
def test_quantize_per_tensor_rounds_ties_to_even_and_saturates(zero_point):
    x = np.array([-1000.0, -2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 3.25, 1000.0, 0.0], np.float32)
    run(node("QuantizeLinear", ["x", "scale", "zero"]), {"x": x},
        weights={"scale": np.array(0.5, np.float32), "zero": zero_point}, opset=21)


def test_quantize_per_axis_and_blocked_and_dequantize_them():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32) * 10
    scale, zero = (np.abs(rng.standard_normal(3)) + 0.1).astype(np.float32), np.array([1, -2, 0], np.int8)
    run(node("QuantizeLinear", ["x", "scale", "zero"], axis=1), {"x": x}, weights={"scale": scale, "zero": zero},
        opset=21)
    blocks = (np.abs(rng.standard_normal((2, 3, 2))) + 0.1).astype(np.float32)
    run(node("QuantizeLinear", ["x", "scale"], axis=2, block_size=2, output_dtype=TensorProto.INT8), {"x": x},
        weights={"scale": blocks}, opset=21)
    q = rng.integers(-128, 128, (2, 3, 4)).astype(np.int8)
    run(node("DequantizeLinear", ["q", "scale", "zero"], axis=1), {"q": q}, weights={"scale": scale, "zero": zero},
        opset=21)
    run(node("DequantizeLinear", ["q", "scale"], axis=2, block_size=2), {"q": q}, weights={"scale": blocks}, opset=21)


@pytest.mark.parametrize("x", [np.array([0.0, 2.0, -3.0, 1000.0, -1.1, 7.5], np.float32),
                               np.array([[1.0, 2.5], [3.0, 9.0]], np.float32), np.zeros(4, np.float32)])
def test_dynamic_quantize_linear(x):
    run(node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"]), {"x": x}, opset=11)


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_qlinear_matmul(dtype):
    low, high = np.iinfo(dtype).min, np.iinfo(dtype).max + 1
    a, b = rng.integers(low, high, (2, 3, 5)).astype(dtype), rng.integers(low, high, (2, 5, 4)).astype(dtype)
    weights = {"a_scale": np.array([0.02], np.float32), "a_zero": np.array([3], dtype),
               "b_scale": np.array([0.05], np.float32), "b_zero": np.array([-1 if low else 2], dtype),
               "y_scale": np.array([0.3], np.float32), "y_zero": np.array([5], dtype)}
    run(node("QLinearMatMul", ["a", "a_scale", "a_zero", "b", "b_scale", "b_zero", "y_scale", "y_zero"]),
        {"a": a, "b": b}, weights=weights, opset=21)
