"""Attention's reference facts shared by the op registry and the kernels: which key/value heads a query head reads
(`kv_heads_shared`), and softcapped attention written out (`softcapped_sdpa`), which torch's sdpa cannot compute."""

from __future__ import annotations

import math
from typing import Sequence

import torch


def kv_heads_shared(q_shape: Sequence[int], kv_shape: Sequence[int]) -> int:
    """How many query heads share each head of a key or value tensor of `kv_shape` in an sdpa whose queries are
    `q_shape`: 1 where the heads (dim -3) match or broadcast, Hq / Hkv where fewer key/value heads divide the
    queries' (grouped-query attention: query head h reads key/value head h // (Hq / Hkv), as torch's enable_gqa)."""
    if len(q_shape) < 3 or len(kv_shape) < 3:
        return 1
    heads, kv_heads = q_shape[-3], kv_shape[-3]
    if kv_heads in (heads, 1) or heads % kv_heads:
        return 1
    return heads // kv_heads


def softcapped_sdpa(q, k, v, mask, a):
    """softmax(c·tanh(q·kᵀ·scale / c) + mask)·v in float32 (float64 for float64 inputs), in q's dtype; a row with no
    allowed key is 0, as torch's sdpa gives it."""
    exact = torch.float64 if q.dtype == torch.float64 else torch.float32
    k, v = (x.repeat_interleave(kv_heads_shared(q.shape, x.shape), dim=-3) for x in (k, v))
    scale = a.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    cap = float(a["softcap"])
    scores = torch.matmul(q.to(exact), k.to(exact).transpose(-1, -2)) * scale
    scores = cap * torch.tanh(scores / cap)
    if a.get("is_causal"):
        rows, keys = scores.shape[-2:]
        scores = scores.masked_fill(~torch.ones(rows, keys, dtype=torch.bool, device=q.device).tril(), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask.to(exact)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.matmul(weights, v.to(exact)).to(q.dtype)
