"""ONNX frontend: models built with onnx.helper, imported, run by the IR interpreter, compared with ONNX's reference."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from opfuse.frontend.onnx_import import load_onnx
from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.interpret import interpret

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
rng = np.random.default_rng(0)


def value(name, shape, dtype=FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def random(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def save(tmp_path, nodes, inputs, outputs, weights=None, opset=17, value_info=(), extra_opsets=()):
    """Write a one-graph model to tmp_path/model.onnx; `weights` (name -> array) become initializers."""
    initializers = [numpy_helper.from_array(np.asarray(a), n) for n, a in (weights or {}).items()]
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=initializers, value_info=value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset), *extra_opsets])
    path = tmp_path / "model.onnx"
    onnx.save(model, path)
    return path


def check_against_reference(path, feeds: dict[str, np.ndarray], batch=None) -> Graph:
    """Import, interpret and compare every output with onnx.reference; returns the imported graph."""
    graph = load_onnx(path, batch=batch)
    ours = interpret(graph, [torch.from_numpy(a) for a in feeds.values()])
    expected = ReferenceEvaluator(str(path)).run(None, feeds)
    assert len(ours) == len(expected)
    for got, want in zip(ours, expected):
        got = got.numpy()
        assert got.shape == want.shape and got.dtype == want.dtype
        if np.issubdtype(want.dtype, np.floating):
            error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
            assert error < 1e-5, f"relative error {error}"
        else:
            np.testing.assert_array_equal(got, want)
    return graph


def ops(graph: Graph) -> list[str]:
    return [n.op for n in graph if n.op not in ("input", "constant")]


# ---- numerics against the ONNX reference --------------------------------------------------------

def test_a_model_exported_with_torch_onnx_export_is_analysed(tmp_path):
    """The documented ONNX path works in the pinned environment (issue 19: torch.onnx.export needs onnxscript,
    which the install now brings): export, import, run, plan."""
    from opfuse.api import analyze

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    x = torch.randn(1, 3, 16, 16)
    path = tmp_path / "conv_bn_relu.onnx"
    torch.onnx.export(model, (x,), str(path))
    graph = load_onnx(path)
    (out,) = interpret(graph, [x])
    with torch.no_grad():
        assert torch.allclose(out, model(x), atol=1e-5)
    analysis = analyze(str(path))
    assert analysis.plan.kernel_launches == 1      # conv, folded BN and ReLU: one kernel


def test_conv_bn_relu(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "gamma", "beta", "mean", "var"], ["n"], epsilon=1e-3),
             helper.make_node("Relu", ["n"], ["y"])]
    weights = {"w": random(4, 3, 3, 3), "b": random(4), "gamma": random(4), "beta": random(4),
               "mean": random(4), "var": rng.uniform(0.5, 2, 4).astype(np.float32)}
    path = save(tmp_path, nodes, [value("x", [1, 3, 8, 8])], [value("y", [1, 4, 8, 8])], weights)
    graph = check_against_reference(path, {"x": random(1, 3, 8, 8)})
    assert ops(graph) == ["conv2d", "batch_norm", "relu"]
    conv = next(n for n in graph if n.op == "conv2d")
    assert conv.source == "conv1" and conv.attrs["padding"] == (1, 1)
    assert next(n for n in graph if n.op == "relu").source == "Relu#2"  # unnamed node: op type and index


def test_depthwise_conv_stride_2_padding(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], group=4, strides=[2, 2], pads=[1, 1, 1, 1])]
    path = save(tmp_path, nodes, [value("x", [2, 4, 9, 9])], [value("y", [2, 4, 5, 5])], {"w": random(4, 1, 3, 3)})
    graph = check_against_reference(path, {"x": random(2, 4, 9, 9)})
    (conv,) = [n for n in graph if n.op == "conv2d"]
    assert conv.attrs["groups"] == 4 and conv.attrs["stride"] == (2, 2) and conv.type.shape == (2, 4, 5, 5)


def test_conv_auto_pad_same_and_dilation(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME_UPPER", dilations=[2, 2])]
    path = save(tmp_path, nodes, [value("x", [1, 2, 7, 7])], [value("y", [1, 3, 7, 7])], {"w": random(3, 2, 3, 3)})
    graph = check_against_reference(path, {"x": random(1, 2, 7, 7)})
    assert next(n for n in graph if n.op == "conv2d").attrs["padding"] == (2, 2)


@pytest.mark.parametrize("op, attrs, inputs", [
    ("Conv", {"pads": [0, 0, 1, 1]}, 2), ("Conv", {"auto_pad": "SAME_LOWER"}, 2),
    ("Conv", {"auto_pad": "SAME_UPPER", "strides": [2, 2]}, 2),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1]}, 1),
    ("MaxPool", {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"}, 1),
    ("MaxPool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 0, 0, 1], "ceil_mode": 1}, 1),
    ("MaxPool", {"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]}, 1),                 # over half the window
    ("AveragePool", {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 0, 1, 1], "count_include_pad": 1}, 1)])
def test_asymmetric_padding_becomes_an_explicit_pad(tmp_path, op, attrs, inputs):
    """Caffe-era exports pad one side more (pads [top, left, bottom, right], or auto_pad with an even total), or a
    pool more than half its window, which PyTorch refuses: the input is padded explicitly (zeros for conv and counted
    average padding, -inf for max) and the window unpadded."""
    nodes = [helper.make_node(op, ["x", "w"][:inputs], ["y"], name="odd", **attrs)]
    path = save(tmp_path, nodes, [value("x", [1, 2, 9, 9])], [value("y", ["n", "c", "h", "w"])],
                {"w": random(3, 2, 2, 2)} if inputs == 2 else None)
    graph = check_against_reference(path, {"x": random(1, 2, 9, 9)})
    pad, window = [n for n in graph if n.op not in ("input", "constant")]
    assert pad.op == "pad" and window.attrs["padding"] == (0, 0)
    assert pad.attrs["value"] == (float("-inf") if op == "MaxPool" else 0.0)


@pytest.mark.parametrize("pads, ceil_mode, n", [([0, 0, 1, 1], 0, 9), ([2, 1, 2, 1], 0, 9), ([1, 0, 1, 2], 1, 9),
                                                ([2, 2, 2, 2], 1, 8)])
def test_uncounted_padding_the_pool_cannot_express_is_divided_out(tmp_path, pads, ceil_mode, n):
    """Average pooling that excludes asymmetric padding, or padding over half the window: the input is padded
    explicitly, pooled counting the zeros, and divided by each window's share inside the input. Expected values: the
    mean of each window's elements inside the input, as ONNX defines it; in ceil mode (opset 22) a last window that
    would start in the trailing padding is dropped (the last case), which PyTorch keeps on an explicitly padded
    input."""
    nodes = [helper.make_node("AveragePool", ["x"], ["y"], name="odd", kernel_shape=[3, 3], strides=[2, 2],
                              pads=pads, ceil_mode=ceil_mode)]
    path = save(tmp_path, nodes, [value("x", [1, 2, n, n])], [value("y", ["n", "c", "h", "w"])], opset=22)
    x = random(1, 2, n, n)
    (got,) = interpret(load_onnx(path), [torch.from_numpy(x)])
    top, left, bottom, right = pads
    padded = np.pad(x, ((0, 0), (0, 0), (top, bottom), (left, right)), constant_values=np.nan)
    size = [(m - 3 + 2 - 1) // 2 + 1 if ceil_mode else (m - 3) // 2 + 1 for m in padded.shape[2:]]
    size = [s - 1 if (s - 1) * 2 >= n + p else s for s, p in zip(size, (top, left))] if ceil_mode else size
    expected = np.array([[[[np.nanmean(padded[0, c, 2 * i:2 * i + 3, 2 * j:2 * j + 3]) for j in range(size[1])]
                           for i in range(size[0])] for c in range(2)]], np.float32)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6, atol=1e-6)
    assert "div" in ops(load_onnx(path))


def test_mlp_gemm_relu_softmax(tmp_path):
    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["logits"]),  # weight stored [K, N]: transposed at import
             helper.make_node("Softmax", ["logits"], ["y"], axis=1)]
    weights = {"w1": random(32, 16), "b1": random(32), "w2": random(32, 10), "b2": random(1, 10)}
    path = save(tmp_path, nodes, [value("x", [4, 16])], [value("y", [4, 10])], weights)
    graph = check_against_reference(path, {"x": random(4, 16)})
    assert ops(graph) == ["linear", "relu", "linear", "softmax"]
    assert all(len(n.inputs) == 3 for n in graph if n.op == "linear")  # the bias went into linear


def test_gemm_general_form(tmp_path):
    nodes = [helper.make_node("Gemm", ["a", "b", "c"], ["y"], alpha=0.5, beta=2.0, transA=1, transB=1)]
    path = save(tmp_path, nodes, [value("a", [6, 3]), value("b", [5, 6])], [value("y", [3, 5])], {"c": random(5)})
    graph = check_against_reference(path, {"a": random(6, 3), "b": random(5, 6)})
    assert "matmul" in ops(graph) and "linear" not in ops(graph)


def test_matmul_with_constant_becomes_linear_else_matmul(tmp_path):
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("MatMul", ["h", "z"], ["y"])]
    path = save(tmp_path, nodes, [value("x", [2, 3, 8]), value("z", [2, 6, 4])], [value("y", [2, 3, 4])],
                {"w": random(8, 6)})
    graph = check_against_reference(path, {"x": random(2, 3, 8), "z": random(2, 6, 4)})
    assert ops(graph) == ["linear", "matmul"]


def _erf_gelu_nodes(variant):
    """x*0.5*(1+erf(x/sqrt2)) as the PyTorch exporter writes it, and (x*0.5)*(1+erf(x*0.7071)) as others do."""
    if variant == "torch":
        return [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                helper.make_node("Add", ["e", "one"], ["p"]), helper.make_node("Mul", ["x", "p"], ["m"]),
                helper.make_node("Mul", ["m", "half"], ["y"])]
    return [helper.make_node("Mul", ["x", "inv_sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["one", "e"], ["p"]), helper.make_node("Mul", ["x", "half"], ["h"]),
            helper.make_node("Mul", ["h", "p"], ["y"])]


@pytest.mark.parametrize("variant", ["torch", "scaled"])
def test_erf_gelu_pattern_becomes_one_gelu(tmp_path, variant):
    weights = {"sqrt2": np.float32(math.sqrt(2)), "inv_sqrt2": np.float32(0.70710678), "one": np.float32(1.0),
               "half": np.float32(0.5)}
    path = save(tmp_path, _erf_gelu_nodes(variant), [value("x", [2, 16])], [value("y", [2, 16])], weights)
    graph = check_against_reference(path, {"x": random(2, 16)})
    assert ops(graph) == ["gelu"] and not graph.constants


def test_erf_not_in_gelu_form_is_kept(tmp_path):
    nodes = _erf_gelu_nodes("torch")
    weights = {"sqrt2": np.float32(math.sqrt(2)), "one": np.float32(1.0), "half": np.float32(0.25)}
    path = save(tmp_path, nodes, [value("x", [2, 16])], [value("y", [2, 16])], weights)
    graph = check_against_reference(path, {"x": random(2, 16)})
    assert "gelu" not in ops(graph) and "erf" in ops(graph)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_op_opset_20(tmp_path, approximate):
    nodes = [helper.make_node("Gelu", ["x"], ["y"], approximate=approximate)]
    path = save(tmp_path, nodes, [value("x", [3, 8])], [value("y", [3, 8])], opset=20)
    graph = check_against_reference(path, {"x": random(3, 8)})
    assert [n.attrs["approximate"] for n in graph if n.op == "gelu"] == [approximate]


def test_training_mode_batch_norm_uses_the_batch_statistics(tmp_path):
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "running_mean", "running_var"],
                              training_mode=1, momentum=0.8, epsilon=1e-2)]
    weights = {"s": random(3), "b": random(3), "m": random(3), "v": rng.uniform(0.5, 2, 3).astype(np.float32)}
    path = save(tmp_path, nodes, [value("x", [2, 3, 4, 5])],
                [value("y", [2, 3, 4, 5]), value("running_mean", [3]), value("running_var", [3])], weights, opset=15)
    x = random(2, 3, 4, 5)
    y, running_mean, running_var = interpret(load_onnx(path), [torch.from_numpy(x)])
    mean, var = x.mean(axis=(0, 2, 3)), x.var(axis=(0, 2, 3))
    channel = (1, 3, 1, 1)
    expected = (x - mean.reshape(channel)) / np.sqrt(var.reshape(channel) + 1e-2) * weights["s"].reshape(channel) \
        + weights["b"].reshape(channel)
    np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(running_mean.numpy(), weights["m"] * 0.8 + mean * 0.2, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(running_var.numpy(), weights["v"] * 0.8 + var * 0.2, rtol=1e-5, atol=1e-6)


def test_layer_normalization(tmp_path):
    nodes = [helper.make_node("LayerNormalization", ["x", "scale", "bias"], ["y"], axis=-1, epsilon=1e-5),
             helper.make_node("LayerNormalization", ["x", "scale2"], ["z"], axis=1)]
    weights = {"scale": random(8), "bias": random(8), "scale2": random(5, 8)}
    path = save(tmp_path, nodes, [value("x", [2, 5, 8])], [value("y", [2, 5, 8]), value("z", [2, 5, 8])], weights)
    graph = check_against_reference(path, {"x": random(2, 5, 8)})
    assert [n.attrs["normalized_shape"] for n in graph if n.op == "layer_norm"] == [(8,), (5, 8)]


def test_layer_normalization_mean_and_inverse_std_dev_outputs(tmp_path):
    """The optional outputs: the statistics over the normalised dims, kept as size 1, in the stash type."""
    nodes = [helper.make_node("LayerNormalization", ["x", "scale"], ["y", "mean", "inv_std"], axis=1, epsilon=0.1)]
    path = save(tmp_path, nodes, [value("x", [2, 3, 4])],
                [value("y", [2, 3, 4]), value("mean", [2, 1, 1]), value("inv_std", [2, 1, 1])], {"scale": random(3, 4)})
    graph = check_against_reference(path, {"x": random(2, 3, 4)})
    assert [graph[name].type.shape for name in graph.outputs] == [(2, 3, 4), (2, 1, 1), (2, 1, 1)]


def test_layout_ops(tmp_path):
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),             # [2, 3, 4] -> [2, 12]
             helper.make_node("Transpose", ["x"], ["t"], perm=[0, 2, 1]),     # [2, 4, 3]
             helper.make_node("Flatten", ["t"], ["f"], axis=1),               # [2, 12]
             helper.make_node("Concat", ["r", "f"], ["c"], axis=1),           # [2, 24]
             helper.make_node("Split", ["c", "split"], ["s0", "s1", "s2"], axis=-1),
             helper.make_node("Unsqueeze", ["s1", "axes"], ["u"]),           # [2, 1, 10]
             helper.make_node("Squeeze", ["u", "axes"], ["q"]),
             helper.make_node("Slice", ["q", "starts", "ends", "slice_axes", "steps"], ["sl"]),
             helper.make_node("Gather", ["t", "index"], ["g"], axis=1)]       # t[:, 2, :]
    weights = {"shape": np.array([0, -1], np.int64), "split": np.array([4, 10, 10], np.int64),
               "axes": np.array([1], np.int64), "starts": np.array([1, -8], np.int64),
               "ends": np.array([2, 1000], np.int64), "slice_axes": np.array([0, 1], np.int64),
               "steps": np.array([1, 3], np.int64), "index": np.array(2, np.int64)}
    outputs = [value("s0", [2, 4]), value("s2", [2, 10]), value("q", [2, 10]), value("sl", [1, 3]),
               value("g", [2, 3])]
    path = save(tmp_path, nodes, [value("x", [2, 3, 4])], outputs, weights)
    graph = check_against_reference(path, {"x": random(2, 3, 4)})
    assert {"reshape", "permute", "cat", "slice"} <= set(ops(graph))
    assert ops(graph).count("slice") >= 3  # one per used Split output, the Slice, the Gather


@pytest.mark.parametrize("starts, ends, steps", [([-1], [-1000], [-1]), ([20], [0], [-2]), ([3], [-6], [-3])])
def test_slice_backwards(tmp_path, starts, ends, steps):
    """A negative step walks back from start (clamped to the last element) to before end (clamped to -1)."""
    nodes = [helper.make_node("Slice", ["x", "starts", "ends", "axes", "steps"], ["y"])]
    weights = {"starts": np.array(starts, np.int64), "ends": np.array(ends, np.int64),
               "axes": np.array([1], np.int64), "steps": np.array(steps, np.int64)}
    path = save(tmp_path, nodes, [value("x", [2, 7])], [value("y", [2, "n"])], weights)
    x = random(2, 7)
    (got,) = interpret(load_onnx(path), [torch.from_numpy(x)])
    np.testing.assert_array_equal(got.numpy(), x[:, slice(starts[0], ends[0] if ends[0] > -7 else None, steps[0])])


def test_shape_arithmetic_is_folded_into_reshape(tmp_path):
    """Exporters compute Reshape targets from Shape(x): that folds to a constant, then a plain reshape."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "zero_axes"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus_one"], ["target"], axis=0),
             helper.make_node("Reshape", ["x", "target"], ["y"])]
    weights = {"zero": np.array(0, np.int64), "zero_axes": np.array([0], np.int64),
               "minus_one": np.array([-1], np.int64)}
    path = save(tmp_path, nodes, [value("x", ["batch", 3, 4])], [value("y", ["batch", 12])], weights)
    graph = check_against_reference(path, {"x": random(5, 3, 4)}, batch=5)
    assert ops(graph) == ["reshape"] and graph[graph.outputs[0]].type.shape == (5, 12)


