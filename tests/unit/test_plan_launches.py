"""The plan counts the launches the compiled model makes untuned on a GPU: split-K's second kernel only where the
kernel's default tile (`opfuse.fusion.tiles`, shared by the templates and the planner) splits the reduction. The
kernels are built with the interpreter's tiny tile switched off (nothing runs); the plan follows the GPU's rules
whether or not the interpreter is on."""


import pytest

from opfuse.api import analyze
from opfuse.bench.zoo import load_builtin
from opfuse.codegen.split_k import slices_of
from opfuse.codegen.lower import lower_plan
from opfuse.config import FusionConfig


@pytest.mark.parametrize("name,batch", [("resnet18", 1), ("resnet18", 8)])
def test_plan_launches_are_what_the_default_configs_launch(gpu_tiles, name, batch):
    model, inputs = load_builtin(name, batch=batch)
    analysis = analyze(model.half(), tuple(x.half() for x in inputs), FusionConfig(dtype="float16"), name=name)
    plan = analysis.plan
    kernels, _ = lower_plan(plan, "cpu")
    assert set(kernels) == {g.name for g in plan.groups if g.launches}    # every launching group has a kernel
    assert sum(k.launches() for k in kernels.values()) == plan.kernel_launches == analysis.fused.kernel_launches
    offered = {g.name for g in plan.groups if g.split_k}
    split = {name for name, k in kernels.items() if slices_of(k.configs()[0]) > 1}
    assert split <= offered and all(g.launches == 1 for g in plan.groups if g.name in split)     # one launch, split
    if batch == 1:     # batch 1: the resource model's tile offers more splits than the default tile takes
        assert split and offered - split
        why = next(g.reason for g in plan.groups if g.name in offered - split)
        assert "split-K offered" in why and "one kernel unless the autotuner" in why
        assert "K blocks, under the 16" in why or "quarter of the SMs busy" in why, why


TILE_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


@pytest.mark.parametrize("name,batch", [("resnet18", 2), ("resnet50", 8), ("regnet_y_400mf", 1),
                                        ("efficientnet_b0", 1), ("convnext_tiny", 2), ("mobilenet_v2", 8),
                                        ("bert", 2), ("vit_b_16", 1)])
def test_the_tile_priced_is_the_tile_launched(gpu_tiles, name, batch):
    """Every group of the plan is priced (registers, shared memory, the split-K decision) on the tile its kernel
    launches untuned: GEMMs, matmuls and implicit-GEMM convs, depthwise convs, attention (its Triton form, where the
    library form comes first), elementwise, row and pooling kernels. The resource model and the templates read one
    tile space (`opfuse.fusion.tiles`), the default first."""
    from opfuse.codegen.attention import AttentionKernel
    from opfuse.codegen.base import FORM_TRITON
    from opfuse.codegen.conv_conv import ConvConvKernel
    from opfuse.codegen.conv_depthwise import DepthwiseConvKernel
    from opfuse.codegen.conv_implicit_gemm import ConvKernel
    from opfuse.codegen.gemm import GemmKernel
    from opfuse.codegen.pointwise import PointwiseKernel
    from opfuse.codegen.pool import PoolKernel
    from opfuse.codegen.reduction import RowReductionKernel
    from opfuse.codegen.squeeze import SqueezeKernel

    model, inputs = load_builtin(name, batch=batch, seq_len=64)
    inputs = tuple(x.half() if x.is_floating_point() else x for x in inputs)
    plan = analyze(model.half(), inputs, FusionConfig(dtype="float16"), name=name).plan
    kernels, _ = lower_plan(plan, "cpu")
    compared = {family: 0 for family in (GemmKernel, ConvKernel, DepthwiseConvKernel, ConvConvKernel,
                                         AttentionKernel, PointwiseKernel, RowReductionKernel, PoolKernel,
                                         SqueezeKernel)}
    for group in plan.groups:
        kernel, tile = kernels.get(group.name), group.resources.tile if group.resources else {}
        family = next((f for f in compared if isinstance(kernel, f)), None)
        if kernel is None:
            continue
        assert family is not None, (group.name, type(kernel).__name__)
        config = next(c for c in kernel.configs() if c.form == FORM_TRITON)
        launched = dict(config.params) | {"num_warps": config.num_warps, "num_stages": config.num_stages}
        priced = dict(tile)
        if family in (GemmKernel, ConvKernel, AttentionKernel):
            launched.pop("SPLIT_K", None)           # the plan's slices of that tile (`FusionGroup.split_k`)
            launched.pop("BLOCK_G", None)
        if family is AttentionKernel:
            priced.pop("HEAD_DIM")                  # the head dim's block, from the shapes
        if "num_stages" not in priced:              # (Triton's default: the template has no pipeline)
            launched.pop("num_stages")
        assert launched == priced, (group.name, group.nodes, type(kernel).__name__)
        compared[family] += 1
    assert sum(compared.values()) == len([g for g in plan.groups if g.name in kernels])
    kinds = {"bert": [AttentionKernel, PointwiseKernel, RowReductionKernel], "resnet18": [PoolKernel],
             "efficientnet_b0": [DepthwiseConvKernel, SqueezeKernel], "convnext_tiny": [DepthwiseConvKernel],
             "mobilenet_v2": [ConvConvKernel]}
    assert all(compared[family] > 0 for family in kinds.get(name, []))


