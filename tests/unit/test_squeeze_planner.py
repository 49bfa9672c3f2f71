"""The planner on a squeeze-and-excitation block (conv -> SE -> mul -> conv): the squeeze (global average pool ->
1x1 conv + activation -> 1x1 conv + sigmoid) is one SQUEEZE group of one launch, with a kernel of opfuse's; the
switch, the shapes and the budget refuse it with their codes."""

import pytest

from graph_builders import GraphBuilder
from opfuse.codegen.lower import choose_lowering, groups_through_pytorch
from opfuse.config import FusionConfig
from opfuse.fusion.plan import GroupKind, Verdict
from opfuse.fusion.planner import plan_fusion
from opfuse.fusion.reasons import Code
from opfuse.fusion.squeeze import MAX_HIDDEN
from opfuse.hardware import get_hardware

H200 = get_hardware("h200")


def se_block(batch: int = 1, channels: int = 10, hidden: int = 3, size: int = 7, activation: str = "silu",
             linear: bool = False):
    """conv + silu -> [pool -> fc1 + act -> fc2 + sigmoid] -> mul -> 1x1 conv: the squeeze's nodes named."""
    b = GraphBuilder("se_block")
    x = b.input("x", (batch, 4, size, size))
    y = b.unary("silu", b.conv(x, channels, 3, padding=1, name="conv"), name="act")
    if linear:
        pooled = b.op("mean", [y], {"dims": [2, 3], "keepdim": False}, name="pool")
        fc1 = b.linear(pooled, hidden, name="fc1")
    else:
        pooled = b.op("adaptive_avg_pool2d", [y], {"output_size": (1, 1)}, name="pool")
        fc1 = b.conv(pooled, hidden, name="fc1")
    hidden_value = b.unary(activation, fc1, name="fc1_act")
    fc2 = b.linear(hidden_value, channels, name="fc2") if linear else b.conv(hidden_value, channels, name="fc2")
    scale = b.unary("sigmoid", fc2, name="scale")
    if linear:
        scale = b.op("reshape", [scale], {"shape": [batch, channels, 1, 1]}, name="scale_map")
    return b.output(b.conv(b.op("mul", [y, scale], name="excite"), 6, name="project"))


SQUEEZE = ["pool", "fc1", "fc1_act", "fc2", "scale"]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("activation", ["silu", "relu"])
def test_the_squeeze_is_one_group_of_one_launch(batch, activation):
    plan = plan_fusion(se_block(batch, activation=activation), FusionConfig(split_k=False, squeeze=True), H200)
    squeeze = plan.group_of("pool")
    assert squeeze.kind is GroupKind.SQUEEZE and squeeze.nodes == SQUEEZE and squeeze.launches == 1
    assert squeeze.code is Code.FUSED and squeeze.outputs == ["scale"]
    assert choose_lowering(plan.graph, squeeze) == "squeeze"
    assert plan.group_of("excite") is plan.group_of("project")      # the scale stays the project conv's prologue
    assert plan.kernel_launches == 3                                 # conv + silu, the squeeze, mul + project
    assert groups_through_pytorch(plan) == {}
    decision = next(d for d in plan.decisions if d.fusion == "squeeze")
    assert decision.verdict is Verdict.FUSED and decision.time_fused < decision.time_unfused


def test_a_mean_and_linears_squeeze_too():
    plan = plan_fusion(se_block(2, linear=True), FusionConfig(split_k=False, squeeze=True), H200)
    squeeze = plan.group_of("pool")
    assert squeeze.kind is GroupKind.SQUEEZE and squeeze.nodes == SQUEEZE
    assert groups_through_pytorch(plan) == {}


def test_the_switch_keeps_three_kernels():
    assert FusionConfig().squeeze          # on by default since measured (RESULTS.md run 88); off, three kernels
    plan = plan_fusion(se_block(), FusionConfig(split_k=False, squeeze=False), H200)
    assert plan.group_of("pool").nodes == ["pool"] and plan.kernel_launches == 5
    decision = next(d for d in plan.decisions if d.fusion == "squeeze")
    assert decision.verdict is Verdict.ILLEGAL and decision.code is Code.DISABLED


def test_a_hidden_vector_past_the_bound_is_refused_over_budget():
    plan = plan_fusion(se_block(channels=4, hidden=MAX_HIDDEN * 2, size=2), FusionConfig(split_k=False, squeeze=True), H200)
    assert plan.group_of("pool").kind is not GroupKind.SQUEEZE
    decision = next(d for d in plan.decisions if d.fusion == "squeeze")
    assert decision.verdict is Verdict.OVER_BUDGET and decision.code is Code.OVER_BUDGET
    assert "hidden channels" in decision.reason


def test_a_pool_read_elsewhere_is_no_squeeze():
    b = GraphBuilder("pool_read_twice")
    x = b.input("x", (1, 8, 5, 5))
    pooled = b.op("adaptive_avg_pool2d", [x], {"output_size": (1, 1)}, name="pool")
    fc1 = b.unary("relu", b.conv(pooled, 2, name="fc1"), name="fc1_act")
    scale = b.unary("sigmoid", b.conv(fc1, 8, name="fc2"), name="scale")
    plan = plan_fusion(b.output(scale, pooled), FusionConfig(split_k=False, squeeze=True), H200)
    assert all(g.kind is not GroupKind.SQUEEZE for g in plan.groups)
    decision = next(d for d in plan.decisions if d.fusion == "squeeze")
    assert decision.verdict is Verdict.ILLEGAL and decision.code is Code.NOT_SQUEEZE


def test_the_plan_counts_a_row_split_only_where_the_row_template_runs_it():
    """review of b74d365: a squeeze-and-excitation group's pool splits inside the squeeze kernel (one launch), the
    same pool alone in the row template's two; a sum of no rows splits nothing (it divided by zero)."""
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.tiles import RowView, row_slices

    graph = se_block(batch=1, channels=16, hidden=4, size=64)
    plan = plan_fusion(graph, FusionConfig(split_k=False, squeeze=True), H200)
    group = plan.group_of("pool")
    assert group.kind is GroupKind.SQUEEZE
    assert group.launches == lower_group(plan.graph, group, "cpu", {}, hw=H200).launches() == 1
    apart = plan_fusion(se_block(batch=1, channels=16, hidden=4, size=64), FusionConfig(split_k=False, squeeze=False),
                        H200)
    assert apart.group_of("pool").launches == 2
    assert row_slices(RowView("sum", (1,), 0, 16, False), 64, 64, 132) == 1