def test_pools(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["x"], ["a"], kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("AveragePool", ["x"], ["a2"], kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["x"], ["g"])]
    outputs = [value("m", [1, 3, 5, 5]), value("a", [1, 3, 5, 5]), value("a2", [1, 3, 4, 4]),
               value("g", [1, 3, 1, 1])]
    path = save(tmp_path, nodes, [value("x", [1, 3, 9, 9])], outputs)
    graph = check_against_reference(path, {"x": random(1, 3, 9, 9)})
    assert ops(graph) == ["max_pool2d", "avg_pool2d", "avg_pool2d", "adaptive_avg_pool2d"]


def test_1d_pools_are_2d_pools_one_high(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[3], strides=[2]),
             helper.make_node("AveragePool", ["x"], ["a"], kernel_shape=[3], pads=[1, 1]),
             helper.make_node("AveragePool", ["x"], ["s"], kernel_shape=[2], auto_pad="SAME_UPPER")]
    path = save(tmp_path, nodes, [value("x", [2, 3, 9])],
                [value("m", [2, 3, 4]), value("a", [2, 3, 9]), value("s", [2, 3, 9])])
    graph = check_against_reference(path, {"x": random(2, 3, 9)})
    assert {"max_pool2d", "avg_pool2d"} <= set(ops(graph))


