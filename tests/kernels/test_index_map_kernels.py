"""Index maps on a kernel's loads, on Triton's interpreter: stack (a cat of reshapes), and the captures that plan
them with nothing through PyTorch. Outputs are NaN-poisoned and compared with the float32 reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from opfuse.codegen.lower import groups_through_pytorch
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.planner import plan_fusion
from opfuse.ir.interpret import interpret
from opfuse.passes import prepare_graph
from tests.kernels.test_pointwise_kernels import Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def plan_of(model: nn.Module, *inputs: torch.Tensor):
    """The captured graph (checked against eager through the reference interpreter) and its plan in float32."""
    graph = capture_torch(model.eval(), inputs)
    assert not [n.attrs["target"] for n in graph if n.op == "opaque"]
    torch.testing.assert_close(interpret(graph, list(inputs))[0], model(*inputs), rtol=1e-5, atol=1e-5)
    prepared, _ = prepare_graph(graph, "float32")
    return plan_fusion(prepared, FusionConfig(dtype="float32"))


@pytest.mark.parametrize("dim", [0, 1, 3])
def test_stack_of_three_computed_values_along_a_dim(dim):
    b = Builder()
    x = b.input("x", (3, 5, 7), b.random(3, 5, 7))
    y = b.input("y", (3, 5, 7), b.random(3, 5, 7).permute(2, 0, 1).contiguous().permute(1, 2, 0))
    parts = [b.op("sin", x), b.op("cos", y), b.op("mul", x, y)]
    shape = [3, 5, 7]
    shape.insert(dim, 1)
    stacked = b.op("cat", *[b.op("reshape", p, shape=shape) for p in parts], dim=dim)
    run_group(b, [b.op("neg", stacked)], GroupKind.POINTWISE)


class RotaryTable(nn.Module):
    """GPT-J / EVA-02 style: sin and cos interleaved by a stack, then flattened and applied."""

    def forward(self, x):
        s, c = torch.sin(x), torch.cos(x)
        return torch.stack([-s, c], dim=-1).flatten(-2) * 2.0


def test_a_stack_plans_as_one_kernel_with_what_it_feeds():
    plan = plan_of(RotaryTable(), torch.randn(2, 5, 6))
    assert groups_through_pytorch(plan) == {}
    stacks = [g for g in plan.groups if any(plan.graph[n].op == "cat" for n in g.nodes)]
    assert len(stacks) == 1 and {"sin", "cos", "mul"} <= {plan.graph[n].op for n in stacks[0].nodes}


@pytest.mark.parametrize("pads,value", [((1, 2), 0.0), ((0, 1, 2, 0), -1.5), ((1, 1, 1, 1, 0, 2), 0.0),
                                        ((-1, 2), 3.0)])
def test_a_constant_pad_of_a_computed_value_loads_under_the_extent_mask(pads, value):
    """TF's asymmetric 'same' padding after an activation; a negative pad crops."""
    b = Builder()
    x = b.input("x", (2, 3, 5, 6))                     # channels-last
    padded = b.op("pad", b.op("silu", x), pads=pads, value=value)
    run_group(b, [b.op("mul", padded, b.const("two", torch.tensor(2.0)))], GroupKind.POINTWISE)


def test_a_lone_pad_is_a_kernel_of_ours():
    b = Builder()
    x = b.input("x", (3, 7), b.random(3, 7))
    run_group(b, [b.op("pad", x, pads=(2, 0, 0, 1), value=-7.0)], GroupKind.SINGLE)


class PadThenConv(nn.Module):
    """tf_efficientnet's 'same' convolution: an asymmetric pad of an activation, then a strided conv."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, stride=2, groups=4)

    def forward(self, x):
        return self.conv(nn.functional.pad(torch.relu(x), (0, 1, 0, 1)))


def test_a_pad_joins_the_activation_before_it_and_nothing_runs_through_pytorch():
    plan = plan_of(PadThenConv(), torch.randn(1, 4, 8, 8))
    assert groups_through_pytorch(plan) == {}
    padded = next(g for g in plan.groups if any(plan.graph[n].op == "pad" for n in g.nodes))
    assert {plan.graph[n].op for n in padded.nodes} == {"relu", "pad"}


def test_a_repeat_is_an_index_map_of_what_reads_it():
    """x [3, 5] repeated [2, 1, 3] (a split, an expand, a merge PyTorch would copy) read by an add: loaded through
    the maps, every element written."""
    b = Builder()
    x = b.input("x", (3, 5), b.random(3, 5))
    z = b.input("z", (2, 3, 15), b.random(2, 3, 15))
    split = b.op("reshape", x, shape=[1, 3, 1, 5])
    grown = b.op("expand", split, shape=[2, 3, 3, 5])
    merged = b.op("reshape", grown, shape=[2, 3, 15])
    run_group(b, [b.op("add", merged, z)], GroupKind.POINTWISE)


class Repeats(nn.Module):
    """repeat, tile and repeat_interleave of activations (along dims of size 1 and more), each read by an op."""

    def forward(self, x, y):
        a = torch.relu(x).repeat(2, 1, 3) * 2.0                      # [4, 3, 12]: copies in PyTorch
        b = torch.sigmoid(x).repeat_interleave(2, dim=1) + 1.0       # [2, 6, 4]
        c = torch.tile(y, (3, 1)) - 1.0                               # y [1, 4] -> [3, 4]: an expand, a view
        return a.sum() + b.sum() + c.sum()


def test_captured_repeats_copy_nothing():
    """Each repeat joins the kernel that reads it (a sum's prologue here), which loads what it repeats (the ReLU's
    and the sigmoid's results, not recomputed): nothing runs through PyTorch, and compiled it matches eager."""
    import opfuse
    from opfuse.fusion.legality_views import loaded_view

    x, y = torch.randn(2, 3, 4), torch.randn(1, 4)
    plan = plan_of(Repeats(), x, y)
    assert groups_through_pytorch(plan) == {}
    expands = [n for n in plan.graph if n.op == "expand"]
    assert len(expands) == 3
    for node in expands[:2]:        # the two that merge a repeat: read through by the kernel that reads them
        group = plan.group_of(node.name)
        assert group.kind is GroupKind.REDUCTION and loaded_view(plan.graph, node.name, set(group.nodes))
    compiled = opfuse.compile(Repeats(), (x, y), opfuse.FusionConfig(dtype="float32"))
    assert not {why.code.value for why in compiled.fallbacks.values()} - {"view"}
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), Repeats()(x, y), rtol=1e-5, atol=1e-4)


