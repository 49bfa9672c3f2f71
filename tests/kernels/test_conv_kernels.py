"""Conv anchor kernels (implicit GEMM, 1x1 as GEMM, depthwise) with fused epilogues, on Triton's interpreter.

Each test builds a tiny graph by hand, lowers it as one fusion group, runs the kernel on NaN-poisoned output
buffers and compares every group output with the IR reference interpreter run in float32.
"""

from __future__ import annotations

import pytest
import torch

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.conv_depthwise import DepthwiseConvKernel
from opfuse.codegen.conv_implicit_gemm import ConvKernel
from opfuse.codegen.expr import Unsupported
from opfuse.codegen.gemm import GemmKernel
from opfuse.fusion.plan import GroupKind

from tests.kernels.builders import KernelGraph


class Builder(KernelGraph):
    default_kind = GroupKind.ANCHOR_EPILOGUE

    def conv(self, x: str, cout: int, kernel: int | tuple[int, int] = 3, stride=1, padding=0, dilation=1,
             groups: int = 1, bias: bool = True) -> str:
        kh, kw = (kernel, kernel) if isinstance(kernel, int) else kernel
        cin = self.graph[x].type.shape[1]
        w = self.const("w", self.random(cout, cin // groups, kh, kw) * 0.3)
        inputs = [x, w] + ([self.const("b", self.random(cout))] if bias else [])
        return self.op("conv2d", *inputs, stride=_pair(stride), padding=_pair(padding),
                       dilation=_pair(dilation), groups=groups)


def _pair(v):
    return (v, v) if isinstance(v, int) else tuple(v)


def run_group(builder: Builder, outputs: list[str], kind: GroupKind = GroupKind.ANCHOR_EPILOGUE, lower=None):
    """Lower, run with poisoned outputs, check against the float32 reference; returns (kernel, results)."""
    lower = lower or lower_conv_group
    group = builder.group(outputs, kind)
    kernel = lower(builder.graph, group, "cpu")
    kernel.epilogue.output_fill = float("nan")
    results = kernel.run([builder.feeds[name] for name in kernel.runtime_inputs])
    builder.check(outputs, results)
    return kernel, results


@pytest.mark.parametrize("batch,cin,cout,hw,stride,padding,dilation", [
    (2, 5, 7, (6, 5), 1, 1, 1),      # 3x3 pad 1, channels not multiples of the block, non-square
    (1, 5, 7, (7, 6), 2, 1, 1),      # stride 2, batch 1
    (1, 4, 6, (9, 8), 1, 2, 2),      # dilation 2
    (2, 20, 9, (5, 4), 1, 1, 1),     # Cin >= BLOCK_K: the tap-by-tap loop with a channel tail
])
def test_conv_bias_relu(batch, cin, cout, hw, stride, padding, dilation):
    b = Builder()
    x = b.input("x", (batch, cin, *hw))
    y = b.op("relu", b.conv(x, cout, 3, stride, padding, dilation))
    kernel, (out,) = run_group(b, [y])
    assert isinstance(kernel, ConvKernel)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert kernel.name.startswith("fused_conv2d_relu_")
    from opfuse.codegen.base import recording_launches
    with recording_launches() as launches:
        kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    (record,) = launches
    rows = record.args[kernel.kernel.arg_names.index("M")]
    # few channels gather across taps, with a last tile of rows past M (they gather row M - 1's window)
    assert dict(record.kwargs)["K_GATHER"] == (cin < dict(record.kwargs)["BLOCK_K"]) and rows % 32 != 0


def test_conv_bias_relu6_non_square_kernel():
    b = Builder()
    x = b.input("x", (2, 3, 6, 7))
    y = b.op("clamp", b.conv(x, 5, (3, 1), stride=(2, 1), padding=(1, 0)), min=0.0, max=6.0)
    run_group(b, [y])


def test_grouped_conv_hardswish():
    b = Builder()
    x = b.input("x", (1, 6, 5, 5))
    y = b.op("hardswish", b.conv(x, 10, 3, padding=1, groups=2))
    kernel, _ = run_group(b, [y])
    assert isinstance(kernel, ConvKernel)


@pytest.mark.parametrize("stride,multiplier", [(1, 1), (2, 1), (2, 2)])
def test_depthwise(stride, multiplier):
    b = Builder()
    x = b.input("x", (2, 6, 7, 6))
    y = b.op("silu", b.conv(x, 6 * multiplier, 3, stride=stride, padding=1, groups=6))
    kernel, _ = run_group(b, [y])
    assert isinstance(kernel, DepthwiseConvKernel)


@pytest.mark.parametrize("stride,dilation", [(1, 1), (2, 2)])
def test_depthwise_row_loop(stride, dilation):
    """The filter rows in a loop (ROW_LOOP=1) compute what the unrolled taps do, on a 5x5 filter."""
    b = Builder()
    x = b.input("x", (2, 5, 9, 8))
    y = b.op("relu", b.conv(x, 5, 5, stride=stride, padding=2 * dilation, dilation=dilation, groups=5))
    kernel, (unrolled,) = run_group(b, [y])
    assert isinstance(kernel, DepthwiseConvKernel)
    (looped,) = kernel.run([b.feeds[name] for name in kernel.runtime_inputs],
                           KernelConfig.of(BLOCK_M=32, BLOCK_N=16, ROW_LOOP=1))
    b.check([y], [looped])
    torch.testing.assert_close(looped, unrolled, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k,stride,dilation,cols,width", [
    (3, 1, 1, 4, 7),      # a row of 7 outputs: one whole run and one cut at the row's end
    (5, 2, 1, 2, 9),      # stride 2: a run's outputs 2 input columns apart
    (7, 1, 1, 8, 6),      # a run longer than the row
    (3, 2, 2, 4, 11),     # dilation 2: each input column feeds every other tap
])
def test_depthwise_runs(k, stride, dilation, cols, width):
    """The runs form (COLS outputs along a row share their input columns) computes what the pixel tiles do, with a
    channel multiplier of 2 and rows that do not divide into runs."""
    b = Builder()
    x = b.input("x", (2, 5, 6, width))
    y = b.op("relu", b.conv(x, 10, k, stride=stride, padding=(k // 2) * dilation, dilation=dilation, groups=5))
    kernel, (direct,) = run_group(b, [y])
    assert isinstance(kernel, DepthwiseConvKernel)
    (runs,) = kernel.run([b.feeds[name] for name in kernel.runtime_inputs],
                         KernelConfig.of(BLOCK_M=16, BLOCK_N=8, COLS=cols))
    b.check([y], [runs])
    torch.testing.assert_close(runs, direct, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("norm,stride", [("layer_norm", 1), ("rms_norm", 2)])
def test_depthwise_conv_normalizes_its_channels_in_its_epilogue(norm, stride):
    """ConvNeXt's depthwise conv -> permute -> layer norm (and an RMS norm), then GELU and a store channels-last, as one
    kernel whose tiles span every channel: 12 channels in a 16-wide tile (masked lanes stay out of the statistics),
    pixels past the last row, the pixel tile (unrolled, in a row loop) and the runs form alike; a tile narrower than
    the channels is refused."""
    b = Builder()
    x = b.input("x", (2, 12, 7, 9))
    rows = b.op("permute", b.conv(x, 12, 5, stride=stride, padding=2, groups=12), dims=[0, 2, 3, 1])
    weight = b.const("nw", b.random(12) * 0.5 + 1.0)
    if norm == "layer_norm":
        normed = b.op("layer_norm", rows, weight, b.const("nb", b.random(12)), normalized_shape=[12], eps=1e-6)
    else:
        normed = b.op("rms_norm", rows, weight, eps=1e-6)
    y = b.op("gelu", normed)
    kernel, (direct,) = run_group(b, [y])
    assert isinstance(kernel, DepthwiseConvKernel) and kernel.epilogue.whole_rows
    assert all(c["BLOCK_N"] >= 12 for c in kernel.configs()) and kernel.library_anchor is None
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    for config in (KernelConfig.of(BLOCK_M=8, BLOCK_N=16, ROW_LOOP=1), KernelConfig.of(BLOCK_M=16, BLOCK_N=16, COLS=4)):
        (out,) = kernel.run(feeds, config)
        b.check([y], [out])
        torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-5)
    with pytest.raises(Unsupported, match="all 12 channels"):
        kernel.run(feeds, KernelConfig.of(BLOCK_M=32, BLOCK_N=8, ROW_LOOP=0))


def test_whole_row_depthwise_tiles_span_the_channels_with_as_many_elements():
    """With a norm in the epilogue every depthwise candidate spans the channels (ConvNeXt's 96 to 768) and keeps
    its elements per program, at least one run of outputs."""
    from opfuse.codegen.conv_depthwise import depthwise_configs

    for channels in (96, 768):
        plain = depthwise_configs(3136, channels, sm_count=132, taps=49, width=56)
        whole = depthwise_configs(3136, channels, sm_count=132, taps=49, width=56, whole_rows=True)
        width = 1 << (channels - 1).bit_length()
        assert whole and all(c["BLOCK_N"] == width for c in whole)
        assert {c["BLOCK_M"] * c["BLOCK_N"] for c in whole} <= {max(c["BLOCK_M"] * c["BLOCK_N"],
                                                                    dict(c.params).get("COLS", 1) * width)
                                                                for c in plain}
        assert all(c["BLOCK_M"] >= dict(c.params).get("COLS", 1) for c in whole)


def test_depthwise_row_loop_where_taps_overflow_registers():
    """A tile whose unrolled taps would not fit a thread's 255 registers loops over the filter rows; a 3x3 filter
    and small tiles of a 7x7 one stay unrolled."""
    from opfuse.codegen.conv_depthwise import depthwise_configs
    from opfuse.fusion.tiles import unrolled_tap_registers

    for taps in (9, 25, 49):
        configs = [c for c in depthwise_configs(64 * 56 * 56, 96, sm_count=132, taps=taps) if "COLS" not in dict(c.params)]
        for config in configs:
            tile = dict(config.params, num_warps=config.num_warps)
            assert config["ROW_LOOP"] == int(unrolled_tap_registers(tile, taps, 2) > 255)
        looped = {(c["BLOCK_M"], c["BLOCK_N"]) for c in configs if c["ROW_LOOP"]}
        if taps == 9:
            assert not looped
        else:
            assert (128, 32) in looped and (16, 32) not in looped
    assert unrolled_tap_registers({"num_warps": 4, "BLOCK_M": 128, "BLOCK_N": 32}, 49, 2) > 255


@pytest.mark.parametrize("stride", [1, 2])
def test_pointwise_conv_is_a_gemm(stride):
    b = Builder()
    x = b.input("x", (2, 5, 5, 6))
    y = b.op("gelu", b.conv(x, 7, 1, stride=stride))
    kernel, _ = run_group(b, [y])
    assert isinstance(kernel, GemmKernel)


@pytest.mark.parametrize("residual_layout", ["nhwc", "nchw"])
def test_residual_add_relu(residual_layout):
    b = Builder()
    x = b.input("x", (2, 5, 6, 6))
    skip = b.random(2, 7, 6, 6)
    if residual_layout == "nhwc":
        skip = skip.to(memory_format=torch.channels_last)
    s = b.input("skip", (2, 7, 6, 6), skip)
    y = b.op("relu", b.op("add", b.conv(x, 7, 3, padding=1), s))
    run_group(b, [y], GroupKind.RESIDUAL)


def test_conv_output_also_stored_and_batch_norm_epilogue():
    """A group with two outputs (the conv itself is read outside) and an unfolded batch norm."""
    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    c = b.conv(x, 6, 3, padding=1, bias=False)
    params = [b.const("bn_w", b.random(6)), b.const("bn_b", b.random(6)), b.const("bn_m", b.random(6)),
              b.const("bn_v", b.random(6).abs() + 0.5)]
    bn = b.op("batch_norm", c, *params, eps=1e-5)
    y = b.op("mul", b.op("sigmoid", bn), b.const("scale", b.random(1, 6, 1, 1)))
    y = b.op("sub", y, b.const("shift", torch.tensor(0.25)))
    run_group(b, [c, y])


def test_cast_to_float16_output():
    b = Builder()
    x = b.input("x", (1, 3, 5, 5))
    y = b.op("cast", b.op("relu", b.conv(x, 4, 3, padding=1)), dtype="float16")
    _, (out,) = run_group(b, [y])
    assert out.dtype == torch.float16


def test_channel_slice_view_input():
    b = Builder()
    wide = b.random(2, 9, 5, 5).to(memory_format=torch.channels_last)
    view = wide[:, 2:7]                      # 5 channels out of 9: a strided view, not a copy
    x = b.input("x", (2, 5, 5, 5), view)
    y = b.op("relu", b.conv(x, 6, 3, padding=1))
    run_group(b, [y])
    b2 = Builder()
    x2 = b2.input("x", (2, 5, 5, 5), view)
    y2 = b2.op("relu", b2.conv(x2, 6, 1))
    kernel, _ = run_group(b2, [y2])
    assert isinstance(kernel, GemmKernel)


@pytest.mark.parametrize("kernel_size,groups,kind", [(1, 1, GemmKernel), (3, 1, ConvKernel),
                                                      (3, 24, DepthwiseConvKernel)])
def test_channels_in_multiples_of_8_launch_in_units_of_8(kernel_size, groups, kind):
    """24 channels: Triton knows no integer of the launch as a multiple of 16, so the launcher passes UNIT, the
    largest power of two dividing every channel count and row stride the kernel rebinds (8), and the kernel's
    result is the reference's; read through a channel-slice view whose pixels are 36 channels apart, 4."""
    from opfuse.codegen.base import recording_launches

    for width, unit in ((24, 8), (36, 4)):
        b = Builder()
        wide = b.random(2, width, 5, 5).to(memory_format=torch.channels_last)
        x = b.input("x", (2, 24, 5, 5), wide[:, :24])
        skip = b.input("skip", (2, 24, 5, 5), b.random(2, 24, 5, 5).to(memory_format=torch.channels_last))
        y = b.op("relu", b.op("add", b.conv(x, 24, kernel_size, padding=kernel_size // 2, groups=groups), skip))
        kernel, _ = run_group(b, [y], GroupKind.RESIDUAL)
        assert isinstance(kernel, kind)
        assert "    N = N // UNIT * UNIT" in kernel.source or "N_TOTAL = N_TOTAL // UNIT * UNIT" in kernel.source
        with recording_launches() as launches:
            kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
        assert [dict(record.kwargs)["UNIT"] for record in launches] == [unit]


def test_float16_conv():
    b = Builder("float16")
    x = b.input("x", (2, 5, 6, 6))
    y = b.op("relu", b.conv(x, 7, 3, padding=1))
    _, (out,) = run_group(b, [y])
    assert out.dtype == torch.float16


def test_horizontal_3x3_convs_return_views():
    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    y1 = b.op("relu", b.conv(x, 3, 3, padding=1))
    y2 = b.op("relu", b.conv(x, 5, 3, padding=1, bias=False))
    kernel, (o1, o2) = run_group(b, [y1, y2], GroupKind.HORIZONTAL)
    assert isinstance(kernel, ConvKernel)
    assert o1.untyped_storage().data_ptr() == o2.untyped_storage().data_ptr()


def test_unsupported_cases():
    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    w = b.input("w", (6, 4, 3, 3))
    y = b.op("relu", b.op("conv2d", x, w, stride=(1, 1), padding=(1, 1), dilation=(1, 1), groups=1))
    with pytest.raises(Unsupported, match="weight is not a constant"):
        lower_conv_group(b.graph, b.group([y]), "cpu")

    b = Builder()
    x = b.input("x", (1, 4, 5, 5))
    y = b.op("softmax", b.conv(x, 6, 3, padding=1), dim=1)
    with pytest.raises(Unsupported, match="not elementwise"):
        lower_conv_group(b.graph, b.group([y]), "cpu")


def test_depthwise_tiles_fill_the_gpu_first():
    """A layer the measured tiles fill keeps their order; one too small for them (ConvNeXt's last stage at batch 1:
    49 pixels x 768 channels) gets the tiles with the most programs first."""
    from opfuse.codegen.conv_depthwise import depthwise_configs
    from opfuse.fusion.tiles import DEPTHWISE, DEPTHWISE_RUNS

    DEPTHWISE_CONFIGS = [KernelConfig.of(**t) for t in DEPTHWISE]
    DEPTHWISE_RUN_CONFIGS = [KernelConfig.of(**t) for t in DEPTHWISE_RUNS]

    def programs(config, m, n):
        return -(-m // config["BLOCK_M"]) * -(-n // config["BLOCK_N"])

    def tiles(configs):
        return [(c["BLOCK_M"], c["BLOCK_N"], c.num_warps) for c in configs]

    large = depthwise_configs(64 * 112 * 112, 96, sm_count=132)
    assert large[:len(DEPTHWISE_RUN_CONFIGS)] == DEPTHWISE_RUN_CONFIGS       # the runs form first
    assert tiles(large[len(DEPTHWISE_RUN_CONFIGS):][:len(DEPTHWISE_CONFIGS)]) == tiles(DEPTHWISE_CONFIGS)
    small = depthwise_configs(49, 768, sm_count=132)
    assert sorted(small, key=str) == sorted(large, key=str)        # the same candidates, reordered
    counts = [programs(c, 49, 768) for c in small]
    assert counts == sorted(counts, reverse=True) and counts[0] > programs(DEPTHWISE_CONFIGS[0], 49, 768)
    mixed = depthwise_configs(3136, 96, sm_count=132)
    filling = [programs(c, 3136, 96) >= 132 for c in mixed]
    assert filling == sorted(filling, reverse=True) and any(filling) and not all(filling)
    # ShuffleNet's 58 channels: the 128-channel tiles, mostly past the output's edge, come after those that fit
    narrow = depthwise_configs(64 * 28 * 28, 58, sm_count=132)
    wide = [c["BLOCK_N"] == 128 for c in narrow]
    assert wide == sorted(wide) and any(wide)
    assert [c for c in narrow if c["BLOCK_N"] < 128] == [c for c in large if c["BLOCK_N"] < 128]


def test_depthwise_source_holds_every_form_it_may_run(monkeypatch):
    """A depthwise kernel's source (what the tuning cache and a package compare) holds its runs forms' sources
    where its candidates run them, so a change to the runs template alone is noticed."""
    from opfuse.codegen import conv, conv_depthwise
    from opfuse.hardware import get_hardware

    b = Builder()
    x = b.input("x", (1, 4, 5, 16))
    y = b.conv(x, 4, 3, padding=1, groups=4)
    direct = conv.lower_conv_group(b.graph, b.group([y]), "cpu")
    assert "dw_acc" not in direct.source                  # the interpreter's one candidate is a pixel tile
    monkeypatch.setattr(conv_depthwise, "kernel_profile", lambda hw=None: hw or get_hardware())   # the GPU's tiles
    runs = conv.lower_conv_group(b.graph, b.group([y]), "cpu")
    lengths = sorted({dict(c.params).get("COLS", 1) for c in runs.configs()} - {1})
    assert lengths == [4, 8] and runs.source.startswith(direct.source)
    assert runs.source.count("\ndef fused_") == 3 and "dw_acc7" in runs.source
    monkeypatch.setattr(conv_depthwise, "DEPTHWISE_RUNS_TEMPLATE",
                        conv_depthwise.DEPTHWISE_RUNS_TEMPLATE.replace("# run of", "# a run of"))
    assert conv.lower_conv_group(b.graph, b.group([y]), "cpu").source != runs.source


def test_depthwise_runs_only_where_rows_hold_them():
    """Runs of COLS outputs are candidates where a row's runs are mostly outputs: 7-wide rows take runs of 8 and 4,
    3-wide rows runs of 4 only, 1-wide rows none; a run length that is no power of two is refused."""
    from opfuse.codegen.conv_depthwise import depthwise_configs

    def run_lengths(width):
        configs = depthwise_configs(64 * 7 * width, 768, sm_count=132, taps=49, width=width)
        return {dict(c.params).get("COLS", 1) for c in configs}

    assert run_lengths(7) == {1, 4, 8} and run_lengths(3) == {1, 4} and run_lengths(1) == {1}
    b = Builder()
    x = b.input("x", (1, 4, 5, 6))
    y = b.conv(x, 4, 3, padding=1, groups=4)
    kernel, _ = run_group(b, [y])
    with pytest.raises(Unsupported, match="power of two"):
        kernel.run([b.feeds[name] for name in kernel.runtime_inputs], KernelConfig.of(BLOCK_M=24, BLOCK_N=8, COLS=6))


@pytest.mark.parametrize("kernel_size,groups,kind", [(1, 1, GemmKernel), (3, 1, ConvKernel),
                                                      (3, 6, DepthwiseConvKernel)])
def test_row_counts_launch_in_row_units_only_where_a_tensor_runs_along_the_rows(kernel_size, groups, kind):
    """Triton does not specialise the templates' row count on 16 dividing it (`rows_jit`): only a tensor
    contiguous along the rows (here an NCHW residual, row stride 1) is accessed wider for knowing it, so there the
    launcher passes ROW_UNIT 16 where 16 divides the row count, and 1 elsewhere; the kernel's result is the
    reference's either way."""
    from opfuse.codegen.base import recording_launches

    for (batch, side), skip_layout, unit in (((2, 4), "nchw", 16), ((1, 6), "nchw", 1), ((2, 4), "nhwc", 1)):
        b = Builder()
        x = b.input("x", (batch, 6, side, side))
        skip = b.random(batch, 6, side, side)
        if skip_layout == "nhwc":
            skip = skip.to(memory_format=torch.channels_last)
        s = b.input("skip", (batch, 6, side, side), skip)
        y = b.op("relu", b.op("add", b.conv(x, 6, kernel_size, padding=kernel_size // 2, groups=groups), s))
        kernel, _ = run_group(b, [y], GroupKind.RESIDUAL)
        assert isinstance(kernel, kind) and "do_not_specialize_on_alignment=['M']" in kernel.source
        with recording_launches() as launches:
            kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
        assert [dict(record.kwargs)["ROW_UNIT"] for record in launches] == [unit], (batch, side, skip_layout)


def test_a_plan_folds_the_row_counts_of_a_kernel_only_where_it_launches_both_kinds():
    """Inside `folding_rows` (how `lower_plan` builds a plan's kernels) one conv source built for 4x4 images (16
    rows) and for 3x3 (9) folds its row counts: its decorator leaves them unspecialised, one compile. Another whose
    groups all have rows 16 divides (4x4, 8x8) launches a copy of its module with a plain `triton.jit`, which
    Triton specialises on them as before folding; a kernel built outside any plan folds. Every launch passes
    ROW_UNIT 1 (no tensor runs along the rows) and every result is the reference's."""
    from pathlib import Path

    from opfuse.codegen.base import folding_rows, recording_launches, rows_jit

    def build(side: int, relu: bool) -> tuple[Builder, object, str]:
        b = Builder()
        y = b.conv(b.input("x", (1, 6, side, side)), 6, 3, padding=1)
        y = b.op("relu", y) if relu else y
        return b, lower_conv_group(b.graph, b.group([y]), "cpu"), y

    def row_unit(built) -> int:
        b, kernel, y = built
        kernel.epilogue.output_fill = float("nan")
        b.check([y], kernel.run([b.feeds[name] for name in kernel.runtime_inputs]))
        with recording_launches() as launches:
            kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
        (record,) = launches
        return dict(record.kwargs)["ROW_UNIT"]

    with folding_rows():
        mixed = [build(4, relu=True), build(3, relu=True)]
        aligned = [build(4, relu=False), build(8, relu=False)]
    alone = build(4, relu=False)
    assert mixed[0][1].kernel.function is mixed[1][1].kernel.function          # one source, one jitted function
    assert aligned[0][1].kernel.function is aligned[1][1].kernel.function
    decorated = {name: rows_jit(["M"]) in Path(built[1].kernel.path).read_text()
                 for name, built in (("mixed", mixed[0]), ("aligned", aligned[0]), ("alone", alone))}
    assert decorated == {"mixed": True, "aligned": False, "alone": True}
    assert aligned[0][1].kernel.path != alone[1].kernel.path and aligned[0][1].kernel.name == alone[1].kernel.name
    assert [row_unit(k) for k in (*mixed, *aligned, alone)] == [1] * 5
