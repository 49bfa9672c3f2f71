"""Softcapped attention (Gemma 2's `attn_logit_softcapping`): scores capped to c·tanh(S / c) before the mask, written
out in matmuls, a tanh and a softmax, become one sdpa with a softcap, which the attention template computes in its
tile; values unchanged."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import get_op
from opfuse.passes.recognize_attention import recognize_attention


class Softcapped(nn.Module):
    """Gemma 2's eager attention: q·kᵀ·scaling, / cap, tanh, · cap, + a causal mask, softmax, · v."""

    def __init__(self, cap: float = 5.0, scaling: float = 0.25, tokens: int = 5):
        super().__init__()
        self.cap, self.scaling = cap, scaling
        self.register_buffer("causal", torch.full((tokens, tokens), float("-inf")).triu(1))

    def forward(self, q, k, v):
        scores = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        scores = torch.tanh(scores / self.cap) * self.cap
        return torch.matmul(torch.softmax(scores + self.causal.to(q.dtype), dim=-1), v)


def _inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return tuple(torch.randn(1, 2, 5, 16, generator=generator, dtype=dtype) * 2 for _ in range(3))


def test_written_out_softcapped_attention_is_one_sdpa_with_its_cap():
    inputs = _inputs(torch.float64)
    graph = capture_torch(Softcapped().double().eval(), inputs)
    fused, changes = recognize_attention(graph)
    (sdpa,) = [node for node in fused if node.op == "sdpa"]
    assert math.isclose(sdpa.attrs["softcap"], 5.0) and math.isclose(sdpa.attrs["scale"], 0.25)
    assert "softcap 5" in changes[0] and not [node for node in fused if node.op in ("tanh", "softmax")]
    (got,), want = interpret(fused, list(inputs)), Softcapped().double()(*inputs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


def test_the_reference_caps_the_scores_before_the_mask():
    q, k, v = _inputs(torch.float64)
    mask = torch.randn(5, 5, dtype=torch.float64)
    got = get_op("sdpa").run([q, k, v, mask], {"scale": 0.5, "softcap": 2.0, "is_causal": True})
    scores = 2.0 * torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 2.0) + mask
    scores = scores.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    assert torch.allclose(got, torch.softmax(scores, -1) @ v, rtol=1e-12, atol=1e-12)


def test_a_tanh_that_is_no_cap_is_left_written_out():
    """A shift before the tanh is no softcap: the chain stays as it is."""

    class Shifted(Softcapped):
        def forward(self, q, k, v):
            scores = torch.tanh(torch.matmul(q, k.transpose(2, 3)) + 1.0)
            return torch.matmul(torch.softmax(scores, dim=-1), v)

    fused, changes = recognize_attention(capture_torch(Shifted().eval(), _inputs()))
    assert changes == [] and [node for node in fused if node.op == "tanh"]


def test_softcapped_attention_is_one_kernel_and_matches_eager():
    model, inputs = Softcapped().eval(), _inputs()
    compiled = opfuse.compile(model, inputs, FusionConfig(dtype="float32"))
    kernels = [group for group in compiled.plan.groups if group.kind is not GroupKind.VIEW]
    assert len(kernels) == 1 and [compiled.analysis.prepared[n].op for n in kernels[0].nodes] == ["sdpa"]
    inputs = tuple(x.flip(-2) for x in _inputs())
    with torch.no_grad():
        got, want = compiled(*inputs), model(*inputs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


class GroupedSoftcapped(nn.Module):
    """Gemma 2's attention with key/value heads repeated for the query heads (expand + reshape)."""

    def forward(self, q, k, v):
        batch, kv_heads, tokens, dim = k.shape
        rep = q.shape[1] // kv_heads
        k, v = (t[:, :, None].expand(batch, kv_heads, rep, tokens, dim).reshape(batch, -1, tokens, dim)
                for t in (k, v))
        scores = torch.tanh(q @ k.transpose(2, 3) / 8.0) * 8.0
        return torch.softmax(scores, dim=-1) @ v


def test_grouped_softcapped_attention_reads_the_shared_heads():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 6, 5, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    model = GroupedSoftcapped().eval()
    compiled = opfuse.compile(model, (q, k, v), FusionConfig(dtype="float32"))
    graph = compiled.plan.graph
    (sdpa,) = [node for node in graph if node.op == "sdpa"]
    assert [graph[i].type.shape[1] for i in sdpa.inputs] == [6, 2, 2] and sdpa.attrs["softcap"] == 8.0
    with torch.no_grad():
        got, want = compiled(q, k, v), model(q, k, v)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
