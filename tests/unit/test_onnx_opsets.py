"""The ONNX operators of issue 18 across opsets 7 to the newest: each a one-node (or few-node) model built with
onnx.helper at several opsets, imported with no opaque node, run through the IR interpreter and compared with
onnx.reference.ReferenceEvaluator (onnxruntime is not in the environment). Where the reference implements only the
newest meaning of an operator, the expected values are computed here and the reason is written next to them."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from opfuse.frontend.onnx_import import load_onnx
from opfuse.ir.interpret import interpret

FLOAT = TensorProto.FLOAT
NEWEST = onnx.defs.onnx_opset_version()
rng = np.random.default_rng(0)


def floats(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def ints(*values):
    return np.array(values, np.int64)


def model(nodes, feeds: dict, weights: dict, opset: int, shapes: dict | None = None) -> onnx.ModelProto:
    """Feeds become graph inputs, weights initializers; outputs are the last node's, typed by `shapes` when given."""
    outputs = [o for o in nodes[-1].output if o]
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape) for n, a in
              feeds.items()]
    out_info = [helper.make_tensor_value_info(n, *(shapes[n] if shapes else (FLOAT, None))) for n in outputs]
    graph = helper.make_graph(nodes, "opsets", inputs, out_info,
                              initializer=[numpy_helper.from_array(np.asarray(a), n) for n, a in weights.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    proto.ir_version = min(proto.ir_version, 8 if opset < 21 else proto.ir_version)
    return proto


def check(nodes, feeds: dict, weights: dict | None = None, opset: int = NEWEST, expected=None, tolerance=1e-5):
    """Import at `opset`, check nothing is opaque, run, compare with the reference (or `expected`)."""
    weights = weights or {}
    typed = model(nodes, feeds, weights, opset)
    if expected is None:
        expected = ReferenceEvaluator(typed).run(None, feeds)
    shapes = {n: (helper.np_dtype_to_tensor_dtype(np.asarray(e).dtype), np.asarray(e).shape)
              for n, e in zip([o for o in nodes[-1].output if o], expected)}
    graph = load_onnx(model(nodes, feeds, weights, opset, shapes), runnable=True)
    assert not [n for n in graph if n.op == "opaque"]
    got = interpret(graph, [torch.from_numpy(np.ascontiguousarray(a)) for a in feeds.values()])
    for ours, want in zip(got, expected):
        ours, want = ours.numpy(), np.asarray(want)
        assert ours.shape == want.shape and ours.dtype == want.dtype, (ours.shape, ours.dtype, want.shape, want.dtype)
        if np.issubdtype(want.dtype, np.floating):
            error = np.linalg.norm(ours.astype(np.float64) - want) / max(np.linalg.norm(want.astype(np.float64)), 1e-30)
            assert error < tolerance, f"relative error {error}"
        else:
            np.testing.assert_array_equal(ours, want)
    return graph


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)


# ---- convolution, matrix products, normalisation ---------------------------------------------------------

@pytest.mark.parametrize("opset", [7, 11, NEWEST])
@pytest.mark.parametrize("attrs", [dict(pads=[1, 1, 1, 1], strides=[2, 1]), dict(group=2, dilations=[2, 1]),
                                   dict(auto_pad="SAME_LOWER", strides=[2, 2]), dict(pads=[0, 1, 2, 0])])
def test_conv(opset, attrs):
    check([node("Conv", ["x", "w", "b"], **attrs)], {"x": floats(1, 4, 7, 6)},
          {"w": floats(6, 4 // attrs.get("group", 1), 3, 3), "b": floats(6)}, opset)


def test_conv_1d():
    check([node("Conv", ["x", "w"], pads=[1, 2], strides=[2])], {"x": floats(2, 3, 9)}, {"w": floats(4, 3, 3)}, 11)


@pytest.mark.parametrize("opset", [7, 11, NEWEST])
@pytest.mark.parametrize("attrs", [dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 1]),
                                   dict(strides=[2, 1], pads=[0, 1, 2, 0]), dict(dilations=[2, 2]),
                                   dict(strides=[2, 2], auto_pad="SAME_UPPER")])
def test_conv_transpose(opset, attrs):
    check([node("ConvTranspose", ["x", "w", "b"], **attrs)], {"x": floats(1, 4, 3, 4)},
          {"w": floats(4, 6, 3, 3), "b": floats(6)}, opset)


@pytest.mark.parametrize("attrs, expected", [
    # onnx's reference fails on these three (its col2im), so the expected values come from PyTorch
    (dict(group=2, dilations=[2, 2]), lambda x, w, b: F.conv_transpose2d(x, w, b, groups=2, dilation=2)),
    (dict(strides=[3, 2], output_shape=[8, 8]),   # the first output_shape rows and columns of the full output
     lambda x, w, b: F.conv_transpose2d(x, w, b, stride=(3, 2))[..., :8, :8]),
    (dict(strides=[2, 2], output_padding=[2, 0], dilations=[1, 3]),   # output_padding >= stride: bias-only rows
     lambda x, w, b: F.pad(F.conv_transpose2d(x, w, None, stride=2, dilation=(1, 3)), (0, 0, 0, 2))
     + b.reshape(-1, 1, 1)),
])
def test_conv_transpose_groups_output_shape_and_large_output_padding(attrs, expected):
    x, w, b = floats(1, 4, 3, 4), floats(4, 6 // attrs.get("group", 1), 3, 3), floats(6)
    want = expected(*(torch.from_numpy(a) for a in (x, w, b))).numpy()
    check([node("ConvTranspose", ["x", "w", "b"], **attrs)], {"x": x}, {"w": w, "b": b}, 11, [want])


@pytest.mark.parametrize("shape", [(1, 2, 5), (1, 2, 3, 3, 2)])
def test_conv_transpose_1d_and_3d(shape):
    kernel = (3,) * (len(shape) - 2)
    check([node("ConvTranspose", ["x", "w"], strides=[2] * len(kernel))], {"x": floats(*shape)},
          {"w": floats(2, 3, *kernel)}, 11)


@pytest.mark.parametrize("opset", [7, 9, 11, 13])
@pytest.mark.parametrize("attrs, a, b, c", [
    ({}, (3, 4), (4, 5), (5,)),
    (dict(transA=1, transB=1, alpha=0.5, beta=2.0), (4, 3), (5, 4), (3, 5)),
    (dict(transB=1, beta=0.0), (3, 4), (5, 4), (1, 5)),
    (dict(alpha=2.0), (3, 4), (4, 5), ()),
])
def test_gemm(opset, attrs, a, b, c):
    check([node("Gemm", ["a", "b", "c"], **attrs)], {"a": floats(*a)}, {"b": floats(*b), "c": floats(*c)}, opset)


@pytest.mark.parametrize("opset", [11, 13])
def test_gemm_without_c_and_with_both_operands_given(opset):
    check([node("Gemm", ["a", "b"], transA=1)], {"a": floats(4, 3), "b": floats(4, 5)}, opset=opset)


@pytest.mark.parametrize("opset", [9, 13])
@pytest.mark.parametrize("a, b, weight", [((2, 1, 3, 4), (5, 4, 6), False), ((4,), (4, 3), True),
                                           ((2, 3, 4), (4,), False), ((3, 4), (4, 2), True)])
def test_matmul_broadcast(opset, a, b, weight):
    feeds, weights = {"a": floats(*a)}, {}
    (weights if weight else feeds)["b"] = floats(*b)
    check([node("MatMul", ["a", "b"])], feeds, weights, opset)


def _batch_norm_weights(shape):
    return {"s": floats(*shape), "bias": floats(*shape), "m": floats(*shape),
            "v": np.abs(floats(*shape)) + 0.5}


@pytest.mark.parametrize("opset", [7, 9, 14, 15])
def test_batch_normalization(opset):
    # onnx's reference is wrong before opset 14 (a tuple at 7, other values at 9): the formula, per channel
    x, w = floats(2, 3, 4, 4), _batch_norm_weights((3,))
    per_channel = {k: v.reshape(3, 1, 1) for k, v in w.items()}
    expected = (x - per_channel["m"]) / np.sqrt(per_channel["v"] + 1e-3) * per_channel["s"] + per_channel["bias"]
    check([node("BatchNormalization", ["x", "s", "bias", "m", "v"], epsilon=1e-3)], {"x": x}, w, opset,
          [expected.astype(np.float32)])


def test_batch_normalization_per_element_before_opset_9():
    """spatial=0 (opsets 7-8): one statistic per element of [C, H, W]; the reference has only the spatial meaning."""
    x, w = floats(2, 3, 4, 5), _batch_norm_weights((3, 4, 5))
    expected = (x - w["m"]) / np.sqrt(w["v"] + 1e-5) * w["s"] + w["bias"]
    check([node("BatchNormalization", ["x", "s", "bias", "m", "v"], spatial=0)], {"x": x}, w, 7, [expected])


@pytest.mark.parametrize("opset", [7, 13])
def test_lrn(opset):
    # onnx's reference loops over the wrong axis (test_onnx_import.py), so an odd window, equal to PyTorch's
    x = floats(2, 5, 3, 3)
    expected = torch.nn.functional.local_response_norm(torch.from_numpy(x), 3, 1e-3, 0.75, 2.0).numpy()
    check([node("LRN", ["x"], size=3, alpha=1e-3, beta=0.75, bias=2.0)], {"x": x}, opset=opset, expected=[expected])


@pytest.mark.parametrize("opset", [17, NEWEST])
def test_layer_normalization(opset):
    check([node("LayerNormalization", ["x", "s", "b"], axis=-2, epsilon=1e-3)], {"x": floats(2, 3, 4)},
          {"s": floats(3, 4), "b": floats(3, 4)}, opset)


# ---- pooling ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset, attrs", [
    (7, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2])),
    (8, dict(kernel_shape=[2, 3], storage_order=1)),
    (10, dict(kernel_shape=[3, 3], strides=[2, 2], dilations=[1, 2])),
    (11, dict(kernel_shape=[3, 3], auto_pad="SAME_UPPER", strides=[2, 2])),
    (12, dict(kernel_shape=[2, 2], pads=[0, 1, 1, 0])),
    (NEWEST, dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
])
def test_max_pool(opset, attrs):
    check([node("MaxPool", ["x"], **attrs)], {"x": floats(1, 2, 7, 8)}, opset=opset)


