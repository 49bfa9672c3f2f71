"""ONNX's own operator conformance cases against opfuse (`opfuse.frontend.onnx_conformance`): the comparison rule,
the generated docs table, and the run itself."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from opfuse.frontend import onnx_conformance as conformance
from opfuse.frontend.onnx_conformance import BEGIN, END, compare, replace_generated


def test_floats_compare_by_relative_error_within_the_dtype_tolerance():
    want = np.linspace(-3, 3, 1000).astype(np.float32)
    assert compare(want * np.float32(1 + 5e-6), want) is None
    assert compare(want * np.float32(1 + 5e-5), want).endswith("e-05 over 1e-05")
    half = want.astype(np.float16)
    assert compare(half * np.float16(1 + 2 ** -10), half) is None      # one float16 rounding
    assert compare(want.astype(np.float64) * (1 + 1e-9), want.astype(np.float64)).startswith("relative error")


def test_nan_and_infinities_must_be_where_expected_and_integers_exact():
    want = np.array([1.0, np.nan, np.inf, -np.inf], np.float32)
    assert compare(want.copy(), want) is None
    assert compare(np.array([1.0, 0.0, np.inf, -np.inf], np.float32), want) is not None
    assert compare(np.array([1.0, np.nan, -np.inf, -np.inf], np.float32), want) is not None
    assert compare(np.array([1, 2, 4], np.int64), np.array([1, 2, 3], np.int64)) == "1 of 3 values differ"
    assert compare(np.array([1, 2, 3], np.int32), np.array([1, 2, 3], np.int64)) == "dtype int32, expected int64"
    assert compare(np.zeros((2, 3), np.float32), np.zeros((3, 2), np.float32)) == "shape [2, 3], expected [3, 2]"


def test_a_model_with_a_dtype_the_ir_lacks_is_not_run():
    node = helper.make_node("Cast", ["x"], ["y"], to=TensorProto.FLOAT8E4M3FN)
    graph = helper.make_graph([node], "cast", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT8E4M3FN, [2])])
    assert conformance.unsupported_dtype(helper.make_model(graph)) == "'y' is FLOAT8E4M3FN"


def test_the_generated_section_is_replaced_and_nothing_else():
    text = f"# title\n\nprose\n\n{BEGIN}\nold table\n{END}\n\nmore prose\n"
    assert replace_generated(text, "new table") == f"# title\n\nprose\n\n{BEGIN}\nnew table\n{END}\n\nmore prose\n"
    with pytest.raises(ValueError, match="no generated section"):
        replace_generated("# no markers\n", "table")
