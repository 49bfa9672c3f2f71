"""ONNX operators written out in the IR's own ops, elementwise and reductions (`opfuse.frontend.onnx_math`):
each built with onnx.helper, imported with no opaque node, run through the IR interpreter and compared with
onnx.reference.ReferenceEvaluator (exactly for integer results), on odd shapes and edge values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto

from onnx_cases import node, one_node_graph, ops, run_node as run
from opfuse.ir.graph import GraphError
from opfuse.ir.interpret import interpret

rng = np.random.default_rng(0)


def floats(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---- elementwise ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64])
@pytest.mark.parametrize("fmod", [0, 1])
def test_integer_mod_is_exact_for_every_sign(dtype, fmod):
    a = np.array([-7, 7, -7, 7, 0, -128 if dtype == np.int8 else -9, 5], dtype)
    b = np.array([3, -3, -3, 3, 4, 7, 1], dtype)
    run(node("Mod", ["a", "b"], fmod=fmod), {"a": a, "b": b})


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("fmod", [0, 1])
def test_floating_mod_with_infinities_nan_and_zero(dtype, fmod):
    a = np.array([-4.3, 7.2, 5.0, -3.0, 3.0, np.inf, 1.0, np.nan, 1.0, 1e6], dtype)
    b = np.array([2.1, -3.4, 8.0, np.inf, -np.inf, 2.0, 0.0, 2.0, np.nan, 3.7], dtype)
    run(node("Mod", ["a", "b"], fmod=fmod), {"a": a, "b": b})


def test_float64_mod_is_refused_by_name():
    with pytest.raises(GraphError, match="Mod of float64 values"):
        run(node("Mod", ["a", "b"], fmod=1), {"a": floats(3, dtype=np.float64), "b": floats(3, dtype=np.float64)})


@pytest.mark.parametrize("op, attrs", [
    ("IsInf", {}), ("IsInf", {"detect_negative": 0}), ("IsInf", {"detect_positive": 0}), ("IsNaN", {}),
    ("Sign", {}), ("Celu", {"alpha": 1.5}), ("ThresholdedRelu", {"alpha": 0.3}),
    ("Shrink", {"lambd": 0.4, "bias": 0.1}),
    ("Softsign", {}), ("Mish", {}), ("Swish", {}), ("Swish", {"alpha": 0.7}),
])
def test_unary_functions_with_edge_values(op, attrs):
    x = np.array([[-np.inf, -3.0, -0.5, 0.0, 0.2, 1.0, 40.0, np.inf]], np.float32)
    if op in ("IsInf", "IsNaN", "Sign"):
        x = np.concatenate([x, np.array([[np.nan, -0.0, 1e-30, -1e30, 2.0, -2.0, 3.0, 5.0]], np.float32)])
    else:
        x = x[:, 1:-1]                   # the references compute exp(-inf) * inf and the like
    run(node(op, ["x"], **attrs), {"x": x})


def test_sign_of_integers_and_swiglu():
    run(node("Sign", ["x"]), {"x": np.array([-5, 0, 3], np.int32)})
    run(node("SwiGLU", ["a", "b"], alpha=1.2), {"a": floats(2, 5), "b": floats(2, 5)})


# ---- reductions -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceL1", "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp",
                                "ReduceProd"])
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([0, 2], 0), (None, 1)])
def test_norm_log_and_product_reductions(op, axes, keepdims):
    x = np.abs(floats(3, 4, 5)) + 0.1
    weights = {} if axes is None else {"axes": np.array(axes, np.int64)}
    run(node(op, ["x"] + (["axes"] if axes is not None else []), keepdims=keepdims), {"x": x}, weights=weights)


def test_log_sum_exp_does_not_overflow_and_keeps_infinities():
    x = np.array([[1000.0, 1000.0, -1.0], [np.inf, 1.0, 2.0]], np.float32)
    graph = run(node("ReduceLogSumExp", ["x", "axes"]), {"x": x}, weights={"axes": np.array([1], np.int64)})
    # a slice of -inf: log(sum(exp(x))) = log(0) = -inf by the operator's function body (onnx 1.23's reference
    # evaluator gives NaN there, subtracting -inf from -inf)
    (got,) = interpret(graph, [torch.tensor([[-np.inf, -np.inf, -np.inf], [0.0, 0.0, 0.0]])])
    assert got[0, 0] == -np.inf and torch.isclose(got[1, 0], torch.tensor(np.log(3.0), dtype=torch.float32))


def test_empty_axes_with_noop_keeps_every_element():
    run(node("ReduceL1", ["x", "axes"], noop_with_empty_axes=1), {"x": floats(2, 3)},
        weights={"axes": np.array([], np.int64)})


@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis, keepdims, last", [(0, 1, 0), (1, 0, 0), (-1, 1, 1), (2, 0, 1)])
def test_arg_max_and_min_pick_the_first_or_last_of_ties(op, axis, keepdims, last):
    x = rng.integers(-2, 3, (3, 4, 5)).astype(np.float32)           # many ties
    run(node(op, ["x"], axis=axis, keepdims=keepdims, select_last_index=last), {"x": x})


def test_arg_max_counts_nan_as_the_largest_and_works_on_integers():
    run(node("ArgMax", ["x"], axis=1), {"x": np.array([[1.0, np.nan, 3.0, np.nan], [0.0, 2.0, 2.0, 1.0]], np.float32)})
    run(node("ArgMin", ["x"], axis=0, keepdims=0), {"x": rng.integers(-5, 5, (4, 3)).astype(np.int32)})


@pytest.mark.parametrize("axis", [None, 0, 1])
def test_hardmax_is_one_at_the_first_largest_along_its_axis(axis):
    x = rng.integers(-2, 3, (3, 4, 5)).astype(np.float32)           # ties: the first one is hot
    x[1, 2, 3] = np.nan                                                 # a NaN is the largest
    run(node("Hardmax", ["x"], **({} if axis is None else {"axis": axis})), {"x": x}, opset=13)


@pytest.mark.parametrize("axis", [None, 0, 2])
def test_hardmax_before_opset_13_is_one_hot_over_the_flattened_tail(axis):
    """Before opset 13 Hardmax takes every dim from `axis` on (default 1) as one; onnx.reference implements only the
    opset-13 meaning, so the expected values are the definition's, computed here."""
    x = rng.integers(-2, 3, (3, 4, 5)).astype(np.float32)
    x[1, 2, 3] = np.nan
    start = 1 if axis is None else axis
    rows = x.reshape(int(np.prod(x.shape[:start])), -1)
    expected = np.zeros_like(rows)
    expected[np.arange(len(rows)), np.argmax(rows, axis=1)] = 1.0     # numpy's argmax: the first NaN, else max
    graph = one_node_graph(node("Hardmax", ["x"], **({} if axis is None else {"axis": axis})), x, 11)
    (got,) = interpret(graph, [torch.from_numpy(x)])
    np.testing.assert_array_equal(got.numpy(), expected.reshape(x.shape))


