"""Prefetch ahead (FusionConfig.weight_prefetch; Hopper and later): which kernel asks L2 for which weight.

A kernel that streams a constant weight (a GEMM's packed B) waits a few microseconds before its stream is full
(t = 3.1 us + bytes / 2.9 TB/s for a decode step's GEMMs: RESULTS.md, session 33), and the small kernels between
two such kernels (a norm, a rotary embedding, decode attention) leave device memory nearly idle. So the first of
the light kernels before a weight-streaming kernel prefetches the first bytes of that weight into L2 as it starts
(`opfuse.codegen.base.PREFETCH_CODE`): the weight streams in while the light kernels run, and the GEMM's loads hit
L2. At most half the L2 is asked for, so what one prefetch brings is not pushed out by itself.

Light: moving (reading and writing, as the plan prices it) at most 1/LIGHT_SHARE of the bytes it would prefetch;
a step that streams a weight itself, or moves more, ends the run of light steps before a weight. Only a generated
kernel run in its Triton form issues the prefetch; a light step through PyTorch or a library is passed over.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from opfuse.codegen.base import FORM_TRITON, KernelConfig
from opfuse.hardware import HardwareProfile

LIGHT_SHARE = 8


def prefetch_targets(steps: Sequence, configs: Mapping[str, KernelConfig], hw: HardwareProfile
                     ) -> dict[int, tuple[torch.Tensor, int]]:
    """{index of a step: (the weight it prefetches, how many of its first bytes)} for `steps` (the compiled model's
    schedule: each with its group, and its kernel or None) run with `configs` (by group name)."""
    def weight_of(step) -> torch.Tensor | None:
        return step.kernel.streamed_weight(configs.get(step.group.name)) if step.kernel is not None else None

    def issues(step) -> bool:
        config = configs.get(step.group.name)
        return step.kernel is not None and (config is None or config.form == FORM_TRITON)

    targets: dict[int, tuple[torch.Tensor, int]] = {}
    for index, step in enumerate(steps):
        weight = weight_of(step)
        if weight is None:
            continue
        amount = min(weight.nbytes, hw.l2_bytes // 2) // 16 * 16     # bulk prefetches move 16-byte units
        issuer = None
        for before in range(index - 1, -1, -1):
            earlier = steps[before]
            moved = earlier.group.bytes_read + earlier.group.bytes_written
            if weight_of(earlier) is not None or moved * LIGHT_SHARE > amount or before in targets:
                break
            if issues(earlier):
                issuer = before
        if issuer is not None and amount > 0:
            targets[issuer] = (weight, amount)
    return targets
