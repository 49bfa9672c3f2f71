"""The compile workers on a real GPU (opfuse.runtime.precompile): every recorded launch of a small convnet's
candidates compiles in the workers, and the tuner's own runs then find them in Triton's cache.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu
"""

import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def small_convnet():
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Conv2d(32, 32, 3, padding=1, groups=32), torch.nn.ReLU6(), torch.nn.Conv2d(32, 64, 1),
              torch.nn.SiLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(64, 10)]
    return torch.nn.Sequential(*layers).eval()


def test_the_workers_compile_every_launch_and_the_tuner_loads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))   # read by Triton at each compile
    import opfuse
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.autotune import candidates, kernel_inputs
    from opfuse.runtime.compiled import CompiledModel
    from opfuse.runtime.precompile import precompile

    x = torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.float16)
    model = small_convnet().to("cuda", torch.float16)
    analysis = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float16"))
    kernels, _ = lower_plan(analysis.plan, "cuda")
    values = CompiledModel(analysis.plan, kernels, "cuda").collect_values(x)
    jobs = [(k, kernel_inputs(k, values), candidates(k, 4, False)[1]) for k in kernels.values()]
    result = precompile(jobs, workers=4, device_index=0)
    assert result.launches >= 8, result
    assert result.failed == 0 and result.compiled == result.launches, result

    def cached() -> int:
        return sum(1 for _ in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))

    compiled_by_workers = cached()
    assert compiled_by_workers >= result.launches
    for kernel, inputs, configs in jobs:
        for config in configs:
            kernel.run(inputs, config)      # what the tuner does first: every candidate once
    torch.cuda.synchronize()
    assert cached() == compiled_by_workers   # nothing compiled again: every launch came from the cache


def test_a_cold_compile_tunes_what_the_workers_built_while_they_build_the_rest(tmp_path, monkeypatch):
    """opfuse.compile on empty caches: every candidate launch queued is built by the workers or, while it waited
    for them, by the compiling process (none left to the tuner), the tuner compiled no kernel of its own (every
    cubin in Triton's cache is one of those), and the compiled model matches eager."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    import opfuse
    from opfuse.numerics import relative_error

    x = torch.randn(4, 3, 32, 32, device="cuda").contiguous(memory_format=torch.channels_last)
    model = small_convnet().to("cuda")
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", compile_workers=4,
                                                               cache_dir=str(tmp_path / "tuning")))
    precompiled = compiled.compiled.tuning.precompiled
    assert precompiled is not None and precompiled.launches >= 8, precompiled
    assert precompiled.failed == 0 and precompiled.compiled == precompiled.launches, precompiled
    cubins = sum(1 for _ in (tmp_path / "triton").rglob("*.cubin"))
    assert cubins == precompiled.compiled, (cubins, precompiled)
    with torch.inference_mode():
        assert relative_error(compiled(x), model(x)) < 1e-3
