"""Reduction group kernels (softmax, layer norm, mean/sum, pooling) with prologues and epilogues, on Triton's
interpreter.

Each test builds a tiny graph by hand, lowers it as one fusion group, runs the kernel on NaN-poisoned outputs and
compares every group output with the IR reference interpreter run in float32. Rows longer than one block run the
looped (two-sweep) code path, picked by a small BLOCK_L. With OPFUSE_GPU_TESTS=1 the same tests run on the GPU.
"""

from __future__ import annotations

import os
import re

import pytest
import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.expr import Unsupported
from opfuse.codegen.pool import PoolKernel
from opfuse.codegen.reduction import RowReductionKernel, lower_reduction_group
from opfuse.fusion.plan import GroupKind

from tests.kernels.builders import KernelGraph

DEVICE = "cuda" if os.environ.get("OPFUSE_GPU_TESTS") == "1" else "cpu"
# masked-off lanes (rows past the end) may compute inf/NaN that is never stored
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
SMALL_CHUNKS = KernelConfig.of(BLOCK_M=2, BLOCK_L=16, num_warps=1)


class Builder(KernelGraph):
    default_kind = GroupKind.REDUCTION


def run_group(builder: Builder, outputs: list[str], config: KernelConfig | None = None):
    """Lower, run with NaN-poisoned outputs, check against the float32 reference; returns (kernel, results)."""
    kernel = lower_reduction_group(builder.graph, builder.group(outputs), DEVICE)
    kernel.output_fill = float("nan")
    results = kernel.run([builder.feeds[name].to(DEVICE) for name in kernel.runtime_inputs], config)
    assert kernel.last_compiled is not None
    builder.check(outputs, results)
    return kernel, results


# ---- softmax ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
def test_softmax_last_dim_row_37(config):
    b = Builder()
    kernel, _ = run_group(b, [b.op("softmax", b.input("x", (5, 37), b.random(5, 37) * 4), dim=-1)], config)
    assert isinstance(kernel, RowReductionKernel)


def test_softmax_row_longer_than_the_default_block():
    b = Builder()
    kernel, _ = run_group(b, [b.op("softmax", b.input("x", (3, 300)), dim=1)])
    if DEVICE == "cpu":                                   # the interpreter's default block is 128: it loops
        assert kernel.configs()[0]["BLOCK_L"] < 300


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
def test_softmax_with_scale_prologue_and_mask(config):
    b = Builder()
    scores = b.input("scores", (2, 2, 6, 40))
    y = b.op("mul", scores, b.const("scale", torch.tensor(0.125)))
    mask = torch.zeros(1, 1, 6, 40)
    mask[..., :20] = float("-inf")                         # whole first chunks of -inf (left padding)
    y = b.op("add", y, b.const("mask", mask))
    kernel, _ = run_group(b, [b.op("softmax", y, dim=-1)], config)
    assert not kernel.channels_inner                       # rows tile along the reduced (contiguous) dim


def test_softmax_over_a_middle_dim():
    b = Builder()
    run_group(b, [b.op("softmax", b.input("x", (3, 9, 4)), dim=1)], SMALL_CHUNKS)


@pytest.mark.parametrize("length,config", [(128, None), (200, SMALL_CHUNKS)])
def test_softmax_float16(length, config):
    b = Builder("float16")
    run_group(b, [b.op("softmax", b.input("x", (4, length), b.random(4, length) * 3), dim=-1)], config)


# ---- layer norm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("hidden,config", [(48, None), (48, SMALL_CHUNKS), (200, None)],
                         ids=["48-one-pass", "48-looped", "200-default"])
def test_layer_norm_with_residual_add_prologue(hidden, config):
    b = Builder()
    x = b.input("x", (2, 3, hidden), b.random(2, 3, hidden) * 3 + 5)   # a large mean tests the variance
    h = b.op("add", x, b.input("residual", (2, 3, hidden)))
    y = b.op("layer_norm", h, b.const("w", b.random(hidden)), b.const("b", b.random(hidden)),
             normalized_shape=[hidden], eps=1e-5)
    run_group(b, [h, y], config)                           # the residual sum is needed later: stored too


