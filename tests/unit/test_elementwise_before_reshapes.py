"""`elementwise_before_unit_reshapes`: the elementwise ops after a 1-D conv (the 2-D conv of [N, C, 1, L] viewed back
as [N, C, L]) move before the view, so they join the conv's kernel and a batch norm folds into it; values unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.interpret import interpret
from opfuse.passes.elementwise_before_unit_reshapes import elementwise_before_unit_reshapes, unit_reshape
from opfuse.passes.manager import prepare_graph


class ConvBlock1d(nn.Module):
    """An audio block: conv1d, batch norm, a per-channel scale, GELU, and a residual of the block's input."""

    def __init__(self, channels: int = 6):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 3, padding=1)
        self.norm = nn.BatchNorm1d(channels)
        self.scale = nn.Parameter(torch.rand(channels, 1) + 0.5)

    def forward(self, x):
        return nn.functional.gelu(self.norm(self.conv(x)) * self.scale) + x


def _block() -> ConvBlock1d:
    torch.manual_seed(0)
    model = ConvBlock1d().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    return model


def test_a_unit_reshape_only_inserts_or_drops_size_one_dims():
    assert unit_reshape((2, 6, 1, 9), (2, 6, 9)) and unit_reshape((4, 5), (1, 4, 1, 5))
    assert not unit_reshape((2, 6, 9), (2, 6, 9)) and not unit_reshape((2, 6, 9), (12, 9))
    assert not unit_reshape((2, 6, 9), (2, 9, 6))


def test_the_ops_after_a_conv1d_move_before_its_view_and_the_batch_norm_folds():
    model, x = _block(), torch.randn(2, 6, 9, dtype=torch.float64)
    graph = capture_torch(model.double(), (x,))
    moved, changes = elementwise_before_unit_reshapes(graph)
    assert len(changes) == 4        # batch norm, mul, gelu, add
    conv = next(node for node in moved if node.op == "conv2d")
    readers = [node for node in moved if conv.name in node.inputs]
    assert [node.op for node in readers] == ["batch_norm"] and readers[0].type.shape == conv.type.shape
    (got,), want = interpret(moved, [x]), model(x).detach()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12
    prepared, _ = prepare_graph(graph, "float64")
    assert "batch_norm" not in {node.op for node in prepared}


def test_a_conv1d_block_is_one_kernel_and_matches_eager():
    """Before the pass: the conv alone, and batch norm, scale, GELU and the residual in a kernel of their own."""
    model, x = _block(), torch.randn(2, 6, 9)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    kernels = [group for group in analysis.plan.groups if group.kind is not GroupKind.VIEW]
    # the batch norm and the scale folded into the conv's weight, GELU its epilogue, the residual added in it
    assert len(kernels) == 1 and kernels[0].kind is GroupKind.RESIDUAL
    assert [analysis.prepared[n].op for n in kernels[0].nodes] == ["conv2d", "gelu", "add"]
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 6, 9)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


class SumThenView(nn.Module):
    def forward(self, x):
        return torch.relu((x * 2).unsqueeze(1)) + 1


def test_a_reshape_after_anything_but_an_anchor_stays_where_it_is():
    graph = capture_torch(SumThenView(), (torch.randn(3, 4),))
    moved, changes = elementwise_before_unit_reshapes(graph)
    assert changes == [] and [node.op for node in moved] == [node.op for node in graph]


class CausalConv(nn.Module):
    """Mamba's step: a depthwise conv padded on both sides, cut to the first L positions, SiLU, then a gate."""

    def __init__(self, channels: int = 4):
        super().__init__()
        self.conv = nn.Conv1d(channels, channels, 4, padding=3, groups=channels)

    def forward(self, x, gate):
        return torch.nn.functional.silu(self.conv(x)[..., :x.shape[-1]] + 0.5) * gate


def test_an_activation_after_a_causal_cut_moves_before_it_but_a_gate_varying_along_it_does_not():
    torch.manual_seed(0)
    model, x, gate = CausalConv().eval().double(), torch.randn(2, 4, 7, dtype=torch.float64), \
        torch.randn(2, 4, 7, dtype=torch.float64)
    graph = capture_torch(model, (x, gate))
    moved, changes = elementwise_before_unit_reshapes(graph)
    conv = next(node for node in moved if node.op == "conv2d")
    order = list(moved.nodes)
    chain = [moved[name].op for name in order[order.index(conv.name):] if moved[name].op != "constant"]
    # add and silu before the view back to 3-D (then before the cut); the gate's mul after both
    assert chain == ["conv2d", "add", "silu", "reshape", "slice", "mul"], chain
    assert all(node.type.shape == conv.type.shape for node in moved if node.op in ("add", "silu"))
    (got,), want = interpret(moved, [x, gate]), model(x, gate).detach()
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


class TwoViewedProducts(nn.Module):
    """lambda_resnet26t's sum of two matmuls, one of them viewed with a size-1 dim: each side is a unit reshape of
    an anchor, and moving the add through one views the other (the pass looped, moving it back and forth)."""

    def forward(self, x, w1, w2):
        return (x @ w1).unsqueeze(2) + (x @ w2).reshape(2, 3, 1, 4)


def test_a_sum_of_two_viewed_products_moves_once():
    x, w1, w2 = (torch.randn(*shape, dtype=torch.float64) for shape in ((2, 3, 5), (5, 4), (5, 4)))
    graph = capture_torch(TwoViewedProducts(), (x, w1, w2))
    moved, changes = elementwise_before_unit_reshapes(graph)
    assert len(changes) == 1
    (got,), want = interpret(moved, [x, w1, w2]), TwoViewedProducts()(x, w1, w2)
    torch.testing.assert_close(got, want)


class RotaryHalves(nn.Module):
    """GPT-J's rotary step: a linear's heads split by a reshape, every other element sliced and scaled."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        heads = self.proj(x).reshape(2, 3, 2, 4)
        return heads[..., ::2] * 2.0


def test_an_op_after_a_linears_head_split_stays_where_it_is():
    """Only a conv's way back to 5-D regroups dims for an op to move through: after a linear's head split, ops moved
    there left the kernels they had joined (GPT-J 16 -> 20 launches)."""
    graph = capture_torch(RotaryHalves().eval(), (torch.randn(2, 3, 8),))
    moved, changes = elementwise_before_unit_reshapes(graph)
    assert changes == []