@pytest.mark.parametrize("opset, attrs", [
    (7, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1)),
    (7, dict(kernel_shape=[3, 3], pads=[1, 0, 1, 2])),
    (11, dict(kernel_shape=[3, 2], auto_pad="SAME_LOWER", strides=[2, 2])),
    (19, dict(kernel_shape=[2, 2], dilations=[2, 2], pads=[1, 1, 1, 1])),
    (19, dict(kernel_shape=[2, 2], dilations=[2, 1], count_include_pad=1, pads=[1, 0, 1, 0], strides=[2, 1])),
    (NEWEST, dict(kernel_shape=[3, 3], dilations=[2, 2], strides=[2, 2], ceil_mode=1, pads=[1, 1, 1, 1])),
    (NEWEST, dict(kernel_shape=[3, 3], strides=[2, 2], ceil_mode=1)),
])
def test_average_pool(opset, attrs):
    check([node("AveragePool", ["x"], **attrs)], {"x": floats(1, 2, 8, 9)}, opset=opset)


@pytest.mark.parametrize("attrs", [
    dict(kernel_shape=[2, 2, 2], dilations=[2, 2, 2]),
    dict(kernel_shape=[2, 3, 2], dilations=[2, 1, 3], strides=[2, 1, 1], pads=[1, 0, 1, 0, 1, 1]),
    dict(kernel_shape=[3, 2, 2], dilations=[1, 2, 2], strides=[2, 2, 1], pads=[1, 1, 1, 1, 1, 1], ceil_mode=1,
         count_include_pad=1),
])
def test_dilated_average_pool_in_3d_sums_its_taps(attrs):
    """PyTorch has no dilated 3-D pool: each window's sum is its taps' strided slices added, over ONNX's count."""
    graph = check([node("AveragePool", ["x"], **attrs)], {"x": floats(1, 2, 7, 8, 9)})
    kernel, ops = attrs["kernel_shape"], [n.op for n in graph]
    assert ops.count("add") == kernel[0] * kernel[1] * kernel[2] - 1 and "avg_pool3d" not in ops