@pytest.mark.parametrize("normalized", ["channels", "last"])
def test_a_4d_row_reduction_stores_its_rows_dense_along_the_reduced_dim(normalized):
    """ConvNeXt's downsampling norm: a channels-last [N, C, H, W] residual sum, permuted to [N, H, W, C] and layer
    normed over C, is stored dense along C (not in the largest input's channels-last format, which puts H
    innermost); a softmax over the channels of an [N, C, H, W] value is stored channels-last."""
    b = Builder()
    if normalized == "last":    # channels-last inputs (the builder's default for 4-D)
        x, residual = b.input("x", (2, 6, 3, 5)), b.input("residual", (2, 6, 3, 5))
    else:                       # dense NCHW inputs, whose layout the old rule would have copied
        x, residual = (b.input(name, (2, 6, 3, 5), b.random(2, 6, 3, 5)) for name in ("x", "residual"))
    h = b.op("add", x, residual)
    w, bias = b.const("w", b.random(6)), b.const("b", b.random(6))
    if normalized == "last":
        y = b.op("layer_norm", b.op("permute", h, dims=[0, 2, 3, 1]), w, bias, normalized_shape=[6], eps=1e-6)
    else:
        y = b.op("softmax", h, dim=1)
    kernel, (out,) = run_group(b, [y])
    assert isinstance(kernel, RowReductionKernel)
    if normalized == "last":
        assert out.shape == (2, 3, 5, 6) and out.is_contiguous()
    else:
        assert out.shape == (2, 6, 3, 5) and out.is_contiguous(memory_format=torch.channels_last)


def test_layer_norm_float16_without_affine_then_cast():
    b = Builder("float16")
    y = b.op("layer_norm", b.input("x", (5, 96)), normalized_shape=[96], eps=1e-6)
    run_group(b, [b.op("cast", y, dtype="float32")], KernelConfig.of(BLOCK_M=4, BLOCK_L=32, num_warps=1))


def test_layer_norm_over_two_dims():
    b = Builder()
    y = b.op("layer_norm", b.input("x", (3, 4, 5)), b.const("w", b.random(4, 5)), b.const("b", b.random(4, 5)),
             normalized_shape=[4, 5], eps=1e-5)
    run_group(b, [y], SMALL_CHUNKS)


# ---- mean / sum / global pool -----------------------------------------------------------------------

@pytest.mark.parametrize("keepdim", [True, False])
@pytest.mark.parametrize("dims,config", [([2, 3], SMALL_CHUNKS), ([-1, -2], None)], ids=["looped", "default"])
def test_mean_over_spatial_dims(keepdim, dims, config):
    b = Builder()
    run_group(b, [b.op("mean", b.input("x", (2, 6, 5, 7)), dims=dims, keepdim=keepdim)], config)


def test_sum_over_middle_dim_with_epilogue():
    b = Builder()
    y = b.op("sum", b.input("x", (4, 9, 3)), dims=[1])
    run_group(b, [b.op("mul", y, b.input("g", (4, 3)))])


class Counts(torch.nn.Module):
    """mBART's index of each row's last token that is not padding, and sums of int64 values past 2^24."""

    def forward(self, ids, big):
        return ids.ne(0).sum(dim=1) - 1, big.sum(dim=-1) * 3, (ids * 2).sum()


def test_an_integer_sum_is_exact_in_int64_and_never_split():
    """A count of a comparison's trues and a sum of int64 values near 2^40 (float32 would round them), unsplit
    (the float32 workspace of slices would round them too)."""
    import opfuse

    ids, big = torch.tensor([[5, 7, 0, 0, 9], [3, 0, 0, 0, 0]]), torch.randint(-2**40, 2**40, (3, 37))
    compiled = opfuse.compile(Counts(), (ids.to(DEVICE), big.to(DEVICE)), opfuse.FusionConfig(dtype="float32"))
    assert compiled.analysis.pytorch_groups == {} and not compiled.analysis.opaque_ops
    ids, big = torch.randint(0, 3, (2, 5)), torch.randint(-2**40, 2**40, (3, 37))
    for got, want in zip(compiled(ids.to(DEVICE), big.to(DEVICE)), Counts()(ids, big)):
        assert got.dtype == torch.int64 and torch.equal(got.cpu(), want)
    # on an H100 a float sum of two rows of 100k elements takes slices, the integer one none
    from opfuse.hardware import get_hardware

    splits = {}
    for dtype in ("float32", "int64"):
        b = Builder(dtype)
        group = b.group([b.op("sum", b.input("x", (2, 100_000)), dims=[1])])
        kernel = lower_reduction_group(b.graph, group, "cpu")
        kernel.hw = get_hardware("h100")       # its tiles, not the interpreter's one
        splits[dtype] = {dict(config.params)["SPLIT"] for config in kernel.configs()}
    assert max(splits["float32"]) > 1 and splits["int64"] == {1}


