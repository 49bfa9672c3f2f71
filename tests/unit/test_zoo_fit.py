"""Fitting the profile's time factor to whole-model times across the zoo (opfuse.bench.zoo_fit), and what the
factor does to the cost model: every kernel time scaled alike, so no plan changes."""

import pytest

import opfuse
from opfuse.bench import zoo_fit
from opfuse.bench.zoo import load_builtin
from opfuse.bench.zoo_fit import Workload
from opfuse.config import FusionConfig
from opfuse.hardware import PROFILES


def test_the_multiplier_minimises_the_sum_of_relative_errors():
    workloads = [Workload(f"w{i}", predicted=1.0, measured=m) for i, m in enumerate((1.5, 2.0, 2.1, 2.2, 9.0))]
    k = zoo_fit.fit_multiplier(workloads)

    def cost(value: float) -> float:
        return sum(zoo_fit.relative_error(w, value) for w in workloads)

    assert k == 2.0             # the median weighted by 1 / measured: the outlier at 9x does not drag it
    assert all(cost(k) <= cost(k * (1 + step)) for step in (-0.2, -0.01, 0.01, 0.2))
    exact = [Workload(f"e{i}", predicted=p, measured=1.7 * p) for i, p in enumerate((1e-4, 3e-4, 2e-3))]
    assert zoo_fit.fit_multiplier(exact) == pytest.approx(1.7)


def test_leave_one_out_predicts_each_workload_without_it():
    workloads = [Workload("a", 1.0, 2.0), Workload("b", 1.0, 2.0), Workload("c", 1.0, 4.0)]
    held_out = zoo_fit.leave_one_out(workloads)
    assert held_out["c"] == pytest.approx(0.5)          # fitted to a and b alone: 2x, so 2 against 4
    assert held_out["a"] == pytest.approx(0.0)           # fitted to b and c: 2x (c, measured 4x, weighs half)
    report = zoo_fit.fit_report(workloads, given_factor=1.5)
    assert report["time_factor_fitted"] == pytest.approx(1.5 * zoo_fit.fit_multiplier(workloads))
    assert report["median_error_given"] == pytest.approx(0.5)


def test_the_time_factor_scales_the_prediction_and_changes_no_plan(monkeypatch):
    model, inputs = load_builtin("resnet18", 1)
    config = FusionConfig(dtype="float16", hardware="h200")
    before = opfuse.analyze(model, inputs, config)
    monkeypatch.setitem(PROFILES, "h200", PROFILES["h200"].with_calibration(
        time_factor=PROFILES["h200"].time_factor * 3))
    after = opfuse.analyze(model, inputs, config)
    assert [g.nodes for g in after.plan.groups] == [g.nodes for g in before.plan.groups]
    assert [d.verdict for d in after.plan.decisions] == [d.verdict for d in before.plan.decisions]
    assert after.plan.kernel_launches == before.plan.kernel_launches
    assert any("split-K:" in g.reason for g in after.plan.groups)     # split-K groups' partials' prices scale too
    assert after.fused.predicted_time == pytest.approx(3 * before.fused.predicted_time, rel=1e-9)
    assert after.unfused.predicted_time == pytest.approx(3 * before.unfused.predicted_time, rel=1e-9)


def test_runs_give_only_workloads_whose_plan_is_what_was_measured():
    model, inputs = load_builtin("resnet18", 1)
    analysis = opfuse.analyze(model, inputs, FusionConfig(dtype="float16", hardware="h200"))
    launches = analysis.plan.kernel_launches
    run = {"workloads": {
        "resnet18-bs1": {"model": "resnet18", "batch": 1, "measure": {"row": {
            "plan_launches": launches, "fallbacks": {}, "opfuse_replay": {"median_ms": 0.2}}}},
        "resnet18-bs2": {"model": "resnet18", "batch": 2, "measure": {"row": {
            "plan_launches": launches + 5, "fallbacks": {}, "opfuse_replay": {"median_ms": 0.3}}}},
        "resnet18-bs3": {"model": "resnet18", "batch": 1, "measure": {"row": {
            "plan_launches": launches, "fallbacks": {"g1": "opaque op: runs through PyTorch"},
            "opfuse_replay": {"median_ms": 0.3}}}},
        "resnet18-bs4": {"model": "resnet18", "batch": 4, "measure": {"error": "timed out"}}}}
    workloads, left_out = zoo_fit.workloads_of_runs([run], progress=lambda _: None)
    assert [w.name for w in workloads] == ["resnet18-bs1"]
    assert workloads[0].measured == pytest.approx(2e-4)
    assert workloads[0].predicted == pytest.approx(analysis.fused.predicted_time)
    assert "launches" in left_out["resnet18-bs2"] and "through PyTorch" in left_out["resnet18-bs3"]
    assert left_out["resnet18-bs4"] == "not measured"
