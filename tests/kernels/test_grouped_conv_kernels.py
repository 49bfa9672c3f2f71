"""Group-blocked grouped convolutions (BLOCK_G: one program computes G consecutive conv groups over a block-diagonal
packed weight) on Triton's interpreter.

Every config of a grouped conv's kernel, and block sizes the rule would not pick (so that the last block is padded
with groups that do not exist), must match torch.nn.functional.conv2d in float32 with every output element written
(outputs NaN-poisoned) and no channel read past the conv's input (its input is a channel slice of a tensor whose
other channels are NaN). The configs offer G > 1 exactly where a tile holds several groups' output channels.
Lowering copies the weight to the device once, as the default config's packing.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from opfuse.codegen.base import KernelConfig
from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.conv_implicit_gemm import ConvKernel, group_block_of, pack_conv_weight
from opfuse.codegen.forms import LIBRARY, UNFUSED, is_library, is_unfused
from opfuse.codegen.split_k import slices_of
from opfuse.config import FusionConfig
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.tiles import INTERPRETER, MAX_BLOCKED_CHANNELS, group_block, tile_key
from opfuse.hardware import get_hardware
from opfuse.runtime.autotune import tune
from opfuse.runtime.launch_records import record_launches
from tests.kernels.builders import rel_err
from tests.kernels.test_conv_kernels import Builder


INTERPRETER_BLOCKS = {k: INTERPRETER[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}


def with_block(config: KernelConfig, block: int) -> KernelConfig:
    return KernelConfig.of(config.num_warps, config.num_stages, **(dict(config.params) | {"BLOCK_G": block}))


def grouped_conv(groups: int, cin_per_group: int, cout_per_group: int, size=(6, 5), stride=1, padding=1,
                 dilation=1, residual: bool = False, batch: int = 2, group_changes=None, hw=None):
    """A grouped 3x3 conv + bias (+ residual) + relu as one group, lowered; its input a channel slice of a wider
    tensor whose other channels are NaN. Returns (builder, kernel, feeds, the float32 reference)."""
    b = Builder()
    cin, cout = groups * cin_per_group, groups * cout_per_group
    wide = torch.full((batch, cin + 5, *size), float("nan")).to(memory_format=torch.channels_last)
    wide[:, :cin] = b.random(batch, cin, *size)
    x = b.input("x", (batch, cin, *size), wide[:, :cin])
    y = b.conv(x, cout, 3, stride, padding, dilation, groups=groups)
    kind = GroupKind.ANCHOR_EPILOGUE
    if residual:
        h_out, w_out = b.graph[y].type.shape[2:]
        y = b.op("add", y, b.input("skip", (batch, cout, h_out, w_out)))
        kind = GroupKind.RESIDUAL
    y = b.op("relu", y)
    group = b.group([y], kind)
    if group_changes:
        group = replace(group, **group_changes)
    kernel = lower_conv_group(b.graph, group, "cpu", hw=hw)
    assert isinstance(kernel, ConvKernel)
    kernel.epilogue.output_fill = float("nan")
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    (conv,) = [n for n in b.graph if n.op == "conv2d"]
    weight, bias = (b.graph.constants[name] for name in conv.inputs[1:])
    expected = F.conv2d(b.feeds["x"], weight, bias, stride, padding, dilation, groups)
    if residual:
        expected = expected + b.feeds["skip"]
    return b, kernel, feeds, torch.relu(expected)


def assert_matches(got: torch.Tensor, expected: torch.Tensor, what) -> None:
    assert got.shape == expected.shape, what
    assert not torch.isnan(got).any(), f"{what}: unwritten (NaN) elements, or NaN channels read"
    assert rel_err(got, expected) < 1e-5, (what, rel_err(got, expected))


@pytest.mark.parametrize("groups,cin_per_group,cout_per_group,stride,padding,dilation,residual", [
    (3, 2, 4, 1, 1, 1, False),      # one block holds all three groups
    (5, 8, 2, 2, 1, 1, False),      # stride 2; 8 input channels a group: blocks of 2+ walk taps one by one
    (13, 3, 2, 1, 2, 2, False),     # dilation 2, 13 groups: the rule's 13, and padded blocks of 2 and 3
    (5, 4, 6, 2, 0, 1, True),       # stride 2 without padding, a residual add in the epilogue
])
def test_every_group_block_matches_conv2d(groups, cin_per_group, cout_per_group, stride, padding, dilation,
                                          residual):
    b, kernel, feeds, expected = grouped_conv(groups, cin_per_group, cout_per_group, stride=stride,
                                              padding=padding, dilation=dilation, residual=residual)
    configs = kernel.configs()
    blocks = {group_block_of(c) for c in configs}
    assert 1 in blocks and max(blocks) > 1
    tried = configs + [with_block(configs[0], g) for g in (2, 3) if g not in blocks]   # padded last blocks
    for config in tried:
        (out,) = kernel.run(feeds, config)
        assert out.is_contiguous(memory_format=torch.channels_last)
        assert_matches(out, expected, config)


def test_the_packed_weight_is_block_diagonal():
    """Column o holds its own group's weight in its group's rows of the block, zeros in the other groups' rows."""
    groups, cin_per_group, cout_per_group, block = 5, 3, 2, 2
    weight = torch.randn(groups * cout_per_group, cin_per_group, 3, 3)
    packed = pack_conv_weight(weight, groups, block).reshape(3, 3, block, cin_per_group, -1)
    for o in range(groups * cout_per_group):
        position = (o // cout_per_group) % block
        for p in range(block):
            want = weight[o].permute(1, 2, 0) if p == position else torch.zeros(3, 3, cin_per_group)
            assert torch.equal(packed[:, :, p, :, o], want), (o, p)
    assert torch.equal(pack_conv_weight(weight, groups), weight.permute(2, 3, 1, 0).reshape(-1, 10))


@pytest.mark.parametrize("groups,cout_per_group,cin_per_group,block_n,expected", [
    (1, 8, 8, 64, 1),          # one group: nothing to block
    (13, 8, 8, 64, 7),         # 8 fit in 64 columns: two blocks of 7 (6 + 7 real groups), not 8 and 5
    (55, 8, 8, 128, 14),       # 16 fit: four blocks of 14
    (32, 4, 4, 128, 32),       # all 32 groups in one 128-wide tile
    (6, 8, 8, 16, 2),          # two groups fill a 16-wide tile
    (32, 64, 64, 64, 1),       # a group fills the tile already
    (32, 40, 40, 64, 1),       # under two groups fit
    (13, 2, 100, 64, 2),       # wide input groups: at most MAX_BLOCKED_CHANNELS input channels a block
])
def test_group_block_rule(groups, cout_per_group, cin_per_group, block_n, expected):
    block = group_block(groups, cout_per_group, cin_per_group, block_n)
    assert block == expected
    if block > 1:
        assert block * cout_per_group <= block_n and block * cin_per_group <= MAX_BLOCKED_CHANNELS


def test_blocked_configs_are_offered_exactly_for_narrow_groups(monkeypatch):
    """With the GPU's tile list: every tile keeps its one-group-a-program config, with its blocked form beside it
    exactly where the tile holds two groups' output channels or more; none for an ungrouped or a wide-grouped conv."""
    for template in ("gemm", "conv_implicit_gemm"):     # the GPU's profile, not as the interpreter runs it
        monkeypatch.setattr(f"opfuse.codegen.{template}.kernel_profile", lambda hw=None: hw or get_hardware())
    _, kernel, _, _ = grouped_conv(13, 8, 20, size=(5, 5), batch=1)     # 25 pixels: tiles 32 to 128 wide
    configs = kernel.configs()
    plain = [c for c in configs if group_block_of(c) == 1]
    blocked = [c for c in configs if group_block_of(c) > 1]
    twins = set()
    for config in blocked:
        twin = KernelConfig.of(config.num_warps, config.num_stages,
                               **{k: v for k, v in config.params if k != "BLOCK_G"})
        assert abs(configs.index(twin) - configs.index(config)) == 1     # its tile unblocked, beside it
        assert group_block_of(config) == group_block(13, 20, 8, config["BLOCK_N"])
        twins.add(twin)
    assert twins == {c for c in plain if c["BLOCK_N"] >= 2 * 20}
    assert twins and len(twins) < len(plain)             # the 32-wide tiles hold one group of 20 channels
    for groups, cin_per_group, cout_per_group in ((1, 8, 8), (2, 4, 80)):    # ungrouped; groups wider than tiles
        _, kernel, _, _ = grouped_conv(groups, cin_per_group, cout_per_group)
        assert all(group_block_of(c) == 1 for c in kernel.configs())


def test_the_default_blocks_groups_only_where_the_blocked_grid_fills_the_gpu():
    few_sms = replace(get_hardware(), sm_count=2)
    _, kernel, feeds, expected = grouped_conv(13, 3, 2, hw=few_sms)
    assert group_block_of(kernel.configs()[0]) == 13 and group_block_of(kernel.configs()[1]) == 1
    assert list(kernel._packed) == [13]          # the default's weight, packed at build time
    assert_matches(kernel.run(feeds)[0], expected, "default")
    _, kernel, _, _ = grouped_conv(13, 3, 2)     # 132 SMs: one block of 13 groups would run on one of them
    assert group_block_of(kernel.configs()[0]) == 1 and list(kernel._packed) == [1]


class HostToDevice(TorchFunctionMode):
    """Records the shape of every tensor a torch function copies from the host to another device."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        if isinstance(source, torch.Tensor) and isinstance(out, torch.Tensor) and source.device.type == "cpu" \
                and out.device.type != "cpu":
            self.shapes.append(tuple(source.shape))
        return out


@pytest.mark.parametrize("sm_count, default_block", [(132, 1), (2, 8)])
def test_lowering_copies_the_weight_to_the_device_once(sm_count, default_block):
    """Once, for the default config's packing, whether it blocks groups or not (lowered for the `meta` device, so
    every copy off the host shows and nothing runs); another block size's packing is one copy more."""
    b = Builder()
    x = b.input("x", (2, 16, 6, 5))
    y = b.op("relu", b.conv(x, 32, 3, padding=1, groups=8))
    with HostToDevice() as copies:
        kernel = lower_conv_group(b.graph, b.group([y]), "meta", hw=replace(get_hardware(), sm_count=sm_count))
    assert isinstance(kernel, ConvKernel) and group_block_of(kernel.configs()[0]) == default_block
    weight_shape = (32, 2, 3, 3)
    assert copies.shapes.count(weight_shape) == 1
    assert [(block, w.device.type) for block, w in kernel._packed.items()] == [(default_block, "meta")]
    with HostToDevice() as copies:
        kernel.packed_weight(8 if default_block == 1 else 1)
    assert copies.shapes == [weight_shape]