@pytest.mark.parametrize("op", ["GlobalAveragePool", "GlobalMaxPool"])
@pytest.mark.parametrize("opset, shape", [(7, (2, 3, 4, 5)), (NEWEST, (2, 3, 5)), (NEWEST, (1, 2, 3, 2, 2))])
def test_global_pools(op, opset, shape):
    x = floats(*shape)
    # onnx's reference GlobalMaxPool keeps 2 spatial dims whatever the rank
    reduce = np.mean if op == "GlobalAveragePool" else np.max
    check([node(op, ["x"])], {"x": x}, opset=opset, expected=[reduce(x, axis=tuple(range(2, x.ndim)), keepdims=True)])


@pytest.mark.parametrize("attrs, shape", [
    (dict(kernel_shape=[2, 2], p=3), (1, 2, 5, 5)),
    (dict(kernel_shape=[3, 2], pads=[1, 0, 0, 1], strides=[2, 1]), (1, 3, 6, 5)),
    (dict(kernel_shape=[2, 2], dilations=[2, 1], p=1), (2, 2, 6, 4)),
    (dict(kernel_shape=[3], p=2), (1, 2, 7)),
    (dict(kernel_shape=[2, 2, 2], auto_pad="SAME_UPPER"), (1, 2, 3, 4, 5)),
])
def test_lp_pool(attrs, shape):
    """(sum of |x|^p over each window)^(1/p): a depthwise conv2d of ones (1-D as 2-D), 3-D an avg_pool3d times the
    window's size."""
    graph = check([node("LpPool", ["x"], **attrs)], {"x": floats(*shape)}, opset=18)
    assert ("avg_pool3d" if len(shape) == 5 else "conv2d") in [n.op for n in graph]


