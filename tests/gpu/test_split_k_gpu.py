"""Split-K on the GPU (FusionConfig.split_k, on by default since the H200 runs of 2026-11-30): whole models at
batch 1, where the planner splits most convs and linears, compiled in fp16, must match fp32 eager and launch no more
kernels than the plan (which counts each split group's second kernel).

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_split_k_gpu.py
"""

import pytest
import torch

from tests.gpu.test_models_gpu import compile_and_check

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("name", ["resnet50", "bert-base"])
def test_split_k_model_matches_eager_and_plan(name):
    compiled = compile_and_check(name, 1, dict(autotune=False, split_k=True))
    split = [g.name for g in compiled.plan.groups if g.split_k]
    assert len(split) >= 10, "the planner split too few groups at batch 1"
    assert not set(split) & set(compiled.fallbacks), compiled.fallbacks    # each runs its own split kernels
