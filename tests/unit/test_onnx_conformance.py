"""ONNX's own operator conformance cases against opfuse (`opfuse.frontend.onnx_conformance`): the comparison rule,
the generated docs table, and the run itself."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

import opfuse
from opfuse.frontend import onnx_conformance as conformance
from opfuse.frontend.onnx_converters import CONVERTERS
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


# ---- the run: every case of the claimed operators, on the reference path and a sample compiled ------------

@pytest.fixture(scope="module")
def cases():
    return conformance.claimed_cases()


@pytest.fixture(scope="module")
def report(cases):
    return conformance.run_conformance(cases)


def test_at_least_95_percent_of_the_claimed_operators_cases_pass(report):
    failures = "\n".join(f"{r.name}: {r.reason}" for r in report.failures)
    assert report.pass_rate >= 0.95, f"{report.passed} of {len(report.run)} pass; failing:\n{failures}"
    assert set(report.per_operator()) == set(CONVERTERS), "a claimed operator has no conformance case"


def test_what_fails_is_refused_by_name_or_differs_in_value_never_a_crash(report):
    """A case opfuse cannot run is an UnsupportedOnnxNode naming the operator; any other failure is an output
    compared and found different, not an error on the way."""
    crashes = [f"{r.name}: {r.reason}" for r in report.failures
               if not r.reason.startswith(("unsupported ", "output "))]
    assert not crashes, "\n".join(crashes)


def test_the_docs_table_is_this_runs(report):
    text = conformance.DOCS.read_text()
    assert replace_generated(text, conformance.markdown_table(report)) == text, (
        "docs/onnx.md is out of date: python -m opfuse.frontend.onnx_conformance --markdown")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the Triton interpreter computes masked-off lanes too
def test_a_sample_compiled_with_opfuse_matches_the_expected_outputs(report, cases):
    """One small case per kind of opfuse kernel through opfuse.compile (the Triton interpreter on the CPU): each
    matches the case's expected outputs and runs at least one opfuse kernel."""
    sample = conformance.compile_sample(report.results, cases)
    assert [conformance.model_operators(c.model)[0] for c in sample] == list(conformance.SAMPLED)
    results = [conformance.run_case(case, config=opfuse.FusionConfig(dtype="float32")) for case in sample]
    assert [(r.name, r.outcome, r.reason) for r in results if r.outcome != "passed"] == []
    assert [r.name for r in results if r.kernels < 1] == []