@pytest.mark.parametrize("k, activation, with_past, with_bias", [(4, "none", True, True), (3, "silu", False, False),
                                                                 (1, "swish", True, False)])
def test_causal_conv_with_state(k, activation, with_past, with_bias):
    """Opset 27: the past state in front of the input, a depthwise conv, the last k - 1 positions carried."""
    feeds = {"x": floats(2, 3, 5), "w": floats(3, 1, k)}
    inputs = ["x", "w", "b" if with_bias else "", "past" if with_past else ""]
    if with_bias:
        feeds["b"] = floats(3)
    if with_past:
        feeds["past"] = floats(2, 3, k - 1)
    graph = check([node("CausalConvWithState", inputs, ["y", "state"], activation=activation)], feeds, opset=27)
    assert "conv2d" in [n.op for n in graph]


@pytest.mark.parametrize("image, block, attrs", [
    ((5, 5), (2, 2), {}), ((6, 7), (3, 2), dict(strides=[2, 1], pads=[1, 0, 1, 1], dilations=[1, 2])),
    ((6, 7), (3, 2), dict(strides=[2, 1], pads=[1, 2, 1, 2], dilations=[1, 2])),
    ((7,), (3,), dict(strides=[2])), ((3, 4, 3), (2, 2, 2), {}),
])
def test_col2im(image, block, attrs):
    """Blocks summed back into an image: F.fold's col2im for a 2-D image padded alike on both sides, else a
    grouped conv_transpose of one-hot weights, the pads cropped."""
    spatial = len(image)
    strides, dilations = attrs.get("strides", [1] * spatial), attrs.get("dilations", [1] * spatial)
    pads = attrs.get("pads", [0] * 2 * spatial)
    counts = [(n + pads[d] + pads[d + spatial] - dil * (k - 1) - 1) // s + 1
              for d, (n, k, s, dil) in enumerate(zip(image, block, strides, dilations))]
    x = floats(2, 2 * int(np.prod(block)), int(np.prod(counts)))
    graph = check([node("Col2Im", ["x", "image", "block"], **attrs)], {"x": x},
                  {"image": np.array(image, np.int64), "block": np.array(block, np.int64)}, opset=18)
    folds = spatial == 2 and pads[:2] == pads[2:]
    assert ("col2im" if folds else "conv_transpose") in [n.op for n in graph]


# ---- activations and elementwise ---------------------------------------------------------------------

ACTIVATIONS = [("Relu", {}, [7, 14]), ("LeakyRelu", dict(alpha=0.2), [7, 16]), ("Sigmoid", {}, [7, 13]),
               ("Tanh", {}, [7, 13]), ("HardSigmoid", dict(alpha=0.3, beta=0.4), [7, 22]),
               ("HardSwish", {}, [14, 22]), ("Elu", dict(alpha=0.7), [7, 22]), ("Selu", {}, [7, 22]),
               ("Selu", dict(alpha=1.5, gamma=2.0), [7]), ("Softplus", {}, [7, 22]), ("Erf", {}, [9, 13]),
               ("Gelu", dict(approximate="tanh"), [20]), ("Sqrt", {}, [7, 13]), ("Exp", {}, [7, 13]),
               ("Log", {}, [7, 13]), ("Neg", {}, [7, 13]), ("Abs", {}, [7, 13]), ("Reciprocal", {}, [7, 13]),
               ("Identity", {}, [7, 13, 16])]


@pytest.mark.parametrize("op, attrs, opset", [(op, a, v) for op, a, vs in ACTIVATIONS for v in vs])
def test_activations(op, attrs, opset):
    x = floats(3, 4, 5) * 4
    if op in ("Sqrt", "Log"):
        x = np.abs(x) + 0.1
    check([node(op, ["x"], **attrs)], {"x": x}, opset=opset)


@pytest.mark.parametrize("opset", [7, 9, 16])
@pytest.mark.parametrize("slope", [(3, 1, 1), (1,), (4,)])
def test_prelu(opset, slope):
    check([node("PRelu", ["x", "slope"])], {"x": floats(2, 3, 2, 4)}, {"slope": floats(*slope)}, opset)