@pytest.mark.parametrize("keepdim", [True, False])
@pytest.mark.parametrize("shape,dims,config", [((3, 300), [1], None), ((2, 6, 5, 7), [2, 3], SMALL_CHUNKS),
                                               ((4, 37, 3), [1], SMALL_CHUNKS), ((5, 2, 0), [2], None)],
                         ids=["long-row", "spatial-looped", "middle-dim", "empty"])
def test_prod_multiplies_each_chunk_into_its_lanes_then_the_lanes(shape, dims, keepdim, config):
    """Values of either sign near 1 (so that 300 of them stay finite), an epilogue on the product, and rows of no
    element (a product of 1)."""
    b = Builder()
    values = torch.exp(torch.randn(shape) * 0.05) * torch.where(torch.rand(shape) < 0.1, -1.0, 1.0)
    y = b.op("prod", b.input("x", shape, values), dims=dims, keepdim=keepdim)
    kernel, _ = run_group(b, [b.op("mul", y, b.const("two", torch.tensor(2.0)))], config)
    assert kernel.launches() == 1


def test_aten_prod_compiles_to_the_row_template_with_nothing_through_pytorch():
    import opfuse

    class Products(torch.nn.Module):
        def forward(self, x):
            return torch.prod(x, 1), x.prod(-1, keepdim=True) * 3, (x - 1).prod()

    x = torch.exp(torch.randn(2, 40, 3) * 0.05).to(DEVICE)
    compiled = opfuse.compile(Products().eval(), (x,), opfuse.FusionConfig(dtype="float32"))
    assert compiled.analysis.pytorch_groups == {} and not compiled.analysis.opaque_ops
    assert sum(compiled.plan.graph[n].op == "prod" for n in compiled.plan.graph.nodes) == 3
    fresh = torch.exp(torch.randn(2, 40, 3) * 0.05).to(DEVICE)
    for got, want in zip(compiled(fresh), Products()(fresh)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30)


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
@pytest.mark.parametrize("overflow", [False, True])
def test_any_isinf_over_the_last_dim_then_a_where_epilogue(overflow, config):
    """T5's fp16 overflow check, its first step: any(isinf(h)) per row, then where(., a, b) on the result."""
    b = Builder()
    value = b.random(4, 3, 40)
    if overflow:
        value[1, 2, 7], value[3, 0, 39] = float("inf"), float("-inf")
    seen = b.op("any", b.op("isinf", b.input("h", (4, 3, 40), value)), dims=[2], keepdim=True)
    picked = b.op("where", seen, b.const("a", torch.tensor(1.5)), b.const("b", torch.tensor(-2.0)))
    _, (flags, values) = run_group(b, [seen, picked], config)
    assert flags.dtype == torch.bool and bool(flags.any()) == overflow


@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_with_a_residual_prologue_and_a_clamp_epilogue(weighted, config):
    b = Builder()
    x = b.op("add", b.input("x", (3, 5, 37)), b.input("skip", (3, 5, 37)))
    inputs = [x] + ([b.const("w", b.random(37))] if weighted else [])
    normed = b.op("rms_norm", *inputs, eps=1e-6)
    run_group(b, [x, b.op("clamp", normed, min=-1.0, max=1.0)], config)


@pytest.mark.parametrize("split", [2, 4])
def test_any_in_row_slices(split):
    """Each slice's flag (the max of its x != 0) to the workspace, the row's the max of them: an inf in one slice
    of one row only."""
    b = Builder()
    value = b.random(4, 3, 40)
    value[1, 2, 37] = float("inf")
    seen = b.op("any", b.op("isinf", b.input("h", (4, 3, 40), value)), dims=[2], keepdim=True)
    config = KernelConfig.of(BLOCK_M=4, BLOCK_L=4, SPLIT=split, num_warps=1)
    kernel, (flags,) = run_group(b, [seen], config)
    assert kernel.launches(config) == 2 and flags.flatten().tolist() == [i == 5 for i in range(12)]