def test_3d_pools(tmp_path):
    nodes = [helper.make_node("MaxPool", ["x"], ["m"], kernel_shape=[2, 2, 2], dilations=[2, 2, 2]),
             helper.make_node("AveragePool", ["x"], ["a"], kernel_shape=[3, 3, 3], strides=[2, 2, 2],
                              pads=[1, 1, 1, 1, 1, 1], count_include_pad=1)]
    path = save(tmp_path, nodes, [value("x", [1, 2, 6, 6, 6])],
                [value("m", [1, 2, 4, 4, 4]), value("a", [1, 2, 3, 3, 3])])
    graph = check_against_reference(path, {"x": random(1, 2, 6, 6, 6)})
    assert ops(graph) == ["max_pool3d", "avg_pool3d"]


def test_clip(tmp_path):
    nodes = [helper.make_node("Clip", ["x", "lo", "hi"], ["y"]),
             helper.make_node("Clip", ["x", "", "hi"], ["z"]),
             helper.make_node("Clip", ["x", "floor"], ["w"])]  # a bound known only at run time
    path = save(tmp_path, nodes, [value("x", [4, 5]), value("floor", [])],
                [value("y", [4, 5]), value("z", [4, 5]), value("w", [4, 5])],
                {"lo": np.float32(-0.5), "hi": np.float32(0.7)})
    graph = check_against_reference(path, {"x": random(4, 5), "floor": np.array(0.1, np.float32)})
    clamps = [n.attrs for n in graph if n.op == "clamp"]
    assert {"min": pytest.approx(-0.5), "max": pytest.approx(0.7)} in clamps
    assert "maximum" in ops(graph)