@pytest.mark.parametrize("opset", [7, 13, 14])
@pytest.mark.parametrize("op", ["Add", "Sub", "Mul", "Div", "Pow"])
def test_binary_broadcast(opset, op):
    check([node(op, ["a", "b"])], {"a": np.abs(floats(2, 1, 4)) + 0.5, "b": floats(3, 1)}, opset=opset)


@pytest.mark.parametrize("opset", [7, 8, 13])
@pytest.mark.parametrize("op", ["Sum", "Mean", "Max", "Min"])
def test_variadic(opset, op):
    feeds = {"a": floats(2, 3, 4), "b": floats(3, 1), "c": floats(4)} if opset >= 8 else \
        {"a": floats(3, 4), "b": floats(3, 4), "c": floats(3, 4)}     # broadcasting from opset 8
    check([node(op, ["a", "b", "c"])], feeds, opset=opset)
    check([node(op, ["a"])], {"a": floats(3, 4)}, opset=opset)


@pytest.mark.parametrize("opset, inputs, attrs", [
    (7, ["x"], dict(min=-0.5, max=0.7)), (7, ["x"], dict(max=0.2)), (11, ["x", "lo", "hi"], {}),
    (12, ["x", "", "hi"], {}), (13, ["x", "lo"], {}), (13, ["x"], {}),
])
def test_clip(opset, inputs, attrs):
    weights = {"lo": np.float32(-0.3), "hi": np.float32(0.4)}
    check([node("Clip", inputs, **attrs)], {"x": floats(3, 5)}, {k: v for k, v in weights.items() if k in inputs},
          opset)


def test_clip_int32_opset_12():
    x = rng.integers(-10, 10, (4, 5)).astype(np.int32)
    check([node("Clip", ["x", "lo", "hi"])], {"x": x}, {"lo": np.int32(-3), "hi": np.int32(5)}, 12)


@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
@pytest.mark.parametrize("opset, axis", [(7, 1), (11, 1), (11, -1), (11, None), (13, 1), (NEWEST, None)])
def test_softmax_axis_coercion(op, opset, axis):
    """Before opset 13 the input is coerced to 2-D at `axis` (default 1) and normalised over the flattened tail;
    from 13 over `axis` alone (default -1). The reference has only the opset-13 meaning, so values are made here."""
    x = floats(2, 3, 4) * 3
    attrs = {} if axis is None else {"axis": axis}
    axis = (1 if opset < 13 else -1) if axis is None else axis
    t = torch.from_numpy(x).double()
    fn = torch.softmax if op == "Softmax" else torch.log_softmax
    expected = fn(t.reshape(int(np.prod(x.shape[:axis % 3])), -1), 1).reshape(x.shape) if opset < 13 else fn(t, axis)
    check([node(op, ["x"], **attrs)], {"x": x}, opset=opset, expected=[expected.float().numpy()])


def test_log_softmax_of_far_apart_values_is_finite():
    x = np.array([[0.0, -200.0, 10.0]], np.float32)   # onnx's reference: log(softmax) = log(0) = -inf
    expected = torch.log_softmax(torch.from_numpy(x).double(), 1).float().numpy()
    assert np.isfinite(expected).all()
    check([node("LogSoftmax", ["x"], axis=1)], {"x": x}, opset=13, expected=[expected])


@pytest.mark.parametrize("opset", [7, 11, 13])
@pytest.mark.parametrize("op", ["Equal", "Less", "Greater"])
def test_comparisons(opset, op):
    a, b = rng.integers(0, 3, (3, 4)).astype(np.int64), rng.integers(0, 3, (4,)).astype(np.int64)
    check([node(op, ["a", "b"])], {"a": a, "b": b}, opset=opset)
    check([node(op, ["a", "b"])], {"a": floats(2, 3), "b": floats(3)}, opset=opset)


@pytest.mark.parametrize("op", ["And", "Or", "Xor", "Not"])
def test_logical(op):
    a, b = rng.integers(0, 2, (3, 4)).astype(bool), rng.integers(0, 2, (4,)).astype(bool)
    check([node(op, ["a"] if op == "Not" else ["a", "b"])], {"a": a} if op == "Not" else {"a": a, "b": b}, opset=7)


@pytest.mark.parametrize("opset", [9, 16])
def test_where(opset):
    c = rng.integers(0, 2, (3, 1)).astype(bool)
    check([node("Where", ["c", "a", "b"])], {"c": c, "a": floats(3, 4), "b": floats(4)}, opset=opset)


@pytest.mark.parametrize("opset, to", [(7, TensorProto.INT32), (13, TensorProto.FLOAT16), (19, TensorProto.INT64),
                                       (NEWEST, TensorProto.DOUBLE)])
