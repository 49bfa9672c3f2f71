"""Traffic analysis: the seed's Conv+BN+ReLU table, FLOPs by hand, peak intermediate memory by hand."""

import pytest

from graph_builders import GraphBuilder, conv_bn_relu, conv_relu
from opfuse.analysis.traffic import (compare, op_table, peak_intermediate_bytes, summarize_plan,
                                     summarize_unfused)
from opfuse.config import FusionConfig
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.planner import plan_fusion
from opfuse.hardware import get_hardware
from opfuse.ir.ops import node_flops

H200 = get_hardware("h200")


# ---- the seed's worked example -------------------------------------------------------------------------

def test_seed_conv_bn_relu_fusion_saves_four_times_the_conv_output():
    """Unfused, BN and ReLU each read and write the conv output S; fused, none of that happens: 4*S saved."""
    graph = conv_bn_relu(batch=2, c_in=16, c_out=64, size=32)
    s = graph["conv"].type.nbytes
    assert s == 2 * 64 * 32 * 32 * 2
    plan = plan_fusion(graph, FusionConfig())
    assert [g.nodes for g in plan.groups] == [["conv", "bn", "relu"]]
    assert plan.groups[0].kind is GroupKind.ANCHOR_EPILOGUE

    unfused = summarize_unfused(graph, H200)
    fused = summarize_plan(plan)
    assert unfused.total_bytes - fused.total_bytes == 4 * s
    assert (unfused.kernel_launches, fused.kernel_launches) == (3, 1)
    # the table row by row: reads S twice more (BN, ReLU) and writes S twice more (conv, BN) unfused
    assert unfused.bytes_read - fused.bytes_read == 2 * s
    assert unfused.bytes_written - fused.bytes_written == 2 * s
    savings = compare(unfused, fused)
    assert savings["bytes_saved"] == 4 * s
    assert savings["launches_saved"] == 2
    assert savings["time_saved"] > 0 and savings["speedup"] > 1


def test_folded_batch_norm_versus_the_unfolded_original():
    """Folding also drops BN's four parameter vectors and adds the conv's bias: 4*S + P - bias."""
    c_out = 64
    original = conv_bn_relu(batch=1, c_in=16, c_out=c_out, size=32)
    folded = conv_relu(batch=1, c_in=16, c_out=c_out, size=32)
    s = original["conv"].type.nbytes
    bn_params = 4 * c_out * 2     # weight, bias, running mean, running var in float16
    bias = c_out * 2
    unfused_original = summarize_unfused(original, H200)
    fused_folded = summarize_plan(plan_fusion(folded, FusionConfig()))
    assert fused_folded.kernel_launches == 1
    assert unfused_original.total_bytes - fused_folded.total_bytes == 4 * s + bn_params - bias


# ---- FLOPs by hand -------------------------------------------------------------------------------------

@pytest.mark.parametrize("kernel, stride, padding, dilation, groups, c_in, expected", [
    # 2 * N * Hout * Wout * Cout * (Cin / groups) * Kh * Kw, N = 2, Cout = 16, input 3 x 32 x 32 (or 16 x 32 x 32)
    (3, 1, 1, 1, 1, 3, 2 * 2 * 32 * 32 * 16 * 3 * 9),    # normal: 32x32 out
    (3, 2, 1, 1, 1, 3, 2 * 2 * 16 * 16 * 16 * 3 * 9),    # strided: 16x16 out
    (3, 1, 2, 2, 1, 3, 2 * 2 * 32 * 32 * 16 * 3 * 9),    # dilated 2, padding 2: 32x32 out
    (3, 1, 0, 2, 1, 3, 2 * 2 * 28 * 28 * 16 * 3 * 9),    # dilated 2, no padding: 32 - 4 = 28
    (3, 1, 1, 1, 16, 16, 2 * 2 * 32 * 32 * 16 * 1 * 9),  # depthwise: one input channel per output
])
def test_conv2d_flops_by_hand(kernel, stride, padding, dilation, groups, c_in, expected):
    b = GraphBuilder("conv")
    x = b.input("x", (2, c_in, 32, 32))
    graph = b.output(b.conv(x, 16, kernel, stride, padding, dilation, groups, name="conv"))
    assert node_flops(graph, graph["conv"]) == expected
    row = next(r for r in op_table(graph, H200) if r.name == "conv")
    assert row.flops == expected


def test_linear_and_matmul_flops_by_hand():
    b = GraphBuilder("gemm")
    x = b.input("x", (4, 10, 32))                 # M = 40 rows, K = 32
    y = b.linear(x, 48, name="fc")                # N = 48
    a = b.input("a", (3, 5, 7))
    c = b.input("c", (3, 7, 9))
    graph = b.output(y, b.op("matmul", [a, c], name="mm"))
    assert node_flops(graph, graph["fc"]) == 2 * 40 * 48 * 32
    assert node_flops(graph, graph["mm"]) == 2 * 3 * 5 * 9 * 7


