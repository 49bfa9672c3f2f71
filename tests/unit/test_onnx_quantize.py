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


@pytest.mark.parametrize("dtype", [np.uint8, np.int8])
def test_matmul_integer_with_a_zero_point_per_column(dtype):
    """(a - a_zp) @ (b - b_zp) as int32, exactly: products of 8-bit integers summed in float64."""
    low, high = np.iinfo(dtype).min, np.iinfo(dtype).max + 1
    a, b = rng.integers(low, high, (2, 3, 300)).astype(dtype), rng.integers(low, high, (300, 4)).astype(dtype)
    weights = {"a_zero": np.array(7, dtype), "b_zero": rng.integers(low, high, (4,)).astype(dtype)}
    run(node("MatMulInteger", ["a", "b", "a_zero", "b_zero"]), {"a": a, "b": b}, weights=weights, opset=10)


@pytest.mark.parametrize("attrs", [{"pads": [1, 1, 1, 1]}, {"group": 2, "strides": [2, 1]}])
def test_conv_integer_pads_with_the_zero_point(attrs):
    x = rng.integers(0, 256, (1, 4, 6, 5)).astype(np.uint8)
    w = rng.integers(0, 256, (6, 4 // attrs.get("group", 1), 3, 3)).astype(np.uint8)
    weights = {"w": w, "x_zero": np.array(131, np.uint8), "w_zero": np.array(9, np.uint8)}
    run(node("ConvInteger", ["x", "w", "x_zero", "w_zero"], **attrs), {"x": x}, weights=weights, opset=10)


def test_qlinear_conv_with_a_scale_per_output_channel_and_a_bias():
    x = rng.integers(-128, 128, (1, 3, 7, 6)).astype(np.int8)
    w = rng.integers(-128, 128, (4, 3, 3, 3)).astype(np.int8)
    weights = {"w": w, "x_scale": np.array(0.05, np.float32), "x_zero": np.array(-3, np.int8),
               "w_scale": np.array([0.01, 0.02, 0.005, 0.03], np.float32), "w_zero": np.zeros(4, np.int8),
               "y_scale": np.array(0.9, np.float32), "y_zero": np.array(4, np.int8),
               "bias": rng.integers(-500, 500, (4,)).astype(np.int32)}
    run(node("QLinearConv", ["x", "x_scale", "x_zero", "w", "w_scale", "w_zero", "y_scale", "y_zero", "bias"],
             pads=[1, 1, 1, 1]), {"x": x}, weights=weights, opset=10)
