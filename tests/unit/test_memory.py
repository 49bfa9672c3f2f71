"""The memory pre-flight (`opfuse.runtime.memory`) counts what the build allocates: here, the block-diagonal packed
weights of group-blocked grouped convs (`opfuse.codegen.conv_implicit_gemm.pack_conv_weight`), against the kernels
the build makes.

The weights, inputs, intermediates and verification parts are tested in tests/unit/test_bad_inputs.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.codegen.base import FORM_TRITON
from opfuse.codegen.conv_implicit_gemm import ConvKernel, group_block_of
from opfuse.codegen.lower import lower_plan
from opfuse.ir.graph import GraphError
from opfuse.runtime.autotune import candidates
from opfuse.runtime.launch_records import record_launches
from opfuse.runtime.memory import check_memory, estimate_memory


def grouped_model() -> nn.Module:
    """A grouped 3x3 conv of 8 groups of 2 -> 4 channels (blocked: 8 groups fill the interpreter's 32-wide tile), a
    depthwise conv (its own kernel, no packing) and an ungrouped one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(16, 32, 3, padding=1, groups=8), nn.ReLU(),
                         nn.Conv2d(32, 32, 3, padding=1, groups=32), nn.ReLU(),
                         nn.Conv2d(32, 8, 3, padding=1)).eval()


def image() -> torch.Tensor:
    return torch.randn(2, 16, 16, 16)    # 512 pixels: 16 tiles of 32, one program per SM of an Orin


def conv_kernels(analysis) -> list[ConvKernel]:
    kernels, _ = lower_plan(analysis.plan, "cpu")
    return [k for k in kernels.values() if isinstance(k, ConvKernel)]


def extra_packed_bytes(kernels: list[ConvKernel]) -> int:
    """What the kernels' packed weights hold beyond one copy of each weight (which the weights part counts)."""
    return sum(sum(w.nbytes for w in k._packed.values()) - sum(w.nbytes for w in k.weights) for k in kernels)


@pytest.mark.parametrize("hardware, blocked_default", [("orin", True), ("h200", False)])
def test_the_estimate_counts_the_packings_the_build_holds(hardware, blocked_default):
    """Without tuning: the default config's packing (8 groups a program where its grid fills the 16 SMs of an Orin,
    one where an H200's 132 would idle). With tuning: the packing of every block size the tuner runs, all held while
    that kernel's configs run (the recording for the compile workers, then its tuning), freed before the next's."""
    config = opfuse.FusionConfig(dtype="float32", hardware=hardware, tune_top=2)
    x = image()
    analysis = opfuse.analyze(grouped_model(), (x,), config)
    kernels = conv_kernels(analysis)
    grouped = next(k for k in kernels if k.geometry.groups == 8)
    assert (group_block_of(grouped.configs()[0]) == 8) is blocked_default
    built = estimate_memory(analysis, (x,)).packed_weights
    assert built == extra_packed_bytes(kernels) == (7 * 32 * 2 * 9 * 4 if blocked_default else 0)

    jobs = []
    for kernel in kernels:    # as the tuner runs them: precompile's recording runs every candidate
        inputs = [torch.randn(analysis.plan.graph[name].type.shape).to(memory_format=torch.channels_last)
                  for name in kernel.runtime_inputs]
        jobs.append((kernel, inputs, candidates(kernel, config.tune_top, config.library_anchors)[1]))
    held = []
    keep_form = ConvKernel.keep_form

    def recorded(kernel, config):            # what each kernel holds when its recording is done
        held.append(extra_packed_bytes([kernel]))
        keep_form(kernel, config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ConvKernel, "keep_form", recorded)
        record_launches(jobs)
    assert {group_block_of(c) for c in jobs[kernels.index(grouped)][2] if c.form == FORM_TRITON} == {1, 8}
    tuned = estimate_memory(analysis, (x,), tuning=True).packed_weights
    assert max(held) == tuned == 8 * 32 * 2 * 9 * 4     # one packing per group and another of 8 groups a program
    assert extra_packed_bytes(kernels) == built         # then only the default config's


def test_check_memory_refuses_what_the_packed_weights_would_not_leave_room_for():
    """A limit that fits everything but the packings the build makes (an Orin's default config: 8 groups a
    program) is refused before any kernel is built; one that fits them too is not."""
    x = image()
    analysis = opfuse.analyze(grouped_model(), (x,), opfuse.FusionConfig(dtype="float32", hardware="orin"))
    estimate = estimate_memory(analysis, (x,))
    unpacked = estimate.weights + estimate.inputs + estimate.intermediates + estimate.verification
    packed = extra_packed_bytes(conv_kernels(analysis))
    assert packed > 0

    def limited(limit: int) -> opfuse.FusionConfig:
        return opfuse.FusionConfig(dtype="float32", hardware="orin", memory_limit=limit)

    with pytest.raises(GraphError, match="grouped convs' packed weights"):
        check_memory(analysis, (x,), "cpu", limited(unpacked + packed - 1))
    assert check_memory(analysis, (x,), "cpu", limited(unpacked + packed)).total == unpacked + packed


def test_tuning_counts_the_other_forms_of_the_largest_kernel_once():
    """While a kernel is tuned its library and unfused forms hold copies of its weights, one kernel at a time: the
    estimate adds twice the largest anchor group's constants, in the compute dtype, and only where it tunes."""
    x = image()
    analysis = opfuse.analyze(grouped_model(), (x,), opfuse.FusionConfig(dtype="float32"))
    graph = analysis.plan.graph
    largest = max(sum(graph.constants[n].numel() for n in g.inputs if n in graph.constants)
                  for g in analysis.plan.groups if g.anchor is not None)
    assert estimate_memory(analysis, (x,)).other_forms == 0
    tuned = estimate_memory(analysis, (x,), tuning=True)
    assert tuned.other_forms == 2 * 4 * largest > 0
    assert "the other forms of the kernel being tuned" in tuned.describe()


def test_the_spill_check_after_precompile_frees_what_it_packed():
    """After the workers' recording, tune() runs every kernel's first tune_top configs once more to see whether all
    spill (`next_configs`), re-packing each grouped conv's block sizes: each kernel frees them before the next, so
    what all kernels hold stays within the estimate (a review found it twice over with three grouped convs)."""
    from opfuse.hardware import get_hardware
    from opfuse.runtime.autotune import next_configs

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1, groups=8), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1, groups=8), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1, groups=8)).eval()
    config = opfuse.FusionConfig(dtype="float32", hardware="h200", tune_top=2)
    x = torch.randn(1, 16, 6, 6)
    analysis = opfuse.analyze(model, (x,), config)
    kernels = conv_kernels(analysis)
    jobs = [(kernel, [torch.randn(analysis.plan.graph[name].type.shape).to(memory_format=torch.channels_last)
                      for name in kernel.runtime_inputs], candidates(kernel, config.tune_top, True)[1])
            for kernel in kernels]
    record_launches(jobs)
    for kernel, inputs, _ in jobs:
        next_configs(kernel, inputs, get_hardware("h200"), config.tune_top)
    assert extra_packed_bytes(kernels) <= estimate_memory(analysis, (x,), tuning=True).packed_weights
    assert extra_packed_bytes(kernels) == estimate_memory(analysis, (x,)).packed_weights   # the defaults' alone
