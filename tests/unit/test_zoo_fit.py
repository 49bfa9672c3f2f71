"""Fitting the cost model's factors to whole-model times across the zoo (opfuse.bench.zoo_fit)."""

import math

import pytest

import opfuse
from opfuse.bench import zoo_fit
from opfuse.bench.zoo import load_builtin
from opfuse.bench.zoo_fit import KernelTerms, Workload
from opfuse.config import FusionConfig
from opfuse.hardware import get_hardware


@pytest.fixture(scope="module")
def resnet18_analysis():
    model, inputs = load_builtin("resnet18", 1)
    return opfuse.analyze(model, inputs, FusionConfig(dtype="float16", hardware="h200"))


def test_the_split_reproduces_the_analysis_prediction(resnet18_analysis):
    terms = zoo_fit.kernel_terms(resnet18_analysis)
    assert sum(t.launches for t in terms) == resnet18_analysis.fused.kernel_launches
    # resnet18 at batch 1 has split-K groups: their reduce kernel and partial tiles are in the prediction too
    assert any(t.launches == 2 for t in terms)
    workload = Workload("resnet18-bs1", terms, 1.0)
    given = zoo_fit.factors_of(resnet18_analysis.hardware)
    assert zoo_fit.predict(workload, given) == pytest.approx(resnet18_analysis.fused.predicted_time, rel=1e-9)
    # every part scales with its own factor: halving the memory efficiency slows the memory-bound kernels alone
    slower = zoo_fit.predict(workload, given | {"memory_efficiency": given["memory_efficiency"] / 2})
    memory_bound = sum(t.memory / given["memory_efficiency"] for t in terms
                       if t.memory / given["memory_efficiency"] >= max(t.matrix / given["matrix_efficiency"],
                                                                       t.vector / given["vector_efficiency"]))
    assert memory_bound > 0
    assert slower > resnet18_analysis.fused.predicted_time + memory_bound * 0.99


def _synthetic(truth: dict, count: int) -> list[Workload]:
    """Workloads of differently mixed kernels, 'measured' exactly as `truth` predicts them."""
    workloads = []
    for i in range(count):
        kernels = (KernelTerms(memory=(i + 1) * 1e-5, matrix=0.0, vector=0.0, floor=0.0, launches=1),
                   KernelTerms(memory=1e-6, matrix=(count - i) * 2e-5, vector=0.0, floor=1e-6, launches=2),
                   KernelTerms(memory=1e-7, matrix=0.0, vector=(i % 3 + 1) * 3e-6, floor=0.0, launches=1 + i))
        workload = Workload(f"w{i}", kernels, 1.0)
        workloads.append(Workload(workload.name, kernels, zoo_fit.predict(workload, truth)))
    return workloads


def test_the_fit_recovers_the_factors_that_made_the_times():
    truth = {"memory_efficiency": 0.4, "matrix_efficiency": 0.75, "vector_efficiency": 0.3, "launch_overhead": 4e-6}
    workloads = _synthetic(truth, 8)
    start = zoo_fit.factors_of(get_hardware("h200"))
    assert zoo_fit.median_error(workloads, start) > 0.2
    fitted = zoo_fit.fit_workloads(workloads, start)
    assert zoo_fit.median_error(workloads, fitted) < 0.01
    for name, value in truth.items():
        assert fitted[name] == pytest.approx(value, rel=0.1), name
    held_out = zoo_fit.leave_one_out(workloads, start)
    assert sorted(held_out) == sorted(w.name for w in workloads)
    assert max(held_out.values()) < 0.05


def test_efficiencies_stay_physical():
    # times only an efficiency over 1 would explain: the fit stops at 1
    truth = {"memory_efficiency": 3.0, "matrix_efficiency": 0.7, "vector_efficiency": 0.5, "launch_overhead": 0.0}
    workloads = _synthetic(truth, 5)
    fitted = zoo_fit.fit_workloads(workloads, zoo_fit.factors_of(get_hardware("h200")))
    assert fitted["memory_efficiency"] == 1.0
    assert all(0 < fitted[n] <= 1 for n in ("memory_efficiency", "matrix_efficiency", "vector_efficiency"))
    assert fitted["launch_overhead"] >= 0 and math.isfinite(fitted["launch_overhead"])


def test_runs_give_only_workloads_whose_plan_is_what_was_measured(resnet18_analysis):
    launches = resnet18_analysis.plan.kernel_launches
    run = {"workloads": {
        "resnet18-bs1": {"model": "resnet18", "batch": 1, "measure": {"row": {
            "plan_launches": launches, "opfuse_replay": {"median_ms": 0.2}}}},
        "resnet18-bs2": {"model": "resnet18", "batch": 2, "measure": {"row": {
            "plan_launches": launches + 5, "opfuse_replay": {"median_ms": 0.3}}}},
        "resnet18-bs4": {"model": "resnet18", "batch": 4, "measure": {"error": "timed out"}}}}
    workloads, left_out = zoo_fit.workloads_of_runs([run], progress=lambda _: None)
    assert [w.name for w in workloads] == ["resnet18-bs1"] and workloads[0].measured == pytest.approx(2e-4)
    assert "launches" in left_out["resnet18-bs2"] and left_out["resnet18-bs4"] == "not measured"