def test_global_average_pool_on_channels_last_input():
    b = Builder()
    y = b.op("adaptive_avg_pool2d", b.input("x", (2, 40, 7, 7)), output_size=[1, 1])
    kernel, (out,) = run_group(b, [b.op("relu", y)])
    assert isinstance(kernel, RowReductionKernel) and kernel.channels_inner and out.shape == (2, 40, 1, 1)


def test_the_prologue_value_of_a_mean_over_h_w_keeps_its_inputs_layout():
    """SE's pool reads relu(x + r): stored too (a later conv reads it), it stays channels-last like its inputs."""
    b = Builder()
    h = b.op("relu", b.op("add", b.input("x", (2, 6, 3, 5)), b.input("r", (2, 6, 3, 5))))
    kernel, (stored, _) = run_group(b, [h, b.op("mean", h, dims=[2, 3], keepdim=True)])
    assert kernel.channels_inner and stored.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("split", [2, 4])
def test_a_mean_in_row_slices_keeps_its_prologue_output_and_epilogue(split):
    """SPLIT slices of each row (the last one empty at 4: 35 lanes in slices of 12), summed by a second launch."""
    b = Builder()
    h = b.op("relu", b.op("add", b.input("x", (2, 6, 5, 7)), b.input("r", (2, 6, 5, 7))))
    pooled = b.op("adaptive_avg_pool2d", h, output_size=[1, 1])
    config = KernelConfig.of(BLOCK_M=4, BLOCK_L=4, SPLIT=split, num_warps=1)
    kernel, _ = run_group(b, [h, b.op("sigmoid", pooled)], config)
    assert kernel.launches(config) == 2 and kernel.launches(KernelConfig.of(BLOCK_M=4, BLOCK_L=4, SPLIT=1)) == 1


@pytest.mark.parametrize("groups,split,block", [(1, 2, 4), (1, 4, 4), (1, 4, 64), (2, 4, 4)])
def test_a_group_norm_of_few_groups_in_row_slices(groups, split, block):
    """GroupNorm(G, C) at batch 1 is G long rows: SPLIT slices each keep a mean and an M2 (a large mean tests the
    merge; at 4 slices of 4-lane chunks the last slice of a 35-lane row lies wholly past it), and the second launch
    writes every slice normalised, the residual prologue stored once, the per-channel affine after the reshape back;
    two groups, two rows a program."""
    b = Builder()
    channels = 3 * groups
    h = b.op("add", b.input("x", (1, channels, 5, 7), b.random(1, channels, 5, 7) * 3 + 5),
             b.input("r", (1, channels, 5, 7)))
    rows = b.op("reshape", h, shape=[1, groups, 3, 35])
    normed = b.op("reshape", b.op("layer_norm", rows, normalized_shape=[3, 35], eps=1e-5),
                  shape=[1, channels, 5, 7])
    y = b.op("add", b.op("mul", normed, b.const("w", b.random(channels, 1, 1))), b.const("b", b.random(channels, 1, 1)))
    config = KernelConfig.of(BLOCK_M=groups, BLOCK_L=block, SPLIT=split, num_warps=1)
    kernel, _ = run_group(b, [h, y], config)
    assert kernel.launches(config) == 2


@pytest.mark.parametrize("split", [2, 4])
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_in_row_slices(split, weighted):
    b = Builder()
    x = b.op("add", b.input("x", (2, 37)), b.input("skip", (2, 37)))
    normed = b.op("rms_norm", *([x] + ([b.const("w", b.random(37))] if weighted else [])), eps=1e-6)
    config = KernelConfig.of(BLOCK_M=2, BLOCK_L=4, SPLIT=split, num_warps=1)
    kernel, _ = run_group(b, [x, b.op("relu", normed)], config)
    assert kernel.launches(config) == 2


