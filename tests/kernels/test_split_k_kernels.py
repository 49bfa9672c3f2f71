"""Split-K anchor kernels on the interpreter: K slices store fp32 partial tiles, the last slice of each tile sums
them in slice order and runs the epilogue, in one launch; the tiles' counts are back at zero after each. Every config (including uneven and empty slices) must match the float32 reference and
the unsplit kernel, write every output element (NaN-poisoned), and give identical results run after run."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from opfuse.codegen.base import KernelConfig, recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.conv_implicit_gemm import ConvKernel
from opfuse.codegen.forms import is_unfused
from opfuse.codegen.split_k import slices_of
from opfuse.codegen.gemm import GemmKernel, lower_gemm_group
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.tiles import INTERPRETER, split_k_slices, tile_key
from tests.kernels.test_conv_kernels import Builder
from tests.kernels.test_gemm_kernels import linear


# a plan's split-K decision for the interpreter's tile (`FusionGroup.split_k`), made by hand
PLANNED = {tile_key(INTERPRETER): 4}


def run_split(b: Builder, outputs: list[str], lower, kind: GroupKind = GroupKind.ANCHOR_EPILOGUE):
    """The group lowered as the planner's split-K group; run with each config, then with explicit slice counts."""
    group = replace(b.group(outputs, kind), split_k=PLANNED)
    kernel = lower(b.graph, group, "cpu")
    kernel.epilogue.output_fill = float("nan")
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    base = kernel.configs()[0]
    assert slices_of(base) == 4, base          # the slices the plan gives the interpreter's tile
    unsplit = None
    for slices in (slices_of(base), 1, 3, 7):   # the planned count, none, uneven slices, more slices than needed
        config = KernelConfig.of(base.num_warps, base.num_stages, **(dict(base.params) | {"SPLIT_K": slices}))
        results = kernel.run(feeds, config)
        b.check(outputs, results)
        if slices == 1:
            unsplit = results
        if slices > 1:
            assert not kernel.split.counts.tensor.any(), "a tile's arrival count was left for the next launch"
        again = kernel.run(feeds, config)
        assert all(torch.equal(x, y) for x, y in zip(results, again)), "split-K results changed between runs"
    return kernel, unsplit


def test_linear_split_k_with_bias_relu_and_residual():
    b = Builder()
    x = b.input("x", (3, 520))                 # K = 520: 33 blocks of 16, the last one partial
    r = b.input("r", (3, 24))
    y = b.op("relu", b.op("add", linear(b, x, 24), r))
    kernel, _ = run_split(b, [y], lower_gemm_group, GroupKind.RESIDUAL)
    assert isinstance(kernel, GemmKernel) and kernel.split is not None
    # 24 columns, K = 520: one launch, in units of 8 (`opfuse.codegen.base.unit_of`)
    with recording_launches() as launches:
        kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    assert [(record.function.split("_")[0], dict(record.kwargs)["UNIT"]) for record in launches] == [("splitk", 8)]



def test_split_kernels_make_their_arrival_counts_when_built():
    """The tiles' arrival counts exist, zero, as soon as the kernel is built (never first made inside a CUDA graph
    capture, which would zero them only at replay), sized for its split configs' tiles; a launch of more tiles than
    they were made for is an error, not a race."""
    b = Builder()
    x = b.input("x", (3, 520))
    kernel = lower_gemm_group(b.graph, replace(b.group([b.op("relu", linear(b, x, 24))]), split_k=PLANNED), "cpu")
    counts = kernel.split.counts.tensor
    assert counts.numel() >= 1 and not counts.any()
    config = kernel.configs()[0]
    assert counts.numel() == kernel._tiles(config) and slices_of(config) > 1
    with pytest.raises(ValueError, match="tiles on cpu, counts made for"):
        kernel.split.counts.of(counts.numel() + 1, torch.device("cpu"), kernel.name)
    kernel.run([b.feeds["x"]], config)
    assert kernel.split.counts.tensor is counts and not counts.any()

def test_linear_split_k_two_outputs():
    """An epilogue that stores two values (the pre-activation is read outside the group too)."""
    b = Builder()
    x = b.input("x", (2, 5, 300))
    pre = linear(b, x, 18)
    run_split(b, [pre, b.op("gelu", pre)], lower_gemm_group)


def test_horizontal_linears_split_k_with_per_sibling_epilogues():
    """Sibling linears on one input (q, k, v style), their columns concatenated, outputs handed on as views."""
    b = Builder()
    x = b.input("x", (2, 400))
    ys = [b.op("relu", b.op("mul", linear(b, x, n), b.const("s", b.random(n)))) for n in (5, 9)]
    kernel, outs = run_split(b, ys, lower_gemm_group, GroupKind.HORIZONTAL)
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()


def test_batched_matmul_split_k():
    b = Builder()
    a = b.input("a", (2, 3, 4, 400))
    m = b.input("m", (2, 3, 400, 9))
    run_split(b, [b.op("mul", b.op("matmul", a, m), b.const("s", torch.tensor(0.5)))], lower_gemm_group)


