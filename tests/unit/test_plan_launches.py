"""The plan counts the launches the compiled model makes untuned on a GPU: split-K's second kernel only where the
kernel's default tile (`opfuse.fusion.tiles`, shared by the templates and the planner) splits the reduction. The
kernels are built with the interpreter's tiny tile switched off (nothing runs); the plan follows the GPU's rules
whether or not the interpreter is on."""

import sys

import pytest

from opfuse.api import analyze
from opfuse.bench.zoo import load_builtin
from opfuse.codegen.split_k import slices_of
from opfuse.codegen.lower import lower_plan
from opfuse.config import FusionConfig


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The GPU's tile rules for one test; the generated kernel modules it imports (compiled for the GPU, not the
    interpreter) are dropped afterwards so that later tests generate their own."""
    before = set(sys.modules)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("opfuse_generated_"):
            del sys.modules[name]


@pytest.mark.parametrize("name,batch", [("resnet18", 1), ("resnet18", 8)])
def test_plan_launches_are_what_the_default_configs_launch(gpu_tiles, name, batch):
    model, inputs = load_builtin(name, batch=batch)
    analysis = analyze(model.half(), tuple(x.half() for x in inputs), FusionConfig(dtype="float16"), name=name)
    plan = analysis.plan
    kernels, _ = lower_plan(plan, "cpu")
    assert set(kernels) == {g.name for g in plan.groups if g.launches}    # every launching group has a kernel
    assert sum(k.launches() for k in kernels.values()) == plan.kernel_launches == analysis.fused.kernel_launches
    offered = {g.name for g in plan.groups if g.split_k > 1}
    split = {name for name, k in kernels.items() if slices_of(k.configs()[0]) > 1}
    assert split <= offered and {g.name for g in plan.groups if g.launches == 2} == split
    if batch == 1:     # batch 1: the resource model's tile offers more splits than the default tile takes
        assert split and offered - split
        why = next(g.reason for g in plan.groups if g.name in offered - split)
        assert "split-K offered" in why and "one kernel unless the autotuner" in why
        assert "K blocks, under the 16" in why or "quarter of the SMs busy" in why, why


def test_kernels_follow_the_profile_the_plan_was_made_for(monkeypatch):
    """A plan for a GPU of 4 SMs, under a name opfuse does not know: its kernels split K for those 4 SMs."""
    import dataclasses

    from graph_builders import GraphBuilder
    from opfuse.fusion.planner import plan_fusion
    from opfuse.hardware import get_hardware

    monkeypatch.setenv("TRITON_INTERPRET", "0")       # the GPU's tiles, not the interpreter's
    small = dataclasses.replace(get_hardware("h200"), name="my gpu", sm_count=4)
    b = GraphBuilder("long_k")
    graph = b.output(b.linear(b.input("x", (16, 4096)), 64, name="fc"))
    plan = plan_fusion(graph, FusionConfig(), small)
    kernels, reasons = lower_plan(plan, "cpu")
    assert not reasons and plan.profile is small
    assert all(slices_of(c) <= 4 for c in kernels[plan.group_of("fc").name].configs())
