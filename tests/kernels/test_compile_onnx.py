"""opfuse.compile of an ONNX model (a path, its bytes or an onnx.ModelProto), on Triton's interpreter: the result
matches ONNX's own reference evaluator, and a wrong example input is an error naming it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import opfuse
from opfuse.frontend.onnx_module import OnnxModule, example_inputs_of, onnx_module
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import GraphError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def small_cnn() -> onnx.ModelProto:
    """Conv + BatchNorm + Relu, global average pool, Flatten, Gemm: a dynamic batch, opset 17 (onnx 1.23's reference
    evaluator computes BatchNormalization of opsets 9-13 differently from their definition)."""
    rng = np.random.default_rng(0)
    weights = {"w": rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3,
               "b": rng.standard_normal(8).astype(np.float32) * 0.1,
               "scale": rng.uniform(0.5, 1.5, 8).astype(np.float32), "shift": rng.standard_normal(8).astype(np.float32),
               "mean": rng.standard_normal(8).astype(np.float32) * 0.1, "var": rng.uniform(0.5, 1.5, 8).astype(np.float32),
               "fc": rng.standard_normal((8, 4)).astype(np.float32) * 0.3, "fc_b": np.zeros(4, np.float32) + 0.1}
    nodes = [helper.make_node("Conv", ["x", "w", "b"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("BatchNormalization", ["c", "scale", "shift", "mean", "var"], ["n"]),
             helper.make_node("Relu", ["n"], ["r"]),
             helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "fc", "fc_b"], ["y"])]
    graph = helper.make_graph(nodes, "small_cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
                              initializer=[numpy_helper.from_array(a, n) for n, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("form", ["path", "bytes", "proto"])
def test_compiled_onnx_model_matches_onnx_reference(tmp_path, form):
    proto = small_cnn()
    path = tmp_path / "small_cnn.onnx"
    onnx.save(proto, path)
    before = proto.SerializeToString()
    source = {"path": str(path), "bytes": path.read_bytes(), "proto": proto}[form]
    x = torch.randn(2, 3, 8, 8)
    compiled = opfuse.compile(source, (x,), opfuse.FusionConfig(dtype="float32"))
    reference = ReferenceEvaluator(str(path))
    # the symbolic batch N is dynamic by default: one model serves other batch sizes too
    for batch in (2, 5):
        x = torch.randn(batch, 3, 8, 8)
        expected = reference.run(None, {"x": x.numpy()})[0]
        got = compiled(x)
        assert got.shape == (batch, 4)
        error = np.linalg.norm(got.detach().numpy() - expected) / np.linalg.norm(expected)
        assert error < 1e-4
    assert [dim.describe() for dim in compiled.dims] == ["N in [1, inf]"]
    assert sorted(compiled.buckets) == [(2,), (8,)]                    # batch 5 ran padded in bucket 8
    assert compiled.compiled.compiled.kernels, "the plan got no opfuse kernel"
    assert proto.SerializeToString() == before                          # the caller's ModelProto is untouched


def test_an_onnx_models_symbolic_dims_pinned_take_the_examples_sizes():
    """dynamic_shapes={} pins the symbolic dims to the examples' sizes: another size is a one-line error."""
    compiled = opfuse.compile(small_cnn(), (torch.randn(2, 3, 8, 8),), opfuse.FusionConfig(dtype="float32"),
                              dynamic_shapes={})
    assert compiled.compiled.kernels
    with pytest.raises(GraphError, match="x"):
        compiled(torch.randn(3, 3, 8, 8))


def test_the_module_runs_the_graph_and_moves_like_a_module(tmp_path):
    module = onnx_module(small_cnn(), batch=3)
    (x,) = example_inputs_of(module)
    assert isinstance(module, OnnxModule) and x.shape == (3, 3, 8, 8) and x.dtype == torch.float32
    reference = ReferenceEvaluator(small_cnn()).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(module(x).numpy(), reference, rtol=1e-4, atol=1e-5)
    doubled = module.to(torch.float64)                                  # weights are buffers: cast with the module
    assert doubled(x.double()).dtype == torch.float64