@pytest.mark.parametrize("opset", [17, 18])
def test_reduce_mean(tmp_path, opset):
    if opset == 17:
        nodes = [helper.make_node("ReduceMean", ["x"], ["y"], axes=[1, -1], keepdims=0),
                 helper.make_node("ReduceMean", ["x"], ["z"])]
        weights = {}
    else:  # from opset 18 the axes are an input
        nodes = [helper.make_node("ReduceMean", ["x", "axes"], ["y"], keepdims=0),
                 helper.make_node("ReduceMean", ["x"], ["z"])]
        weights = {"axes": np.array([1, -1], np.int64)}
    path = save(tmp_path, nodes, [value("x", [2, 3, 4])], [value("y", [2]), value("z", [1, 1, 1])], weights,
                opset=opset)
    graph = check_against_reference(path, {"x": random(2, 3, 4)})
    assert [n.attrs["dims"] for n in graph if n.op == "mean"] == [[1, 2], [0, 1, 2]]


def test_gather_embedding(tmp_path):
    nodes = [helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)]
    path = save(tmp_path, nodes, [value("ids", [2, 3], INT64)], [value("y", [2, 3, 4])], {"table": random(10, 4)})
    graph = check_against_reference(path, {"ids": rng.integers(0, 10, (2, 3)).astype(np.int64)})
    assert ops(graph) == ["embedding"]


