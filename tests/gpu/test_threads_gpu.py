"""Concurrent calls on the CUDA-graph path of a real GPU: the warm-up, the capture and every replay with its copies
in and out serialise on the model's lock, so each thread gets its own call's outputs (issue 53, item 8).

Run on the device machine: OPFUSE_GPU_TESTS=1 python3 -m pytest -m gpu tests/gpu/test_threads_gpu.py
"""

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

import opfuse  # noqa: E402
from opfuse.numerics import relative_error, tolerance  # noqa: E402

from tests.unit.test_threads_call_path import CALLS, THREADS, call_from_threads  # noqa: E402


def small_cnn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Sigmoid(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).cuda().eval()


def image(seed: int) -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(seed)).cuda()


def compiled_fresh(model: nn.Module):
    """`model` compiled in float32, its CUDA graph not captured yet: the threads' first calls warm up and capture."""
    compiled = opfuse.compile(model, (image(0),), opfuse.FusionConfig(dtype="float32", autotune=False))
    assert compiled.compiled.use_cuda_graph and compiled.compiled._cuda_graph is None
    return compiled


def wrong_calls(results: dict[int, object], reference) -> list[str]:
    """The calls whose outcome is an error or is further from `reference(seed)` than float32's bound."""
    bound = tolerance("float32", "cuda")
    wrong = []
    for seed, out in sorted(results.items()):
        if isinstance(out, Exception):
            wrong.append(f"call {seed}: {type(out).__name__}: {str(out)[:120]}")
        elif (error := relative_error(out, reference(seed))) > bound:
            wrong.append(f"call {seed}: relative error {error:.2e} > {bound:.0e}")
    return wrong


def test_threads_calling_one_model_through_its_cuda_graph_each_get_their_own_outputs():
    model = small_cnn(0)
    compiled = compiled_fresh(model)
    seeds = [[100 + thread * CALLS + call for call in range(CALLS)] for thread in range(THREADS)]
    results = call_from_threads(lambda seed: compiled(image(seed)), seeds)
    torch.cuda.synchronize()
    with torch.inference_mode():
        wrong = wrong_calls(results, lambda seed: model(image(seed)))
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls: " + "; ".join(wrong)
    assert compiled.compiled._cuda_graph is not None, compiled.compiled.cuda_graph_error   # the replays ran


def test_threads_calling_two_models_on_one_gpu_each_get_their_own_outputs():
    """Two models, each with its own lock: one may capture its graph while the other replays."""
    models = [small_cnn(1), small_cnn(2)]
    compiled = [compiled_fresh(m) for m in models]
    seeds = [[200 + thread * CALLS + call for call in range(CALLS)] for thread in range(THREADS)]
    which = lambda seed: (seed - 200) // CALLS % 2      # noqa: E731 (threads 0 and 2 call model 0, 1 and 3 model 1)
    results = call_from_threads(lambda seed: compiled[which(seed)](image(seed)), seeds)
    torch.cuda.synchronize()
    with torch.inference_mode():
        wrong = wrong_calls(results, lambda seed: models[which(seed)](image(seed)))
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls: " + "; ".join(wrong)
    assert all(c.compiled._cuda_graph is not None for c in compiled), [c.compiled.cuda_graph_error for c in compiled]
