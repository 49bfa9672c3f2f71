"""opfuse behind ONNX's backend interface (`opfuse.frontend.onnx_backend`): prepare / run on the reference path, and
a clear refusal, naming operator, node and opset, of what opfuse cannot run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from opfuse.config import FusionConfig
from opfuse.frontend.onnx_backend import OpfuseBackend, UnsupportedOnnxNode, shape_inputs_of
from opfuse.ir.graph import GraphError

FLOAT = TensorProto.FLOAT
rng = np.random.default_rng(0)


def model(nodes, inputs, outputs, opset=17, weights=None) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "backend_test", [helper.make_tensor_value_info(*i) for i in inputs],
                              [helper.make_tensor_value_info(*o) for o in outputs],
                              initializer=[numpy_helper.from_array(a, n) for n, a in (weights or {}).items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_prepare_and_run_give_the_outputs_as_arrays_by_position_and_name():
    w = rng.standard_normal((4, 3)).astype(np.float32)
    proto = model([helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Relu", ["m"], ["y"]),
                   helper.make_node("Neg", ["m"], ["z"])],
                  [("x", FLOAT, [2, 4])], [("y", FLOAT, [2, 3]), ("z", FLOAT, [2, 3])], weights={"w": w})
    x = rng.standard_normal((2, 4)).astype(np.float32)
    rep = OpfuseBackend.prepare(proto, "CPU")
    y, z = rep.run([x])
    np.testing.assert_allclose(y, np.maximum(x @ w, 0), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(z, -(x @ w), rtol=1e-6, atol=1e-6)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32
    outputs = OpfuseBackend.run_model(proto, {"x": x})          # inputs by name, outputs by name
    np.testing.assert_array_equal(outputs["z"], z)


def test_devices():
    assert OpfuseBackend.supports_device("CPU")
    assert OpfuseBackend.supports_device("CUDA") == torch.cuda.is_available()
    assert not OpfuseBackend.supports_device("TPU")


def test_an_operator_without_converter_is_refused_at_prepare_naming_operator_node_and_opset():
    proto = model([helper.make_node("Bernoulli", ["x"], ["y"], name="pick")], [("x", FLOAT, [2, 3])],
                  [("y", FLOAT, [2, 3])], opset=15)
    with pytest.raises(UnsupportedOnnxNode, match=r"ONNX operator Bernoulli \(opset 15\) at node 'pick' is not "
                                                  r"supported by opfuse: no converter for Bernoulli; the supported "
                                                  r"operators are Abs, Acos, Acosh, Add, ") as refused:
        OpfuseBackend.prepare(proto)
    assert (refused.value.op_type, refused.value.node, refused.value.opset) == ("Bernoulli", "pick", 15)


def test_a_use_of_a_claimed_operator_its_converter_refuses_says_why():
    proto = model([helper.make_node("Conv", ["x", "w"], ["y"])], [("x", FLOAT, [1, 2, 4, 4, 4, 4])],
                  [("y", FLOAT, [1, 3, 3, 3, 3, 3])],
                  weights={"w": rng.standard_normal((3, 2, 2, 2, 2, 2), np.float32)})
    with pytest.raises(UnsupportedOnnxNode, match=r"Conv \(opset 17\) at node 'Conv#0' .*only 1-D, 2-D and 3-D "
                                                  r"convolutions and pools are mapped"):
        OpfuseBackend.prepare(proto)


def test_a_wrong_input_is_named():
    rep = OpfuseBackend.prepare(model([helper.make_node("Relu", ["x"], ["y"])], [("x", FLOAT, [2, 3])],
                                      [("y", FLOAT, [2, 3])]))
    with pytest.raises(GraphError, match=r"input 'x' is float32\[2,3\] in the model, got float64\[2, 3\]"):
        rep.run([np.zeros((2, 3))])
    with pytest.raises(GraphError, match="the model takes 1 inputs"):
        rep.run([np.zeros((2, 3), np.float32)] * 2)
    with pytest.raises(GraphError, match="no value given for input 'x'"):
        rep.run({"other": np.zeros((2, 3), np.float32)})


def test_inputs_may_be_tensor_protos_and_bfloat16_comes_back_as_bfloat16():
    proto = model([helper.make_node("Cast", ["x"], ["y"], to=TensorProto.BFLOAT16)], [("x", FLOAT, [3])],
                  [("y", TensorProto.BFLOAT16, [3])])
    x = np.array([1.0, -2.5, 3.0078125], np.float32)
    (y,) = OpfuseBackend.prepare(proto).run([numpy_helper.from_array(x)])
    assert y.dtype.name == "bfloat16"
    np.testing.assert_array_equal(y.astype(np.float32), torch.from_numpy(x).bfloat16().float().numpy())


def test_a_0d_bfloat16_input_stays_0d():
    """A scalar bfloat16 input (Range's start, limit and delta) is read as a 0-d tensor, not made 1-d."""
    import ml_dtypes

    from opfuse.frontend.onnx_backend import to_tensor
    from opfuse.ir.graph import TensorType

    value = np.array(2.5, dtype=ml_dtypes.bfloat16)
    tensor = to_tensor(value, "start", TensorType((), "bfloat16"), "m.onnx")
    assert tensor.shape == () and tensor.dtype == torch.bfloat16 and float(tensor) == 2.5


def test_shape_inputs_are_specialised_on_at_each_run():
    """ONNX's conformance cases give a Reshape's shape as a graph input: each value is imported as a constant."""
    proto = model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                  [("x", FLOAT, [2, 3, 4]), ("shape", TensorProto.INT64, [2])], [("y", FLOAT, ["a", "b"])])
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    rep = OpfuseBackend.prepare(proto)
    (wide,) = rep.run([x, np.array([4, -1], np.int64)])
    (tall,) = rep.run({"x": x, "shape": np.array([0, 12], np.int64)})   # 0 copies the input's dim
    assert wide.shape == (4, 6) and tall.shape == (2, 12)
    np.testing.assert_array_equal(wide, x.reshape(4, 6))
    assert len(rep.imported) == 2 and rep.run([x, np.array([4, -1], np.int64)])[0].shape == (4, 6)
    with pytest.raises(GraphError, match=r"input 'shape' is INT64\[2\] in the model, got int64\[3\]"):
        rep.run([x, np.array([2, 3, 4], np.int64)])


