"""Shared by the ONNX operator tests: one node as a model, imported and interpreted, compared with onnx's
reference evaluator."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from opfuse.frontend.onnx_import import load_onnx
from opfuse.ir.interpret import interpret

NEWEST = onnx.defs.onnx_opset_version()


def run_node(node: onnx.NodeProto, feeds: dict, opset: int = NEWEST, weights: dict | None = None,
             tolerance: float = 1e-5):
    """One node as a model (feeds as graph inputs, weights as initializers, an empty name an omitted input),
    imported with no opaque node and interpreted; each output compared with onnx.reference (integers and booleans
    exactly, floats by relative error with NaN and infinities where expected). Returns the imported graph."""
    weights = weights or {}
    names = [o for o in node.output if o]
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in feeds.items()]
    initializers = [numpy_helper.from_array(np.asarray(a), n) for n, a in weights.items()]

    def make(outputs):
        graph = helper.make_graph([node], "one_node", inputs, outputs, initializer=initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])

    expected = ReferenceEvaluator(make([helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None)
                                        for n in names])).run(names, feeds)
    typed = make([helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
                  for n, e in zip(names, expected)])
    graph = load_onnx(typed, runnable=True)
    got = interpret(graph, [torch.from_numpy(np.ascontiguousarray(a)) for a in feeds.values()])
    for ours, want in zip(got, expected):
        ours, want = ours.numpy(), np.asarray(want)
        assert ours.shape == want.shape and ours.dtype == want.dtype, (ours.shape, ours.dtype, want.shape, want.dtype)
        if np.issubdtype(want.dtype, np.floating):
            np.testing.assert_array_equal(np.isnan(ours), np.isnan(want))
            np.testing.assert_array_equal(ours[np.isinf(want)], want[np.isinf(want)])
            finite = np.isfinite(want)
            error = np.linalg.norm(ours[finite].astype(np.float64) - want[finite]) / max(
                np.linalg.norm(want[finite].astype(np.float64)), 1e-30)
            assert error <= tolerance, f"relative error {error}"
        else:
            np.testing.assert_array_equal(ours, want)
    return graph


def one_node_graph(node: onnx.NodeProto, x: np.ndarray, opset: int):
    """The imported graph of one node of input x whose output is typed like x (for expected values computed by a
    test where the reference evaluator departs from the operator's definition)."""
    graph = helper.make_graph([node], "one_node", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)],
                              [helper.make_tensor_value_info(node.output[0], TensorProto.FLOAT, x.shape)])
    return load_onnx(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]), runnable=True)


def ops(graph) -> list[str]:
    """The graph's ops, inputs and constants left out."""
    return [n.op for n in graph if n.op not in ("input", "constant")]


def node(op, inputs, outputs=("y",), **attrs):
    return helper.make_node(op, list(inputs), list(outputs), **attrs)
