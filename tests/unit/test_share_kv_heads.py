"""share_kv_heads: key/value heads repeated for grouped-query attention (expand + reshape, a copy in PyTorch) are
read by sdpa unrepeated; captured models with the repeat, or with torch's enable_gqa, plan with no copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from opfuse.api import analyze
from opfuse.config import FusionConfig
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import recognize_attention, share_kv_heads
from tests.unit.test_passes import assert_same_numerics, op, run_pass

B, H, HKV, S, D = 2, 6, 2, 5, 4


def _repeated(kv_heads: int = HKV, through_unsqueeze: bool = True, seq: int = S, grow_dim: int = 2) -> Graph:
    """q [B, H, seq, D]; k and v [B, kv_heads, seq, D] repeated as transformers' repeat_kv does (a size-1 dim after
    the heads grown to H / kv_heads, merged into them), then sdpa; `grow_dim` 3: the size-1 dim after the sequence
    grown instead, the same merge."""
    graph = Graph("gqa")
    q = graph.add_input("q", TensorType((B, H, seq, D), "float64")).name
    rep = H // kv_heads
    inputs = [q]
    for name in "kv":
        single = [B, kv_heads, seq, D]
        single.insert(grow_dim, 1)
        if through_unsqueeze:
            x = graph.add_input(name, TensorType((B, kv_heads, seq, D), "float64")).name
            x = op(graph, f"{name}_unsqueezed", "reshape", [x], shape=tuple(single))
        else:       # the 5-D value comes from elsewhere: the pass reshapes it (a view)
            x = graph.add_input(name, TensorType(tuple(single), "float64")).name
            x = op(graph, f"{name}_tanh", "tanh", [x])
        single[grow_dim] = rep
        x = op(graph, f"{name}_expanded", "expand", [x], shape=tuple(single))
        inputs.append(op(graph, f"{name}_repeated", "reshape", [x], shape=(B, H, seq, D)))
    graph.outputs = [op(graph, "attention", "sdpa", inputs, is_causal=True, scale=None)]
    return graph


@pytest.mark.parametrize("kv_heads, through_unsqueeze", [(HKV, True), (1, True), (3, False)])
def test_sdpa_reads_the_key_value_heads_unrepeated(kv_heads, through_unsqueeze):
    before = _repeated(kv_heads, through_unsqueeze=through_unsqueeze)
    after, changes = run_pass(share_kv_heads, before)
    sdpa = after["attention"]
    assert len(changes) == 2
    assert [after[i].type.shape for i in sdpa.inputs] == [(B, H, S, D)] + [(B, kv_heads, S, D)] * 2
    assert not any(n.op == "expand" for n in after)        # the repeat is gone
    assert_same_numerics(before, after)


def test_an_expand_of_another_dim_is_no_head_repeat():
    """The same ops growing a dim after the sequence (as long as the heads' repeat) and merging it into the heads:
    not a repeat of the heads, left alone."""
    before = _repeated(seq=H // HKV, grow_dim=3)
    after, changes = run_pass(share_kv_heads, before)
    assert changes == [] and after.format() == before.format()


def _written_out(softcap: bool) -> Graph:
    """Attention written out over repeated key/value heads: q @ repeat(k)^T, a tanh softcap (Gemma 2's, which keeps
    it from being one sdpa) or not, softmax, @ repeat(v)."""
    graph = Graph("eager")
    q = graph.add_input("q", TensorType((B, H, S, D), "float64")).name
    repeated = []
    for name in "kv":
        x = graph.add_input(name, TensorType((B, HKV, S, D), "float64")).name
        x = op(graph, f"{name}_unsqueezed", "reshape", [x], shape=(B, HKV, 1, S, D))
        x = op(graph, f"{name}_expanded", "expand", [x], shape=(B, HKV, H // HKV, S, D))
        repeated.append(op(graph, f"{name}_repeated", "reshape", [x], shape=(B, H, S, D)))
    keys = op(graph, "keys", "permute", [repeated[0]], dims=(0, 1, 3, 2))
    scores = op(graph, "scores", "matmul", [q, keys])
    if softcap:
        scores = op(graph, "capped", "tanh", [scores])
    probs = op(graph, "probs", "softmax", [scores], dim=3)
    graph.outputs = [op(graph, "context", "matmul", [probs, repeated[1]])]
    return graph


def test_a_matmul_reads_repeated_heads_as_a_broadcast():
    """q @ repeat(k)^T and p @ repeat(v) become matmuls of the heads split [B, Hkv, rep, ...] by the unrepeated
    k, v [B, Hkv, 1, ...] (broadcast over rep), merged back: the same values, no expand left."""
    before = _written_out(softcap=True)
    after, changes = run_pass(share_kv_heads, before)
    assert len(changes) == 2
    products = [n for n in after if n.op == "matmul"]
    assert [after[i].type.shape for i in products[0].inputs] == [(B, HKV, H // HKV, S, D), (B, HKV, 1, D, S)]
    assert [after[i].type.shape for i in products[1].inputs] == [(B, HKV, H // HKV, S, S), (B, HKV, 1, S, D)]
    assert not any(n.op == "expand" for n in after)
    assert_same_numerics(before, after)


def test_recognized_attention_over_repeated_heads_reads_them_shared():
    """Without the softcap the written-out attention is one sdpa first (its keys a transpose of the transposed
    repeat), which then reads k and v unrepeated."""
    before = _written_out(softcap=False)
    recognized, _ = run_pass(recognize_attention, before)
    after, changes = run_pass(share_kv_heads, recognized)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert [after[i].type.shape for i in sdpa.inputs] == [(B, H, S, D)] + [(B, HKV, S, D)] * 2
    assert not any(n.op in ("expand", "permute") for n in after)
    assert_same_numerics(before, after)


class GroupedQueryAttention(nn.Module):
    """q with 4 heads, k and v with 2, repeated as transformers' repeat_kv does or shared through enable_gqa."""

    def __init__(self, repeat: bool):
        super().__init__()
        self.repeat = repeat
        self.q, self.kv, self.out = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        q = self.q(x).view(batch, tokens, 4, 8).transpose(1, 2)
        k, v = self.kv(x).view(batch, tokens, 2, 2, 8).permute(2, 0, 3, 1, 4)
        if self.repeat:
            k, v = (t[:, :, None].expand(batch, 2, 2, tokens, 8).reshape(batch, 4, tokens, 8) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not self.repeat)
        return self.out(y.transpose(1, 2).reshape(batch, tokens, 32))


@pytest.mark.parametrize("repeat", [True, False])
def test_captured_grouped_query_attention_copies_nothing(repeat):
    torch.manual_seed(0)
    model = GroupedQueryAttention(repeat).eval()
    x = torch.randn(1, 7, 32)
    analysis = analyze(model, (x,), config=FusionConfig(dtype="float32"))
    graph = analysis.prepared
    (sdpa,) = [n for n in graph if n.op == "sdpa"]
    assert [graph[i].type.shape[1] for i in sdpa.inputs] == [4, 2, 2]
    assert not analysis.opaque_ops and not analysis.pytorch_groups
    assert not any(g.code is Code.VIEW_COPY for g in analysis.plan.groups)
    from opfuse.ir.interpret import interpret
    with torch.no_grad():
        torch.testing.assert_close(interpret(graph, [x])[0], model(x), rtol=1e-5, atol=1e-6)