def test_gather_with_indices_known_at_run_time(tmp_path):
    """Indices of any rank, negative ones counting from the end, along any axis: the IR's take."""
    nodes = [helper.make_node("Gather", ["x", "ids"], ["y"], axis=1)]
    path = save(tmp_path, nodes, [value("x", [2, 5, 3]), value("ids", [2, 2], INT64)], [value("y", [2, 2, 2, 3])])
    graph = check_against_reference(path, {"x": random(2, 5, 3), "ids": np.array([[0, -1], [4, -5]], np.int64)})
    assert ops(graph) == ["take"]


def test_small_elementwise_ops(tmp_path):
    nodes = [helper.make_node("Sub", ["x", "c"], ["a"]), helper.make_node("Div", ["a", "c"], ["b"]),
             helper.make_node("Sigmoid", ["b"], ["s"]), helper.make_node("Tanh", ["s"], ["t"]),
             helper.make_node("HardSigmoid", ["t"], ["h"]), helper.make_node("HardSwish", ["h"], ["w"]),
             helper.make_node("Dropout", ["w"], ["d"]), helper.make_node("Identity", ["d"], ["i"]),
             helper.make_node("Cast", ["i"], ["y"], to=TensorProto.DOUBLE)]
    path = save(tmp_path, nodes, [value("x", [3, 4])], [value("y", [3, 4], TensorProto.DOUBLE)],
                {"c": rng.uniform(1, 2, 4).astype(np.float32)})
    graph = check_against_reference(path, {"x": random(3, 4)})
    assert graph[graph.outputs[0]].type.dtype == "float64"