@pytest.mark.parametrize("cin,groups,kernel_size,stride", [
    (40, 1, 3, 2),     # tap-by-tap loop (Cin >= BLOCK_K) with a channel tail, stride 2
    (6, 1, 7, 2),      # the gather loop (few input channels): taps x channels in BLOCK_K blocks
    (40, 2, 3, 1),     # grouped: slices and conv groups on two grid axes
])
def test_conv_split_k_with_bias_relu(cin, groups, kernel_size, stride):
    b = Builder()
    x = b.input("x", (1, cin, 9, 7))
    y = b.op("relu", b.conv(x, 10, kernel_size, stride, kernel_size // 2, groups=groups))
    kernel, (out,) = run_split(b, [y], lower_conv_group)
    assert isinstance(kernel, ConvKernel) and kernel.split is not None
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_pointwise_conv_split_k_runs_as_gemm_with_residual():
    b = Builder()
    x = b.input("x", (1, 300, 3, 3))
    r = b.input("r", (1, 12, 3, 3))
    y = b.op("add", b.conv(x, 12, 1, padding=0), r)
    kernel, _ = run_split(b, [y], lower_conv_group, GroupKind.RESIDUAL)
    assert isinstance(kernel, GemmKernel)


def test_split_kernels_offer_their_unsplit_form_to_the_autotuner():
    b = Builder()
    x = b.input("x", (3, 520))
    # an epilogue (GELU) to run: a bare linear's library form has no epilogue kernel, nor a ReLU's fused one
    kernel = lower_gemm_group(b.graph, replace(b.group([b.op("gelu", linear(b, x, 24))]), split_k=PLANNED), "cpu")
    unsplit, *library, unfused = kernel.alternatives(library=True)
    assert library and all(kernel.launches(c) == 2 for c in library) and is_unfused(unfused)
    assert slices_of(kernel.configs()[0]) > 1 and slices_of(unsplit) == 1 and kernel.launches(unsplit) == 1
    assert dict(unsplit.params) == dict(kernel.configs()[0].params) | {"SPLIT_K": 1}
    b.check([kernel.group.outputs[0]], kernel.run([b.feeds["x"]], unsplit))
    for config in library:      # the library form's epilogue is the split form's reduce kernel
        b.check([kernel.group.outputs[0]], kernel.run([b.feeds["x"]], config))
    assert kernel._library_epilogue is kernel.split


def test_unsplit_groups_keep_one_kernel_and_configs_without_slices():
    b = Builder()
    x = b.input("x", (3, 520))
    group = b.group([linear(b, x, 24)])
    kernel = lower_gemm_group(b.graph, group, "cpu")
    assert kernel.split is None and all(slices_of(c) == 1 for c in kernel.configs())


@pytest.mark.parametrize("programs,steps,sms,expected", [
    (132, 100, 132, 1),     # the tiles fill the GPU
    (40, 100, 132, 1),      # over a quarter of the SMs busy already
    (8, 12, 132, 1),        # a short reduction
    (8, 96, 132, 16),       # few tiles, long reduction: as many slices as fill the SMs, at most 16
    (20, 40, 132, 7),       # ceil(132 / 20) = 7 slices of 6 steps (the last one 4)
    (30, 17, 132, 4),       # 17 steps allow 4 slices of at least 4 steps: 5, 5, 5, 2
])
def test_split_k_slices(programs, steps, sms, expected):
    slices = split_k_slices(programs, steps, sms)
    assert slices == expected
    if slices > 1:
        per_slice = -(-steps // slices)
        assert (slices - 1) * per_slice < steps <= slices * per_slice    # no empty slice


def test_compile_with_split_k_matches_eager_in_one_launch():
    import opfuse
    from opfuse.config import FusionConfig

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)).eval()
    x = torch.randn(2, 600)
    plain = opfuse.compile(model, (x,), FusionConfig(autotune=False, split_k=False))
    split = opfuse.compile(model, (x,), FusionConfig(autotune=False))     # on by default
    assert not any(g.split_k for g in plain.plan.groups)
    (group,) = [g for g in split.plan.groups if g.split_k]      # the 600-deep linear, not the 24-deep one
    # the interpreter's tiny tile walks 38 K blocks and splits, in one launch
    assert slices_of(split.compiled.configs[group.name]) > 1
    assert split.launches == plain.launches and split.compiled.kernels[group.name].launches() == 1
    # the plan counts what a GPU's default tile launches: 5 K blocks of 128, no split
    assert group.launches == 1 and "split-K offered" in group.reason and "5 K blocks" in group.reason
    assert split.plan.kernel_launches == plain.plan.kernel_launches
    assert split.analysis.fused.kernel_launches == split.plan.kernel_launches     # what `opfuse analyze` prints
    assert all(check.passed for check in split.checks)
    with torch.no_grad():
        torch.testing.assert_close(split(x), model(x), rtol=1e-4, atol=1e-5)


def test_split_k_slices_apply_the_prologue_to_their_own_tiles():
    """The SE scale before a long 1x1 conv: each K slice scales the tiles it loads."""
    b = Builder()
    x = b.input("x", (2, 300, 3, 3))
    scaled = b.op("mul", x, b.input("s", (2, 300, 1, 1)))
    kernel, _ = run_split(b, [b.op("relu", b.conv(scaled, 9, 1))], lower_conv_group)
    assert kernel.prologue is not None


def test_a_split_kernels_source_holds_its_slices_and_reduce_kernels():
    """The tuning cache and a package key a kernel by its `source`: a split-K anchor's holds the sliced kernel and
    the reduce kernel it runs too, so a change to either is a new kernel, not a stale cached choice."""
    b = Builder()
    x = b.input("x", (3, 520))
    y = b.op("relu", linear(b, x, 24))
    split = lower_gemm_group(b.graph, replace(b.group([y], GroupKind.ANCHOR_EPILOGUE), split_k=PLANNED), "cpu")
    whole = lower_gemm_group(b.graph, b.group([y], GroupKind.ANCHOR_EPILOGUE), "cpu")
    assert split.split is not None and whole.split is None
    assert f"def {split.split.name}(" in split.source and f"def {split.split.reduce_name}(" in split.source
    assert split.source.startswith(whole.source) and f"def {split.split.name}(" not in whole.source