def test_cast(opset, to):
    check([node("Cast", ["x"], to=to)], {"x": floats(3, 4) * 10}, opset=opset)


# ---- reductions ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["ReduceMean", "ReduceSum", "ReduceMax", "ReduceMin"])
@pytest.mark.parametrize("opset", [7, 11, 13, 18, NEWEST])
@pytest.mark.parametrize("axes, keepdims", [([1], 1), ([0, -1], 0), (None, 1)])
def test_reductions(op, opset, axes, keepdims):
    """axes an attribute until opset 13 (ReduceSum) or 18 (the others), an input after."""
    as_input = opset >= (13 if op == "ReduceSum" else 18)
    attrs, inputs, weights = {"keepdims": keepdims}, ["x"], {}
    if axes is not None:
        if as_input:
            inputs.append("axes")
            weights["axes"] = np.array(axes, np.int64)
        else:
            attrs["axes"] = axes
    check([node(op, inputs, **attrs)], {"x": floats(2, 3, 4)}, weights, opset)


def test_reduce_with_empty_axes_and_noop():
    check([node("ReduceMax", ["x", "axes"], noop_with_empty_axes=1)], {"x": floats(2, 3)},
          {"axes": np.array([], np.int64)}, 18)


# ---- layout -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("opset", [7, 13, 14, NEWEST])
@pytest.mark.parametrize("shape", [(0, -1), (-1, 4), (2, 0, 2, -1)])
def test_reshape(opset, shape):
    check([node("Reshape", ["x", "shape"])], {"x": floats(2, 3, 4)}, {"shape": ints(*shape)}, opset)


@pytest.mark.parametrize("opset, axis", [(7, 2), (9, 0), (11, -1), (13, 1), (NEWEST, -2)])
def test_flatten(opset, axis):
    check([node("Flatten", ["x"], axis=axis)], {"x": floats(2, 3, 4)}, opset=opset)


@pytest.mark.parametrize("opset", [7, 11, 13, 21, NEWEST])
def test_squeeze_and_unsqueeze(opset):
    """axes an attribute before opset 13 (negative from 11), an input from 13."""
    axes = [0, 3] if opset < 11 else [0, -1]
    if opset < 13:
        nodes = [node("Unsqueeze", ["x"], ["u"], axes=axes), node("Squeeze", ["u"], axes=axes)]
        weights = {}
    else:
        nodes = [node("Unsqueeze", ["x", "axes"], ["u"]), node("Squeeze", ["u", "axes"])]
        weights = {"axes": ints(*axes)}
    check(nodes, {"x": floats(3, 1, 4)}, weights, opset)
    check([node("Squeeze", ["x"])], {"x": floats(3, 1, 4, 1)}, opset=opset)


@pytest.mark.parametrize("opset", [7, 13, NEWEST])
def test_transpose(opset):
    check([node("Transpose", ["x"], perm=[2, 0, 1])], {"x": floats(2, 3, 4)}, opset=opset)
    check([node("Transpose", ["x"])], {"x": floats(2, 3, 4)}, opset=opset)


@pytest.mark.parametrize("opset, axis", [(7, 1), (11, -1), (13, 0)])
def test_concat(opset, axis):
    shapes = {1: [(2, 3, 4), (2, 1, 4)], -1: [(2, 3, 4), (2, 3, 2)], 0: [(2, 3, 4), (1, 3, 4)]}[axis]
    check([node("Concat", ["a", "b"], axis=axis)], {"a": floats(*shapes[0]), "b": floats(*shapes[1])}, opset=opset)


@pytest.mark.parametrize("opset, how", [(7, "attr"), (11, "equal"), (13, "input"), (18, "num_outputs"),
                                        (NEWEST, "input")])
def test_split(opset, how):
    """split an attribute before 13 and an input from 13; num_outputs (uneven last part) from 18."""
    outputs, attrs, inputs, weights = ["p", "q", "r"], {"axis": 1}, ["x"], {}
    if how == "attr":
        attrs["split"] = [1, 2, 3]
    elif how == "input":
        inputs.append("split")
        weights["split"] = ints(1, 2, 3)
    elif how == "num_outputs":
        attrs["num_outputs"] = 3
        outputs = ["p", "q", "r"]
    x = floats(2, 6 if how != "num_outputs" else 7)
    check([node("Split", inputs, outputs, **attrs)], {"x": x}, weights, opset)