def test_integer_div_truncates_toward_zero(tmp_path):
    nodes = [helper.make_node("Div", ["x", "y"], ["z"])]
    path = save(tmp_path, nodes, [value("x", [4], TensorProto.INT32), value("y", [4], TensorProto.INT32)],
                [value("z", [4], TensorProto.INT32)])
    graph = check_against_reference(path, {"x": np.array([7, -7, 7, -7], np.int32),
                                           "y": np.array([2, 2, -2, -2], np.int32)})
    assert ops(graph) == ["trunc_div"]
    (z,) = interpret(graph, [torch.tensor([7, -7, 7, -7], dtype=torch.int32), torch.tensor([2, 2, -2, -2],
                                                                                          dtype=torch.int32)])
    assert z.tolist() == [3, -3, -3, 3]


def test_pow_has_its_base_type(tmp_path):
    nodes = [helper.make_node("Pow", ["x", "y"], ["z"])]
    path = save(tmp_path, nodes, [value("x", [4], TensorProto.INT32), value("y", [4])],
                [value("z", [4], TensorProto.INT32)])
    graph = check_against_reference(path, {"x": np.array([1, 2, 3, -3], np.int32),
                                           "y": np.array([4.0, 0.5, 2.5, 3.0], np.float32)})
    assert ops(graph) == ["pow", "cast"]


def test_dropout_mask_and_training_mode(tmp_path):
    """At inference Dropout passes its input and a mask of ones; in training mode only a ratio of 0 does that."""
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"]),
             helper.make_node("Dropout", ["x", "zero", "yes"], ["z", "kept"])]
    path = save(tmp_path, nodes, [value("x", [3, 4])], [value("y", [3, 4]), value("mask", [3, 4], TensorProto.BOOL),
                                                        value("z", [3, 4]), value("kept", [3, 4], TensorProto.BOOL)],
                {"zero": np.float32(0.0), "yes": np.bool_(True)}, opset=13)
    x = random(3, 4)
    y, mask, z, kept = interpret(load_onnx(path), [torch.from_numpy(x)])
    assert torch.equal(y, torch.from_numpy(x)) and torch.equal(z, y) and mask.dtype == torch.bool
    assert mask.all() and kept.all() and mask.shape == (3, 4)
    random_dropout = [helper.make_node("Dropout", ["x", "half", "yes"], ["y"])]
    path = save(tmp_path, random_dropout, [value("x", [3, 4])], [value("y", [3, 4])],
                {"half": np.float32(0.5), "yes": np.bool_(True)}, opset=13)
    (node,) = [n for n in load_onnx(path) if n.op == "opaque"]
    assert "training mode (random)" in node.attrs["reason"]


def test_softmax_before_opset_13_normalises_the_flattened_tail(tmp_path):
    nodes = [helper.make_node("Softmax", ["x"], ["y"], axis=1)]
    path = save(tmp_path, nodes, [value("x", [2, 3, 4])], [value("y", [2, 3, 4])], opset=11)
    x = random(2, 3, 4)
    (got,) = interpret(load_onnx(path), [torch.from_numpy(x)])
    # onnx.reference implements only the opset-13 meaning, so the expected values are computed here
    expected = torch.softmax(torch.from_numpy(x).reshape(2, 12), dim=1).reshape(2, 3, 4)
    torch.testing.assert_close(got, expected)
    assert got.sum(dim=(1, 2)).allclose(torch.ones(2))


# ---- unknown ops -------------------------------------------------------------------------------

