"""Weight prefetch (FusionConfig.weight_prefetch; Hopper and later): which kernel asks L2 for its own weight early.

A kernel that streams a constant weight (a GEMM's packed B) waits a few microseconds before its stream is full
(t = 3.1 us + bytes / 2.9 TB/s for a decode step's GEMMs: RESULTS.md, session 33), and the light kernel before it
(a norm, a rotary embedding, decode attention) leaves device memory nearly idle while it runs. Launched dependently
(`opfuse.codegen.base.DEPENDENT_LAUNCH_CODE`), the weight-streaming kernel's programs start while that light kernel
runs and wait inside for it; before they wait, they ask L2 for the first bytes of their weight
(`opfuse.codegen.base.PREFETCH_CODE`, spread over all of the kernel's programs), so the weight streams in during the
light kernel and the GEMM's first loads hit L2. A weight is no kernel's output, so this reads nothing the kernel
before may still write. At most half the L2 is asked for, so what one prefetch brings is not pushed out by itself.

Light: moving (reading and writing, as the plan prices it) at most 1/LIGHT_SHARE of the bytes prefetched. Only a
kernel run in its Triton form prefetches, and only after a kernel of ours in its Triton form, which lets it start
early (a kernel of PyTorch's or a library's is waited for whole, so nothing would overlap it). (Session 35 had the
light kernel before prefetch the next weight instead: one program of a norm issuing 25 MB of prefetches took 52 us.)
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from opfuse.codegen.base import FORM_TRITON, KernelConfig
from opfuse.hardware import HardwareProfile

LIGHT_SHARE = 8


def prefetch_targets(steps: Sequence, configs: Mapping[str, KernelConfig], hw: HardwareProfile
                     ) -> dict[int, tuple[torch.Tensor, int]]:
    """{index of a step: (its own weight, how many of its first bytes to prefetch)} for `steps` (the compiled model's
    schedule: each with its group, and its kernel or None) run with `configs` (by group name)."""
    def in_triton(step) -> bool:
        config = configs.get(step.group.name)
        return step.kernel is not None and (config is None or config.form == FORM_TRITON)

    targets: dict[int, tuple[torch.Tensor, int]] = {}
    for index, step in enumerate(steps):
        weight = step.kernel.streamed_weight(configs.get(step.group.name)) if step.kernel is not None else None
        if weight is None or not in_triton(step):
            continue
        amount = min(weight.nbytes, hw.l2_bytes // 2) // 16 * 16     # bulk prefetches move 16-byte units
        before = next((steps[i] for i in range(index - 1, -1, -1) if steps[i].group.launches), None)
        if before is None or not in_triton(before) or amount <= 0:
            continue
        if (before.group.bytes_read + before.group.bytes_written) * LIGHT_SHARE <= amount:
            targets[index] = (weight, amount)
    return targets
