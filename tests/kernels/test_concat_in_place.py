"""A cat written in place (`opfuse.fusion.concat_in_place`): its parts' kernels store into its slices through
Triton's interpreter, against eager."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import opfuse
from opfuse.codegen.forms import UNFUSED, EpilogueKernel
from opfuse.fusion.concat_in_place import planned_slots
from opfuse.fusion.plan import GroupKind


class InceptionBlock(nn.Module):
    """Three 1x1 convs on x (siblings: one horizontal kernel), a 3x3 after one, two convs of a split branch
    concatenated (nested in the block's cat), an average-pooled 1x1 and a max pool, then a 1x1 conv over the cat."""

    def __init__(self, c: int = 4):
        super().__init__()
        self.a, self.b, self.d, self.p = nn.Conv2d(c, 3, 1), nn.Conv2d(c, 2, 1), nn.Conv2d(c, 2, 1), nn.Conv2d(c, 2, 1)
        self.b2 = nn.Conv2d(2, 3, 3, padding=1)
        self.d1, self.d2 = nn.Conv2d(2, 2, (1, 3), padding=(0, 1)), nn.Conv2d(2, 2, (3, 1), padding=(1, 0))
        self.out = nn.Conv2d(3 + 3 + 4 + 2 + c, 5, 1)

    def forward(self, x):
        a = F.relu(self.a(x))
        b = F.relu(self.b2(F.relu(self.b(x))))
        d = F.relu(self.d(x))
        d = torch.cat([F.relu(self.d1(d)), F.relu(self.d2(d))], 1)
        p = F.relu(self.p(F.avg_pool2d(x, 3, 1, 1)))
        return self.out(torch.cat([a, b, d, p, F.max_pool2d(x, 3, 1, 1)], 1))


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture
def copies(monkeypatch):
    """The shapes of the tensors `Tensor.copy_` writes into while the test runs."""
    seen = []
    original = torch.Tensor.copy_

    def spy(self, source, *args, **kwargs):
        seen.append(tuple(self.shape))
        return original(self, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", spy)
    return seen


def test_the_parts_kernels_store_into_the_cat_a_horizontal_groups_sibling_too(copies):
    torch.manual_seed(0)
    model, x = InceptionBlock().eval(), torch.randn(2, 4, 5, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    cats = [g for g in compiled.compiled.plan.groups if g.kind is GroupKind.IN_PLACE]
    assert len(cats) == 1 and cats[0].launches == 0      # the nested cat spliced in, every part stored in place
    assert cats[0].name not in compiled.compiled.kernels
    siblings = [k for k in compiled.compiled.kernels.values() if k.group.kind is GroupKind.HORIZONTAL]
    assert len(siblings) == 1 and siblings[0].epilogue.separate      # the three 1x1 convs, each output apart
    copies.clear()
    with torch.no_grad():
        y = compiled(x)
        expected = model(x)
    assert copies == []          # no part copied
    assert relative_error(y, expected) < 1e-5


def test_a_producer_whose_form_cannot_store_there_is_copied_into_its_slice(copies):
    """The unfused form (the group's ops through PyTorch) returns a tensor of its own: the runtime copies it."""
    torch.manual_seed(1)
    model, x = InceptionBlock().eval(), torch.randn(1, 4, 5, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", verify=False))
    inner = compiled.compiled
    part = next(p for p in planned_slots(inner.plan)
                if isinstance(inner.kernels.get(inner.plan.group_of(p).name), EpilogueKernel))
    expected = model(x).detach()
    inner.set_configs({inner.plan.group_of(part).name: UNFUSED})
    copies.clear()
    with torch.no_grad():
        y = compiled(x)
    assert copies == [tuple(inner.graph[part].type.shape)]
    assert relative_error(y, expected) < 1e-5


class Rank5(nn.Module):
    """Linears over rank-5 tensors concatenated along dim 1: more row dims than the GEMM's kernel addresses apart,
    so a slice of the cat (whose rows then do not merge) cannot be stored into as it is."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2, self.out = nn.Linear(8, 6), nn.Linear(8, 6), nn.Linear(6, 3)

    def forward(self, x1, x2):
        return self.out(torch.cat([F.relu(self.l1(x1)), F.relu(self.l2(x2))], 1))


def test_a_slice_whose_rows_do_not_merge_is_stored_apart_and_copied_in():
    torch.manual_seed(2)
    model, inputs = Rank5().eval(), (torch.randn(2, 3, 4, 5, 8), torch.randn(2, 2, 4, 5, 8))
    compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float32"))     # verified end to end
    assert any(g.kind is GroupKind.IN_PLACE for g in compiled.compiled.plan.groups)
    with torch.no_grad():
        assert relative_error(compiled(*inputs), model(*inputs)) < 1e-5


def test_a_model_with_a_cat_in_place_can_run_on_stand_ins():
    """The autotuner's and the verification's stand-in run: a cat in place runs nothing of PyTorch's."""
    torch.manual_seed(0)
    model, x = InceptionBlock().eval(), torch.randn(1, 4, 5, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", verify=False))
    assert compiled.compiled.stand_ins_are_safe()


def test_the_peak_memory_estimate_holds_the_cats_buffer_from_its_first_part():
    """No kernel writes the cat in place itself: its buffer is live from its first part's kernel to its last reader,
    with the other parts' inputs, which the memory pre-flight must count."""
    model, x = InceptionBlock(8).eval(), torch.randn(4, 8, 12, 12)
    analysis = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float16"))
    cat = next(g.nodes[0] for g in analysis.plan.groups if g.kind is GroupKind.IN_PLACE)
    assert analysis.fused.peak_intermediate_bytes >= analysis.plan.graph[cat].type.nbytes