@pytest.mark.parametrize("opset", [7, 10, 11, 13])
def test_slice(opset):
    """starts/ends/axes attributes before opset 10, inputs (with steps) from 10; negative and clamped bounds."""
    if opset < 10:
        nodes, weights = [node("Slice", ["x"], starts=[1, -3], ends=[100, -1], axes=[0, 2])], {}
    else:
        nodes = [node("Slice", ["x", "starts", "ends", "axes", "steps"])]
        weights = {"starts": ints(1, -1), "ends": ints(100, -5), "axes": ints(0, 2), "steps": ints(1, -2)}
    check(nodes, {"x": floats(3, 4, 6)}, weights, opset)


@pytest.mark.parametrize("opset", [7, 11, 13])
@pytest.mark.parametrize("indices", [ints(0, 2, 1), np.array(1, np.int64), ints(-1, 0).reshape(2, 1)])
def test_gather(opset, indices):
    if opset < 11 and (indices < 0).any():
        pytest.skip("negative indices from opset 11")
    check([node("Gather", ["x", "i"], axis=1)], {"x": floats(2, 3, 4)}, {"i": indices}, opset)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
@pytest.mark.parametrize("opset", [7, 11, 13, 18, 19, NEWEST])
def test_pad(mode, opset):
    """pads (and value) attributes before opset 11, inputs from 11; axes from 18."""
    x = floats(1, 3, 4, 5)
    pads = [0, 0, 1, 2, 0, 1, 2, 1]
    if opset < 11:
        nodes, weights = [node("Pad", ["x"], mode=mode, pads=pads, value=1.5)], {}
    elif opset < 18:
        nodes, weights = [node("Pad", ["x", "pads", "value"], mode=mode)], {"pads": ints(*pads),
                                                                              "value": np.float32(1.5)}
    else:
        nodes = [node("Pad", ["x", "pads", "value", "axes"], mode=mode)]
        weights = {"pads": ints(1, 2, 2, 1), "value": np.float32(1.5), "axes": ints(2, -1)}
    check(nodes, {"x": x}, weights, opset)


@pytest.mark.parametrize("mode", ["constant", "edge", "reflect"])
def test_negative_pads_crop(mode):
    # onnx's reference refuses negative pads: the crop, then numpy's pad
    x = floats(3, 5)
    expected = np.pad(x[:, 2:], ((1, 0), (0, 2)), mode=mode)
    check([node("Pad", ["x", "pads"], mode=mode)], {"x": x}, {"pads": ints(1, -2, 0, 2)}, 13, [expected])


def test_pad_wrap_opset_19():
    check([node("Pad", ["x", "pads"], mode="wrap")], {"x": floats(2, 3, 4)}, {"pads": ints(0, 1, 3, 0, 2, 2)}, 19)


# ---- Resize and Upsample ---------------------------------------------------------------------------------

RESIZE_11 = [dict(mode="nearest"), dict(mode="nearest", nearest_mode="ceil", coordinate_transformation_mode="asymmetric"),
             dict(mode="nearest", nearest_mode="round_prefer_ceil", coordinate_transformation_mode="align_corners"),
             dict(mode="linear"), dict(mode="linear", coordinate_transformation_mode="align_corners"),
             dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel"),
             dict(mode="cubic"), dict(mode="cubic", cubic_coeff_a=-0.5, exclude_outside=1)]


@pytest.mark.parametrize("opset", [11, 13, 18, NEWEST])
@pytest.mark.parametrize("attrs", RESIZE_11)
@pytest.mark.parametrize("scales", [(1, 1, 2, 1.5), (1, 1, 0.6, 0.5)])
def test_resize_scales(opset, attrs, scales):
    check([node("Resize", ["x", "roi", "scales"], **attrs)], {"x": floats(1, 2, 5, 4)},
          {"roi": np.array([], np.float32), "scales": np.array(scales, np.float32)}, opset)


@pytest.mark.parametrize("opset", [13, 18])
@pytest.mark.parametrize("mode", ["nearest", "linear", "cubic"])
def test_resize_sizes(opset, mode):
    check([node("Resize", ["x", "", "", "sizes"], mode=mode)], {"x": floats(2, 1, 4, 6)},
          {"sizes": ints(2, 1, 7, 3)}, opset)


@pytest.mark.parametrize("attrs, sizes", [
    (dict(mode="linear", antialias=1, axes=[2, 3]), (3, 2)),
    (dict(mode="cubic", antialias=1), (1, 2, 3, 5)),
    (dict(mode="nearest", axes=[3], keep_aspect_ratio_policy="not_larger"), (9,)),
    (dict(mode="linear", axes=[2, 3], keep_aspect_ratio_policy="not_smaller"), (7, 5)),
])
def test_resize_opset_18_attributes(attrs, sizes):
    check([node("Resize", ["x", "", "", "sizes"], **attrs)], {"x": floats(1, 2, 6, 8)}, {"sizes": ints(*sizes)}, 18)


