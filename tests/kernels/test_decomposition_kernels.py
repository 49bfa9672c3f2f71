"""ATen ops decomposed onto existing IR ops where that is exact: einsum (permutes, reshapes and a batched matmul
or a broadcast mul), baddbmm (a matmul with its scale and add), masked_fill (a where). Each capture is checked
against eager through the reference interpreter; the batched matmul with baddbmm's epilogue runs on Triton's
interpreter with NaN-poisoned outputs."""

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
from tests.kernels.test_conv_kernels import Builder
from tests.kernels.test_gemm_kernels import run_gemm

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


class Einsum(nn.Module):
    def __init__(self, equation: str):
        super().__init__()
        self.equation = equation

    def forward(self, *xs):
        return torch.einsum(self.equation, *xs)


@pytest.mark.parametrize("equation,shapes", [
    ("ij,jk->ik", [(5, 7), (7, 3)]),
    ("bhqd,bhkd->bhqk", [(2, 3, 5, 8), (2, 3, 6, 8)]),
    ("bclhn,bcshn->bclsh", [(1, 2, 5, 3, 4), (1, 2, 6, 3, 4)]),          # mamba2's chunked scores
    ("bchpn,bcn->bchp", [(1, 2, 3, 4, 5), (1, 2, 5)]),
    ("i,j->ij", [(4,), (6,)]),                                             # an outer product: no contraction
    ("bij,bjk->bk", [(2, 3, 4), (2, 4, 5)]),                               # i summed away first
    ("nchw->nhwc", [(2, 3, 4, 5)]),
])
def test_einsum_is_captured_exactly(equation, shapes):
    xs = [torch.randn(*shape) for shape in shapes]
    model = Einsum(equation)
    graph = capture_torch(model, tuple(xs))
    assert not [n for n in graph if n.op == "opaque"]
    torch.testing.assert_close(interpret(graph, xs)[0], model(*xs), rtol=1e-5, atol=1e-5)


class AlibiScores(nn.Module):
    """Bloom's scores: baddbmm(alibi, q, k, beta=1, alpha=1/sqrt(d)), then a masked_fill of the causal mask."""

    def forward(self, alibi, q, k, mask):
        scores = torch.baddbmm(alibi, q, k, beta=1.0, alpha=0.125)
        twice = torch.baddbmm(alibi, q, k, beta=0.5, alpha=2.0) + torch.baddbmm(alibi, q, k, beta=0.0)
        return scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1) + twice


def test_baddbmm_and_masked_fill_are_captured_and_plan_as_kernels():
    alibi, q, k = torch.randn(4, 1, 6), torch.randn(4, 5, 8), torch.randn(4, 8, 6)
    mask = torch.ones(5, 6, dtype=torch.bool).triu(1)
    model = AlibiScores()
    graph = capture_torch(model, (alibi, q, k, mask))
    assert not [n for n in graph if n.op == "opaque"]
    torch.testing.assert_close(interpret(graph, [alibi, q, k, mask])[0], model(alibi, q, k, mask))
    prepared, _ = prepare_graph(graph, "float32")
    assert groups_through_pytorch(plan_fusion(prepared, FusionConfig(dtype="float32"))) == {}


def test_baddbmm_epilogue_on_the_batched_matmul_kernel():
    b = Builder()
    q, k = b.input("q", (3, 5, 9)), b.input("k", (3, 9, 7))
    alibi = b.input("alibi", (3, 1, 7))
    scaled = b.op("mul", b.op("matmul", q, k), b.const("alpha", torch.tensor(0.125)))
    run_gemm(b, [b.op("add", alibi, scaled)], GroupKind.RESIDUAL)      # Bloom's beta = 1