def test_unknown_ops_become_named_opaque_nodes(tmp_path):
    nodes = [helper.make_node("Bernoulli", ["x"], ["h"], name="draw", seed=3.0),
             helper.make_node("MyPair", ["h"], ["values", "indices"], domain="acme"),
             helper.make_node("MyOp", ["values"], ["m"], domain="acme", alpha=2.0),
             helper.make_node("Relu", ["m"], ["y"])]
    path = save(tmp_path, nodes, [value("x", [2, 6])], [value("y", [2, 3]), value("indices", [2, 3], INT64)],
                {}, value_info=[value("m", [2, 3]), value("values", [2, 3])],
                extra_opsets=[helper.make_opsetid("acme", 1)])
    graph = load_onnx(path)
    opaque = {n.attrs["target"]: n for n in graph if n.op == "opaque"}
    assert set(opaque) == {"onnx::Bernoulli", "onnx::acme.MyPair", "onnx::acme.MyOp"}
    assert opaque["onnx::Bernoulli"].source == "draw" and opaque["onnx::Bernoulli"].attrs["onnx_attrs"] == {"seed": 3.0}
    assert opaque["onnx::acme.MyOp"].attrs["onnx_attrs"] == {"alpha": 2.0}
    pair = [n for n in graph if n.attrs.get("target") == "onnx::acme.MyPair"]
    assert sorted((n.attrs["output_index"], str(n.type)) for n in pair) == [(0, "float32[2,3]"), (1, "int64[2,3]")]
    assert "relu" in ops(graph)
    with pytest.raises(GraphError, match="analysed but not run"):
        interpret(graph, [torch.randn(2, 6)])


def test_unknown_op_without_a_known_shape_is_a_clear_error(tmp_path):
    nodes = [helper.make_node("MyOp", ["x"], ["y"], name="mystery", domain="acme")]
    path = save(tmp_path, nodes, [value("x", [2, 6])], [value("y", [None, None])],
                extra_opsets=[helper.make_opsetid("acme", 1)])
    with pytest.raises(GraphError, match=r"'mystery' \(MyOp\).*value_info"):
        load_onnx(path)


# ---- files, errors, batch ---------------------------------------------------------------------------

def _relu_model(tmp_path, shape):
    return save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [value("x", shape)], [value("y", shape)])


def test_missing_truncated_and_garbage_files(tmp_path):
    missing = tmp_path / "absent.onnx"
    with pytest.raises(GraphError, match="absent.onnx"):
        load_onnx(missing)
    good = _relu_model(tmp_path, [1, 3, 8, 8]).read_bytes()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good[: len(good) // 2])
    with pytest.raises(GraphError, match="truncated.onnx"):
        load_onnx(truncated)
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(bytes(rng.integers(0, 256, 300, dtype=np.uint8)))
    with pytest.raises(GraphError, match="garbage.onnx"):
        load_onnx(garbage)


def test_bad_node_is_named(tmp_path):
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="broken_conv")]
    path = save(tmp_path, nodes, [value("x", [1, 3, 8, 8])], [value("y", [1, 4, 6, 6])], {"w": random(4, 2, 3)})
    with pytest.raises(GraphError, match="model.onnx.*broken_conv"):
        load_onnx(path)


def test_dynamic_batch_dim_gets_batch(tmp_path):
    path = _relu_model(tmp_path, ["N", 3, 8, 8])
    assert load_onnx(path).input_nodes[0].type.shape == (1, 3, 8, 8)
    graph = check_against_reference(path, {"x": random(4, 3, 8, 8)}, batch=4)
    assert graph.input_nodes[0].type.shape == (4, 3, 8, 8) and graph[graph.outputs[0]].type.shape == (4, 3, 8, 8)


def test_other_symbolic_dim_is_an_error_naming_the_input(tmp_path):
    path = _relu_model(tmp_path, ["N", 3, "height", 8])
    with pytest.raises(GraphError, match=r"input 'x'.*height.*fixed shape"):
        load_onnx(path)


def test_graph_input_that_is_an_initializer_is_a_constant(tmp_path):
    nodes = [helper.make_node("Add", ["x", "bias"], ["y"])]
    path = save(tmp_path, nodes, [value("x", [2, 3]), value("bias", [3])], [value("y", [2, 3])], {"bias": random(3)})
    graph = check_against_reference(path, {"x": random(2, 3)})
    assert [n.name for n in graph.input_nodes] == ["x"] and graph["bias"].op == "constant"