def test_resize_half_pixel_symmetric_and_tf_crop_and_resize():
    check([node("Resize", ["x", "", "scales"], mode="linear", coordinate_transformation_mode="half_pixel_symmetric")],
          {"x": floats(1, 1, 4, 5)}, {"scales": np.array([1, 1, 1.7, 0.7], np.float32)}, 19)
    check([node("Resize", ["x", "roi", "", "sizes"], mode="linear", extrapolation_value=10.0,
                coordinate_transformation_mode="tf_crop_and_resize")], {"x": floats(1, 1, 4, 4)},
          {"roi": np.array([0, 0, 0.4, -0.2, 1, 1, 1.2, 0.8], np.float32), "sizes": ints(1, 1, 3, 3)}, 13)


@pytest.mark.parametrize("mode", ["nearest", "linear"])
def test_resize_10_and_upsample_are_asymmetric(mode):
    """Resize 10, Upsample 7 (scales an attribute) and 9 (an input): x_in = x_out / scale, nearest rounding down;
    the expected values are Resize 11's with those attributes (the reference's Upsample has nearest only)."""
    x, scales = floats(1, 2, 3, 4), np.array([1, 1, 2, 3], np.float32)
    same = ReferenceEvaluator(model([node("Resize", ["x", "", "scales"], mode=mode, nearest_mode="floor",
                                          coordinate_transformation_mode="asymmetric")], {"x": x},
                                    {"scales": scales}, 13)).run(None, {"x": x})
    check([node("Resize", ["x", "scales"], mode=mode)], {"x": x}, {"scales": scales}, 10, same)
    check([node("Upsample", ["x"], mode=mode, scales=scales.tolist())], {"x": x}, opset=7, expected=same)
    check([node("Upsample", ["x", "scales"], mode=mode)], {"x": x}, {"scales": scales}, 9, same)


# ---- dropout, constants, shape ------------------------------------------------------------------------------

@pytest.mark.parametrize("opset, inputs, attrs", [(7, ["x"], dict(ratio=0.3)), (10, ["x"], {}),
                                                  (12, ["x", "ratio"], {}), (13, ["x", "ratio", "train"], {}),
                                                  (NEWEST, ["x"], {})])
def test_dropout_is_the_identity_at_inference(opset, inputs, attrs):
    weights = {"ratio": np.float32(0.4), "train": np.bool_(False)}
    check([node("Dropout", inputs, **attrs)], {"x": floats(3, 4)}, {k: weights[k] for k in inputs[1:]}, opset)


@pytest.mark.parametrize("opset, attrs", [
    (7, dict(value=numpy_helper.from_array(floats(3, 4)))), (12, dict(value_float=2.5)),
    (12, dict(value_ints=[1, 2, 3, 4])), (NEWEST, dict(value=numpy_helper.from_array(floats(4))))])
def test_constant(opset, attrs):
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else None
    dtype = np.int64 if "value_ints" in attrs else np.float32
    x = np.ones(value.shape if value is not None else (4,), dtype)
    check([node("Constant", [], ["c"], **attrs), node("Add", ["x", "c"])], {"x": x}, opset=opset)


@pytest.mark.parametrize("opset", [9, 20, NEWEST])
def test_constant_of_shape_and_shape(opset):
    value = numpy_helper.from_array(np.array([0.5], np.float32))
    nodes = [node("Shape", ["x"], ["s"]), node("ConstantOfShape", ["s"], ["c"], value=value),
             node("Add", ["x", "c"])]
    check(nodes, {"x": floats(2, 3)}, opset=opset)


@pytest.mark.parametrize("start, end", [(1, None), (-2, -1), (0, 10)])
def test_shape_start_and_end_opset_15(start, end):
    attrs = {"start": start} | ({} if end is None else {"end": end})
    check([node("Shape", ["x"], ["s"], **attrs), node("Cast", ["s"], to=FLOAT)], {"x": floats(2, 3, 4)}, opset=15)


@pytest.mark.parametrize("opset", [8, 13])
@pytest.mark.parametrize("shape", [(2, 1, 4), (3, 1), (1, 1, 1, 1)])
def test_expand(opset, shape):
    check([node("Expand", ["x", "shape"])], {"x": floats(3, 1)}, {"shape": ints(*shape)}, opset)


@pytest.mark.parametrize("opset", [7, 13])
def test_tile(opset):
    check([node("Tile", ["x", "r"])], {"x": floats(2, 3)}, {"r": ints(3, 2)}, opset)
    check([node("Tile", ["x", "r"])], {"x": rng.integers(0, 9, (2, 1, 3))}, {"r": ints(1, 4, 1)}, opset)