def test_a_conv_of_one_input_channel_a_group_is_priced_on_the_depthwise_tiles(gpu_tiles):
    """groups == input channels with two filters each (a channel multiplier of 2) runs the depthwise template, not a
    GEMM: it is priced on that template's tiles (random models found it priced as a GEMM it has no view of)."""
    from graph_builders import GraphBuilder
    from opfuse.fusion.planner import plan_fusion

    b = GraphBuilder("multiplier")
    graph = b.output(b.conv(b.input("x", (1, 7, 3, 3)), 14, 1, groups=7, name="conv"))
    plan = plan_fusion(graph, FusionConfig())
    (kernel,) = lower_plan(plan, "cpu")[0].values()
    config = kernel.configs()[0]
    assert type(kernel).__name__ == "DepthwiseConvKernel"
    assert plan.group_of("conv").resources.tile == dict(config.params) | {"num_warps": config.num_warps,
                                                                         "num_stages": config.num_stages}


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


def split_linear_plan():
    """The plan of a linear whose tiles leave the H200's SMs idle over a long reduction (K = 4096, 16 rows)."""
    from graph_builders import GraphBuilder
    from opfuse.fusion.planner import plan_fusion

    b = GraphBuilder("long_k")
    graph = b.output(b.linear(b.input("x", (16, 4096)), 64, name="fc"))
    plan = plan_fusion(graph, FusionConfig())
    return plan, plan.group_of("fc")


def test_the_plan_decides_each_tiles_slices_and_the_kernel_runs_them(gpu_tiles):
    """The slices are the planner's (every tile of the tables, `split_k_table`), the rule each tile's own grid
    (`split_k_slices`) as before the plan carried them; the kernel's configs read theirs from the plan."""
    from opfuse.fusion.tiles import KERNEL_TILES, anchor_grid, split_k_slices, tile_key

    plan, group = split_linear_plan()
    assert set(group.split_k) == {tile_key(t) for t in KERNEL_TILES}
    for tile in KERNEL_TILES:
        assert group.split_k[tile_key(tile)] == split_k_slices(*anchor_grid(tile, 16, 64, 4096, 1), 132)
    kernels, _ = lower_plan(plan, "cpu")
    configs = kernels[group.name].configs()
    assert len(configs) > 1 and any(slices_of(c) > 1 for c in configs)
    assert all(slices_of(c) == group.split_k[tile_key(c)] for c in configs)
    assert kernels[group.name].launches() == group.launches


def test_a_plan_whose_slices_are_changed_by_hand_gets_kernels_of_those_slices(gpu_tiles):
    import dataclasses

    plan, group = split_linear_plan()
    edited = dataclasses.replace(group, split_k={key: 5 for key in group.split_k})
    plan.groups[plan.groups.index(group)] = edited
    kernels, _ = lower_plan(plan, "cpu")
    assert {slices_of(c) for c in kernels[group.name].configs()} == {5}
    unsplit = dataclasses.replace(group, split_k={key: 1 for key in group.split_k})
    plan.groups[plan.groups.index(edited)] = unsplit
    kernels, _ = lower_plan(plan, "cpu")
    assert {slices_of(c) for c in kernels[group.name].configs()} == {1} and kernels[group.name].launches() == 1


def test_a_plan_without_slices_for_a_kernels_tile_is_an_error(gpu_tiles):
    import dataclasses

    from opfuse.ir.graph import GraphError

    plan, group = split_linear_plan()
    plan.groups[plan.groups.index(group)] = dataclasses.replace(group, split_k={"1x1x1": 2})
    with pytest.raises(GraphError, match="no K slices for tile"):
        lower_plan(plan, "cpu")


@pytest.mark.parametrize("m,n,k,batch,itemsize,gather", [
    (16, 4096, 4096, 1, 2, False), (3136, 64, 576, 1, 2, False), (12544, 64, 147, 1, 2, True),
    (49, 2048, 512, 64, 4, False), (8192, 3072, 768, 1, 4, False)])