def test_wrong_example_inputs_are_named(tmp_path):
    with pytest.raises(GraphError, match=r"input 'x' is float32\[2,3,8,8\] in the model, the example input is "
                                         r"float32\[2, 3, 9, 9\]"):
        opfuse.compile(small_cnn(), (torch.randn(2, 3, 9, 9),))
    with pytest.raises(GraphError, match="the model takes 1 inputs"):
        opfuse.compile(small_cnn(), (torch.randn(2, 3, 8, 8), torch.randn(2)))
    with pytest.raises(GraphError, match="no such ONNX file"):
        opfuse.compile(str(tmp_path / "missing.onnx"), (torch.randn(2, 3, 8, 8),))
    with pytest.raises(GraphError, match="not a readable ONNX model"):
        opfuse.compile(b"not a model", (torch.randn(2, 3, 8, 8),))


def test_the_cli_loads_an_onnx_file_as_a_model_with_inputs(tmp_path):
    from opfuse.cli import load_model

    path = tmp_path / "small_cnn.onnx"
    onnx.save(small_cnn(), path)
    model, inputs, name = load_model(str(path), batch=4)
    assert isinstance(model, OnnxModule) and name == "small_cnn" and inputs[0].shape == (4, 3, 8, 8)
    assert model(*inputs).shape == (4, 4)