class WindowsAndSkip(nn.Module):
    """TinyViT: a conv's output permuted to NHWC, partitioned into windows (a reshape PyTorch copies) for a layer
    norm, and added to itself through the same permute."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        nhwc = self.conv(x).permute(0, 2, 3, 1)
        windows = nhwc.reshape(1, 2, 3, 2, 3, 4).permute(0, 1, 3, 2, 4, 5).reshape(4, 9, 4)
        return torch.layer_norm(windows, [4]).sum() + (nhwc * 2.0).sum()


def test_a_copy_through_a_shared_view_is_an_index_map_of_its_reader():
    import opfuse

    model, x = WindowsAndSkip().eval(), torch.randn(1, 4, 6, 6)
    plan = plan_of(model, x)
    assert groups_through_pytorch(plan) == {}
    norm = plan.group_of(next(n.name for n in plan.graph if n.op == "layer_norm"))
    assert sum(plan.graph[n].op == "permute" for n in norm.nodes) == 2     # the NHWC one and the windows'
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-4)


class Subsample(nn.Module):
    """LeViT's attention subsample: a residual sum read by the next block and, every other row and column of its
    token grid, by a linear (a strided slice merged back into tokens: a reshape PyTorch copies)."""

    def __init__(self):
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x, y):
        tokens = x + y
        grid = tokens.view(1, 6, 6, 4)[:, ::2, ::2].reshape(1, 9, 4)
        return self.q(grid).mean(1) + tokens.amax(1)


def test_a_copying_view_no_neighbour_reads_is_a_copy_kernel_of_ours():
    import opfuse
    from opfuse.fusion.reasons import Code

    model, x, y = Subsample().eval(), torch.randn(1, 36, 4), torch.randn(1, 36, 4)
    plan = plan_of(model, x, y)
    (copy,) = [g for g in plan.groups if g.code is Code.VIEW_COPY]
    assert copy.kind is GroupKind.POINTWISE and copy.launches == 1
    assert groups_through_pytorch(plan) == {}
    compiled = opfuse.compile(model, (x, y), opfuse.FusionConfig(dtype="float32"))
    assert {why.code for why in compiled.fallbacks.values()} <= {Code.VIEW}   # free views: no kernel
    with torch.no_grad():
        torch.testing.assert_close(compiled(x, y), model(x, y), rtol=1e-5, atol=1e-5)


class PositionsAndGathers(nn.Module):
    """RoBERTa's embeddings: position ids computed from the token ids (int32 mask, scan, casts), an integer buffer
    gathered at them (values past 2^24), a float tensor gathered at them, and the position embedding."""

    def __init__(self):
        super().__init__()
        self.register_buffer("kinds", 2 ** 40 + torch.arange(12).reshape(1, 12) * 3)
        self.positions = nn.Embedding(12, 4)

    def forward(self, ids, x):
        mask = ids.ne(1).int()
        positions = ((torch.cumsum(mask, dim=1).type_as(mask) + 1) * mask).long() + 1
        kinds = torch.gather(self.kinds.expand(ids.shape[0], -1), 1, positions)
        picked = torch.gather(x, 1, positions.unsqueeze(-1).expand(-1, -1, 4))
        return self.positions(positions) * 2.0 + picked, kinds - 5


def shift_tokens_right(ids: torch.Tensor, pad: int, start: int) -> torch.Tensor:
    """transformers' BART: the decoder's tokens, shifted right by one, the start token first."""
    shifted = ids.new_zeros(ids.shape)
    shifted[:, 1:] = ids[:, :-1].clone()
    shifted[:, 0] = start
    shifted.masked_fill_(shifted == -100, pad)
    return shifted


class ShiftedTokens(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(10, 4)

    def forward(self, ids):
        shifted = shift_tokens_right(ids, 1, 2)
        return self.tokens(shifted), shifted


@pytest.mark.parametrize("build", ["positions", "shift"])
def test_integer_index_chains_compile_exactly_with_nothing_through_pytorch(build):
    import opfuse
    from opfuse.fusion.reasons import Code

    ids = torch.tensor([[0, 5, 7, 1, 1, 3, 1, 9], [1, 1, 4, 0, 2, 9, 8, 6]])
    if build == "positions":
        model, inputs = PositionsAndGathers().eval(), (ids, torch.randn(2, 12, 4))
    else:       # (called below with BART's -100 for "ignore", replaced by the pad token)
        model, inputs = ShiftedTokens().eval(), (ids,)
    config = opfuse.FusionConfig(dtype="float32")
    analysis = opfuse.analyze(model, inputs, config)
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    compiled = opfuse.compile(model, inputs, config)
    assert {why.code for why in compiled.fallbacks.values()} <= {Code.VIEW}
    if build == "shift":
        inputs = (torch.where(ids == 4, -100, ids),)
    with torch.no_grad():
        got, want = compiled(*inputs), model(*inputs)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].dtype == want[1].dtype and torch.equal(got[1], want[1])
