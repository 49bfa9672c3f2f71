"""Split-K on the GPU (FusionConfig.split_k, off by default until measured): whole models at batch 1, where the
planner splits most convs and linears, compiled in fp16, must match fp32 eager and launch no more kernels than the
plan (which counts each split group's second kernel).

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_split_k_gpu.py
"""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("name", ["resnet50", "bert-base"])
def test_split_k_model_matches_eager_and_plan(name):
    import opfuse
    from opfuse.bench.harness import kernel_profile
    from opfuse.bench.zoo import load_builtin
    from opfuse.numerics import relative_error

    model, inputs = load_builtin(name, batch=1)
    reference_model = copy.deepcopy(model).float().cuda()
    model = model.half().cuda()
    inputs = tuple(x.cuda() for x in inputs)
    fp16_inputs = tuple(x.half().contiguous(memory_format=torch.channels_last) if x.is_floating_point() else x
                        for x in inputs)
    compiled = opfuse.compile(model, fp16_inputs, opfuse.FusionConfig(dtype="float16", autotune=False,
                                                                       split_k=True))
    split = [g for g in compiled.plan.groups if g.split_k > 1]
    assert len(split) >= 10, "the planner split too few groups at batch 1"
    assert all(name not in compiled.fallbacks for name in (g.name for g in split)), compiled.fallbacks
    with torch.inference_mode():
        out = compiled(*fp16_inputs)
        reference = reference_model(*inputs)
    assert relative_error(out.float(), reference.float()) < 1e-2
    compiled.compiled.set_cuda_graph(False)
    with torch.inference_mode():
        kernels, _ = kernel_profile(compiled, fp16_inputs)
    assert kernels <= compiled.plan.kernel_launches, compiled.fallbacks
