"""`opfuse.analyze` reports what the last compile of its plan runs (opfuse.analysis.as_compiled): the launches,
and the groups that left their fused form, when they differ from the plan's."""

import json

import torch

import opfuse
from opfuse.codegen import lower


def model_and_input():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4), torch.nn.Tanh())
    return model.eval(), torch.randn(2, 8)


def test_analyze_reports_the_compiled_launches_where_verification_unfused_a_group(tmp_path, monkeypatch):
    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    before = opfuse.analyze(model, (x,), config)
    assert before.as_compiled is None                     # nothing compiled yet: the plan is all analyze knows

    original = lower.lower_group

    def wrong_second_linear(graph, group, device, reasons=None, hw=None):   # fails its check: runs through PyTorch
        kernel = original(graph, group, device, reasons, hw)
        if kernel is not None and group.anchor and graph[group.anchor].op == "linear" and len(group.nodes) > 1 \
                and any(graph[n].op == "tanh" for n in group.nodes):
            run = kernel.run
            kernel.run = lambda inputs, config=None: [out + 1.0 for out in run(inputs, config)]
        return kernel

    monkeypatch.setattr(lower, "lower_group", wrong_second_linear)
    compiled = opfuse.compile(model, (x,), config)
    monkeypatch.setattr(lower, "lower_group", original)
    assert compiled.launches > compiled.plan.kernel_launches     # the unfused group launches one kernel per op

    after = opfuse.analyze(model, (x,), config)
    record = after.as_compiled
    assert record.launches == compiled.launches and record.planned == before.plan.kernel_launches
    assert list(record.through_pytorch) == [g for g in compiled.fallbacks]
    assert "failed verification" in next(iter(record.through_pytorch.values()))
    assert f"{compiled.launches} kernel launches per forward, planned {record.planned}" in record.summary()
    assert json.loads(json.dumps(after.to_dict()))["as_compiled"]["launches"] == compiled.launches
    assert compiled.analysis.as_compiled == record               # the compiled model says the same


def test_a_record_is_only_of_the_same_plan_and_tuning_settings(tmp_path):
    model, x = model_and_input()
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path))
    compiled = opfuse.compile(model, (x,), config)
    assert opfuse.analyze(model, (x,), config).as_compiled.launches == compiled.launches
    other_tuning = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), tune_top=1)
    assert opfuse.analyze(model, (x,), other_tuning).as_compiled is None
    assert opfuse.analyze(model, (torch.randn(3, 8),), config).as_compiled is None     # another shape
    unfused = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), vertical=False)
    assert opfuse.analyze(model, (x,), unfused).as_compiled is None                     # another plan