def test_op_table_rows():
    graph = conv_bn_relu(batch=1, c_in=16, c_out=64, size=32)
    rows = {r.name: r for r in op_table(graph, H200, FusionConfig())}
    assert set(rows) == {"conv", "bn", "relu"}                   # inputs and constants launch nothing
    s = graph["conv"].type.nbytes
    relu = rows["relu"]
    assert (relu.op, relu.kind, relu.bytes_read, relu.bytes_written, relu.flops) == ("relu", "pointwise", s, s,
                                                                                     s // 2)
    assert relu.density == pytest.approx(0.25) and relu.candidate
    assert rows["bn"].bytes_read == s + 4 * 64 * 2 and rows["bn"].candidate
    assert not rows["conv"].candidate
    assert relu.predicted_time == pytest.approx((2 * s / (H200.memory_bandwidth * H200.memory_efficiency)
                                                 + H200.launch_overhead) * H200.time_factor)


# ---- peak intermediate memory by hand ------------------------------------------------------------------

def _two_layer_chain():
    """x[8,128] -> fc1 [8,256] -> relu -> fc2 [8,64] -> sigmoid (output)."""
    b = GraphBuilder("chain")
    x = b.input("x", (8, 128))
    y = b.unary("relu", b.linear(x, 256, name="fc1"), "relu")
    return b.output(b.unary("sigmoid", b.linear(y, 64, name="fc2"), "sigmoid"))


def test_peak_intermediate_memory_on_a_small_chain():
    graph = _two_layer_chain()
    wide, narrow = 8 * 256 * 2, 8 * 64 * 2        # 4096 B, 1024 B
    # unfused: while relu runs, fc1's output and relu's are live: 2 * wide (then fc2: wide + narrow, ...)
    assert summarize_unfused(graph, H200).peak_intermediate_bytes == 2 * wide
    plan = plan_fusion(graph, FusionConfig())
    assert [g.nodes for g in plan.groups] == [["fc1", "relu"], ["fc2", "sigmoid"]]
    # fused: while fc2+sigmoid runs, relu's output and the graph output are live
    assert summarize_plan(plan).peak_intermediate_bytes == wide + narrow


def test_graph_outputs_stay_live_and_views_allocate_nothing():
    b = GraphBuilder("views")
    x = b.input("x", (4, 256))
    a = b.unary("relu", x, "a")                                   # 2048 B, also a graph output via a view
    flat = b.op("reshape", [a], {"shape": [1024]}, "flat")
    c = b.unary("exp", x, "c")                                    # 2048 B, read by d only
    d = b.unary("neg", c, "d")                                    # 2048 B output
    graph = b.output(flat, d)
    kernels = [(["x"], ["a"]), (["x"], ["c"]), (["c"], ["d"])]
    # a stays live to the end (its view is a graph output), c until d ran: while d runs a + c + d are live.
    # (Were a freed after its last reader, as a plain intermediate, the peak would be c + d = 4096.)
    assert peak_intermediate_bytes(graph, kernels) == 3 * 2048
    # c is freed once d ran: running another kernel after d adds to a + d only
    kernels.append((["x"], ["e"]))
    graph.add_node("abs", ["x"], graph["a"].type, name="e")
    assert peak_intermediate_bytes(graph, kernels) == 3 * 2048
    assert summarize_unfused(graph, H200).kernel_launches == 4     # the reshape launches nothing


def test_the_plan_priced_on_its_own_profile_keeps_the_split_k_partials():
    """summarize_plan given the plan's own profile (as the analysis passes it) prices what the planner priced:
    a split-K group's partial tiles included; another profile is priced again."""
    import opfuse
    from opfuse.bench.zoo import load_builtin

    model, inputs = load_builtin("resnet18", 1)
    analysis = opfuse.analyze(model, inputs, FusionConfig(dtype="float16", hardware="h200"))
    plan = analysis.plan
    split = [g for g in plan.groups if "split-K:" in g.reason]
    assert split, "resnet18 at batch 1 should have split-K groups"
    planned = sum(g.predicted_time for g in plan.groups if g.launches and g.name not in analysis.pytorch_groups)
    assert not analysis.pytorch_groups
    assert analysis.fused.predicted_time == pytest.approx(planned, rel=1e-12)
    assert summarize_plan(plan, H200).predicted_time == pytest.approx(planned, rel=1e-12)
    # another profile: priced again, every launch of the plan charged
    one, two = (H200.with_calibration(launch_overhead=H200.launch_overhead + extra) for extra in (1e-6, 2e-6))
    added = summarize_plan(plan, two).predicted_time - summarize_plan(plan, one).predicted_time
    assert added == pytest.approx(plan.kernel_launches * 1e-6 * H200.time_factor, rel=1e-9)
