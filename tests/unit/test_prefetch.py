"""Prefetch ahead (`opfuse.runtime.prefetch`): which step asks L2 for which weight."""

from types import SimpleNamespace

import torch
from torch import nn

import opfuse
from opfuse.codegen.base import FORM_LIBRARY, FORM_TRITON, KernelConfig, prefetching, _AHEAD
from opfuse.hardware import get_hardware
from opfuse.runtime.prefetch import LIGHT_SHARE, prefetch_targets

H100 = get_hardware("h100")
MB = 1 << 20


def step(name, moved, weight=None, kernel=True):
    """A schedule step of a group moving `moved` bytes; its kernel streams `weight` (a tensor) or nothing."""
    group = SimpleNamespace(name=name, bytes_read=moved, bytes_written=0)
    runs = SimpleNamespace(streamed_weight=lambda config: weight) if kernel else None
    return SimpleNamespace(group=group, kernel=runs)


def weight(mb):
    return torch.empty(mb * MB // 2, dtype=torch.float16)


def test_the_first_light_kernel_after_a_gemm_prefetches_the_next_gemms_weight():
    """A decode layer's shape: norm, QKV, rotary, attention, o-proj, norm, gate/up, down. Each GEMM's weight is
    prefetched by the first light kernel of the run before it; the down projection follows a GEMM directly, and
    the gate/up weight (larger than half the L2) is prefetched up to half the L2."""
    qkv, o, gated, down = weight(12), weight(8), weight(44), weight(22)
    steps = [step("norm", 8 << 10), step("qkv", 12 * MB, qkv), step("rotary", 20 << 10),
             step("attention", 400 << 10), step("o", 8 * MB, o), step("norm2", 8 << 10),
             step("gated", 44 * MB, gated), step("down", 22 * MB, down)]
    targets = prefetch_targets(steps, {}, H100)
    assert set(targets) == {0, 2, 5}
    assert targets[0][0] is qkv and targets[0][1] == 12 * MB
    assert targets[2][0] is o and targets[2][1] == 8 * MB
    assert targets[5][0] is gated and targets[5][1] == H100.l2_bytes // 2


def test_a_kernel_that_moves_much_neither_prefetches_nor_lets_one_before_it():
    """Light means moving at most 1/LIGHT_SHARE of what is prefetched: attention over a long cache ends the run,
    so only the kernel after it may prefetch; with none, nothing does."""
    o = weight(8)
    heavy = 8 * MB // LIGHT_SHARE + 16
    targets = prefetch_targets([step("rotary", 1 << 10), step("attention", heavy), step("combine", 1 << 10),
                                step("o", 8 * MB, o)], {}, H100)
    assert list(targets) == [2]
    assert prefetch_targets([step("rotary", 1 << 10), step("attention", heavy), step("o", 8 * MB, o)], {},
                            H100) == {}


def test_only_a_generated_kernel_in_its_triton_form_issues_the_prefetch():
    """A light step through PyTorch or a library form is passed over (it launches no kernel of ours), not a stop."""
    o = weight(8)
    steps = [step("view", 0, kernel=False), step("attention", 1 << 10), step("combine", 1 << 10), step("o", 8 * MB, o)]
    library = {"attention": KernelConfig((), form=FORM_LIBRARY)}
    assert list(prefetch_targets(steps, library, H100)) == [2]
    triton = {"attention": KernelConfig((), form=FORM_TRITON)}
    assert list(prefetch_targets(steps, triton, H100)) == [1]


def test_prefetching_hands_the_weight_to_one_launch_and_only_inside():
    w = weight(1)
    with prefetching((w, 4096)):
        ahead = _AHEAD.get()
        assert ahead.weight is w and ahead.nbytes == 4096 and not ahead.issued
    assert _AHEAD.get() is None
    with prefetching(None):
        assert _AHEAD.get() is None


def test_a_compiled_rms_norm_then_linear_plans_the_norm_to_prefetch_the_weight():
    """On a real plan: the norm's kernel step is the one that prefetches the linear's packed weight (asked of the
    schedule for an H100; a CPU compile itself prefetches nothing, as its device is no GPU)."""
    torch.manual_seed(0)

    class NormLinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.linear = nn.RMSNorm(64), nn.Linear(64, 256, bias=False)

        def forward(self, x):
            return self.linear(self.norm(x))

    model = NormLinear().eval()
    x = torch.randn(1, 1, 64)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", weight_prefetch=True))
    runtime = compiled.compiled
    assert all(s.ahead is None for s in runtime._steps)
    targets = prefetch_targets(runtime._steps, runtime.configs, H100)
    [(index, (streamed, amount))] = targets.items()
    assert runtime._steps[index].kernel is not None and "rms_norm" in runtime._steps[index].kernel.name
    assert streamed.shape == (64, 256) and amount == 64 * 256 * 4
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), rtol=1e-4, atol=1e-5)
