"""ONNX's own operator conformance cases against opfuse (`opfuse.frontend.onnx_conformance`): the comparison rule,
the generated docs tables, the reference path over every claimed case, a subset through the compiled path (opfuse's
kernels, on Triton's interpreter) and, in the slow tier, every case through the compiled path."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from onnx import TensorProto, helper

from opfuse.frontend import onnx_conformance as conformance
from opfuse.frontend import onnx_conformance_docs as docs
from opfuse.frontend.onnx_conformance import compare
from opfuse.frontend.onnx_conformance_docs import BEGIN, END, replace_generated
from opfuse.frontend.onnx_converters import CONVERTERS

JOBS = 1   # forking after torch and triton have started threads can deadlock a full pytest run


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


def test_a_case_using_an_operator_without_converter_is_unclaimed_and_says_which():
    cases = {case.name: case for case in conformance.all_cases()}
    assert len(cases) == 1884                                   # onnx 1.23's node cases, all of them
    result = conformance.run_case(cases["test_unique_length_1"], "reference")
    assert (result.outcome, result.reason) == ("unclaimed", "no converter for Unique")
    with pytest.raises(ValueError, match="no path 'fast'"):
        conformance.run_case(cases["test_relu"], "fast")


def test_the_generated_section_is_replaced_and_nothing_else():
    text = f"# title\n\nprose\n\n{BEGIN}\nold table\n{END}\n\nmore prose\n"
    assert replace_generated(text, "new table") == f"# title\n\nprose\n\n{BEGIN}\nnew table\n{END}\n\nmore prose\n"
    with pytest.raises(ValueError, match="no generated section"):
        replace_generated("# no markers\n", "table")


def test_a_table_that_differs_from_a_run_is_found_by_operator_and_path():
    results = [conformance.CaseResult("test_a", ("Relu",), 14, "passed"),
               conformance.CaseResult("test_b", ("Relu",), 14, "failed", "output 0: relative error"),
               conformance.CaseResult("test_c", ("Unique",), 11, "unclaimed", "no converter for Unique")]
    report = conformance.ConformanceReport(results, "reference")
    text = f"{BEGIN}\n{docs.markdown_tables({'reference': report})}\n{END}\n"
    assert docs.table_mismatches(text, report) == []
    assert "| Relu | 14 | 2 | 0 | 1 | - | - | `b` |" in text
    assert "| Unique | 1 | needs an IR op that does not exist yet: unique (a data-dependent shape) |" in text
    worse = conformance.ConformanceReport([results[0], replace(results[1], outcome="no_dtype"), results[2]],
                                          "reference")
    problems = docs.table_mismatches(text, worse)
    assert problems[0].startswith("summary: ")                    # 1 of 2 run, now 1 of 1
    assert problems[-1].startswith("Relu: docs have ('2', '0', '1'), this run ('2', '1', '1')")


# ---- the runs: every claimed case on the reference path, a subset compiled -------------------------------

@pytest.fixture(scope="module")
def cases():
    return conformance.all_cases()


@pytest.fixture(scope="module")
def report(cases):
    """Every case on the reference path (the unclaimed ones are only counted, not run)."""
    return conformance.run_conformance(cases, "reference", JOBS)


def test_at_least_97_percent_of_the_claimed_cases_pass_the_reference_path(report):
    failures = "\n".join(f"{r.name}: {r.reason}" for r in report.failures)
    assert report.pass_rate >= 0.97, f"{report.passed} of {len(report.run)} pass; failing:\n{failures}"
    assert set(report.per_operator()) == set(CONVERTERS), "a claimed operator has no conformance case"


def test_what_fails_is_refused_by_name_or_differs_in_value_never_a_crash(report):
    """A case opfuse cannot run is an UnsupportedOnnxNode naming the operator; any other failure is an output
    compared and found different, not an error on the way."""
    crashes = [f"{r.name}: {r.reason}" for r in report.failures
               if not r.reason.startswith(("unsupported ", "output "))]
    assert not crashes, "\n".join(crashes)


def test_the_docs_tables_hold_this_runs_reference_numbers(report):
    problems = docs.table_mismatches(docs.DOCS.read_text(), report)
    assert not problems, ("docs/onnx.md is out of date: python -m opfuse.frontend.onnx_conformance --markdown\n"
                          + "\n".join(problems))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the Triton interpreter computes masked-off lanes too
def test_a_case_of_every_claimed_operator_passes_compiled_and_each_kind_of_kernel_runs(cases):
    """One case per claimed operator through the compiled path (OpfuseBackend with a FusionConfig: opfuse.compile,
    kernels on Triton's interpreter): at least 97% match the expected outputs. And a small case per kind of opfuse
    kernel, its weights read as constants as an exported model holds them, each matches and runs a kernel."""
    subset = conformance.fast_subset(cases)
    assert {op for case in subset for op in conformance.model_operators(case.model)} >= set(CONVERTERS)
    compiled = conformance.run_conformance(subset, "compiled", JOBS)
    failures = "\n".join(f"{r.name}: {r.reason}" for r in compiled.failures)
    assert compiled.pass_rate >= 0.97, f"{compiled.passed} of {len(compiled.run)} pass; failing:\n{failures}"
    sampled = conformance.kernel_sample(cases)
    assert [conformance.model_operators(c.model)[0] for c in sampled] == list(conformance.SAMPLED)
    results = [conformance.run_case(case, "compiled", weights_as_constants=True) for case in sampled]
    assert [(r.name, r.outcome, r.reason) for r in results if r.outcome != "passed" or not r.kernels] == []


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_every_case_through_the_compiled_path():
    """All 1,884 cases on the compiled path: at least 97% of the claimed ones run pass, and the docs hold this
    run's compiled numbers (about 6 minutes in 2 processes on 2 cores)."""
    compiled = conformance.run_conformance(conformance.all_cases(), "compiled", JOBS)
    failures = "\n".join(f"{r.name}: {r.reason}" for r in compiled.failures)
    assert compiled.pass_rate >= 0.97, f"{compiled.passed} of {len(compiled.run)} pass; failing:\n{failures}"
    problems = docs.table_mismatches(docs.DOCS.read_text(), compiled)
    assert not problems, ("docs/onnx.md is out of date: python -m opfuse.frontend.onnx_conformance --markdown\n"
                          + "\n".join(problems))
