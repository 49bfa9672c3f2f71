"""`opfuse.analyze` reports what the last compile of its plan runs (opfuse.analysis.as_compiled): the launches,
and the groups that left their fused form, when they differ from the plan's; or that the compile failed."""

import json

import pytest
import torch

import opfuse
from opfuse.codegen import lower
from opfuse.ir.graph import GraphError


def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Tanh())
    return model.eval(), torch.randn(2, 8)


def sabotage_the_tanh_group(monkeypatch):
    """Lower the second linear's group (+ tanh) to a kernel that is off by one: it fails verification."""
    original = lower.lower_group

    def wrong(graph, group, device, reasons=None, hw=None):
        kernel = original(graph, group, device, reasons, hw)
        if kernel is not None and any(graph[n].op == "tanh" for n in group.nodes) and len(group.nodes) > 1:
            run = kernel.run
            kernel.run = lambda inputs, config=None: [out + 1.0 for out in run(inputs, config)]
        return kernel

    monkeypatch.setattr(lower, "lower_group", wrong)
    return original


def test_analyze_reports_the_compiled_launches_where_verification_unfused_a_group(tmp_path, monkeypatch):
    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    before = opfuse.analyze(model, (x,), config)
    assert before.as_compiled is None                     # nothing compiled yet: the plan is all analyze knows

    original = sabotage_the_tanh_group(monkeypatch)
    compiled = opfuse.compile(model, (x,), config)
    monkeypatch.setattr(lower, "lower_group", original)
    assert compiled.launches > compiled.plan.kernel_launches     # the unfused group launches one kernel per op

    after = opfuse.analyze(model, (x,), config)
    record = after.as_compiled
    assert record.launches == compiled.launches and record.planned == before.fused.kernel_launches
    assert list(record.through_pytorch) == list(compiled.fallbacks) and not record.failed
    assert "failed verification" in next(iter(record.through_pytorch.values()))
    assert (f"{compiled.launches} kernel launches per forward, planned {record.planned} (1 through PyTorch after "
            "verification)") in record.summary()
    assert json.loads(json.dumps(after.to_dict()))["as_compiled"]["launches"] == compiled.launches
    assert compiled.analysis.as_compiled == record               # the compiled model says the same

    unverified = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), verify=False)
    assert opfuse.analyze(model, (x,), unverified).as_compiled is None   # unverified, the group keeps its kernel


def test_a_record_is_only_of_the_same_plan_settings_and_device(tmp_path):
    from opfuse.analysis import as_compiled

    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    compiled = opfuse.compile(model, (x,), config)
    analysis = opfuse.analyze(model, (x,), config)
    assert analysis.as_compiled.launches == compiled.launches
    for other in (dict(split_k=False), dict(verify=False), dict(vertical=False)):   # settings, the plan
        assert opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path),
                                                               **other)).as_compiled is None, other
    assert opfuse.analyze(model, (torch.randn(3, 8),), config).as_compiled is None     # another shape
    assert as_compiled.load(analysis.plan, config, as_compiled.Target(as_compiled.CPU, False)) == analysis.as_compiled
    assert as_compiled.load(analysis.plan, config, as_compiled.Target("NVIDIA H200", True)) is None   # another device


def test_where_nothing_tunes_the_tuning_settings_are_no_part_of_the_key(tmp_path):
    """On the CPU nothing is tuned: a compile with tuning off finds the record of one with tune_top 8 (and the
    CLI's --tune-top 0, tune_top None, is the same compile)."""
    model, x = model_and_input()
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), tune_top=8))
    for settings in (dict(autotune=False), dict(autotune=False, tune_top=None), dict(library_anchors=False)):
        config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), **settings)
        assert opfuse.analyze(model, (x,), config).as_compiled.launches == compiled.launches, settings


def test_a_group_analyze_already_sends_through_pytorch_is_planned_not_lost(tmp_path):
    """A linear whose weight is an input runs through PyTorch by analyze's own count: the record's planned launches
    are analyze's (`fused`), and it lists no group as lost."""
    class InputWeight(torch.nn.Module):
        def forward(self, x, w):
            return torch.relu(torch.nn.functional.linear(x, w))

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    compiled = opfuse.compile(InputWeight(), (x, w), config)
    record = opfuse.analyze(InputWeight(), (x, w), config).as_compiled
    assert compiled.analysis.pytorch_groups and record.through_pytorch == {}
    assert record.planned == compiled.analysis.fused.kernel_launches == record.launches == compiled.launches


def test_a_failed_compile_is_recorded_as_failed(tmp_path):
    """The record is of the last compile: one that fails after a good one replaces its record (memory_limit is no
    setting of the key, so both compiles are of one plan)."""
    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    opfuse.compile(model, (x,), config)
    assert opfuse.analyze(model, (x,), config).as_compiled.launches > 0
    with pytest.raises(GraphError, match="memory"):
        opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), memory_limit=1))
    record = opfuse.analyze(model, (x,), config).as_compiled
    assert record.launches == 0 and record.failed.startswith("GraphError: ")
    assert "the last compile of this plan on the CPU (Triton's interpreter)" in record.summary()
    assert "failed: GraphError" in record.summary()


def test_a_record_says_the_forward_time_measured_at_the_compile(tmp_path):
    """On a GPU the compile times a replay of the forward (`CompiledModel.measure_forward`); the record keeps it,
    its summary and the report's table say it, and a record written before the field existed still loads."""
    from opfuse.analysis import as_compiled
    from opfuse.analysis.report import summary_rows

    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    compiled = opfuse.compile(model, (x,), config)
    assert compiled.compiled.forward_ms is None          # the CPU runs no CUDA graph: nothing measured
    analysis = opfuse.analyze(model, (x,), config)
    assert analysis.as_compiled.forward_ms is None and " ms a forward" not in analysis.as_compiled.summary()

    timed = as_compiled.AsCompiled(**{**analysis.as_compiled.to_dict(), "forward_ms": 0.4251})
    key = as_compiled.plan_key(analysis.plan, config, as_compiled.target((x,), config))
    as_compiled.store(key, config, timed)
    again = opfuse.analyze(model, (x,), config)
    assert again.as_compiled == timed
    assert ", 0.425 ms a forward (a graph replay timed there), planned" in again.as_compiled.summary()
    rows = {row["metric"]: row["fused"] for row in summary_rows(again, {})}
    assert rows["time of a forward as compiled on the CPU (Triton's interpreter) (a CUDA graph replay)"] == \
        pytest.approx(0.4251e-3)

    old = {k: v for k, v in timed.to_dict().items() if k != "forward_ms"}    # a record of the previous layout
    as_compiled._cache(config).store(key, old)
    assert opfuse.analyze(model, (x,), config).as_compiled == as_compiled.AsCompiled(**old)