def test_split_k_and_group_blocking_exclude_each_other():
    """A tile the plan splits gets no blocked form (a blocked config given anyway runs unsplit); a tile it leaves
    unsplit does, and the unsplit alternative is the one-group form's. Either runs in one launch."""
    few_sms = replace(get_hardware(), sm_count=2)
    key = tile_key(INTERPRETER)
    _, kernel, feeds, expected = grouped_conv(5, 8, 2, hw=few_sms, group_changes={"split_k": {key: 3}})
    (split,) = kernel.configs()
    assert group_block_of(split) == 1 and slices_of(split) == 3 and kernel.launches(split) == 1
    blocked = with_block(KernelConfig.of(split.num_warps, split.num_stages, **INTERPRETER_BLOCKS), 5)
    assert kernel.launches(blocked) == 1
    for config in (split, blocked):
        assert_matches(kernel.run(feeds, config)[0], expected, config)

    _, kernel, feeds, expected = grouped_conv(5, 8, 2, hw=few_sms, group_changes={"split_k": {key: 1}})
    blocked, plain = kernel.configs()
    assert group_block_of(blocked) == 5 and "SPLIT_K" not in dict(blocked.params) and kernel.launches(blocked) == 1
    assert group_block_of(plain) == 1 and slices_of(plain) == 1 and "SPLIT_K" in dict(plain.params)
    assert kernel.alternatives(library=False) == [plain]
    assert_matches(kernel.run(feeds, blocked)[0], expected, blocked)