def test_an_lrn_model_compiles_and_its_lrn_runs_through_pytorch():
    """AlexNet-style Conv -> Relu -> LRN -> Conv: the convs get kernels, the LRN runs through PyTorch, said so."""
    rng = np.random.default_rng(1)
    weights = {"w1": rng.standard_normal((6, 3, 3, 3)).astype(np.float32) * 0.3,
               "w2": rng.standard_normal((4, 6, 1, 1)).astype(np.float32) * 0.3}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1]), helper.make_node("Relu", ["c"], ["r"]),
             helper.make_node("LRN", ["r"], ["n"], size=5, alpha=1e-3, beta=0.75, bias=1.0),
             helper.make_node("Conv", ["n", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "lrn_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
                              initializer=[numpy_helper.from_array(a, n) for n, a in weights.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = torch.randn(1, 3, 6, 6)
    compiled = opfuse.compile(proto, (x,), opfuse.FusionConfig(dtype="float32"))
    lrn = [why for why in compiled.fallbacks.values() if why.code is Code.OPAQUE]
    assert len(lrn) == 1 and "local_response_norm" in lrn[0].text       # the reason names the op
    assert len(compiled.compiled.kernels) == 2
    reference = onnx_module(proto, (x,))(x)
    assert torch.allclose(compiled(x), reference, rtol=1e-4, atol=1e-5)


def test_a_conv_with_asymmetric_padding_compiles():
    """The explicit pad is a kernel of opfuse's (an index map of the elementwise template); the conv after it is
    an opfuse kernel on the padded input."""
    w = np.random.default_rng(2).standard_normal((4, 3, 2, 2)).astype(np.float32) * 0.3
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[0, 0, 1, 1]), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "odd_pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 7, 7])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 7, 7])],
                              initializer=[numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = torch.randn(2, 3, 7, 7)
    compiled = opfuse.compile(proto, (x,), opfuse.FusionConfig(dtype="float32"))
    assert len(compiled.compiled.kernels) == 2
    assert not compiled.fallbacks
    expected = ReferenceEvaluator(proto).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(compiled(x).numpy(), expected, rtol=1e-4, atol=1e-5)


def reshape_model() -> onnx.ModelProto:
    """x [2, 3, 4] -> Relu -> Reshape to a shape given as an input (as ONNX's conformance cases give it)."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Reshape", ["r", "shape"], ["y"])]
    graph = helper.make_graph(nodes, "reshape_input", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4]),
                                                       helper.make_tensor_value_info("shape", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["a", "b"])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_input_that_fixes_a_shape_is_read_as_a_constant_and_checked_at_each_call():
    """compile_onnx reads the Reshape's shape from the example inputs (opfuse's shapes are static) and compiles the
    rest; the compiled model takes every input of the model and refuses another shape, naming the input."""
    from opfuse.frontend.onnx_compile import SpecialisedOnnxModel, compile_onnx

    x, shape = torch.randn(2, 3, 4), torch.tensor([4, 6])
    compiled = compile_onnx(reshape_model(), (x, shape), opfuse.FusionConfig(dtype="float32"))
    assert isinstance(compiled, SpecialisedOnnxModel) and list(compiled.constants) == ["shape"]
    assert torch.equal(compiled.constants["shape"], shape)
    torch.testing.assert_close(compiled(x, shape), x.relu().reshape(4, 6))
    assert len(compiled.compiled.kernels) == 1                    # the compiled model's, through the wrapper
    with pytest.raises(GraphError, match=r"input 'shape' fixes a shape.*compiled for its value \[4, 6\], got "
                                         r"\[2, 12\]"):
        compiled(x, torch.tensor([2, 12]))
    again = compile_onnx(reshape_model(), (x, shape), opfuse.FusionConfig(dtype="float32", recompile=True))
    assert again(x, torch.tensor([2, 12])).shape == (2, 12)     # compiled again for the new value
    torch.testing.assert_close(again(x, shape), x.relu().reshape(4, 6))


def test_an_empty_input_read_only_for_its_type_is_no_example_input_and_a_plain_model_is_not_wrapped():
    from opfuse.frontend.onnx_compile import compile_onnx

    nodes = [helper.make_node("CastLike", ["x", "like"], ["c"]), helper.make_node("Relu", ["c"], ["y"])]
    graph = helper.make_graph(nodes, "cast_like", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                                   helper.make_tensor_value_info("like", TensorProto.DOUBLE, [0])],
                              [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2, 3])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = torch.randn(2, 3)
    compiled = compile_onnx(proto, (x, torch.zeros(0, dtype=torch.float64)))
    y = compiled(x, torch.zeros(0, dtype=torch.float64))
    assert y.dtype == torch.float64 and torch.equal(y, x.double().relu())
    plain = compile_onnx(small_cnn(), (torch.randn(2, 3, 8, 8),), opfuse.FusionConfig(dtype="float32"))
    assert type(plain).__name__ == "OpfuseModule" and plain.compiled.kernels


def tokens_model(softmax_axis: int) -> onnx.ModelProto:
    """x [batch, seq, 8] (both symbolic) -> MatMul by a weight, Add, Softmax over `softmax_axis`."""
    rng = np.random.default_rng(1)
    weights = {"w": rng.standard_normal((8, 8)).astype(np.float32) * 0.5, "b": rng.standard_normal(8).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Add", ["m", "b"], ["a"]),
             helper.make_node("Softmax", ["a"], ["y"], axis=softmax_axis)]
    graph = helper.make_graph(nodes, "tokens", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                              ["batch", "seq", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
                              initializer=[numpy_helper.from_array(a, n) for n, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("softmax_axis, pads_seq", [(-1, True), (1, False)])
def test_an_onnx_model_with_symbolic_dims_serves_their_ranges_from_one_compile(softmax_axis, pads_seq):
    """dynamic_shapes by the ONNX input's name: each bucket is imported at its sizes; a call pads the sequence
    only where the softmax keeps its positions apart, else runs its exact size; every call matches the reference."""
    from torch.export import Dim

    model = tokens_model(softmax_axis)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(0))
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"),
                              dynamic_shapes={"x": {0: Dim("batch", max=4), 1: Dim("seq", max=16)}})
    reference = ReferenceEvaluator(model)
    for shape in [(3, 7, 8), (1, 16, 8), (2, 5, 8)]:
        call = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
        want = reference.run(None, {"x": call.numpy()})[0]
        np.testing.assert_allclose(compiled(call).numpy(), want, rtol=1e-5, atol=1e-6)
    bucket = compiled.buckets[(4, 8)]                   # the bucket of (3, 7)
    if pads_seq:        # (3, 7) ran padded to it
        assert not bucket.refused and (3, 7) not in compiled.buckets
    else:               # the softmax over the sequence mixes its positions: (3, 7) compiled at its own sizes
        assert list(bucket.refused) == ["seq"] and (3, 7) in compiled.buckets


def masked_attention_model() -> onnx.ModelProto:
    """x [batch, seq, 8], mask [batch, seq] (1 attends, 0 masks; both symbolic) -> softmax(x xᵀ + (1 - mask) * -1e9)
    x: attention under a padding mask, as exported encoders compute it."""
    rng = np.random.default_rng(2)
    weights = {"w": rng.standard_normal((8, 8)).astype(np.float32) * 0.5, "one": np.array(1.0, np.float32),
               "low": np.array(-1e9, np.float32), "axis": np.array([1], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "w"], ["q"]),
             helper.make_node("Transpose", ["x"], ["kt"], perm=[0, 2, 1]),
             helper.make_node("MatMul", ["q", "kt"], ["scores"]),
             helper.make_node("Sub", ["one", "mask"], ["masked"]),
             helper.make_node("Mul", ["masked", "low"], ["bias_rows"]),
             helper.make_node("Unsqueeze", ["bias_rows", "axis"], ["bias"]),
             helper.make_node("Add", ["scores", "bias"], ["biased"]),
             helper.make_node("Softmax", ["biased"], ["p"], axis=-1),
             helper.make_node("MatMul", ["p", "x"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 8]),
              helper.make_tensor_value_info("mask", TensorProto.FLOAT, ["batch", "seq"])]
    graph = helper.make_graph(nodes, "masked", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 8])],
                              initializer=[numpy_helper.from_array(a, n) for n, a in weights.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_onnx_model_pads_its_sequence_under_an_attention_mask():
    """The ONNX model imported one position shorter is the reference the sequence padding checks against: a call at
    7 runs padded on bucket 8, the mask padded with zeros, equal to the reference evaluator."""
    from torch.export import Dim

    model = masked_attention_model()
    generator = torch.Generator().manual_seed(0)
    seq = Dim("seq", max=8)

    def call(length: int):
        mask = torch.ones(2, length)
        mask[1, length - 2:] = 0
        return torch.randn(2, length, 8, generator=generator), mask

    compiled = opfuse.compile(model, call(8), opfuse.FusionConfig(dtype="float32"),
                              dynamic_shapes={"x": {1: seq}, "mask": {1: seq}})
    reference = ReferenceEvaluator(model)
    for length in (7, 5):
        x, mask = call(length)
        want = reference.run(None, {"x": x.numpy(), "mask": mask.numpy()})[0]
        np.testing.assert_allclose(compiled(x, mask).numpy(), want, rtol=1e-5, atol=1e-6)
    assert sorted(compiled.buckets) == [(8,)] and compiled.buckets[(8,)].zero_filled["seq"] == (1,)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_bit_cast_compiles_on_its_own_bits_whatever_the_compute_dtype(dtype):
    """BitCast reads its input's bits in the input's own dtype: the float64 reference of a float32 compile and a
    float16 compile both take the float32 input as float32 first, so the integers are the model's, exactly."""
    nodes = [helper.make_node("Mul", ["x", "two"], ["m"]), helper.make_node("BitCast", ["m"], ["bits"], to=6),
             helper.make_node("Det", ["x"], ["d"])]
    graph = helper.make_graph(nodes, "bits", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 4])],
                              [helper.make_tensor_value_info("bits", TensorProto.INT32, [3, 4, 4]),
                               helper.make_tensor_value_info("d", TensorProto.FLOAT, [3])],
                              initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    x = torch.randn(3, 4, 4)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype=dtype))
    bits, det = compiled(x)
    doubled = (x * 2).half().float() if dtype == "float16" else x * 2
    assert torch.equal(bits, doubled.view(torch.int32))
    torch.testing.assert_close(det.float(), torch.linalg.det(x), rtol=1e-2 if dtype == "float16" else 1e-5, atol=1e-3)
