"""The GPU half of the coverage suite: how a result row becomes a verdict, the summary over models, the family
order, and one tiny model run through the whole path on the CPU (interpreter; eager as the only baseline)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict

import pytest
import torch
import torch.nn as nn

from opfuse.bench.suite import SuiteModel
from opfuse.bench.suite_gpu import (FLOAT16_HEADROOM, UNCHECKED, GpuResult, interleave_families, judge,
                                   keep_float16_finite, looks_trained, markdown, run_gpu_suite, run_isolated,
                                   summarize)


def entry(name: str = "m", family: str = "cnn") -> SuiteModel:
    return SuiteModel(name, family, "torch", lambda: (nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(),
                                                       (torch.randn(2, 8),)))


def _dies():
    os._exit(7)


# the models `run_isolated`'s child finds by name (importing this module)
ISOLATED = [SuiteModel("dies", "cnn", "torch", _dies), SuiteModel("tiny", "mlp", "torch", lambda: (
    nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval(), (torch.randn(2, 8),)))]


def test_families_take_turns_each_in_suite_order():
    models = [entry("a1", "a"), entry("a2", "a"), entry("a3", "a"), entry("b1", "b"), entry("c1", "c")]
    assert [m.name for m in interleave_families(models)] == ["a1", "b1", "c1", "a2", "a3"]


@pytest.mark.parametrize("row, status, speedup", [
    ({"opfuse": {"median_ms": 1.0, "rel_error": 1e-3}, "eager": {"median_ms": 3.0, "rel_error": 1e-3},
      "inductor": {"median_ms": 2.0, "rel_error": 1e-3}}, "matched", 2.0),
    # over float16's 1e-2, but within the margin of eager float16's own error: still a match
    ({"opfuse": {"median_ms": 2.0, "rel_error": 0.03}, "eager": {"median_ms": 1.0, "rel_error": 0.025}},
     "matched", 0.5),
    ({"opfuse": {"median_ms": 1.0, "rel_error": 0.2}, "eager": {"median_ms": 1.0, "rel_error": 1e-3}},
     "mismatched", 1.0),
    ({"opfuse": {"error": "GraphError: no"}, "eager": {"median_ms": 1.0, "rel_error": 1e-3}}, "failed", None),
])
def test_a_row_is_judged_against_the_fastest_baseline_and_the_float16_rule(row, status, speedup):
    result = judge(entry(), row, "float16", 1.0)
    assert result.status == status
    assert result.speedup == speedup
    if status == "failed":
        assert result.error == "GraphError: no"


def test_a_row_carries_opfuses_replay_and_both_kernel_times_into_its_columns():
    row = {"opfuse": {"median_ms": 0.12, "rel_error": 1e-3, "gpu_busy_ms": 0.05}, "opfuse_replay_ms": 0.1,
           "eager": {"median_ms": 3.0, "rel_error": 1e-3, "gpu_busy_ms": 1.0},
           "inductor": {"median_ms": 0.07, "rel_error": 1e-3, "gpu_busy_ms": 0.06}}
    result = judge(entry(), row, "float16", 1.0)
    assert (result.replay_ms, result.busy_ms, result.best, result.best_busy_ms) == (0.1, 0.05, "inductor", 0.06)
    assert "| 0.100 | 0.050 (0.060) |" in markdown([result], 1)


def test_a_model_run_keeps_what_opfuse_planned_launched_and_tuned_for_the_json():
    (result,) = run_gpu_suite([entry("tiny")], device="cpu", contenders=("eager", "opfuse"), dtype="float32")
    assert result.detail["plan_launches"] >= 1 and result.detail["runtime_launches"] >= 1
    assert {"unfused", "library_anchors", "tuning"} <= set(result.detail)
    assert json.loads(json.dumps(asdict(result)))["detail"]["plan_launches"] == result.detail["plan_launches"]


def test_the_summary_counts_matches_and_takes_the_geometric_mean_of_matched_models():
    results = [GpuResult("a", "cnn", "matched", speedup=2.0, opfuse_ms=1.0),
               GpuResult("b", "vit", "matched", speedup=0.5, opfuse_ms=1.0),
               GpuResult("c", "vit", "mismatched", speedup=9.0, opfuse_ms=1.0),
               GpuResult("d", "moe", "failed"), GpuResult("e", "moe", "not-reached")]
    s = summarize(results)
    assert (s["tried"], s["compiled"], s["matched"], s["below_0_9"], s["not_reached"]) == (4, 3, 2, 1, 1)
    assert math.isclose(s["geomean_speedup"], 1.0, rel_tol=1e-6) and s["slowest"] == "b 0.50x"
    assert markdown(results, 1).startswith("Batch 1: 2 of 4 models (50.0%)")


def test_a_tiny_model_goes_the_whole_way_and_the_budget_stops_the_rest():
    results = run_gpu_suite([entry("tiny"), entry("late", "vit")], budget=0.0, device="cpu",
                            contenders=("eager", "opfuse"), dtype="float32")
    assert [r.status for r in results] == ["not-reached", "not-reached"]
    (result,) = run_gpu_suite([entry("tiny")], device="cpu", contenders=("eager", "opfuse"), dtype="float32")
    assert result.status == "matched", result
    assert result.best == "eager" and result.speedup > 0 and result.rel_error < 1e-5


def test_a_zero_initialised_head_is_reset_so_the_check_sees_something():
    """timm zeroes some classification heads: an output of zeros would match anything."""
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 3))
    nn.init.zeros_(model[2].weight)
    nn.init.zeros_(model[2].bias)
    looks_trained(model)
    assert model[2].weight.any() and not torch.equal(model[1].weight, torch.ones(8))
    assert model(torch.randn(2, 8)).abs().sum() > 0


def test_where_eager_float16_overflows_the_model_is_unchecked_not_matched():
    """Both outputs infinite where the float32 reference is finite: the two errors are inf, and inf is within any
    margin of inf, so the rule alone would call it a match."""
    row = {"opfuse": {"median_ms": 1.0, "rel_error": math.inf}, "eager": {"median_ms": 2.0, "rel_error": math.inf}}
    result = judge(entry(), row, "float16", 1.0)
    assert (result.status, result.error, result.speedup) == ("unchecked", UNCHECKED, 2.0)
    s = summarize([result, GpuResult("b", "vit", "matched", speedup=1.5, opfuse_ms=1.0)])
    assert (s["tried"], s["matched"], s["geomean_speedup"]) == (2, 1, 1.5)


def test_a_model_past_float16s_range_is_rescaled_to_the_same_function_and_others_are_left_alone():
    torch.manual_seed(0)
    layers = [nn.Linear(64, 64, bias=False) for _ in range(8)]
    for layer in layers:
        nn.init.normal_(layer.weight, std=1.0)     # a gain of 8 a layer: 8^8 = 1.7e7 at the end
    model = nn.Sequential(*[m for layer in layers for m in (layer, nn.ReLU())]).eval()
    x = (torch.randn(2, 64),)
    with torch.no_grad():
        before = model(*x)
        assert before.abs().max() > FLOAT16_HEADROOM
        assert keep_float16_finite(model, x)
        after = model(*x)
    assert after.abs().max() < FLOAT16_HEADROOM and torch.isfinite(model.half()(x[0].half())).all()
    scale = before.norm() / after.norm()          # a bias-free ReLU network: the same function up to a scale
    assert torch.allclose(after * scale, before, rtol=1e-4, atol=1e-3 * float(before.abs().max()))
    tame = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).eval()
    weights = [p.clone() for p in tame.parameters()]
    with torch.no_grad():
        assert not keep_float16_finite(tame, (torch.randn(2, 8),))
    assert all(torch.equal(a, b) for a, b in zip(weights, tame.parameters()))


def test_a_model_that_kills_its_process_is_a_failed_row_and_the_next_one_runs():
    """The models run in a child process; the one it died on is failed with the exit code, a new child runs the rest
    (as a segmentation fault after marian's failed CUDA graph capture would otherwise end the whole call)."""
    seen = []
    results = run_isolated(["dies", "tiny"], device="cpu", contenders=("eager", "opfuse"), dtype="float32",
                           on_result=seen.append, source="tests.unit.test_suite_gpu:ISOLATED")
    assert [(r.name, r.family, r.status) for r in results] == [("dies", "cnn", "failed"), ("tiny", "mlp", "matched")]
    assert results[0].error == "the process died (exit code 7)"
    assert [r.name for r in seen] == ["dies", "tiny"] and results[1].rel_error < 1e-5


def test_a_variant_is_timed_beside_the_default_and_shown_in_its_column():
    """`--variant split_k=0`: opfuse compiled again under the switch, timed in the same rounds; the row keeps the
    default's verdict and carries the variant's time."""
    (result,) = run_gpu_suite([entry("tiny")], device="cpu", contenders=("eager", "opfuse"), dtype="float32",
                              variants=["split_k=0"])
    assert result.status == "matched" and set(result.variants) == {"opfuse:split_k=0"}
    assert result.variants["opfuse:split_k=0"] > 0
    table = markdown([result], 1)
    assert "opfuse:split_k=0 ms |" in table and f"| {result.variants['opfuse:split_k=0']:.3f} |" in table