def test_every_tile_a_kernel_lists_has_its_slices_in_the_table(m, n, k, batch, itemsize, gather):
    from opfuse.fusion.tiles import KERNEL_TILES, anchor_tiles, tile_key
    from opfuse.hardware import get_hardware

    for hw in (get_hardware("h200"), get_hardware("rtx4090"), get_hardware("orin")):
        assert {tile_key(t) for t in anchor_tiles(m, n, k, batch, itemsize, gather, hw=hw)} <= \
            {tile_key(t) for t in KERNEL_TILES}


def test_tiles_mostly_past_the_output_edge_come_after_those_that_fit():
    """A 1x1 conv of 58 channels at batch 64 (ShuffleNet): every tile fills the GPU, and those at least twice
    the output's width (128 and 256 columns) come after the rest, so a short tuning times tiles that fit it; a
    wide output keeps the listed order."""
    from opfuse.fusion.tiles import LARGE, anchor_tiles
    from opfuse.hardware import get_hardware

    hw = get_hardware("h200")
    narrow = anchor_tiles(64 * 28 * 28, 58, 58, hw=hw)
    wide = [t["BLOCK_N"] >= 128 for t in narrow[1:]]
    assert wide == sorted(wide) and any(wide) and not all(wide)
    past = [t["BLOCK_N"] for t in narrow[1:] if t["BLOCK_N"] >= 128]
    assert past == sorted(past) and past[-1] == 256      # least padding first
    wide_output = anchor_tiles(64 * 28 * 28, 512, 58, hw=hw)
    assert wide_output[1:4] == LARGE
    assert sorted(map(str, narrow)) == sorted(map(str, wide_output))     # the same candidates
    # a grouped conv's groups (batch): its group-blocked forms pack groups into a tile, so no reordering
    assert anchor_tiles(64 * 28 * 28, 58, 58, 8, hw=hw)[1:4] == LARGE


def test_gemms_that_only_store_take_narrow_tiles_first():
    """A reduction of 32 or less (EfficientNet's 16 -> 96 expansion), or 32 columns or less (its 144 -> 24
    projection): the 32-column tiles first, 16 deep where K is 16; a longer reduction over more columns (ResNet's
    64 -> 256) keeps its default and lists the narrow tiles after every other."""
    from opfuse.fusion.tiles import NARROW, anchor_tiles
    from opfuse.hardware import get_hardware

    hw = get_hardware("h200")
    expand = anchor_tiles(64 * 112 * 112, 96, 16, hw=hw)
    assert [t["BLOCK_N"] for t in expand[:4]] == [32] * 4 and {t["BLOCK_K"] for t in expand[:4]} == {16}
    assert anchor_tiles(64 * 56 * 56, 24, 144, hw=hw)[0] == NARROW[0]
    resnet = anchor_tiles(64 * 56 * 56, 256, 64, hw=hw)
    assert (resnet[0]["BLOCK_M"], resnet[0]["BLOCK_N"]) == (64, 128)
    assert resnet[-len(NARROW):] == NARROW and all(t["BLOCK_N"] > 32 for t in resnet[:-len(NARROW)])


def test_each_config_runs_the_slices_its_own_grid_needs(gpu_tiles):
    """No change from when codegen counted the slices itself: for a long linear, a grouped 3x3 conv, a 3x3 and a 1x1
    conv over 7x7 pixels (resnet50's last stage at batch 1), every config of every split kernel runs
    `split_k_slices` of its own tile grid and K loop, worked out here from the kernel's geometry."""
    import triton

    from graph_builders import GraphBuilder
    from opfuse.codegen.conv_implicit_gemm import ConvKernel
    from opfuse.fusion.planner import plan_fusion
    from opfuse.fusion.tiles import anchor_steps, split_k_slices

    b = GraphBuilder("split")
    x = b.input("x", (1, 512, 7, 7))
    wide = b.conv(b.unary("relu", b.conv(x, 512, 3, padding=1, name="c3")), 2048, 1, name="c1")
    grouped = b.conv(x, 256, 3, padding=1, groups=4, name="grouped")
    fc = b.linear(b.input("t", (16, 4096)), 64, name="fc")
    plan = plan_fusion(b.output(wide, grouped, fc), FusionConfig())
    kernels, _ = lower_plan(plan, "cpu")
    split = [g for g in plan.groups if g.split_k]
    assert {g.anchor for g in split} >= {"c3", "c1", "grouped", "fc"}
    for group in split:
        kernel = kernels[group.name]
        layout, conv = kernel.layout, isinstance(kernel, ConvKernel)
        groups = kernel.geometry.groups if conv else layout.batch
        for config in kernel.configs():
            programs = triton.cdiv(layout.rows, config["BLOCK_M"]) * \
                triton.cdiv(layout.channels // (groups if conv else 1), config["BLOCK_N"]) * groups
            steps = kernel._steps(config) if conv else anchor_steps(1, kernel.k, config["BLOCK_K"])
            assert slices_of(config) == split_k_slices(programs, steps, 132), (group.anchor, config)
