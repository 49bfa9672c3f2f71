"""Packages on a real GPU (opfuse.save / opfuse.load): resnet50 and BertModel load in a fresh process in under 2 s
once this machine has built Triton's launchers for their kernels' signatures (resnet50; BertModel's time is
reported; the first load, which builds them, is reported too: launchers are host code, never taken from a package),
compute bit for bit what the compiled model computed, call for call (the eager warm-up, the CUDA graph capture, the
replays), and compile no kernel: the load reads every binary from the package's private folder, and no call
compiles one. Several batch sizes pad through the CUDA graph path.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_package_gpu.py
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

ROOT = Path(__file__).resolve().parents[2]
CALLS = 3           # the eager warm-up, the call that captures the CUDA graph, a replay

# A fresh serving process: Triton's own start-up (building its C utilities, hashing its sources) happens before the
# clock, on a kernel of the script's own, so the time measured is the package's load.
LOADER = '''
import json, os, sys, time
from pathlib import Path
import torch, triton, triton.language as tl
from torch.utils._pytree import tree_flatten

@triton.jit
def _warm(x):
    tl.store(x, 1.0)

_warm[(1,)](torch.zeros(1, device="cuda"))
torch.cuda.synchronize()
import opfuse, opfuse.runtime.package, opfuse.runtime.packaged

cache = Path(os.environ["TRITON_CACHE_DIR"])
packages = Path(os.environ["XDG_CACHE_HOME"]) / "opfuse" / "packages"
entries = lambda: {p.name for p in cache.iterdir() if p.is_dir()}
kernels = lambda: sorted(p.parent.name for p in cache.glob("*/*.cubin"))
before = set(kernels())     # the script's own kernel
start = time.perf_counter()
model = opfuse.load(sys.argv[1])
torch.cuda.synchronize()
load_s = time.perf_counter() - start
restored = entries()
served = len(list(packages.glob("*/*/*.cubin")))
compiled_at_load = sorted(set(kernels()) - before)
inputs, expected = torch.load(sys.argv[2])
inputs = [x.cuda() for x in inputs]
start = time.perf_counter()
outputs = [tree_flatten(model(*inputs))[0] for _ in expected]
torch.cuda.synchronize()
calls_s = time.perf_counter() - start
identical = [all(torch.equal(g.cpu(), w) for g, w in zip(got, want)) for got, want in zip(outputs, expected)]
print(json.dumps({"load_s": load_s, "calls_s": calls_s, "identical": identical, "served": served,
                  "compiled_at_load": compiled_at_load, "compiled_at_call": sorted(entries() - restored)}))
'''


def compile_builtin(name: str, batch: int):
    import opfuse
    from opfuse.bench.harness import protocol_form
    from opfuse.cli import load_model

    model, inputs, _ = load_model(name, batch)
    model, inputs = protocol_form(model, inputs, torch.float16, "cuda")
    return opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float16", tune_top=2)), inputs


def reference_calls(model, inputs) -> list[list[torch.Tensor]]:
    """The flat outputs of CALLS calls, on the CPU. A compiled model starts again from its CUDA graph warm-up
    (compile's verification ran it already), so call i of it and of a freshly loaded package take the same path."""
    from torch.utils._pytree import tree_flatten

    runtime = getattr(model, "compiled", None)
    if runtime is not None and hasattr(runtime, "set_cuda_graph"):
        runtime.set_cuda_graph(True)
    return [[t.cpu() for t in tree_flatten(model(*inputs))[0]] for _ in range(CALLS)]


@pytest.mark.parametrize("name, batch, load_limit_s", [("resnet50", 8, 2.0), ("bert", 2, None)])
def test_a_package_loads_fast_in_a_fresh_process_bit_identical_compiling_nothing(name, batch, load_limit_s,
                                                                                 tmp_path):
    import opfuse
    from opfuse.runtime.package import PackageReader

    compiled, inputs = compile_builtin(name, batch)
    path = opfuse.save(compiled, tmp_path / f"{name}.opfuse")
    with PackageReader(path) as package:
        assert package.binaries(), "a GPU package carries its kernels' binaries"
    expected = reference_calls(compiled, inputs)
    reference = tmp_path / "reference.pt"
    torch.save(([x.cpu() for x in inputs], expected), reference)
    (tmp_path / "loader.py").write_text(LOADER)
    (tmp_path / "triton").mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               OPFUSE_KERNEL_DIR=str(tmp_path / "kernels"), XDG_CACHE_HOME=str(tmp_path / "cache"),
               PYTHONPYCACHEPREFIX=str(tmp_path / "pyc"))   # Python's bytecode cached, as on a serving machine
    env.pop("TRITON_INTERPRET", None)
    results = []
    for _ in range(2):      # the first load builds Triton's launchers on this machine, the second finds them
        done = subprocess.run([sys.executable, str(tmp_path / "loader.py"), str(path), str(reference)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"{name} bs{batch}: first load {results[0]}, second {results[1]}")
    for result in results:
        assert result["identical"] == [True] * CALLS, result
        assert result["served"] > 0 and result["compiled_at_load"] == [] == result["compiled_at_call"], result
    if load_limit_s is not None:
        assert results[1]["load_s"] < load_limit_s, results

    loaded = opfuse.load(path)               # and in this process, next to the compiled model
    for got, want in zip(reference_calls(loaded, inputs), expected):
        assert all(torch.equal(g, w) for g, w in zip(got, want))


def small_convnet():
    torch.manual_seed(0)
    layers = [torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
              torch.nn.Conv2d(32, 64, 1), torch.nn.SiLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
              torch.nn.Linear(64, 10)]
    return torch.nn.Sequential(*layers).eval().to("cuda", torch.float16)


def test_several_batch_sizes_pad_through_the_cuda_graph(tmp_path):
    import opfuse

    model = small_convnet()
    config = opfuse.FusionConfig(dtype="float16", tune_top=2)
    compiled = {b: opfuse.compile(model, (torch.randn(b, 3, 32, 32, device="cuda", dtype=torch.float16),), config)
                for b in (1, 4)}
    loaded = opfuse.load(opfuse.save(list(compiled.values()), tmp_path / "convnet.opfuse"))
    assert loaded.batch_sizes == [1, 4]
    x = torch.randn(3, 3, 32, 32, device="cuda", dtype=torch.float16)
    wants = reference_calls(compiled[4], [torch.cat([x, x[-1:]])])
    for want in wants:                       # warm-up, capture, replay: each padded into the static buffers
        assert torch.equal(loaded(x).cpu(), want[0][:3])
    one = torch.randn(1, 3, 32, 32, device="cuda", dtype=torch.float16)
    assert torch.equal(loaded(one), compiled[1](one))
    with pytest.raises(Exception, match="larger than the largest batch size"):
        loaded(torch.randn(5, 3, 32, 32, device="cuda", dtype=torch.float16))