# ---- normalisations ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("p, axis", [(1, 1), (2, -1), (2, 0)])
def test_lp_normalization_with_a_zero_slice(p, axis):
    """x / ||x||_p, 0 where the norm is 0. (onnx 1.23's reference evaluator sums x, not |x|, for p=1: the
    expected values come from the definition here.)"""
    x = floats(3, 4)
    x[1] = 0.0
    x[:, 2] = 0.0
    if p == 2:
        run(node("LpNormalization", ["x"], p=p, axis=axis), {"x": x})
        return
    norm = np.abs(x).sum(axis=axis, keepdims=True)
    want = np.where(norm == 0, 0, x / np.where(norm == 0, 1, norm))
    graph = one_node_graph(node("LpNormalization", ["x"], p=1, axis=axis), x, 13)
    (got,) = interpret(graph, [torch.from_numpy(x)])
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-6)


def test_instance_and_group_normalization():
    x = floats(2, 6, 3, 5)
    run(node("InstanceNormalization", ["x", "s", "b"], epsilon=1e-3), {"x": x},
        weights={"s": floats(6), "b": floats(6)})
    run(node("GroupNormalization", ["x", "s", "b"], num_groups=3, epsilon=1e-4), {"x": x},
        weights={"s": floats(6), "b": floats(6)}, opset=21)