def test_keep_form_frees_the_packed_weights_the_kept_config_does_not_run():
    _, kernel, feeds, expected = grouped_conv(5, 4, 2)
    configs = kernel.configs() + [with_block(kernel.configs()[0], 2)]
    results = {config: kernel.run(feeds, config)[0] for config in configs}
    assert sorted(kernel._packed) == sorted({group_block_of(c) for c in configs})
    kept = configs[-1]
    kernel.keep_form(kept)
    assert list(kernel._packed) == [2]
    kernel.keep_form(LIBRARY)                     # the library form runs cuDNN's own weight
    assert kernel._packed == {}
    assert_matches(kernel.run(feeds, LIBRARY)[0], expected, "library")
    for config in configs:                        # packed again on first use: the same bits
        assert torch.equal(kernel.run(feeds, config)[0], results[config])


def test_the_autotuner_times_blocked_and_unblocked_configs_beside_the_other_forms():
    """A fake clock that finds the blocked config fastest: the tuner picks it among the first tune_top configs,
    having timed the one-group form, the library form and the unfused form too."""
    _, kernel, feeds, _ = grouped_conv(5, 4, 2)
    ran = []
    run = kernel.run

    def recorded(inputs, config=None):
        ran.append(config)
        return run(inputs, config)

    kernel.run = recorded

    def clock(fn):
        fn()
        config = ran[-1]
        return 1e-6 if not (is_library(config) or is_unfused(config)) and group_block_of(config) > 1 else 5e-6

    values = dict(zip(kernel.runtime_inputs, feeds))
    result = tune({"g": kernel}, values, FusionConfig(tune_top=2), benchmark=clock, quiet=True)
    chosen = result[kernel.group.name]
    assert group_block_of(chosen) == group_block(5, 2, 4, INTERPRETER["BLOCK_N"]) > 1
    timed = set(result.timings[kernel.group.name])
    assert set(kernel.configs()[:2]) <= timed and UNFUSED in timed and any(is_library(c) for c in timed)


def test_precompile_records_the_launch_of_each_block_size():
    """Each block size is a launch of its own (its channels per program, and a gather loop or not)."""
    _, kernel, feeds, _ = grouped_conv(5, 4, 2)
    configs = kernel.configs() + [with_block(kernel.configs()[0], 2)]
    records = record_launches([(kernel, feeds, configs + configs)])
    assert len(records) == len({group_block_of(c) for c in configs}) == 3
    assert sorted(r.args[4:6] for r in records) == [(2, 4), (4, 8), (10, 20)]     # COUT_G, CIN_G of 1, 2, 5 groups
    assert {dict(r.kwargs)["K_GATHER"] for r in records} == {True, False}      # 20 channels fill a K block
