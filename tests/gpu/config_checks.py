"""What the GPU tests of a fused kernel assert of each of its candidate configs (test_attention_gpu,
test_layer_norm_prologue_gpu, test_norm_epilogue_gpu)."""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.base import FORM_TRITON, KernelConfig
from opfuse.numerics import relative_error, tolerance


def check_every_config(kernel, inputs: list[torch.Tensor], configs: Sequence[KernelConfig], reference: torch.Tensor,
                       torch_fp16: float) -> None:
    """Run `kernel` on `inputs` with each of `configs`: each writes every element of its one output (the epilogue
    fills the others with NaN), in float16 and the reference's shape, within float16's tolerance of `reference` and
    within twice PyTorch's own float16 error (`torch_fp16`) + 1e-3; at least one Triton config compiles without
    register spills."""
    spill_free = 0
    kernel.epilogue.output_fill = float("nan")
    for config in configs:
        (out,) = kernel.run(inputs, config)
        torch.cuda.synchronize()
        assert out.shape == reference.shape and out.dtype == torch.float16
        assert not torch.isnan(out).any(), f"{config}: unwritten elements"
        error = relative_error(out, reference)
        assert error < tolerance("float16") and error < 2 * torch_fp16 + 1e-3, (config, error, torch_fp16)
        if config.form == FORM_TRITON:
            info = kernel.last_compiled
            spill_free += info is not None and info.spills == 0
    assert spill_free, "every config spills registers"
