"""The fusion planner on hand-built graphs: groups, kinds, kernel counts, and every refusal with its reason (its
code, `opfuse.fusion.reasons`: the words may change)."""

import dataclasses
import json
import time

import pytest

from opfuse.ir.ops import view_copies
import torch

from graph_builders import (GraphBuilder, attention_block, bert_like, conv_bn_relu, conv_relu, inception_siblings,
                            mobilenet_inverted_residual, resnet_basic_block, resnet_bottleneck, transformer_ffn)
from opfuse import config
from opfuse.codegen.lower import choose_lowering
from opfuse.fusion.legality import can_fuse
from opfuse.fusion.plan import Fusion, FusionPlan, GroupKind, Verdict
from opfuse.fusion.reasons import Code
from opfuse.fusion.planner import plan_fusion
from opfuse.hardware import get_hardware
from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.ops import get_op

H200 = get_hardware("h200")


def FusionConfig(**knobs) -> config.FusionConfig:  # noqa: N802 (stands in for the class)
    """The config with split-K off: these tests count fusion groups and their launches, to which split-K adds a
    second kernel where a tiny test layer leaves the GPU idle (tests/kernels/test_split_k_kernels.py tests that)."""
    return config.FusionConfig(**({"split_k": False} | knobs))


def groups_of(plan: FusionPlan) -> dict[str, list[str]]:
    """Kernel groups by their first node (views left out)."""
    return {g.nodes[0]: g.nodes for g in plan.groups if g.kind is not GroupKind.VIEW}


def decisions_between(plan: FusionPlan, producer_node: str, consumer_node: str):
    return [d for d in plan.decisions if producer_node in d.producer and consumer_node in d.consumer]


def assert_well_formed(plan: FusionPlan) -> None:
    """Every computed node in exactly one group; groups in topological order; views and cats written in place
    launch nothing."""
    graph = plan.graph
    placed = [n for g in plan.groups for n in g.nodes]
    computed = [n.name for n in graph if n.op not in ("input", "constant")]
    assert sorted(placed) == sorted(computed)
    position = {n: g.id for g in plan.groups for n in g.nodes}
    for group in plan.groups:
        for name in group.nodes:
            for value in graph[name].inputs:
                if value in position:
                    assert position[value] <= group.id, f"{group.name} reads {value} before it is made"
        copies = any(view_copies(graph, graph[n]) for n in group.nodes)
        if group.kind is GroupKind.VIEW and not copies or group.kind is GroupKind.IN_PLACE:
            assert (group.launches, group.bytes_moved, group.predicted_time) == (0, 0, 0.0)
        elif group.code is Code.VIEW_COPY:   # a reshape of a permuted tensor: a copy kernel
            assert group.kind is GroupKind.POINTWISE and group.launches == 1 and group.bytes_moved == 2 * graph[group.nodes[-1]].type.nbytes
        else:
            assert group.launches == 1 and group.predicted_time > 0
    assert [g.id for g in plan.groups] == list(range(len(plan.groups)))


# ---- vertical: anchor + epilogue, residual -------------------------------------------------------------

@pytest.mark.parametrize("build", [conv_bn_relu, conv_relu])
def test_conv_epilogue_is_one_group_folded_or_not(build):
    graph = build()
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    assert len(plan.groups) == 1
    group = plan.groups[0]
    assert group.kind is GroupKind.ANCHOR_EPILOGUE and group.anchor == "conv"
    assert group.outputs == ["relu"]
    assert group.bytes_written == graph["relu"].type.nbytes
    assert all(d.verdict is Verdict.FUSED for d in plan.decisions)
    assert all(d.time_fused < d.time_unfused for d in plan.decisions)


@pytest.mark.parametrize("fold_bn", [True, False])
def test_resnet_bottleneck_with_downsample(fold_bn):
    plan = plan_fusion(resnet_bottleneck(fold_bn=fold_bn), FusionConfig(), H200)
    assert_well_formed(plan)
    bn = (lambda s: [f"bn{s}"]) if not fold_bn else (lambda s: [])
    assert groups_of(plan) == {
        "conv1": ["conv1", *bn("1"), "relu1"],
        "conv2": ["conv2", *bn("2"), "relu2"],
        "conv3": ["conv3", *bn("3"), "add", "relu_out"],
        "conv_ds": ["conv_ds", *bn("_ds")],
    }
    assert plan.kernel_launches == 4
    kinds = {g.nodes[0]: g.kind for g in plan.groups}
    assert kinds["conv1"] is kinds["conv2"] is GroupKind.ANCHOR_EPILOGUE
    assert kinds["conv3"] is GroupKind.RESIDUAL
    residual = plan.group_of("add")
    ds_output = "bn_ds" if not fold_bn else "conv_ds"
    assert ds_output in residual.inputs               # the skip is read as an extra input
    # the downsample conv cannot join too: two convs share a kernel only when one feeds the other
    refused = [d for d in plan.decisions if "conv_ds" in d.producer and "conv3" in d.consumer]
    assert refused and refused[0].verdict is Verdict.ILLEGAL
    assert refused[0].code is Code.TWO_ANCHORS


def test_resnet_basic_block_kernel_count():
    plan = plan_fusion(resnet_basic_block(), FusionConfig(), H200)
    assert_well_formed(plan)
    assert plan.kernel_launches == 3
    assert plan.group_of("relu_out").nodes == ["conv2", "add", "relu_out"]


def test_mobilenet_inverted_residual_without_conv_conv_fusion():
    """With config.conv_conv off, one anchor per kernel (tests/unit/test_conv_conv_planner.py covers it on)."""
    plan = plan_fusion(mobilenet_inverted_residual(), FusionConfig(conv_conv=False), H200)
    assert groups_of(plan) == {"expand": ["expand", "relu6_1"], "depthwise": ["depthwise", "relu6_2"],
                               "project": ["project", "add"]}
    assert plan.group_of("add").kind is GroupKind.RESIDUAL
    refused = decisions_between(plan, "relu6_2", "project")
    assert refused[-1].fusion == "conv-conv" and refused[-1].code is Code.DISABLED


def test_transformer_ffn():
    plan = plan_fusion(transformer_ffn(), FusionConfig(), H200)
    assert groups_of(plan) == {"fc1": ["fc1", "gelu"], "fc2": ["fc2", "residual"], "ln": ["ln"]}
    refused = decisions_between(plan, "residual", "ln")
    assert refused[-1].code is Code.ANCHOR_AND_REDUCTION


# ---- reductions with prologues ------------------------------------------------------------------------