def test_a_model_with_shape_inputs_is_still_refused_at_prepare_for_an_unknown_operator():
    proto = model([helper.make_node("Reshape", ["x", "shape"], ["r"]), helper.make_node("Bernoulli", ["r"], ["y"])],
                  [("x", FLOAT, [2, 3]), ("shape", TensorProto.INT64, [2])], [("y", FLOAT, ["a", "b"])], opset=15)
    with pytest.raises(UnsupportedOnnxNode, match=r"Bernoulli \(opset 15\) at node 'Bernoulli#1'"):
        OpfuseBackend.prepare(proto)


def test_named_inputs_are_read_as_constants_like_an_exported_models_weights():
    w = rng.standard_normal((4, 3)).astype(np.float32)
    proto = model([helper.make_node("MatMul", ["x", "w"], ["y"])], [("x", FLOAT, [2, 4]), ("w", FLOAT, [4, 3])],
                  [("y", FLOAT, [2, 3])])
    rep = OpfuseBackend.prepare(proto, constants=["w"])
    x = rng.standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(rep.run([x, w])[0], x @ w, rtol=1e-6, atol=1e-6)
    (imported,) = rep.imported.values()
    assert [n.op for n in imported.module.graph if n.op not in ("input", "constant")] == ["linear"]  # a weight
    with pytest.raises(GraphError, match=r"constants \['v'\] are not inputs of the model"):
        OpfuseBackend.prepare(proto, constants=["v"])


def test_an_input_whose_value_no_node_reads_is_read_as_a_constant():
    """CastLike's target and Shape's input are read for their type only, as is an unused input: reading them as
    constants changes no result, and an empty one then needs no run-time tensor (opfuse compiles none)."""
    proto = model([helper.make_node("CastLike", ["x", "like"], ["y"]), helper.make_node("Shape", ["s"], ["n"])],
                  [("x", FLOAT, [2, 3]), ("like", TensorProto.DOUBLE, [0]), ("s", FLOAT, [4, 5]),
                   ("unused", FLOAT, [1])], [("y", TensorProto.DOUBLE, [2, 3]), ("n", TensorProto.INT64, [2])])
    assert shape_inputs_of(proto) == ["like", "s", "unused"]
    x = rng.standard_normal((2, 3)).astype(np.float32)
    y, n = OpfuseBackend.prepare(proto).run([x, np.zeros(0), np.zeros((4, 5), np.float32), np.zeros(1, np.float32)])
    assert y.dtype == np.float64 and n.tolist() == [4, 5]
    np.testing.assert_array_equal(y, x.astype(np.float64))
    both = model([helper.make_node("CastLike", ["x", "like"], ["y"]), helper.make_node("Neg", ["like"], ["z"])],
                 [("x", FLOAT, [2]), ("like", TensorProto.DOUBLE, [2])],
                 [("y", TensorProto.DOUBLE, [2]), ("z", TensorProto.DOUBLE, [2])])
    assert shape_inputs_of(both) == []                       # its value is read too: a run-time input


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_a_compiled_rep_runs_an_empty_input_through_the_graph():
    """opfuse compiles no empty tensor; the rep runs such a run through the reference path instead of failing."""
    proto = model([helper.make_node("Relu", ["x"], ["y"])], [("x", FLOAT, [0, 3])], [("y", FLOAT, [0, 3])])
    rep = OpfuseBackend.prepare(proto, config=FusionConfig(dtype="float32"))
    (y,) = rep.run([np.zeros((0, 3), np.float32)])
    assert y.shape == (0, 3) and [i.compiled for i in rep.imported.values()] == [None]
    full = model([helper.make_node("Relu", ["x"], ["y"])], [("x", FLOAT, [2, 3])], [("y", FLOAT, [2, 3])])
    rep = OpfuseBackend.prepare(full, config=FusionConfig(dtype="float32"))
    x = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(rep.run([x])[0], np.maximum(x, 0))
    (imported,) = rep.imported.values()
    assert imported.compiled is not None and len(imported.compiled.compiled.kernels) == 1
