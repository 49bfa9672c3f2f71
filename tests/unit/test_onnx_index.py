"""ONNX indexing and tensor-making operators written out in the IR's gathers, views and elementwise ops
(`opfuse.frontend.onnx_index`), compared with onnx.reference.ReferenceEvaluator; run-time indices included."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_cases import node, ops, run_node as run

rng = np.random.default_rng(0)


def floats(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---- indexing -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("axis", [0, 1, 2])
def test_gather_elements_at_run_time_and_constant_indices(axis):
    data = floats(3, 4, 5)
    shape = list(data.shape)
    shape[axis] = 2                 # onnx's reference wants the other dims equal (ONNX allows them smaller)
    indices = rng.integers(-data.shape[axis], data.shape[axis], shape).astype(np.int64)
    graph = run(node("GatherElements", ["data", "indices"], axis=axis), {"data": data, "indices": indices})
    assert ops(graph).count("take") == 1
    graph = run(node("GatherElements", ["data", "indices"], axis=axis), {"data": data}, weights={"indices": indices})
    assert ops(graph) == ["reshape", "take"]                     # the whole flat index is a constant


@pytest.mark.parametrize("data_shape, index_shape, batch_dims", [
    ((2, 3, 4), (5, 2), 0), ((2, 3, 4), (2, 1, 3), 0), ((2, 3, 4), (2, 2, 1), 1), ((2, 3, 4, 5), (2, 3, 1), 2),
])
def test_gather_nd(data_shape, index_shape, batch_dims):
    data = floats(*data_shape)
    depth = index_shape[-1]
    sizes = data_shape[batch_dims:batch_dims + depth]
    indices = np.stack([rng.integers(-n, n, index_shape[:-1]) for n in sizes], axis=-1).astype(np.int64)
    run(node("GatherND", ["data", "indices"], batch_dims=batch_dims), {"data": data, "indices": indices})


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_one_hot_with_negative_and_out_of_range_indices(axis):
    indices = np.array([[0, -1, 4], [7, -6, 2]], np.int64)
    run(node("OneHot", ["indices", "depth", "values"], axis=axis),
        {"indices": indices, "values": np.array([-2.0, 3.5], np.float32)}, weights={"depth": np.array(5, np.int64)})


@pytest.mark.parametrize("upper, k", [(1, 0), (0, 0), (1, -1), (0, 2), (1, 7)])
def test_trilu(upper, k):
    run(node("Trilu", ["x", "k"], upper=upper), {"x": floats(2, 4, 5)}, weights={"k": np.array(k, np.int64)})


def test_range_eye_like_and_windows_are_constants():
    graph = run(node("Range", ["start", "limit", "delta"]), {}, weights={
        "start": np.array(10, np.int32), "limit": np.array(2, np.int32), "delta": np.array(-3, np.int32)})
    assert ops(graph) == []
    graph = run(node("EyeLike", ["x"], k=1, dtype=TensorProto.INT32), {"x": floats(3, 4)})
    assert ops(graph) == []
    for window in ("HannWindow", "HammingWindow", "BlackmanWindow"):
        assert ops(run(node(window, ["n"], periodic=0), {}, weights={"n": np.array(7, np.int64)})) == []
    mel = {"bins": np.array(4, np.int64), "dft": np.array(16, np.int64), "rate": np.array(8000, np.int64),
           "low": np.array(100.0, np.float32), "high": np.array(3000.0, np.float32)}
    assert ops(run(node("MelWeightMatrix", list(mel)), {}, weights=mel)) == []


def test_compress_center_crop_pad_depth_to_space_and_back():
    run(node("Compress", ["x", "c"], axis=1), {"x": floats(3, 4)}, weights={"c": np.array([True, False, True])})
    run(node("Compress", ["x", "c"]), {"x": floats(3, 4)}, weights={"c": np.array([0, 1, 1, 0, 1], bool)})
    run(node("CenterCropPad", ["x", "shape"], axes=[0, 2]), {"x": floats(5, 3, 4)},
        weights={"shape": np.array([2, 7], np.int64)})
    for mode in ("DCR", "CRD"):
        run(node("DepthToSpace", ["x"], blocksize=2, mode=mode), {"x": floats(1, 8, 2, 3)})
    run(node("SpaceToDepth", ["x"], blocksize=2), {"x": floats(2, 3, 4, 6)}, opset=13)


@pytest.mark.parametrize("batch_axis, time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence_with_lengths_known_at_run_time(batch_axis, time_axis):
    x = floats(4, 3, 2) if time_axis == 0 else floats(3, 4, 2)
    lengths = np.array([4, 0, 2], np.int64)
    graph = run(node("ReverseSequence", ["x", "lengths"], batch_axis=batch_axis, time_axis=time_axis),
                {"x": x, "lengths": lengths})
    assert ops(graph).count("take") == 1


@pytest.mark.parametrize("size, corners", [((2, 3, 4, 5), 0), ((2, 3, 4, 5), 1), ((1, 2, 3, 4, 2), 0)])
def test_affine_grid(size, corners):
    theta = floats(size[0], len(size) - 2, len(size) - 1)
    graph = run(node("AffineGrid", ["theta", "size"], align_corners=corners), {"theta": theta},
                weights={"size": np.array(size, np.int64)}, opset=20)
    assert ops(graph) == ["matmul", "permute", "reshape"]


@pytest.mark.parametrize("exclusive, reverse", [(0, 0), (1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32])
@pytest.mark.parametrize("onnx_op, op", [("CumSum", "cumsum"), ("CumProd", "cumprod")])
def test_a_scan_is_the_scan_of_the_input_read_backwards_or_shifted(onnx_op, op, exclusive, reverse, dtype):
    x = (floats(3, 5) * 4).astype(dtype)
    graph = run(node(onnx_op, ["x", "axis"], exclusive=exclusive, reverse=reverse), {"x": x},
                weights={"axis": np.array(-1, dtype=np.int64)})
    assert ops(graph).count(op) == 1 and ops(graph).count("take") == 2 * reverse
    assert ops(graph).count("pad") == exclusive


# ---- writes at run-time indices and grid sampling: one library call each ---------------------------------------

@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, -1])
def test_scatter_elements_with_negative_indices_is_one_scatter(axis, reduction):
    data = floats(4, 5)
    shape = [2, 5] if axis == 0 else [4, 3]
    size, other = data.shape[axis], 1 - axis % 2
    indices = np.stack([rng.permutation(np.arange(-size, 0))[:shape[axis]] for _ in range(shape[other])],
                       axis=other).astype(np.int64)         # distinct along the axis: "none" is then defined
    graph = run(node("ScatterElements", ["data", "indices", "updates"], axis=axis, reduction=reduction),
                {"data": data, "indices": indices, "updates": floats(*shape)})
    assert ops(graph).count("scatter") == 1


@pytest.mark.parametrize("reduction", ["none", "add", "max"])
@pytest.mark.parametrize("data_shape, index_shape", [((4, 5, 6), (3, 1)), ((4, 5, 6), (2, 2, 2)), ((4, 5), (3, 2))])
def test_scatter_nd_scatters_the_rows_of_the_indexed_dims(data_shape, index_shape, reduction):
    data = floats(*data_shape)
    depth = index_shape[-1]
    count = int(np.prod(index_shape[:-1]))
    flat = rng.permutation(int(np.prod(data_shape[:depth])))[:count]   # distinct positions
    indices = np.stack(np.unravel_index(flat, data_shape[:depth]), axis=-1).reshape(index_shape)
    indices = np.where(rng.random(index_shape) < 0.5, indices - np.array(data_shape[:depth]), indices)  # negatives
    updates = floats(*index_shape[:-1], *data_shape[depth:])
    graph = run(node("ScatterND", ["data", "indices", "updates"], reduction=reduction),
                {"data": data, "indices": indices.astype(np.int64), "updates": updates})
    assert ops(graph).count("scatter") == 1


@pytest.mark.parametrize("attrs", [{"kernel_shape": [2, 2], "strides": [2, 2]},
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [0, 1, 2, 0]},    # explicit
                                   {"kernel_shape": [2, 3], "strides": [1, 2], "storage_order": 1},
                                   {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1}])
def test_max_pool_indices_are_flat_over_the_input_without_its_padding(attrs):
    """MaxPool's Indices: each window's largest element's position in x, flattened over all of x (row-major, or
    column-major within each plane with storage_order 1), padding not counted; ties to the first."""
    x = rng.integers(-3, 4, (2, 3, 7, 6)).astype(np.float32)              # ties
    graph = run(node("MaxPool", ["x"], ["y", "indices"], **attrs), {"x": x})
    assert ops(graph).count("max_pool2d_indices") == 1 and "opaque" not in ops(graph)


def test_max_unpool_writes_maxpools_values_back_and_pads_to_the_output_shape():
    x = floats(1, 2, 4, 4)
    pooled_node = node("MaxPool", ["x"], ["p", "i"], kernel_shape=[2, 2], strides=[2, 2])
    graph = helper.make_graph([pooled_node], "pool", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in "pi"])
    p, i = ReferenceEvaluator(helper.make_model(graph)).run(None, {"x": x})
    run(node("MaxUnpool", ["p", "i"], kernel_shape=[2, 2], strides=[2, 2]), {"p": p, "i": i})
    graph = run(node("MaxUnpool", ["p", "i", "shape"], kernel_shape=[2, 2], strides=[2, 2]), {"p": p, "i": i},
                weights={"shape": np.array([1, 2, 5, 6], np.int64)})
    assert ops(graph)[-1] == "pad"


@pytest.mark.parametrize("mode, padding, align", [("linear", "zeros", 0), ("nearest", "border", 1),
                                                   ("cubic", "reflection", 0)])
def test_grid_sample(mode, padding, align):
    grid = rng.uniform(-1.2, 1.2, (2, 3, 4, 2)).astype(np.float32)
    graph = run(node("GridSample", ["x", "grid"], mode=mode, padding_mode=padding, align_corners=align),
                {"x": floats(2, 3, 5, 6), "grid": grid}, tolerance=3e-5)
    assert ops(graph) == ["grid_sample"]


@pytest.mark.parametrize("mode, starts", [("linear", [0, 3]), ("circular", [4, 5]), ("linear", None)])
def test_tensor_scatter_writes_each_rows_update_at_its_index(mode, starts):
    cache, update = floats(2, 3, 6, 4), floats(2, 3, 2, 4)
    feeds = {"cache": cache, "update": update} | ({} if starts is None else {"at": np.array(starts, np.int64)})
    graph = run(node("TensorScatter", ["cache", "update", "at" if starts is not None else ""], mode=mode), feeds)
    assert ops(graph).count("scatter") == 1
