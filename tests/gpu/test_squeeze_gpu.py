"""The squeeze-and-excitation squeeze kernel on the GPU (`opfuse.codegen.squeeze`): every squeeze group of
efficientnet_b0, in fp16 and fp32 at batch 1 and 64, in every config and form against its ops through PyTorch,
then captured in a CUDA graph and replayed twice with new inputs (the workspace each call leaves zero); and a small
SE model compiled end to end (warm-up, capture, replays) against eager.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_squeeze_gpu.py
"""

import copy

import pytest
import torch
import torch.nn as nn

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

DTYPES = {"float16": torch.float16, "float32": torch.float32}


def squeeze_kernels(name: str, batch: int, dtype: str):
    """(the plan, [(group, kernel on the GPU)]) of every squeeze group of a built-in model."""
    import opfuse
    from opfuse.bench.zoo import load_builtin
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.plan import GroupKind

    model, inputs = load_builtin(name, batch=batch)
    model = model.to(DTYPES[dtype])
    inputs = tuple(x.to(DTYPES[dtype]).contiguous(memory_format=torch.channels_last) for x in inputs)
    plan = opfuse.analyze(model, inputs, opfuse.FusionConfig(dtype=dtype, squeeze=True)).plan
    groups = [g for g in plan.groups if g.kind is GroupKind.SQUEEZE]
    return plan, [(g, lower_group(plan.graph, g, "cuda", hw=plan.profile)) for g in groups]


def random_input(kernel, dtype: str, seed: int) -> torch.Tensor:
    shape = kernel.graph[kernel.runtime_inputs[0]].type.shape
    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=generator, device="cuda", dtype=DTYPES[dtype])
    return x.contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_efficientnet_squeeze_kernels_match_eager_and_replay(dtype, batch):
    from opfuse.codegen.squeeze import UNFUSED, SqueezeKernel
    from opfuse.numerics import relative_error, tolerance

    _, kernels = squeeze_kernels("efficientnet_b0", batch, dtype)
    # 16 SE blocks; in fp32 the cost model may keep the four widest (1152 -> 48, the weights a tail program
    # streams twice as large) apart
    assert len(kernels) == 16 if dtype == "float16" else len(kernels) >= 12
    bound = tolerance(dtype, "cuda")
    for group, kernel in kernels:
        assert isinstance(kernel, SqueezeKernel), group.name
        x = random_input(kernel, dtype, group.id)
        with torch.inference_mode():
            want = kernel.run([x], UNFUSED)[0].float()
            for config in kernel.configs() + kernel.alternatives():
                for _ in range(2):
                    got = kernel.run([x], config)[0]
                    torch.cuda.synchronize()
                    assert relative_error(got.float(), want) < bound, (group.name, config)
                    assert not kernel.sums.any() and not kernel.tickets.any(), (group.name, config)
        split = kernel.configs()[0]
        assert split["SPLIT"] >= 1
        static = x.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(stream):
            kernel.run([static], split)                  # warm-up (compiles) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(graph):
            captured = kernel.run([static], split)[0]
        for seed in (101, 102):                           # two replays on new inputs
            fresh = random_input(kernel, dtype, seed)
            static.copy_(fresh)
            graph.replay()
            torch.cuda.synchronize()
            with torch.inference_mode():
                want = kernel.run([fresh], UNFUSED)[0].float()
            assert relative_error(captured.float(), want) < bound, (group.name, seed)
            assert not kernel.sums.any() and not kernel.tickets.any(), group.name


class SqueezeExcite(nn.Module):
    """An MBConv tail: depthwise conv + SiLU, squeeze-and-excitation, the 1x1 project conv."""

    def __init__(self, channels: int = 96, hidden: int = 4):
        super().__init__()
        from torchvision.ops import SqueezeExcitation

        self.depthwise = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.SiLU())
        self.excite = SqueezeExcitation(channels, hidden, activation=nn.SiLU)
        self.project = nn.Conv2d(channels, 24, 1)

    def forward(self, x):
        return self.project(self.excite(self.depthwise(x)))


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_small_se_model_matches_eager_through_capture_and_replays(dtype, batch):
    import opfuse
    from opfuse.codegen.squeeze import SqueezeKernel
    from opfuse.fusion.plan import GroupKind
    from opfuse.numerics import relative_error, tolerance

    torch.manual_seed(0)
    model = SqueezeExcite().eval()
    reference = copy.deepcopy(model).double()
    model = model.to(DTYPES[dtype]).cuda()
    x = torch.randn(batch, 96, 56, 56, device="cuda", dtype=DTYPES[dtype]).contiguous(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype=dtype, autotune=False, squeeze=True))
    squeeze = [g for g in compiled.plan.groups if g.kind is GroupKind.SQUEEZE]
    assert len(squeeze) == 1 and isinstance(compiled.compiled.kernels[squeeze[0].name], SqueezeKernel)
    assert compiled.plan.kernel_launches == 3 and not compiled.fallbacks
    for seed in range(4):              # warm-up, the capture, two replays
        fresh = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        with torch.inference_mode():
            got = compiled(fresh.to(device="cuda", dtype=DTYPES[dtype]).contiguous(memory_format=torch.channels_last))
            want = reference(fresh)
        assert relative_error(got.double().cpu(), want) < tolerance(dtype, "cuda"), seed