def test_mean_variance_normalization():
    run(node("MeanVarianceNormalization", ["x"]), {"x": floats(3, 2, 3, 4)}, opset=13)
    run(node("MeanVarianceNormalization", ["x"], axes=[1]), {"x": floats(3, 2, 3, 4)}, opset=13)


# ---- integer shifts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("direction", ["LEFT", "RIGHT"])
@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int32, np.int64])
def test_bit_shift_overflow_negative_amounts_and_the_sign(direction, dtype):
    bits = np.iinfo(dtype).bits
    low = np.iinfo(dtype).min
    a = np.array([16, 1, low, -1 if low else 3, 5, 100 % (np.iinfo(dtype).max + 1), low + 7, 7], dtype)
    b = np.array([1, bits - 1, 1, 3, -1 if low else 0, bits, bits - 1, 0], dtype)
    run(node("BitShift", ["a", "b"], direction=direction), {"a": a, "b": b})


# ---- rounding -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["Floor", "Ceil", "Round"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floor_ceil_and_round_half_to_even_exactly(op, dtype):
    big = float(np.finfo(dtype).max) / 2
    x = np.array([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, -0.2, 0.7, 3.0, -4.0, 2.4999, -7.51, 1e3 + 0.5, 1023.5,
                  big, -big, np.inf, -np.inf, np.nan, 0.0], dtype)
    graph = run(node(op, ["x"]), {"x": x}, tolerance=0)
    assert "cast" in [n.op for n in graph]


# ---- library calls: determinants, bit casts, RoI align, deformable convolutions ---------------------------------

def test_det_of_a_batch_of_matrices_is_one_library_call():
    graph = run(node("Det", ["x"]), {"x": floats(3, 4, 4)})
    assert ops(graph) == ["det"]


@pytest.mark.parametrize("source, to", [(np.float32, TensorProto.INT32), (np.int64, TensorProto.DOUBLE),
                                        (np.int8, TensorProto.UINT8), (np.float16, TensorProto.INT16)])
def test_bit_cast_reads_the_bits_exactly(source, to):
    x = (floats(2, 5) * 100).astype(source)
    graph = run(node("BitCast", ["x"], to=to), {"x": x})
    assert ops(graph) == ["bitcast"]


@pytest.mark.parametrize("transform", ["half_pixel", "output_half_pixel"])
def test_roi_align_averages_as_onnx_does(transform):
    """Equal to onnx.reference's RoiAlign (the conformance cases' expected outputs are written to 4 digits)."""
    rois = np.array([[0, 0, 9, 9], [0, 5, 4, 9], [5.5, 5.2, 9.1, 9.3]], np.float32)
    graph = run(node("RoiAlign", ["x", "rois", "batch"], coordinate_transformation_mode=transform, output_height=3,
                     output_width=4, sampling_ratio=2, spatial_scale=0.8),
                {"x": floats(2, 3, 10, 10), "rois": rois, "batch": np.array([1, 0, 1], np.int64)})
    assert ops(graph) == ["roi_align"]


@pytest.mark.parametrize("with_bias_and_mask", [False, True])
def test_deform_conv_with_groups_of_offsets(with_bias_and_mask):
    extra = {"b": floats(4), "mask": np.abs(floats(1, 2 * 4, 3, 3))} if with_bias_and_mask else {}
    names = ["x", "w", "offset"] + (["b", "mask"] if with_bias_and_mask else [])
    graph = run(node("DeformConv", names, kernel_shape=[2, 2], pads=[1, 1, 1, 1], strides=[2, 2], offset_group=2),
                {"x": floats(1, 4, 5, 5), "w": floats(4, 4, 2, 2), "offset": floats(1, 2 * 2 * 4, 3, 3), **extra})
    assert ops(graph) == ["deform_conv2d"]