@pytest.mark.parametrize("split", [2, 4])
def test_a_softmax_in_row_slices(split):
    """Each slice's max and sum of exponentials go to the workspace; the second launch rescales them to the row's
    max and writes its slice. Large logits (slices' maxes far apart), a row masked but for one lane, and at 4
    slices of 4-lane chunks a last slice wholly past the 37 lanes."""
    b = Builder()
    logits = b.random(3, 37) * 30
    logits[1, 1:] = float("-inf")
    x = b.op("mul", b.input("x", (3, 37), logits), b.const("scale", torch.tensor(0.5)))
    config = KernelConfig.of(BLOCK_M=2, BLOCK_L=4, SPLIT=split, num_warps=1)
    kernel, _ = run_group(b, [b.op("softmax", x, dim=-1)], config)
    assert kernel.launches(config) == 2


@pytest.mark.parametrize("mode", ["sum", "mean", "any", "amax", "amin", "softmax", "layer_norm", "rms_norm"])
@pytest.mark.parametrize("channels_inner", [True, False])
def test_no_default_row_tile_leaves_one_program_a_long_walk(mode, channels_inner):
    """Where the row blocks are fewer than the SMs, no program of the default tile walks more than 8192 elements or
    four times its share of the work, for any row count and length: the bug class of poolformer's group norms (one
    program over 200k elements, 0.05x torch.compile)."""
    from opfuse.fusion.tiles import RowView, row_tiles

    sms = 132
    for rows in (1, 2, 8, 32, 100):
        for length in (768, 4096, 25088, 200704, 1 << 20):
            block_m, block_l, slices = row_tiles(RowView(mode, (1,), rows, length, channels_inner), sms)[0]
            if -(-rows // block_m) < sms:
                walk = min(block_m, rows) * -(-length // slices)
                assert walk <= max(8192, 4 * rows * length / sms), (rows, length, block_m, block_l, slices)


def test_a_long_norm_row_splits_and_keeps_thousands_of_elements_a_program():
    """A norm of one row of 200k elements (poolformer's first GroupNorm at batch 1) is chunked along the row in
    hundreds to thousands of lanes, not 64 (channels_inner's tile shapes are for many rows), in the most slices, each
    one or two chunks (at 4096 lanes, 16 slices of two chunks or more is the alternative); a row of 62720 in 128
    slices of 256-lane chunks on one warp; short rows stay whole."""
    from opfuse.fusion.tiles import RowView, row_kernel_tiles, row_tiles

    tiles = row_tiles(RowView("layer_norm", (2, 3), 1, 64 * 56 * 56, True), 132)
    assert tiles[:2] == [(1, 1024, 128), (1, 4096, 16)]
    assert row_kernel_tiles(RowView("layer_norm", (2, 3), 1, 320 * 14 * 14, True), 132)[0] == \
        {"BLOCK_M": 1, "BLOCK_L": 256, "SPLIT": 128, "num_warps": 1}
    assert row_tiles(RowView("rms_norm", (1,), 1, 2048, False), 132)[0] == (1, 2048, 1)
    assert row_tiles(RowView("layer_norm", (2,), 128, 768, False), 132)[0][2] == 1


def test_rows_split_where_their_blocks_leave_sms_idle():
    from opfuse.fusion.tiles import row_slices, row_tiles

    b = Builder()
    few = b.op("mean", b.input("x", (2, 8, 64, 64)), dims=[2, 3], keepdim=True)     # 16 rows of 4096
    kernel = lower_reduction_group(b.graph, b.group([few]), "cpu")
    assert kernel.hw.sm_count == 132                      # the default profile's, an H200's
    assert row_slices(kernel.view, 64, 64, 132) == 32     # 1 program -> 32 slices of 128 lanes, 2 chunks each
    assert row_slices(kernel.view, 64, 256, 132) == 8
    assert row_tiles(kernel.view, 132)[0] == (16, 64, 32)  # chunks of 16 x 256 halved to 16 x 64 for more slices
    b = Builder()
    many = b.op("mean", b.input("x", (300, 64, 2, 2)), dims=[2, 3], keepdim=True)   # 19200 rows: no split
    assert row_slices(lower_reduction_group(b.graph, b.group([many]), "cpu").view, 64, 64, 132) == 1
    b = Builder()
    scan = b.op("cumsum", b.input("x", (2, 1 << 18)), dim=-1)               # a scan: never split
    kernel = lower_reduction_group(b.graph, b.group([scan]), "cpu")
    assert "SPLIT" not in kernel.source and kernel.alternatives() == []
    assert all(slices == 1 for _, _, slices in row_tiles(kernel.view, 132))


def test_mean_then_cast_float16():
    b = Builder("float16")
    y = b.op("mean", b.input("x", (2, 12, 3, 5)), dims=[2, 3], keepdim=False)
    _, (out,) = run_group(b, [b.op("cast", y, dtype="float32")])
    assert out.dtype == torch.float32


# ---- pools ------------------------------------------------------------------------------------------

def pool_attrs(kernel, stride, padding, ceil_mode=False):
    return dict(kernel_size=[kernel, kernel], stride=[stride, stride], padding=[padding, padding],
                ceil_mode=ceil_mode)


@pytest.mark.parametrize("size", [(9, 11), (8, 8)])
def test_max_pool_resnet_stem(size):
    b = Builder()
    y = b.op("max_pool2d", b.input("x", (2, 5) + size), dilation=[1, 1], **pool_attrs(3, 2, 1))
    kernel, (out,) = run_group(b, [y])
    assert isinstance(kernel, PoolKernel) and out.is_contiguous(memory_format=torch.channels_last)


def test_max_pool_dilation_ceil_mode_and_batch_norm_relu_prologue():
    b = Builder()
    x = b.input("x", (1, 6, 10, 9))
    stats = [b.const(name, tensor) for name, tensor in [
        ("weight", b.random(6)), ("bias", b.random(6)), ("mean", b.random(6)), ("var", b.random(6).abs() + 0.5)]]
    y = b.op("relu", b.op("batch_norm", x, *stats, eps=1e-5))
    y = b.op("max_pool2d", y, dilation=[2, 1], **pool_attrs(3, 2, 1, ceil_mode=True))
    run_group(b, [y])


@pytest.mark.parametrize("padding,ceil_mode,include_pad", [(1, False, True), (1, True, False), (0, True, True)])
def test_avg_pool(padding, ceil_mode, include_pad):
    b = Builder()
    y = b.op("avg_pool2d", b.input("x", (2, 7, 9, 8)), count_include_pad=include_pad,
             **pool_attrs(3, 2, padding, ceil_mode))
    run_group(b, [y])


def test_pool_relu_epilogue_float16():
    b = Builder("float16")
    y = b.op("avg_pool2d", b.input("x", (2, 36, 6, 6)), count_include_pad=True, **pool_attrs(2, 2, 0))
    run_group(b, [b.op("relu", b.op("add", y, b.input("skip", (2, 36, 3, 3))))])


def test_adaptive_pool_to_even_windows():
    b = Builder()
    y = b.op("adaptive_avg_pool2d", b.input("x", (2, 3, 4, 6)), output_size=[2, 3])
    kernel, _ = run_group(b, [y])
    assert isinstance(kernel, PoolKernel)


# ---- refusals ---------------------------------------------------------------------------------------

def test_unsupported_groups():
    b = Builder()
    y = b.op("softmax", b.op("softmax", b.input("x", (2, 8)), dim=-1), dim=-1)
    with pytest.raises(Unsupported, match="2 reductions"):
        lower_reduction_group(b.graph, b.group([y]), DEVICE)

    b = Builder()
    h = b.op("relu", b.input("x", (1, 2, 6, 6)))
    y = b.op("max_pool2d", h, dilation=[1, 1], **pool_attrs(3, 2, 1))
    with pytest.raises(Unsupported, match="prologue"):
        lower_reduction_group(b.graph, b.group([h, y]), DEVICE)

    b = Builder()
    y = b.op("adaptive_avg_pool2d", b.input("x", (1, 2, 5, 5)), output_size=[2, 2])
    with pytest.raises(Unsupported, match="uneven"):
        lower_reduction_group(b.graph, b.group([y]), DEVICE)


def test_groups_that_compute_the_same_share_one_kernel_and_one_tuning(tmp_path):
    """Two layer norms of one shape on other values with other weights (a transformer's 25): one source naming no
    value, one jitted function, and the second tuned from the first's cache entry; each computes its own result."""
    from opfuse.config import FusionConfig
    from opfuse.fusion.plan import FusionGroup
    from opfuse.runtime.autotune import tune
    from opfuse.runtime.cache import TuningCache

    b = Builder()
    norms = []
    for i in (1, 2):
        x = b.input(f"hidden_{i}", (3, 40))
        norms.append(b.op("layer_norm", x, b.const(f"gamma_{i}", 1 + b.random(40)), b.const(f"beta_{i}", b.random(40)),
                          normalized_shape=[40], eps=1e-5))
    b.graph.outputs = norms
    kernels = {}
    for i, norm in enumerate(norms):
        node = b.graph[norm]
        group = FusionGroup(i, GroupKind.SINGLE, [norm], inputs=list(node.inputs), outputs=[norm])
        kernels[group.name] = lower_reduction_group(b.graph, group, DEVICE)
    first, second = kernels.values()
    assert first.source == second.source and first.function.function is second.function.function
    assert not {"hidden_1", "gamma_1", "g0"} & set(re.findall(r"\w+", first.source))
    b.check(norms, [k.run([b.feeds[n].to(DEVICE) for n in k.runtime_inputs])[0] for k in (first, second)])

    timed = []

    def clock(fn):
        fn()
        timed.append(fn)
        return 1e-6 * len(timed)

    values = {name: b.feeds[name].to(DEVICE) for name in ("hidden_1", "hidden_2")}
    result = tune(kernels, values, FusionConfig(tune_top=None), TuningCache(tmp_path), benchmark=clock, quiet=True)
    assert result.from_cache == {second.group.name}
    assert len(timed) == len(first.configs()) and result[first.group.name] == result[second.group.name]


# ---- views after the reduction ------------------------------------------------------------------------

@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["one-pass", "looped"])
def test_a_layer_norm_writes_its_patches_folded_back_directly(config):
    """MobileViT: tokens [P, N, C] layer-normed, then viewed back to an image [1, C, H, W] through a reshape, a
    permute and a reshape (a copy in PyTorch): the kernel stores each element at the coordinates the views map its
    own to, a relu on the way computed there too; every element written (NaN-poisoned)."""
    b = Builder()
    tokens = b.input("tokens", (4, 6, 5), b.random(4, 6, 5))              # 4 patch positions, 6 patches, C = 5
    normed = b.op("layer_norm", tokens, normalized_shape=[5], eps=1e-5)
    split = b.op("reshape", normed, shape=[1, 2, 2, 2, 3, 5])
    moved = b.op("permute", split, dims=(0, 5, 3, 1, 4, 2))               # [1, C, 2, 2, 3, 2]
    image = b.op("reshape", b.op("relu", moved), shape=[1, 5, 4, 6])
    run_group(b, [image], config)


def test_a_node_reading_a_reduction_through_two_views_is_refused():
    from opfuse.fusion.legality import can_fuse
    from opfuse.fusion.reasons import Code

    b = Builder()
    normed = b.op("softmax", b.input("x", (4, 4), b.random(4, 4)), dim=1)
    both = b.op("add", b.op("permute", normed, dims=(1, 0)), normed)
    graph = b.graph
    graph.outputs = [both]
    nodes = [n.name for n in graph if n.op not in ("input", "constant")]
    reason = can_fuse(graph, nodes[:1], nodes[1:], graph.users())
    assert reason is not None and reason.code is Code.VIEW_AFTER_REDUCTION and "two views" in reason.text


@pytest.mark.parametrize("mode", ["layer_norm", "softmax", "mean", "amax"])
def test_split_rows_index_in_int64_where_the_kernel_does(monkeypatch, mode):
    """Past int32 offsets (forced here: every launch counts as past them) a split kernel's slice and slices index
    in int64 too, and the results are unchanged."""
    from opfuse.codegen import template_kernel

    monkeypatch.setattr(template_kernel, "INT32_LIMIT", 0)
    b = Builder()
    x = b.op("add", b.input("x", (2, 37), b.random(2, 37) * 3 + 5), b.input("r", (2, 37)))
    reduced = {"layer_norm": lambda: b.op("layer_norm", x, normalized_shape=[37], eps=1e-5),
               "softmax": lambda: b.op("softmax", x, dim=-1),
               "mean": lambda: b.op("mean", x, dims=[1], keepdim=True),
               "amax": lambda: b.op("amax", x, dims=[1], keepdim=True)}[mode]()
    config = KernelConfig.of(BLOCK_M=2, BLOCK_L=4, SPLIT=4, num_warps=1)
    kernel, _ = run_group(b, [reduced], config)
    assert kernel.launches(config) == 2 and kernel.last_compiled is not None
