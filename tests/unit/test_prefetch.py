"""Weight prefetch (`opfuse.runtime.prefetch`): which step asks L2 for its own weight before it waits."""

from types import SimpleNamespace

import torch
from torch import nn

import opfuse
from opfuse.codegen.base import FORM_LIBRARY, FORM_TRITON, KernelConfig, prefetching, _AHEAD
from opfuse.hardware import get_hardware
from opfuse.runtime.prefetch import LIGHT_SHARE, prefetch_targets

H100 = get_hardware("h100")
MB = 1 << 20


def step(name, moved, weight=None, kernel=True, launches=1):
    """A schedule step of a group moving `moved` bytes; its kernel streams `weight` (a tensor) or nothing."""
    group = SimpleNamespace(name=name, bytes_read=moved, bytes_written=0, launches=launches)
    runs = SimpleNamespace(streamed_weight=lambda config: weight) if kernel else None
    return SimpleNamespace(group=group, kernel=runs)


def weight(mb):
    return torch.empty(mb * MB // 2, dtype=torch.float16)


def test_a_gemm_after_a_light_kernel_prefetches_its_own_weight():
    """A decode layer's shape: norm, QKV, rotary, attention, o-proj, norm, gate/up, down. The QKV, o-proj and gate/up
    GEMMs follow light kernels and prefetch their weights (the gate/up's, larger than half the L2, up to half the
    L2); the down projection follows a GEMM, which keeps device memory busy, and prefetches nothing."""
    qkv, o, gated, down = weight(12), weight(8), weight(44), weight(22)
    steps = [step("norm", 8 << 10), step("qkv", 12 * MB, qkv), step("rotary", 20 << 10),
             step("attention", 400 << 10), step("o", 8 * MB, o), step("norm2", 8 << 10),
             step("gated", 44 * MB, gated), step("down", 22 * MB, down)]
    targets = prefetch_targets(steps, {}, H100)
    assert set(targets) == {1, 4, 6}
    assert targets[1][0] is qkv and targets[1][1] == 12 * MB
    assert targets[4][0] is o and targets[4][1] == 8 * MB
    assert targets[6][0] is gated and targets[6][1] == H100.l2_bytes // 2


def test_the_kernel_before_must_be_light_and_views_between_do_not_count():
    """Light means moving at most 1/LIGHT_SHARE of what is prefetched; a view between (no launch) is passed over to
    the kernel before it; the first step has none before it."""
    o = weight(8)
    heavy = 8 * MB // LIGHT_SHARE + 16
    assert prefetch_targets([step("attention", heavy), step("o", 8 * MB, o)], {}, H100) == {}
    assert list(prefetch_targets([step("attention", heavy - 32), step("view", 0, kernel=False, launches=0),
                                  step("o", 8 * MB, o)], {}, H100)) == [2]
    assert prefetch_targets([step("o", 8 * MB, o)], {}, H100) == {}


def test_only_triton_forms_prefetch_and_only_after_a_triton_form():
    """The GEMM in a library form issues nothing; after a kernel of PyTorch's or a library's (waited for whole,
    nothing to overlap) it does not prefetch either."""
    o = weight(8)
    steps = [step("attention", 1 << 10), step("o", 8 * MB, o)]
    assert list(prefetch_targets(steps, {}, H100)) == [1]
    assert prefetch_targets(steps, {"o": KernelConfig((), form=FORM_LIBRARY)}, H100) == {}
    assert prefetch_targets(steps, {"attention": KernelConfig((), form=FORM_LIBRARY)}, H100) == {}
    assert list(prefetch_targets(steps, {"attention": KernelConfig((), form=FORM_TRITON)}, H100)) == [1]
    through_pytorch = [step("gather", 1 << 10, kernel=False), step("o", 8 * MB, o)]
    assert prefetch_targets(through_pytorch, {}, H100) == {}


def test_prefetching_hands_the_weight_to_one_launch_and_only_inside():
    w = weight(1)
    with prefetching((w, 4096)):
        ahead = _AHEAD.get()
        assert ahead.weight is w and ahead.nbytes == 4096 and not ahead.issued
    assert _AHEAD.get() is None
    with prefetching(None):
        assert _AHEAD.get() is None


def test_a_compiled_rms_norm_then_linear_plans_the_linear_to_prefetch_its_weight():
    """On a real plan: the linear's kernel step prefetches its own packed weight (asked of the schedule for an H100;
    a CPU compile itself prefetches nothing, as its device is no GPU)."""
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
    assert runtime._steps[index].kernel is not None and runtime._steps[index].group.anchor is not None
    assert streamed.shape == (64, 256) and amount == 64 * 256 * 4
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), rtol=1e-4, atol=1e-5)