def lrn_by_the_spec(x: np.ndarray, size: int, alpha: float, beta: float, bias: float) -> np.ndarray:
    """ONNX's LRN definition, channel by channel (onnx 1.23's reference evaluator loops over the batch dim instead
    of the channels, so it cannot be the reference here)."""
    squares = np.zeros_like(x)
    for c in range(x.shape[1]):
        begin, end = max(0, c - (size - 1) // 2), min(x.shape[1], c + math.ceil((size - 1) / 2) + 1)
        squares[:, c] = (x[:, begin:end] ** 2).sum(axis=1)
    return x / (bias + alpha / size * squares) ** beta


@pytest.mark.parametrize("size", [5, 4])
def test_lrn_matches_the_onnx_definition(tmp_path, size):
    """AlexNet's and GoogLeNet's LRN: an odd window, and an even one (ONNX centres it one channel later than
    PyTorch's local_response_norm); it runs through PyTorch."""
    nodes = [helper.make_node("LRN", ["x"], ["y"], size=size, alpha=2e-3, beta=0.75, bias=2.0)]
    path = save(tmp_path, nodes, [value("x", [2, 7, 4, 3])], [value("y", [2, 7, 4, 3])])
    x = random(2, 7, 4, 3) * 3
    graph = load_onnx(path)
    assert ops(graph) == ["local_response_norm"]
    (got,) = interpret(graph, [torch.from_numpy(x)])
    np.testing.assert_allclose(got.numpy(), lrn_by_the_spec(x, size, 2e-3, 0.75, 2.0), rtol=1e-5, atol=1e-6)
    if size % 2:        # the same as PyTorch's where the window is symmetric
        expected = torch.nn.functional.local_response_norm(torch.from_numpy(x), size, 2e-3, 0.75, 2.0)
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)


def test_a_fixed_empty_first_dim_is_not_a_batch(tmp_path):
    """Only a symbolic first dim takes the batch: a model whose input is fixed at 0 rows imports (its batch is its
    own); a symbolic one given batch 0 is still an error."""
    fixed = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [value("x", [0, 3])], [value("y", [0, 3])])
    assert load_onnx(fixed, batch=0).input_nodes[0].type.shape == (0, 3)
    symbolic = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"])], [value("x", ["N", 3])], [value("y", ["N", 3])])
    with pytest.raises(GraphError, match="batch must be at least 1, got 0"):
        load_onnx(symbolic, batch=0)


def test_an_inference_error_inside_an_operators_own_function_body_is_not_the_models(tmp_path):
    """onnx 1.23's strict shape inference fails inside MeanVarianceNormalization's function body (a Constant of its
    own): shapes are then inferred leniently and the node imports; a malformed node of the model is still named."""
    nodes = [helper.make_node("MeanVarianceNormalization", ["x"], ["y"])]
    path = save(tmp_path, nodes, [value("x", [3, 3, 3, 1])], [value("y", [3, 3, 3, 1])], opset=13)
    with pytest.raises(Exception, match="op_type:MeanVarianceNormalization.*op_type:Constant"):
        onnx.shape_inference.infer_shapes(onnx.load(path), strict_mode=True)
    graph = load_onnx(path)
    assert graph[graph.outputs[0]].type.shape == (3, 3, 3, 1)
    bad = save(tmp_path, [helper.make_node("Add", ["x", "w"], ["y"], name="mismatched")],
               [value("x", [2, 3]), value("w", [4])], [value("y", [2, 3])])
    with pytest.raises(GraphError, match="shape inference failed.*mismatched"):
        load_onnx(bad)


def test_a_declared_shape_onnx_infers_otherwise_for_a_converted_operator_is_checked_by_the_converter(tmp_path):
    """onnx 1.23 infers STFT's bins as if onesided defaulted to 0 and fails strictly on a model declaring the 9 bins
    its definition gives: the converter's result is checked against the declared shape instead. A declared shape
    the operator cannot give is still an error naming the node."""
    nodes = [helper.make_node("STFT", ["x", "step", "", "length"], ["y"], name="stft")]
    weights = {"step": np.array(8, np.int64), "length": np.array(16, np.int64)}
    path = save(tmp_path, nodes, [value("x", [1, 128, 1])], [value("y", [1, 15, 9, 2])], weights)
    assert load_onnx(path)[load_onnx(path).outputs[0]].type.shape == (1, 15, 9, 2)
    wrong = save(tmp_path, [helper.make_node("Relu", ["x"], ["y"], name="relu")], [value("x", [2, 3])],
                 [value("y", [2, 4])])
    with pytest.raises(GraphError, match="'relu'.*float32\\[2,3\\]"):
        load_onnx(wrong)


def test_cast_like_of_a_constant_is_a_constant(tmp_path):
    """CastLike(constant, a run-time tensor) reads only the tensor's dtype: the result is known at import (a Pad's
    constant_value in Attention's function body is made so)."""
    nodes = [helper.make_node("CastLike", ["half", "x"], ["fill"]),
             helper.make_node("Pad", ["x", "pads", "fill"], ["y"])]
    path = save(tmp_path, nodes, [value("x", [2, 3], TensorProto.DOUBLE)], [value("y", [2, 5], TensorProto.DOUBLE)],
                {"half": np.array(0.5, np.float32), "pads": np.array([0, 1, 0, 1])}, opset=18)
    graph = check_against_reference(path, {"x": rng.standard_normal((2, 3))})
    assert ops(graph) == ["pad"] and graph[graph.outputs[0]].attrs["value"] == 0.5