def test_layer_norm_takes_the_residual_add_as_prologue():
    b = GraphBuilder("add_ln")
    x, skip = b.input("x", (2, 64, 256)), b.input("skip", (2, 64, 256))
    graph = b.output(b.layer_norm(b.op("add", [x, skip], name="add"), "ln"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert [g.nodes for g in plan.groups] == [["add", "ln"]]
    assert plan.groups[0].kind is GroupKind.REDUCTION
    assert plan.decisions[0].fusion == "prologue"


def test_ffn_without_residual_fusion_gives_the_add_to_the_layer_norm():
    plan = plan_fusion(transformer_ffn(), FusionConfig(residual=False), H200)
    assert groups_of(plan) == {"fc1": ["fc1", "gelu"], "fc2": ["fc2"], "residual": ["residual", "ln"]}
    assert plan.group_of("ln").kind is GroupKind.REDUCTION
    refused = decisions_between(plan, "fc2", "residual")[0]
    assert refused.verdict is Verdict.ILLEGAL and refused.code is Code.DISABLED


def test_softmax_takes_a_scale_as_prologue():
    b = GraphBuilder("scaled_softmax")
    scores = b.input("scores", (2, 4, 128, 128))
    scale = b.graph.add_constant("scale", torch.tensor(0.125, dtype=torch.float16)).name
    scaled = b.op("mul", [scores, scale], name="scale_mul")
    graph = b.output(b.op("softmax", [scaled], {"dim": -1}, "softmax"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert [(g.kind, g.nodes) for g in plan.groups] == [(GroupKind.REDUCTION, ["scale_mul", "softmax"])]


# ---- refusals --------------------------------------------------------------------------------------------

def test_several_users_refused_with_their_names():
    b = GraphBuilder("two_users")
    x = b.input("x", (1, 16, 8, 8))
    y = b.conv(x, 16, 3, padding=1, name="conv")
    graph = b.output(b.unary("relu", y, "relu"), b.unary("sigmoid", y, "sigmoid"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert plan.group_of("conv").nodes == ["conv"]
    assert plan.group_of("relu").nodes == ["relu", "sigmoid"]   # small and independent: one shared launch
    refusal = decisions_between(plan, "conv", "relu")[0]
    assert refusal.verdict is Verdict.ILLEGAL and refusal.code is Code.SEVERAL_USERS
    # the words name the value and every reader, and the lone group says what kept it alone
    assert refusal.reason == "conv has several users: relu, sigmoid"
    assert plan.group_of("conv").reason == f"alone: {refusal.reason}"


def test_opaque_op_never_fuses():
    b = GraphBuilder("opaque")
    x = b.input("x", (1, 16, 8, 8))
    y = b.conv(x, 16, 3, padding=1, name="conv")
    mystery = b.graph.add_node("opaque", [y], b.graph[y].type, {"target": "aten.mystery"}, name="mystery").name
    graph = b.output(b.unary("relu", mystery, "relu"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    assert plan.kernel_launches == 3
    assert plan.group_of("mystery").kind is GroupKind.OPAQUE
    for producer, consumer in (("conv", "mystery"), ("mystery", "relu")):
        assert [d.code for d in decisions_between(plan, producer, consumer)] == [Code.OPAQUE]


def test_a_cat_of_anchor_outputs_stays_its_own_kernel():
    """It joins no anchor's kernel, and (not written in place) is a kernel of the elementwise template on its own,
    not PyTorch's cat."""
    plan = plan_fusion(inception_siblings(), FusionConfig(concat_in_place=False), H200)
    assert plan.group_of("cat").nodes == ["cat"] and plan.group_of("cat").kind is GroupKind.SINGLE
    assert decisions_between(plan, "relu_pool", "cat")[0].code is Code.CAT_WITH_HUB
    assert choose_lowering(plan.graph, plan.group_of("cat")) == "pointwise"


def test_a_cat_of_kernel_outputs_is_written_in_place_by_them():
    """Every branch's kernel stores into its slice of the cat, the 1x1 branch's too: a sibling of the horizontal
    group of the three 1x1 convs, which stores its outputs apart (`Epilogue.separate`). No launch, no byte, where
    the cat's kernel copied every part."""
    from opfuse.fusion.concat_in_place import planned_slots, writes_in_place

    plan = plan_fusion(inception_siblings(), FusionConfig(), H200)
    apart = plan_fusion(inception_siblings(), FusionConfig(concat_in_place=False), H200)
    group, graph, users = plan.group_of("cat"), plan.graph, plan.graph.users()
    assert group.kind is GroupKind.IN_PLACE and group.code is Code.IN_PLACE
    assert plan.group_of("relu_1x1").kind is GroupKind.HORIZONTAL
    assert writes_in_place(graph, plan.groups, "cat", users)
    assert group.launches == group.bytes_read == group.bytes_written == group.predicted_time == 0
    assert plan.kernel_launches == apart.kernel_launches - 1
    assert choose_lowering(graph, group).code is Code.IN_PLACE     # no kernel
    assert planned_slots(plan) == {"relu_1x1": ("cat", 1, 0, 64), "relu_3x3": ("cat", 1, 64, 128),
                      "relu_5x5": ("cat", 1, 192, 32), "relu_pool": ("cat", 1, 224, 32)}


def test_a_cat_whose_parts_no_kernel_can_store_stays_a_kernel():
    """A part that is a graph input, or read by another node too, no kernel stores in place: the cat keeps its copy
    kernel (one launch for all its parts), also where its other part's kernel could store."""
    b = GraphBuilder("cat_of_inputs")
    x, y = b.input("x", (1, 8, 6, 6)), b.input("y", (1, 8, 6, 6))
    shared = b.unary("relu", y, "shared")
    cat = b.op("cat", [x, shared], {"dim": 1}, "cat")
    plan = plan_fusion(b.output(b.conv(cat, 4, name="conv"), shared), FusionConfig(), H200)
    assert plan.group_of("cat").kind is GroupKind.SINGLE
    b = GraphBuilder("cat_of_a_kernel_and_an_input")
    x, y = b.input("x", (1, 8, 6, 6)), b.input("y", (1, 8, 6, 6))
    cat = b.op("cat", [x, b.conv(y, 8, name="part")], {"dim": 1}, "cat")
    assert plan_fusion(b.output(b.conv(cat, 4, name="conv")), FusionConfig(), H200).group_of("cat").kind \
        is GroupKind.SINGLE


def test_a_cat_past_int32_offsets_stays_a_kernel():
    """Through a slice, an anchor kernel's int32 offsets reach as far as the cat's whole buffer (2^31 elements
    here): its own copy kernel, which switches to int64, copies it instead."""
    b = GraphBuilder("huge_cat")
    x = b.input("x", (1, 8, 16384, 16384))
    parts = [b.unary("relu", b.conv(x, 4, kernel=1, padding=0, name=f"conv{i}"), f"part{i}") for i in range(2)]
    cat = b.op("cat", parts, {"dim": 1}, "cat")
    plan = plan_fusion(b.output(b.conv(cat, 4, kernel=1, padding=0, name="out")), FusionConfig(), H200)
    assert plan.graph["cat"].type.numel == 2**31 and plan.group_of("cat").kind is GroupKind.SINGLE


def test_a_cat_joins_the_elementwise_chain_after_it_and_the_shuffle_views_before_a_copy():
    """DenseNet's cat -> batch norm -> relu, and ShuffleNet's cat -> view, transpose, view (a copy in PyTorch)."""
    b = GraphBuilder("cat_chains")
    x, y = b.input("x", (1, 8, 6, 6)), b.input("y", (1, 8, 6, 6))
    scaled = b.op("mul", [b.unary("relu", x, "rx"), b.constant("s", (8, 1, 1))], name="scaled")
    joined = b.op("cat", [scaled, b.unary("sigmoid", y, "sy")], {"dim": 1}, "joined")
    grouped = b.op("reshape", [joined], {"shape": (1, 2, 8, 6, 6)}, "grouped")
    swapped = b.op("permute", [grouped], {"dims": (0, 2, 1, 3, 4)}, "swapped")
    shuffled = b.op("reshape", [swapped], {"shape": (1, 16, 6, 6)}, "shuffled")
    graph = b.output(b.unary("tanh", b.op("slice", [shuffled], {"dim": 1, "start": 0, "end": 8, "step": 1}, "half"),
                             "out"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    group = plan.group_of("joined")
    assert set(group.nodes) == {"rx", "scaled", "sy", "joined", "grouped", "swapped", "shuffled", "half"}
    # the shuffle written directly, and of it only the half that is read (`test_a_value_read_only_in_slices...`)
    assert group.kind is GroupKind.POINTWISE and group.outputs == ["half"] and group.launches == 1
    assert choose_lowering(plan.graph, group) == "pointwise"
    assert "written directly: no copy kernel" in group.reason
    assert sum(g.launches for g in plan.groups) == 2


def chunked() -> Graph:
    """relu(x) -> chunk(2) along the channels, each half read by a 1x1 conv."""
    b = GraphBuilder("chunked")
    y = b.unary("relu", b.input("x", (2, 8, 6, 6)), "y")
    for i in range(2):
        piece = b.op("slice", [y], {"dim": 1, "start": 4 * i, "end": 4 * (i + 1), "step": 1}, f"piece{i}")
        b.conv(piece, 4, name=f"c{i}")
    return b.output("c0", "c1")


def test_a_value_read_only_in_slices_is_stored_as_the_slices():
    """ShuffleNet's chunk: the relu's value is read only through two disjoint halves, so its kernel stores the
    halves, each dense (a cuDNN conv would copy a strided slice first), and not the whole value."""
    plan = plan_fusion(chunked(), FusionConfig(), H200)
    group = plan.group_of("y")
    assert group.nodes == ["y", "piece0", "piece1"] and group.outputs == ["piece0", "piece1"]
    assert group.kind is GroupKind.POINTWISE and "stored as a tensor of its own" in group.reason
    assert choose_lowering(plan.graph, group) == "pointwise"     # one kernel of the elementwise template
    assert group.bytes_written == 2 * 8 * 6 * 6 * 2                 # fp16: the bytes of the whole value


def test_slices_of_a_view_group_stay_views_and_stored_slices_still_share_a_launch():
    """A copying reshape alone (PyTorch's copy) keeps its slices as views; two small groups that each store their
    halves still share one launch (horizontal pointwise)."""
    b = GraphBuilder("views_and_halves")
    x = b.input("x", (2, 8, 3, 3))
    grouped = b.op("reshape", [x], {"shape": (2, 2, 4, 3, 3)}, "grouped")
    swapped = b.op("permute", [grouped], {"dims": (0, 2, 1, 3, 4)}, "swapped")
    shuffled = b.op("reshape", [swapped], {"shape": (2, 8, 3, 3)}, "shuffled")
    outs = []
    for value in (shuffled, b.unary("relu", x, "r"), b.unary("sigmoid", x, "s")):
        for i in range(2):
            piece = b.op("slice", [value], {"dim": 1, "start": 4 * i, "end": 4 * i + 4, "step": 1}, f"{value}{i}")
            outs.append(b.conv(piece, 4, name=f"c_{value}{i}"))
    plan = plan_fusion(b.output(*outs), FusionConfig(), H200)
    assert plan.group_of("shuffled0").kind is GroupKind.VIEW and plan.group_of("shuffled").nodes == ["shuffled"]
    both = plan.group_of("r")
    assert both is plan.group_of("s") and both.kind is GroupKind.HORIZONTAL_POINTWISE
    assert set(both.outputs) == {"r0", "r1", "s0", "s1"}


def test_slices_that_overlap_or_differ_in_size_stay_views():
    b = GraphBuilder("overlap")
    y = b.unary("relu", b.input("x", (2, 8, 6, 6)), "y")
    outs = []
    for name, (start, end) in {"a": (0, 5), "b": (3, 8), "c": (0, 2)}.items():
        piece = b.op("slice", [y], {"dim": 1, "start": start, "end": end, "step": 1}, name)
        outs.append(b.unary("exp", piece, f"e{name}"))
    plan = plan_fusion(b.output(*outs), FusionConfig(), H200)
    assert plan.group_of("y").outputs == ["y"]
    assert all(plan.group_of(name).kind is GroupKind.VIEW for name in "abc")


def test_merge_that_would_make_a_cycle_is_refused():
    """P = {p1, p2} (two independent ops sharing a launch); x reads p1 and feeds c, c reads p2.
    Merging P with c would make the fused kernel both feed x and read it."""
    b = GraphBuilder("cycle")
    a, bb = b.input("a", (1024,)), b.input("b", (1024,))
    p1 = b.unary("relu", a, "p1")
    p2 = b.unary("sigmoid", bb, "p2")
    x = b.unary("exp", p1, "x")
    graph = b.output(b.op("add", [p2, x], name="c"))
    users = graph.users()
    assert can_fuse(graph, ["p2"], ["c"], users) is None
    refusal = can_fuse(graph, ["p1", "p2"], ["c"], users)
    assert refusal.code is Code.CYCLE
    assert refusal.text == "cycle through x: it reads one side of the pair and feeds the other"   # names the node


def test_independent_small_groups_on_both_sides_of_a_conv_do_not_share_a_launch():
    """relu1 and relu2 are small and elementwise, but relu2 depends on relu1 through conv2: no shared launch."""
    b = GraphBuilder("around_conv")
    x = b.input("x", (1, 8, 8, 8))
    r1 = b.unary("relu", x, "relu1")
    y = b.conv(r1, 8, 3, padding=1, name="conv2")
    graph = b.output(b.unary("relu", b.op("mul", [y, x], name="gate"), "relu2"))
    plan = plan_fusion(graph, FusionConfig(vertical=False), H200)
    assert plan.kernel_launches == 4
    refusal = decisions_between(plan, "relu1", "gate")[0]
    assert refusal.fusion == "horizontal" and refusal.verdict is Verdict.ILLEGAL and refusal.code is Code.DEPENDENT


def test_over_budget_keeps_the_groups_apart():
    b = GraphBuilder("residual_conv")
    x = b.input("x", (1, 64, 28, 28))
    skip = b.input("skip", (1, 64, 28, 28))
    y = b.op("add", [b.conv(x, 64, 3, padding=1, name="conv"), skip], name="add")
    graph = b.output(b.unary("relu", y, "relu"))
    assert plan_fusion(graph, FusionConfig(), H200).kernel_launches == 1

    # 9 KiB of shared memory: no tile the conv kernel runs keeps the residual's staging tile beside its operands
    small_smem = dataclasses.replace(H200, shared_memory_per_block=9 * 1024)
    plan = plan_fusion(graph, FusionConfig(), small_smem)
    assert groups_of(plan) == {"conv": ["conv"], "add": ["add", "relu"]}
    over = [d for d in plan.decisions if d.verdict is Verdict.OVER_BUDGET]
    assert over and "conv" in over[0].producer and over[0].code is Code.OVER_BUDGET
    assert "B shared memory > 9216" in over[0].reason     # the resource model's count, in the words

    # registers: the conv alone needs 57 at its smallest tiles (2048 elements on 4 warps: accumulator 16, bias 1,
    # addressing 40); with the skip tile 65
    few_registers = dataclasses.replace(H200, max_registers_per_thread=60)
    plan = plan_fusion(graph, FusionConfig(), few_registers)
    over = [d for d in plan.decisions if d.verdict is Verdict.OVER_BUDGET]
    assert over and over[0].code is Code.OVER_BUDGET and "65 registers/thread > 60" in over[0].reason
    assert plan.group_of("conv").resources.fits
    assert plan.group_of("conv").nodes == ["conv"]


def _big_gemm_with_many_residuals():
    """A compute-bound 8192^3 GEMM whose epilogue adds five full-size tensors."""
    b = GraphBuilder("big_gemm")
    y = b.linear(b.input("x", (8192, 8192)), 8192, name="fc")
    for i in range(5):
        y = b.op("add", [y, b.input(f"r{i}", (8192, 8192))], name=f"add{i}")
    return b.output(y)


def test_unprofitable_when_the_epilogue_forces_a_small_tile_on_a_compute_bound_gemm():
    graph = _big_gemm_with_many_residuals()
    plan = plan_fusion(graph, FusionConfig(), H200)
    refused = [d for d in plan.decisions if d.verdict is Verdict.UNPROFITABLE]
    assert len(refused) == 1
    decision = refused[0]
    assert "fc" in decision.producer and decision.time_fused >= decision.time_unfused
    assert decision.code is Code.UNPROFITABLE
    assert "needs 265 registers/thread > 255" in decision.reason   # the default tile with five residual tiles
    assert plan.kernel_launches == 2
    # without the cost model every legal fusion within budget is taken
    assert plan_fusion(graph, FusionConfig(use_cost_model=False), H200).kernel_launches == 1


# ---- horizontal ------------------------------------------------------------------------------------------

def test_qkv_linears_become_one_horizontal_group():
    plan = plan_fusion(attention_block(), FusionConfig(), H200)
    assert_well_formed(plan)
    qkv = plan.group_of("q_proj")
    assert qkv.kind is GroupKind.HORIZONTAL and qkv.nodes == ["q_proj", "k_proj", "v_proj"]
    assert qkv.outputs == ["q_proj", "k_proj", "v_proj"]
    assert qkv.inputs.count("x") == 1
    # qkv, sdpa, out_proj: the head merge (a reshape of a permuted tensor, which PyTorch copies) is out_proj's
    # operand load
    assert plan.kernel_launches == 3
    out_proj = plan.group_of("out_proj")
    assert out_proj.nodes == ["attn_perm", "attn_merge", "out_proj"] and out_proj.inputs[0] == "sdpa"
    assert "read through as a coordinate map" in out_proj.reason
    assert sum(1 for g in plan.groups if g.kind is GroupKind.VIEW) == 6
    blocked = decisions_between(plan, "q_proj", "sdpa")[0]
    assert blocked.verdict is Verdict.ILLEGAL and blocked.code is Code.VIEW_IN_ANCHOR
    separate = plan_fusion(attention_block(), FusionConfig(horizontal=False), H200)
    assert separate.kernel_launches == 5   # q, k, v, sdpa, out_proj


@pytest.mark.parametrize("fold_bn", [True, False])
def test_inception_1x1_siblings_become_one_group(fold_bn):
    plan = plan_fusion(inception_siblings(fold_bn=fold_bn), FusionConfig(), H200)
    assert_well_formed(plan)
    siblings = plan.group_of("conv_1x1")
    assert siblings.kind is GroupKind.HORIZONTAL
    anchors = [n for n in siblings.nodes if n.startswith("conv")]
    assert anchors == ["conv_1x1", "conv_3x3_reduce", "conv_5x5_reduce"]
    assert set(siblings.outputs) == {"relu_1x1", "relu_3x3_reduce", "relu_5x5_reduce"}
    # 1x1 siblings, 3x3 conv, 5x5 conv, pool, pool-branch conv; the cat written in place by them, or (BN unfolded)
    # joining the elementwise kernel of the 3x3 branch's relu
    assert plan.kernel_launches == (5 if fold_bn else 6)


def test_siblings_with_different_epilogues_are_not_merged():
    b = GraphBuilder("siblings")
    x = b.input("x", (1, 32, 14, 14))
    a = b.unary("relu", b.conv(x, 16, name="conv_a"), "relu_a")
    c = b.unary("relu", b.conv(x, 16, name="conv_c"), "relu_c")
    s = b.unary("sigmoid", b.conv(x, 16, name="conv_s"), "sigmoid_s")
    graph = b.output(a, c, s)
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert plan.group_of("conv_a").nodes == ["conv_a", "relu_a", "conv_c", "relu_c"]
    assert plan.group_of("conv_s").nodes == ["conv_s", "sigmoid_s"]
    refusal = decisions_between(plan, "conv_a", "conv_s")[0]
    assert refusal.fusion == "horizontal" and refusal.verdict is Verdict.ILLEGAL
    assert refusal.code is Code.DIFFERENT_EPILOGUES


def test_independent_small_elementwise_ops_share_a_launch():
    b = GraphBuilder("tiny")
    x, y = b.input("x", (256,)), b.input("y", (64, 4))
    graph = b.output(b.unary("neg", b.unary("exp", x, "exp"), "neg"), b.unary("sigmoid", y, "sigmoid"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert [(g.kind, g.nodes) for g in plan.groups] == [(GroupKind.HORIZONTAL_POINTWISE, ["exp", "neg", "sigmoid"])]
    assert plan.groups[0].outputs == ["neg", "sigmoid"]
    assert plan_fusion(graph, FusionConfig(horizontal=False), H200).kernel_launches == 2


def _rotary(b: GraphBuilder, x: str, cos: str, sin: str, name: str) -> str:
    """x * cos + rotate_half(x) * sin, rotate_half as Llama writes it (two slices, a neg, a cat)."""
    half = b.graph[x].type.shape[-1] // 2
    first = b.op("slice", [x], {"dim": 3, "start": 0, "end": half, "step": 1}, f"{name}_x1")
    second = b.op("slice", [x], {"dim": 3, "start": half, "end": 2 * half, "step": 1}, f"{name}_x2")
    rotated = b.op("cat", [b.unary("neg", second, f"{name}_neg"), first], {"dim": 3}, f"{name}_cat")
    return b.op("add", [b.op("mul", [x, cos], name=f"{name}_mul_cos"), b.op("mul", [rotated, sin], name=f"{name}_mul_sin")],
                name=f"{name}_add")


def test_small_groups_with_a_cat_share_a_launch_and_views_alone_join_none():
    """A decode step's rotary embeddings of q and of k (each a group with a cat) are one launch; a view-only group
    launches nothing, so it is no member of a shared launch and no decision is recorded for it."""
    b = GraphBuilder("rotary_q_k")
    q, k = b.input("q", (1, 8, 1, 16)), b.input("k", (1, 2, 1, 16))
    cos, sin = b.input("cos", (1, 1, 1, 16)), b.input("sin", (1, 1, 1, 16))
    view = b.op("reshape", [b.input("h", (1, 4, 4))], {"shape": [1, 16]}, "view")
    graph = b.output(_rotary(b, q, cos, sin, "q"), _rotary(b, k, cos, sin, "k"), view)
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    shared = plan.group_of("q_add")
    assert shared is plan.group_of("k_add") and shared.kind is GroupKind.HORIZONTAL_POINTWISE
    assert plan.kernel_launches == 1
    assert not [d for d in plan.decisions if d.fusion == "horizontal" and "view" in d.producer + d.consumer]


# ---- switches, data, speed -------------------------------------------------------------------------------

def test_vertical_switch_off_keeps_every_op_alone():
    graph = resnet_bottleneck()
    plan = plan_fusion(graph, FusionConfig(vertical=False, horizontal=False), H200)
    launching = [n for n in graph if get_op(n.op).launches_kernel]
    assert plan.kernel_launches == len(launching)
    assert plan.decisions == []


def test_every_decision_and_group_is_data():
    plan = plan_fusion(resnet_bottleneck(fold_bn=False), FusionConfig(), H200)
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["kernel_launches"] == 4
    assert [d["code"] for d in data["decisions"]] == [d.code.value for d in plan.decisions]
    for decision in plan.decisions:
        assert decision.reason and isinstance(decision.fusion, Fusion) and decision.fusion is not Fusion.SQUEEZE
        assert (decision.code in (Code.FUSED, Code.WHOLE_BLOCK)) == (decision.verdict is Verdict.FUSED)
        if decision.verdict is Verdict.FUSED:
            assert decision.bytes_saved > 0 and decision.time_fused < decision.time_unfused
    for group in plan.groups:
        assert group.reason and group.resources is not None
        assert group.flops > 0 and group.bytes_read > 0


def test_unknown_op_is_reported_with_its_node():
    b = GraphBuilder("bad")
    x = b.input("x", (4,))
    b.graph.add_node("frobnicate", [x], b.graph[x].type, name="weird")
    with pytest.raises(GraphError, match="weird"):
        plan_fusion(b.output("weird"), FusionConfig(), H200)


def test_planning_a_bert_sized_graph_is_fast():
    graph = bert_like(layers=12)
    assert len(graph) > 400
    start = time.perf_counter()
    plan = plan_fusion(graph, FusionConfig(), H200)
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"planning {len(graph)} nodes took {elapsed:.2f} s"
    assert_well_formed(plan)
    # per layer: qkv, sdpa, out_proj (reading the head merge) + residual add, layer norm, fc1 + gelu,
    # fc2 + residual add, layer norm
    assert plan.kernel_launches == 12 * 7


def test_sibling_linears_whose_epilogues_permute_are_not_concatenated():
    """One kernel over concatenated siblings writes their tiles as they are: a sibling whose epilogue permutes
    keeps its own kernel (the review's case: before, the planner merged them and the template refused)."""
    b = GraphBuilder("permuted_siblings")
    x = b.input("x", (2, 6, 16))
    outs = [b.op("mul", [b.op("permute", [b.linear(x, 8, name=f"fc{i}")], {"dims": [0, 2, 1]}, f"p{i}"),
                         b.constant(f"s{i}", (8, 1))], name=f"scaled{i}") for i in range(2)]
    graph = b.output(*outs)
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    for i in range(2):
        assert plan.group_of(f"fc{i}").nodes == [f"fc{i}", f"p{i}", f"scaled{i}"]
        assert plan.group_of(f"fc{i}").kind is not GroupKind.HORIZONTAL


def test_a_lone_cat_of_token_ids_is_an_exact_kernel_of_ours():
    """A lone copy of wide integers is the elementwise template's index map, computed in int64: values past 2^24,
    which float32 would round, come through exactly."""
    from opfuse.codegen.lower import lower_group

    b = GraphBuilder("ids")
    ids = [b.input(f"ids{i}", (2, 5), dtype="int64") for i in range(2)]
    graph = b.output(b.op("cat", ids, {"dim": 1}, "joined"))
    group = plan_fusion(graph, FusionConfig(), H200).group_of("joined")
    assert choose_lowering(graph, group) == "pointwise"
    kernel = lower_group(graph, group, "cpu")
    values = [torch.randint(2 ** 40, 2 ** 41, (2, 5)) for _ in ids]
    (joined,) = kernel.run(values)
    assert torch.equal(joined, torch.cat(values, 1))


def test_every_group_says_why_it_is_what_it_is_with_a_code():
    """A merged group is fused, a lone node carries the code of the first refusal it met, a view its own."""
    plan = plan_fusion(attention_block(), FusionConfig(), H200)
    by_node = {n: g for g in plan.groups for n in g.nodes}
    assert by_node["out_proj"].code is Code.FUSED                    # the head merge's views joined it
    assert by_node["sdpa"].code is Code.VIEW_IN_ANCHOR and by_node["sdpa"].reason.startswith("alone: ")
    assert by_node["q_heads"].code is Code.VIEW
    assert {g.code for g in plan.groups} <= set(Code)


def test_a_pool_does_not_take_a_value_others_read():
    """Pooling windows overlap or skip elements, so a pool's kernel cannot store the prologue value a conv reads
    too; a layer norm's can (the reduction-stored prologue)."""
    b = GraphBuilder("pool_and_conv")
    x = b.input("x", (1, 4, 8, 8))
    t = b.unary("sigmoid", b.op("mul", [x, b.constant("two", (1,))], name="scaled"), "t")
    pooled = b.op("max_pool2d", [t], {"kernel_size": (2, 2), "stride": (2, 2), "padding": (0, 0), "dilation": (1, 1),
                                      "ceil_mode": False}, "pool")
    graph = b.output(pooled, b.conv(t, 4, 1, name="conv"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert plan.group_of("pool").nodes == ["pool"]
    assert [d.code for d in decisions_between(plan, "t", "pool")] == [Code.SEVERAL_USERS]


# ---- a linear absorbs the layer norm before it -------------------------------------------------------------

def test_a_linear_takes_the_layer_norm_before_it_as_its_prologue():
    """ln -> linear (pre-LN transformers' ln -> qkv, ConvNeXt's LN -> pwconv1): one group, one launch, and the
    kernel never writes the normalized activation."""
    b = GraphBuilder("ln_linear")
    x = b.input("x", (1, 128, 768))
    graph = b.output(b.unary("gelu", b.linear(b.layer_norm(x, "ln"), 3072, name="fc"), "gelu"))
    plan = plan_fusion(graph, FusionConfig(norm_prologue=True), H200)
    assert_well_formed(plan)
    assert [g.nodes for g in plan.groups] == [["ln", "fc", "gelu"]]
    assert plan.kernel_launches == 1 and not plan.groups[0].split_k
    assert plan.groups[0].outputs == ["gelu"]
    assert decisions_between(plan, "ln", "fc")[0].verdict is Verdict.FUSED


def test_a_layer_norm_read_by_more_than_a_linear_stays_its_own_kernel():
    """BERT's post-LN: the norm's output is the next residual too, so it must be written; the linear reads it."""
    b = GraphBuilder("post_ln")
    x = b.input("x", (1, 128, 768))
    ln = b.layer_norm(x, "ln")
    graph = b.output(b.op("add", [b.linear(ln, 768, name="fc"), ln], name="residual"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    assert groups_of(plan) == {"ln": ["ln"], "fc": ["fc", "residual"]}
    assert plan.kernel_launches == 2
    assert decisions_between(plan, "ln", "fc")[0].code is Code.ANCHOR_AND_REDUCTION   # the add reads it too
    b = GraphBuilder("ln_two_readers")        # read by a linear and by something outside the linear's group
    x = b.input("x", (1, 128, 768))
    ln = b.layer_norm(x, "ln")
    graph = b.output(b.linear(ln, 768, name="fc"), b.unary("tanh", ln, "other"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert plan.group_of("ln").nodes != plan.group_of("fc").nodes
    assert decisions_between(plan, "ln", "fc")[0].code is Code.SEVERAL_USERS


def test_the_residual_sum_before_a_layer_norm_stays_stored_by_the_previous_gemm():
    """GPT-2's block: c_proj + bias + residual add is one kernel (it stores the sum the next residual reads), and
    the next layer norm joins c_fc; the add cannot join the norm's group (the norm's input must come from outside)."""
    b = GraphBuilder("pre_ln")
    x, h = b.input("x", (1, 128, 768)), b.input("h", (1, 128, 768))
    total = b.op("add", [b.linear(h, 768, name="proj"), x], name="residual")
    fc = b.unary("gelu", b.linear(b.layer_norm(total, "ln"), 3072, name="fc"), "gelu")
    graph = b.output(b.op("add", [b.linear(fc, 768, name="fc2"), total], name="residual2"))
    plan = plan_fusion(graph, FusionConfig(norm_prologue=True), H200)
    assert_well_formed(plan)
    assert groups_of(plan) == {"proj": ["proj", "residual"], "ln": ["ln", "fc", "gelu"],
                               "fc2": ["fc2", "residual2"]}
    assert plan.kernel_launches == 3
    assert can_fuse(graph, ["residual"], ["ln", "fc", "gelu"], graph.users()).code is Code.ANCHOR_AND_REDUCTION


def _depthwise_then_norm(channels: int = 96, permute: bool = True, groups: int | None = None) -> Graph:
    b = GraphBuilder("dw_norm")
    x = b.input("x", (1, channels, 14, 14))
    y = b.conv(x, channels, kernel=7, padding=3, groups=channels if groups is None else groups, name="dw")
    if permute:
        y = b.op("permute", [y], {"dims": [0, 2, 3, 1]}, "perm")
    return b.output(b.unary("gelu", b.layer_norm(y, "ln"), "act"))


def test_a_depthwise_conv_takes_the_norm_over_its_channels_into_its_epilogue():
    """ConvNeXt's dwconv -> permute -> LayerNorm (-> GELU here): one kernel with `norm_epilogue`, whose tile spans
    the channels; off by default (the decision says so). A norm over another dim than the channels, after a conv
    that is not depthwise, or over more channels than a tile spans, stays its own kernel."""
    from opfuse.fusion.tiles import MAX_ROW_CHANNELS

    plan = plan_fusion(_depthwise_then_norm(384), FusionConfig(norm_epilogue=True), H200)
    assert_well_formed(plan)
    assert groups_of(plan)["dw"] == ["dw", "perm", "ln", "act"] and plan.kernel_launches == 1
    group = plan.group_of("dw")
    assert group.resources.fits and group.resources.tile["BLOCK_N"] == 512      # 384 channels in one tile
    assert group.resources.shared_memory_bytes < 1024                           # no operand pipeline
    off = plan_fusion(_depthwise_then_norm(), FusionConfig(), H200)
    assert groups_of(off)["dw"] == ["dw"]
    assert decisions_between(off, "dw", "ln")[0].code is Code.DISABLED
    for graph in (_depthwise_then_norm(permute=False, channels=14),      # normalizes the width
                  _depthwise_then_norm(groups=1),                        # a full conv
                  _depthwise_then_norm(channels=1),                      # one channel: a plain conv's kernel
                  _depthwise_then_norm(channels=2 * MAX_ROW_CHANNELS)):
        plan = plan_fusion(graph, FusionConfig(norm_epilogue=True), H200)
        assert groups_of(plan)["dw"] == ["dw"], graph.name


def test_a_layer_norm_over_two_dims_stays_its_own_kernel():
    b = GraphBuilder("ln_2d")
    x = b.input("x", (1, 16, 64))
    ln = b.op("layer_norm", [x, b.constant("w", (16, 64)), b.constant("b", (16, 64))],
              {"normalized_shape": [16, 64], "eps": 1e-5}, "ln")
    graph = b.output(b.linear(ln, 64, name="fc"))
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert groups_of(plan) == {"ln": ["ln"], "fc": ["fc"]}
    assert decisions_between(plan, "ln", "fc")[0].code is Code.ANCHOR_AND_REDUCTION


@pytest.mark.parametrize("head_dim, fused", [(64, True), (3136, False)])
def test_an_sdpa_the_attention_template_cannot_tile_takes_no_epilogue(head_dim, fused):
    """DaViT's channel attention (head dims of 3136 pixels) is torch's attention, a library call: the activation
    after it stays a kernel of its own (library-anchor), where an sdpa of head dim 64 takes it as its epilogue."""
    b = GraphBuilder("channel_attention")
    q, k, v = (b.input(name, (1, 3, 32, head_dim)) for name in "qkv")
    attention = b.op("sdpa", [q, k, v], {"is_causal": False, "scale": 1.0}, name="sdpa")
    b.graph.outputs = [b.op("gelu", [attention], {"approximate": "none"}, name="act")]
    plan = plan_fusion(b.graph, FusionConfig(), H200)
    assert_well_formed(plan)
    assert (groups_of(plan)["sdpa"] == ["sdpa", "act"]) is fused
    if not fused:
        (refusal,) = decisions_between(plan, "sdpa", "act")
        assert refusal.code is Code.LIBRARY_ANCHOR and "3136" in refusal.reason


@pytest.mark.parametrize("head_dim, copies", [(32, False), (160, True)])
def test_views_of_attention_are_views_of_its_layout(head_dim, copies):
    """An sdpa's [B, H, S, D] lies in memory as [B, S, H, D] (flash attention's layout, the attention kernel's):
    CoAtNet's transpose and reshape of it back to an image [B, H*D, h, w] is a view of that (channels last), no
    copy; over the head dims either tiles, torch's attention writes [B, H, S, D] and the reshape copies."""
    b = GraphBuilder("attention_to_image")
    q, k, v = (b.input(name, (1, 4, 49, head_dim)) for name in "qkv")
    attention = b.op("sdpa", [q, k, v], {"is_causal": False, "scale": None}, name="sdpa")
    moved = b.op("permute", [attention], {"dims": (0, 1, 3, 2)}, name="moved")
    image = b.op("reshape", [moved], {"shape": (1, 4 * head_dim, 7, 7)}, name="image")
    graph = b.output(b.conv(image, 8, 1, name="proj"))
    assert view_copies(graph, graph["image"]) is copies
    plan = plan_fusion(graph, FusionConfig(), H200)
    assert_well_formed(plan)
    assert (plan.group_of("image").code is Code.VIEW_COPY) is copies


def test_a_residual_of_a_copying_view_maps_it_in_its_own_kernel():
    """MobileViTv2: a conv's output unfolded into patches (a reshape PyTorch copies) is the skip of another conv's
    residual add. The conv's epilogue loads its skip through strides, which the copy has none of: the add stays out
    of it (view-in-anchor) and maps the patches' views on its load; nothing is copied, the launches are the same."""
    b = GraphBuilder("patches", "float32")
    x = b.input("x", (1, 4, 8, 8))
    first = b.conv(x, 4, 1, name="first")
    split = b.op("reshape", [first], {"shape": (1, 4, 4, 2, 4, 2)}, name="split")
    moved = b.op("permute", [split], {"dims": (0, 1, 3, 5, 2, 4)}, name="moved")
    patches = b.op("reshape", [moved], {"shape": (1, 4, 4, 16)}, name="patches")
    second = b.conv(b.input("y", (1, 4, 4, 16)), 4, 1, name="second")
    graph = b.output(b.op("add", [second, patches], name="residual"))
    assert view_copies(graph, graph["patches"])
    plan = plan_fusion(graph, FusionConfig(dtype="float32"), H200)
    assert_well_formed(plan)
    assert not [g for g in plan.groups if g.code is Code.VIEW_COPY]
    residual = plan.group_of("residual")
    assert "second" not in residual.nodes and {"split", "moved", "patches"} <= set(residual.nodes)
    (refusal,) = [d for d in decisions_between(plan, "second", "residual") if d.code is Code.VIEW_IN_ANCHOR]
    assert "patches" in refusal.reason and plan.kernel_launches == 3


def test_a_layer_norm_writes_the_copy_a_conv_reads():
    """MobileViT folds its patches back to an image after a layer norm (reshape, permute, reshape: a copy in
    PyTorch) for a conv, whose kernel maps no views: the layer norm's kernel writes the image directly."""
    b = GraphBuilder("fold", "float32")
    tokens = b.input("tokens", (4, 16, 8))
    normed = b.op("layer_norm", [tokens], {"normalized_shape": [8], "eps": 1e-5}, name="norm")
    split = b.op("reshape", [normed], {"shape": (1, 2, 2, 4, 4, 8)}, name="split")
    moved = b.op("permute", [split], {"dims": (0, 5, 3, 1, 4, 2)}, name="moved")
    image = b.op("reshape", [moved], {"shape": (1, 8, 8, 8)}, name="image")
    graph = b.output(b.conv(image, 8, 1, name="conv"))
    assert view_copies(graph, graph["image"])
    plan = plan_fusion(graph, FusionConfig(dtype="float32"), H200)
    assert_well_formed(plan)
    assert plan.group_of("norm").nodes == ["norm", "split", "moved", "image"]
    assert plan.group_of("norm").outputs == ["image"] and plan.kernel_launches == 2


def test_a_linear_reading_through_a_flatten_is_a_single_op_group():
    """A group's kind names what it computes: a linear whose operand load maps the flatten before it (ResNet's
    head, after its pooling) is one op alone, single, not an anchor with an epilogue; a relu after it makes it one."""
    import torch
    import torch.nn as nn

    import opfuse

    for head, kind in ((nn.Identity(), GroupKind.SINGLE), (nn.ReLU(), GroupKind.ANCHOR_EPILOGUE)):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
                              head).eval()
        plan = opfuse.analyze(model, (torch.randn(2, 3, 6, 6),), FusionConfig(dtype="float32")).plan
        group = plan.group_of(next(n.name for n in plan.graph if n.op == "linear"))
        assert [plan.graph[n].op for n in group.nodes][:2] == ["reshape", "linear"], group.nodes
        assert group.kind is kind


def _rms_then_siblings() -> Graph:
    """Llama's attention input: an RMS norm read by the q, k and v projections alone."""
    b = GraphBuilder("rms_qkv")
    x = b.input("x", (1, 1, 256))
    norm = b.op("rms_norm", [x, b.constant("rms_w", (256,))], {"eps": 1e-6}, "rms")
    return b.output(b.linear(norm, 256, name="q"), b.linear(norm, 64, name="k"), b.linear(norm, 64, name="v"))


def test_sibling_linears_share_the_rms_norm_they_read_as_their_prologue():
    """q, k, v on one RMS norm: one horizontal GEMM that normalizes its A tile (one launch, the normalized
    activation never written) with `norm_prologue`; without it, the norm is a kernel of its own."""
    plan = plan_fusion(_rms_then_siblings(), FusionConfig(norm_prologue=True), H200)
    assert_well_formed(plan)
    assert [g.nodes for g in plan.groups] == [["rms", "q", "k", "v"]]
    assert plan.groups[0].kind is GroupKind.HORIZONTAL and plan.kernel_launches == 1
    assert not plan.groups[0].split_k          # a slice of K would see part of each row's statistics
    assert [d.verdict for d in plan.decisions if d.fusion == "prologue"] == [Verdict.FUSED]
    off = plan_fusion(_rms_then_siblings(), FusionConfig(), H200)
    assert groups_of(off)["rms"] == ["rms"] and off.kernel_launches == 2



def test_rms_norm_prologue_takes_rms_norms_and_leaves_layer_norms_their_kernels():
    """`rms_norm_prologue` lets an RMS norm open its linears' prologue (deferred: `opfuse.codegen.prologue`), not a
    layer norm, which stays a kernel of its own (norm_prologue takes both)."""
    rms = plan_fusion(_rms_then_siblings(), FusionConfig(rms_norm_prologue=True), H200)
    assert [g.nodes for g in rms.groups] == [["rms", "q", "k", "v"]]
    b = GraphBuilder("ln_qkv")
    x = b.input("x", (1, 1, 256))
    norm = b.op("layer_norm", [x, b.constant("ln_w", (256,)), b.constant("ln_b", (256,))],
                {"normalized_shape": [256], "eps": 1e-5}, "ln")
    graph = b.output(b.linear(norm, 256, name="q"), b.linear(norm, 64, name="k"), b.linear(norm, 64, name="v"))
    layer = plan_fusion(graph, FusionConfig(rms_norm_prologue=True), H200)
    assert groups_of(layer)["ln"] == ["ln"] and layer.kernel_launches == 2
    both = plan_fusion(graph, FusionConfig(norm_prologue=True), H200)
    assert groups_of(both)["ln"] == ["ln", "q", "k", "v"]

def test_a_norm_read_by_siblings_and_another_op_stays_its_own_kernel():
    b = GraphBuilder("rms_qkv_and_more")
    x = b.input("x", (1, 1, 256))
    norm = b.op("rms_norm", [x, b.constant("rms_w", (256,))], {"eps": 1e-6}, "rms")
    graph = b.output(b.linear(norm, 256, name="q"), b.linear(norm, 64, name="k"), b.unary("tanh", norm, "other"))
    plan = plan_fusion(graph, FusionConfig(norm_prologue=True), H200)
    assert_well_formed(plan)
    assert groups_of(plan)["rms"] == ["rms"] and groups_of(plan)["q"] == ["q", "k"]


def _gated(bias: bool = False, act_read: bool = False) -> Graph:
    """A SwiGLU MLP's first half: silu(x W_g^T) * (x W_u^T), then the down projection."""
    b = GraphBuilder("swiglu")
    x = b.input("x", (1, 4, 64))
    gate = b.linear(x, 128, name="gate", bias=bias)
    act = b.unary("silu", gate, "act")
    product = b.op("mul", [act, b.linear(x, 128, name="up", bias=False)], name="product")
    outputs = [b.linear(product, 64, name="down", bias=False)] + ([b.unary("tanh", act, "other")] if act_read else [])
    return b.output(*outputs)


def test_a_gated_pair_of_sibling_linears_is_one_gemm():
    """gate -> SiLU, up, their product: one HORIZONTAL group (the `gated` decision), one launch fewer, with or
    without biases (each half takes its own in the tile); not where the activation is read outside the pair."""
    for graph in (_gated(), _gated(bias=True)):
        plan = plan_fusion(graph, FusionConfig(), H200)
        assert_well_formed(plan)
        group = plan.group_of("gate")
        assert group.nodes == ["gate", "act", "up", "product"] and group.kind is GroupKind.HORIZONTAL
        assert group.outputs == ["product"] and not group.split_k and plan.kernel_launches == 2
        assert [d.verdict for d in plan.decisions if d.fusion is Fusion.GATED] == [Verdict.FUSED]
    plan = plan_fusion(_gated(act_read=True), FusionConfig(), H200)
    assert plan.group_of("gate").nodes != plan.group_of("up").nodes


def test_a_gated_pair_takes_the_rms_norm_it_reads_as_its_prologue():
    """Llama's MLP input: an RMS norm read by gate and up alone becomes the gated GEMM's prologue with
    `norm_prologue` (one launch: norm, both linears, SiLU and the product); without it, a kernel of its own."""
    b = GraphBuilder("rms_swiglu")
    x = b.input("x", (1, 4, 64))
    norm = b.op("rms_norm", [x, b.constant("rms_w", (64,))], {"eps": 1e-6}, "rms")
    gate = b.linear(norm, 128, name="gate", bias=False)
    product = b.op("mul", [b.unary("silu", gate, "act"), b.linear(norm, 128, name="up", bias=False)], name="product")
    graph = b.output(product)
    plan = plan_fusion(graph, FusionConfig(norm_prologue=True), H200)
    assert_well_formed(plan)
    assert plan.group_of("rms").nodes == ["rms", "gate", "act", "up", "product"] and plan.kernel_launches == 1
    assert plan_fusion(graph, FusionConfig(), H200).group_of("rms").nodes == ["rms"]
