"""ONNX converters of the transformer operators: Attention (opsets 23-25), RMSNormalization and RotaryEmbedding
(23). Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

Attention becomes the IR's `sdpa` (an anchor the attention template takes) with its inputs laid out as PyTorch's
[batch, heads, sequence, head size]: 3-D inputs reshaped and permuted, a past key and value concatenated in front
of the new ones (the present outputs), grouped heads repeated, and every mask (attn_mask, is_causal's bottom-right
frontier, opset 24's nonpad_kv_seqlen, opset 25's sliding window) composed into one additive bias, as ONNX's
reference composes them: a constant when nothing in it comes from an input, else computed at run time. A query row
whose every key is masked gives zeros (ONNX's rule) where PyTorch would give NaN: a `where` over the output. A
softcap, a softmax precision other than the inputs' or a read qk_matmul_output need the scores themselves: then the
op is written out as matmul, tanh, add, softmax and matmul.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import ONNX_DTYPES, Unsupported, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer

ATTENTION_ATTRIBUTES = ("is_causal", "kv_num_heads", "q_num_heads", "qk_matmul_output_mode", "scale", "softcap",
                        "softmax_precision", "left_window_size", "right_window_size")


def _heads_first(importer: Importer, x: str, heads: int | None, name: str) -> str:
    """A 3-D [batch, sequence, heads * size] input as [batch, heads, sequence, size]; a 4-D one as it is."""
    shape = importer.type(x).shape
    if len(shape) == 4:
        return x
    if not heads or shape[2] % heads:
        raise Unsupported(f"3-D attention input {x!r} of {shape[2]} features with num_heads {heads}")
    split = importer.emit("reshape", [x], {"shape": (shape[0], shape[1], heads, shape[2] // heads)},
                          name=f"{name}_heads")
    return importer.emit("permute", [split], {"dims": (0, 2, 1, 3)}, name=f"{name}_heads_first")


def _repeat_heads(importer: Importer, x: str, repeats: int, name: str) -> str:
    """Each head of [batch, heads, sequence, size] repeated `repeats` times in place (numpy.repeat on dim 1)."""
    if repeats == 1:
        return x
    b, h, s, d = importer.type(x).shape
    spread = importer.emit("reshape", [x], {"shape": (b, h, 1, s, d)}, name=f"{name}_spread")
    spread = importer.emit("expand", [spread], {"shape": (b, h, repeats, s, d)}, name=f"{name}_repeated")
    return importer.emit("reshape", [spread], {"shape": (b, h * repeats, s, d)}, name=f"{name}_grouped")


class _Bias:
    """The additive attention bias, built term by term: a constant part (computed here, in float64, then cast) and
    run-time parts (IR nodes). Terms are added in the reference's order so the result is the same value."""

    def __init__(self, importer: Importer, dtype: str, name: str):
        self.importer, self.dtype, self.name = importer, dtype, name
        self.node: str | None = None          # the bias as an IR node, once any part is computed at run time
        self.constant: torch.Tensor | None = None

    def add_constant(self, tensor: torch.Tensor) -> None:
        tensor = tensor.to(torch_dtype(self.dtype))
        if self.node is None:
            self.constant = tensor if self.constant is None else self.constant + tensor
        else:
            self.add_node(self.importer.add_constant(tensor, f"{self.name}_term"))

    def add_node(self, node: str) -> None:
        if self.node is None and self.constant is not None:
            node = self.importer.emit("add", [self.importer.add_constant(self.constant, f"{self.name}_constant"),
                                              node], name=f"{self.name}_sum")
        elif self.node is not None:
            node = self.importer.emit("add", [self.node, node], name=f"{self.name}_sum")
        self.node, self.constant = node, None

    def allowed_node(self, allowed: str) -> None:
        """Add 0 where the bool node `allowed` is true, -inf where not."""
        importer = self.importer
        zero = importer.add_constant(torch.tensor(0.0, dtype=torch_dtype(self.dtype)), f"{self.name}_zero")
        minus_inf = importer.add_constant(torch.tensor(-math.inf, dtype=torch_dtype(self.dtype)),
                                          f"{self.name}_minus_inf")
        self.add_node(importer.emit("where", [allowed, zero, minus_inf], name=f"{self.name}_allowed"))

    @property
    def empty(self) -> bool:
        return self.node is None and self.constant is None

    def as_node(self) -> str:
        if self.node is None:
            self.node = self.importer.add_constant(self.constant, f"{self.name}_constant")
        return self.node


def _additive(tensor: torch.Tensor) -> torch.Tensor:
    return torch.where(tensor, 0.0, -math.inf).to(torch.float64)


def _mask_bias(importer: Importer, bias: _Bias, mask: str, kv: int) -> None:
    """attn_mask as an additive term: a bool mask as 0 / -inf, a float one as it is; a last dim shorter than the
    keys is padded with -inf (masked)."""
    mask_type = importer.type(mask)
    value = importer.constant(mask)
    short = kv - mask_type.shape[-1]
    if value is not None:
        tensor = _additive(value) if mask_type.dtype == "bool" else value.to(torch.float64)
        if short > 0:
            tensor = torch.nn.functional.pad(tensor, (0, short), value=-math.inf)
        bias.add_constant(tensor)
        return
    node = mask
    if mask_type.dtype == "bool":
        zero = importer.add_constant(torch.tensor(0.0, dtype=torch_dtype(bias.dtype)), f"{bias.name}_mask_zero")
        minus_inf = importer.add_constant(torch.tensor(-math.inf, dtype=torch_dtype(bias.dtype)),
                                          f"{bias.name}_mask_minus_inf")
        node = importer.emit("where", [mask, zero, minus_inf], name=f"{bias.name}_mask")
    if short > 0:
        node = importer.emit("pad", [node], {"pads": (0, short), "value": -math.inf}, name=f"{bias.name}_mask_padded")
    bias.add_node(node)


def _frontier_bias(importer: Importer, bias: _Bias, q: int, kv: int, offset: int, nonpad: str | None,
                   causal: bool, left: int, right: int) -> None:
    """is_causal's and the sliding window's terms: query i attends key j iff j <= i + offset (causal) and
    -right <= i + offset - j <= left (window, a side of -1 unbounded); with nonpad_kv_seqlen the offset is
    nonpad[b] - q per batch, computed at run time, and keys from nonpad[b] on are padding."""
    i = torch.arange(q).reshape(q, 1)
    j = torch.arange(kv).reshape(1, kv)
    limits = []      # (bound [q, kv], whether allowed means bound <= nonpad (else nonpad <= bound))
    if causal:
        if nonpad is None:
            bias.add_constant(_additive(j <= i + offset))
        else:
            limits.append((j - i + q, True))        # j <= i + nonpad - q  <=>  j - i + q <= nonpad
    if left >= 0 or right >= 0:
        if nonpad is None:
            diff = i + offset - j
            allowed = torch.ones(q, kv, dtype=torch.bool)
            if left >= 0:
                allowed &= diff <= left
            if right >= 0:
                allowed &= -diff <= right
            bias.add_constant(_additive(allowed))
        else:
            if left >= 0:
                limits.append((left + q + j - i, False))   # i + nonpad - q - j <= left
            if right >= 0:
                limits.append((j - i + q - right, True))  # j - i - nonpad + q <= right
    if nonpad is None:
        return
    batch = importer.type(nonpad).shape[0]
    per_batch = importer.emit("reshape", [nonpad], {"shape": (batch, 1, 1, 1)}, name=f"{bias.name}_nonpad")
    for index, (bound, below) in enumerate(limits):
        bound_node = importer.add_constant(bound.reshape(1, 1, q, kv).to(torch_dtype(importer.type(nonpad).dtype)),
                                           f"{bias.name}_frontier{index}")
        allowed = importer.emit("le", [bound_node, per_batch] if below else [per_batch, bound_node],
                                name=f"{bias.name}_frontier{index}_allowed")
        bias.allowed_node(allowed)
    keys = importer.add_constant(j.reshape(1, 1, 1, kv).to(torch_dtype(importer.type(nonpad).dtype)),
                                 f"{bias.name}_keys")
    bias.allowed_node(importer.emit("lt", [keys, per_batch], name=f"{bias.name}_not_padding"))


@converts("Attention", attributes=ATTENTION_ATTRIBUTES)
def _attention(importer: Importer, node, xs, attrs):
    xs = xs + [None] * (7 - len(xs))
    query, key, value, mask, past_key, past_value, nonpad = xs[:7]
    out = node.output[0]
    rank = len(importer.type(query).shape)
    q = _heads_first(importer, query, attrs.get("q_num_heads"), f"{out}_q")
    k = _heads_first(importer, key, attrs.get("kv_num_heads"), f"{out}_k")
    v = _heads_first(importer, value, attrs.get("kv_num_heads"), f"{out}_v")
    if (past_key is None) != (past_value is None):
        raise Unsupported("past_key without past_value (or the reverse)")
    past = 0
    if past_key is not None:
        past = importer.type(past_key).shape[2]
        k = importer.emit("cat", [past_key, k], {"dim": 2}, name=f"{out}_present_key")
        v = importer.emit("cat", [past_value, v], {"dim": 2}, name=f"{out}_present_value")
    present = [k, v]
    batch, heads, q_len, head_size = importer.type(q).shape
    kv_heads, kv_len = importer.type(k).shape[1:3]
    if heads % kv_heads:
        raise Unsupported(f"{heads} query heads over {kv_heads} key heads")
    dtype = importer.type(q).dtype
    bias = _Bias(importer, dtype, f"{out}_bias")
    causal = bool(attrs.get("is_causal", 0))
    left, right = attrs.get("left_window_size", -1), attrs.get("right_window_size", -1)
    if mask is not None:
        _mask_bias(importer, bias, mask, kv_len)
    _frontier_bias(importer, bias, q_len, kv_len, past, nonpad, causal, left, right)

    k_all = _repeat_heads(importer, k, heads // kv_heads, f"{out}_k")
    v_all = _repeat_heads(importer, v, heads // kv_heads, f"{out}_v")
    scale = attrs.get("scale", 1 / math.sqrt(head_size))
    precision = attrs.get("softmax_precision")
    if precision is not None and precision not in ONNX_DTYPES:
        raise Unsupported(f"softmax_precision {precision}")
    mode = attrs.get("qk_matmul_output_mode", 0)
    wants_scores = len(node.output) > 3 and node.output[3] in importer.used
    explicit = attrs.get("softcap", 0.0) > 0 or wants_scores or (
        precision is not None and ONNX_DTYPES[precision] != dtype)
    guard = _fully_masked_rows(importer, bias, f"{out}_masked_rows")
    if explicit:
        y, scores = _explicit_attention(importer, q, k_all, v_all, bias, guard, scale, attrs, precision, mode, out)
    else:
        y = _sdpa(importer, q, k_all, v_all, bias, guard, scale, causal and past == 0 and nonpad is None and
                  left < 0 and right < 0, out)
        scores = None
    if rank == 3:
        y = importer.emit("permute", [y], {"dims": (0, 2, 1, 3)}, name=f"{out}_heads_last")
        b, s, h, d = importer.type(y).shape
        y = importer.emit("reshape", [y], {"shape": (b, s, h * d)}, name=out)
    return [y, *present, scores]


def _fully_masked_rows(importer: Importer, bias: _Bias, name: str) -> str | None:
    """A bool [..., q, 1] node: the query rows whose every key the bias masks (None when there are none)."""
    if bias.empty:
        return None
    if bias.node is None:
        rows = torch.isneginf(bias.constant.amax(dim=-1, keepdim=True))
        return importer.add_constant(rows, name) if rows.any() else None
    largest = importer.emit("amax", [bias.node], {"dims": [len(importer.type(bias.node).shape) - 1],
                                                  "keepdim": True}, name=f"{name}_largest")
    minus_inf = importer.add_constant(torch.tensor(-math.inf, dtype=torch_dtype(bias.dtype)), f"{name}_minus_inf")
    return importer.emit("eq", [largest, minus_inf], name=name)


def _zero_rows(importer: Importer, x: str, guard: str | None, name: str) -> str:
    """`x` with the fully masked rows zeroed (a select: NaN * 0 would stay NaN)."""
    if guard is None:
        return x
    zero = importer.add_constant(torch.tensor(0.0, dtype=torch_dtype(importer.type(x).dtype)), f"{name}_zero")
    return importer.emit("where", [guard, zero, x], name=name)


def _sdpa(importer: Importer, q: str, k: str, v: str, bias: _Bias, guard: str | None, scale: float, causal: bool,
          out: str) -> str:
    """The IR's sdpa; PyTorch's is_causal is ONNX's frontier without offset, so it stands for that term."""
    inputs = [q, k, v]
    attrs = {"scale": float(scale), "is_causal": False}
    if causal and bias.node is None and bias.constant is not None:
        q_len, kv_len = importer.type(q).shape[2], importer.type(k).shape[2]
        lower = _additive(torch.ones(q_len, kv_len, dtype=torch.bool).tril())
        if torch.equal(bias.constant.to(torch.float64), lower):   # the causal term alone
            bias.constant, attrs["is_causal"] = None, True
    if not bias.empty:
        mask = bias.as_node()
        shape = importer.type(mask).shape
        if len(shape) < 4:
            mask = importer.emit("reshape", [mask], {"shape": (1,) * (4 - len(shape)) + tuple(shape)},
                                 name=f"{out}_mask_4d")
        inputs.append(mask)
    y = importer.emit("sdpa", inputs, attrs, name=f"{out}_sdpa")
    return _zero_rows(importer, y, guard, f"{out}_zeroed")


def _explicit_attention(importer: Importer, q: str, k: str, v: str, bias: _Bias, guard: str | None, scale: float,
                        attrs: dict, precision: int | None, mode: int, out: str) -> tuple[str, str]:
    """Attention op by op, as ONNX's reference: (Q * sqrt(scale)) @ (K * sqrt(scale))^T, softcap, the bias,
    softmax (in softmax_precision), the masked rows zeroed, @ V; and the qk_matmul_output of `mode`."""
    root = importer.scalar(math.sqrt(scale), q)
    k_scaled = importer.emit("mul", [k, root], name=f"{out}_k_scaled")
    scores = importer.emit("matmul", [importer.emit("mul", [q, root], name=f"{out}_q_scaled"),
                                      importer.emit("permute", [k_scaled], {"dims": (0, 1, 3, 2)}, name=f"{out}_k_t")],
                           name=f"{out}_scores")
    shown = scores
    softcap = attrs.get("softcap", 0.0)
    if softcap > 0:
        capped = importer.emit("tanh", [importer.emit("div", [scores, importer.scalar(softcap, scores)],
                                                      name=f"{out}_scores_over_cap")], name=f"{out}_scores_tanh")
        scores = importer.emit("mul", [capped, importer.scalar(softcap, capped)], name=f"{out}_scores_capped")
        shown = scores if mode == 1 else shown
    biased = scores if bias.empty else importer.emit("add", [scores, bias.as_node()], name=f"{out}_scores_biased")
    shown = biased if mode == 2 else shown
    dtype = importer.type(q).dtype
    wide = biased
    if precision is not None and ONNX_DTYPES[precision] != dtype:
        wide = importer.emit("cast", [biased], {"dtype": ONNX_DTYPES[precision]}, name=f"{out}_scores_wide")
    weights = _zero_rows(importer, importer.emit("softmax", [wide], {"dim": 3}, name=f"{out}_weights"), guard,
                         f"{out}_weights_guarded")
    if importer.type(weights).dtype != dtype:
        weights = importer.emit("cast", [weights], {"dtype": dtype}, name=f"{out}_weights_narrow")
    shown = weights if mode == 3 else shown
    return importer.emit("matmul", [weights, v], name=f"{out}_attended"), shown


# ---- RMSNormalization and RotaryEmbedding ------------------------------------------------------------------

@converts("RMSNormalization", attributes=("axis", "epsilon", "stash_type"))
def _rms_normalization(importer: Importer, node, xs, attrs):
    """The IR's rms_norm (over the last dim, in at least float32, the stash type) of x seen as [rows, the dims from
    `axis` on]; a scale of the normalised shape goes in as its weight, any other broadcasting one multiplies after."""
    if attrs.get("stash_type", 1) != 1:
        raise Unsupported("stash_type other than float32")
    shape = importer.type(xs[0]).shape
    axis = attrs.get("axis", -1) % len(shape)
    eps = attrs.get("epsilon", 1e-5)
    normalized = shape[axis:]
    scale = xs[1]
    flat = (math.prod(shape[:axis]), math.prod(normalized))
    x = xs[0] if axis == len(shape) - 1 else importer.emit("reshape", [xs[0]], {"shape": flat},
                                                           name=f"{node.output[0]}_rows")
    inputs = [x]
    whole = importer.type(scale).shape == normalized and importer.type(scale).dtype == importer.type(x).dtype
    if whole:
        inputs.append(scale if len(normalized) == 1 else importer.emit(
            "reshape", [scale], {"shape": (flat[1],)}, name=f"{node.output[0]}_scale_flat"))
    y = importer.emit("rms_norm", inputs, {"eps": float(eps)}, name=f"{node.output[0]}_normalised")
    if x != xs[0]:
        y = importer.emit("reshape", [y], {"shape": shape}, name=f"{node.output[0]}_shaped")
    if not whole:
        y = importer.emit("mul", [y, scale])
        if importer.type(y).dtype != importer.type(xs[0]).dtype:
            y = importer.emit("cast", [y], {"dtype": importer.type(xs[0]).dtype})
    return [y]


@converts("RotaryEmbedding", attributes=("interleaved", "num_heads", "rotary_embedding_dim"))
def _rotary_embedding(importer: Importer, node, xs, attrs):
    """x rotated pairwise by the cached cos and sin of each position: slices, muls, adds and a cat. The caches are
    [positions, half] read at position_ids (a gather), or [batch, sequence, half] as they are."""
    x, cos, sin = xs[:3]
    positions = xs[3] if len(xs) > 3 else None
    out = node.output[0]
    shape = importer.type(x).shape
    if len(shape) == 3:   # [batch, sequence, heads * size] as [batch, sequence, heads, size]
        heads = attrs.get("num_heads", 0)
        if not heads or shape[2] % heads:
            raise Unsupported("a 3-D input needs num_heads dividing its hidden size")
        work = importer.emit("reshape", [x], {"shape": (shape[0], shape[1], heads, shape[2] // heads)},
                             name=f"{out}_heads")
        seq_axis = 1
    else:                 # [batch, heads, sequence, size]
        work, seq_axis = x, 2
    batch, size = shape[0], importer.type(work).shape[3]
    rotated = attrs.get("rotary_embedding_dim", 0) or size
    half = rotated // 2
    if positions is not None:
        cos = importer.emit("take", [cos, positions], {"axis": 0}, name=f"{out}_cos")
        sin = importer.emit("take", [sin, positions], {"axis": 0}, name=f"{out}_sin")
    if importer.type(cos).shape[-1] != half:
        raise Unsupported(f"cos cache of {importer.type(cos).shape[-1]} values for a rotation of {rotated}")
    seq = importer.type(cos).shape[1]
    table = (batch, seq, 1, half) if seq_axis == 1 else (batch, 1, seq, half)
    cos = importer.emit("reshape", [cos], {"shape": table}, name=f"{out}_cos_table")
    sin = importer.emit("reshape", [sin], {"shape": table}, name=f"{out}_sin_table")

    def part(start: int, end: int, step: int, name: str) -> str:
        return importer.emit("slice", [work], {"dim": 3, "start": start, "end": end, "step": step},
                             name=f"{out}_{name}")

    interleaved = bool(attrs.get("interleaved", 0))
    x1 = part(0, rotated, 2, "even") if interleaved else part(0, half, 1, "first")
    x2 = part(1, rotated, 2, "odd") if interleaved else part(half, rotated, 1, "second")
    real = importer.emit("sub", [importer.emit("mul", [cos, x1], name=f"{out}_cos_x1"),
                                 importer.emit("mul", [sin, x2], name=f"{out}_sin_x2")], name=f"{out}_real")
    imag = importer.emit("add", [importer.emit("mul", [sin, x1], name=f"{out}_sin_x1"),
                                 importer.emit("mul", [cos, x2], name=f"{out}_cos_x2")], name=f"{out}_imag")
    if interleaved:   # real and imaginary parts back in alternate places
        pair = importer.type(real).shape + (1,)
        paired = importer.emit("cat", [importer.emit("reshape", [real], {"shape": pair}, name=f"{out}_real_pair"),
                                       importer.emit("reshape", [imag], {"shape": pair}, name=f"{out}_imag_pair")],
                               {"dim": 4}, name=f"{out}_pairs")
        parts = [importer.emit("reshape", [paired], {"shape": importer.type(real).shape[:3] + (rotated,)},
                               name=f"{out}_rotated")]
    else:
        parts = [real, imag]
    if rotated < size:
        parts.append(part(rotated, size, 1, "kept"))
    result = importer.emit("cat", parts, {"dim": 3}, name=f"{out}_joined" if len(shape) == 3 else out)
    if len(shape) == 3:
        result = importer.emit("reshape", [result], {"shape": shape}, name=out)
    return [result]


# ---- LinearAttention (opset 27) ------------------------------------------------------------------------------

@converts("LinearAttention", attributes=("chunk_size", "kv_num_heads", "q_num_heads", "scale", "update_rule"))
def _linear_attention(importer: Importer, node, xs, attrs):
    """The recurrence run token by token, as ONNX defines it, in float32: for each t the state [B, H_kv, d_k, d_v]
    decays by exp(decay_t) (gated rules), the value is corrected by beta_t * (v_t - S^T k_t) (delta rules), the
    state gains k_t v_t^T (a matmul of [d_k, 1] by [1, d_v]) and the output is scale * q_t^T S, each key head's
    state read by its group of query heads. Unrolled over the sequence, which is static: a long prefill is a long
    graph (chunk_size is a tuning hint and changes nothing)."""
    xs = xs + [None] * (6 - len(xs))
    query, key, value, past, decay, beta = xs[:6]
    out = node.output[0]
    rule = attrs.get("update_rule", "gated_delta")
    gating, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    if rule not in ("linear", "gated", "delta", "gated_delta") or (decay is None) == gating or (beta is None) == delta:
        raise Unsupported(f"update_rule {rule!r} with{'' if decay else 'out'} decay and "
                          f"with{'' if beta else 'out'} beta")
    heads, kv_heads = attrs["q_num_heads"], attrs["kv_num_heads"]
    if heads % kv_heads:
        raise Unsupported(f"{heads} query heads over {kv_heads} key heads")

    def wide(x, name):
        return x if importer.type(x).dtype == "float32" else importer.emit("cast", [x], {"dtype": "float32"},
                                                                            name=f"{out}_{name}_f32")

    q = _heads_first(importer, wide(query, "q"), heads, f"{out}_q")            # [B, H, T, d_k]
    k = _heads_first(importer, wide(key, "k"), kv_heads, f"{out}_k")
    v = _heads_first(importer, wide(value, "v"), kv_heads, f"{out}_v")
    batch, _, steps, d_k = importer.type(q).shape
    d_v = importer.type(v).shape[3]
    scale = attrs.get("scale", 0.0) or 1 / math.sqrt(d_k)
    gates = None
    if gating:   # [B, T, H_kv] or [B, T, H_kv * d_k] as [B, H_kv, T, 1 or d_k]
        per = importer.type(decay).shape[2] // kv_heads
        gates = _heads_first(importer, wide(decay, "decay"), kv_heads, f"{out}_decay") if per > 1 else \
            importer.emit("permute", [importer.emit("reshape", [wide(decay, "decay")], {
                "shape": (batch, steps, kv_heads, 1)}, name=f"{out}_decay_heads")], {"dims": (0, 2, 1, 3)},
                name=f"{out}_decay_heads_first")
    rates = None
    if delta:    # [B, T, H_kv or 1] as [B, H_kv or 1, T, 1]
        width = importer.type(beta).shape[2]
        rates = importer.emit("permute", [importer.emit("reshape", [wide(beta, "beta")], {
            "shape": (batch, steps, width, 1)}, name=f"{out}_beta_heads")], {"dims": (0, 2, 1, 3)},
            name=f"{out}_beta_heads_first")
    if past is None:
        state = importer.add_constant(torch.zeros((batch, kv_heads, d_k, d_v)), f"{out}_no_past")
    else:
        state = wide(past, "past")

    def step(x, t, name):
        return importer.emit("slice", [x], {"dim": 2, "start": t, "end": t + 1, "step": 1}, name=f"{out}_{name}{t}")

    outputs = []
    for t in range(steps):
        k_t, v_t = step(k, t, "k"), step(v, t, "v")                            # [B, H_kv, 1, d]
        if gating:
            g_t = step(gates, t, "g")                                          # [B, H_kv, 1, d_k or 1]
            g_t = importer.emit("reshape", [g_t], {"shape": (batch, kv_heads, importer.type(g_t).shape[3], 1)},
                                name=f"{out}_g{t}_column")
            state = importer.emit("mul", [state, importer.emit("exp", [g_t], name=f"{out}_decay{t}")],
                                  name=f"{out}_decayed{t}")
        if delta:
            retrieved = importer.emit("matmul", [k_t, state], name=f"{out}_retrieved{t}")      # [B, H, 1, d_v]
            v_t = importer.emit("mul", [step(rates, t, "beta"), importer.emit("sub", [v_t, retrieved],
                                                                              name=f"{out}_error{t}")],
                                name=f"{out}_corrected{t}")
        column = importer.emit("permute", [k_t], {"dims": (0, 1, 3, 2)}, name=f"{out}_k_column{t}")
        state = importer.emit("add", [state, importer.emit("matmul", [column, v_t], name=f"{out}_outer{t}")],
                              name=f"{out}_state{t}")
        read = _repeat_heads(importer, state, heads // kv_heads, f"{out}_state{t}")
        outputs.append(importer.emit("mul", [importer.emit("matmul", [step(q, t, "q"), read], name=f"{out}_read{t}"),
                                             importer.scalar(scale, read)], name=f"{out}_o{t}"))
    y = outputs[0] if steps == 1 else importer.emit("cat", outputs, {"dim": 2}, name=f"{out}_steps")
    y = importer.emit("permute", [y], {"dims": (0, 2, 1, 3)}, name=f"{out}_heads_last")
    y = importer.emit("reshape", [y], {"shape": (batch, steps, heads * d_v)}, name=f"{out}_packed")
    dtype = importer.type(query).dtype
    y = y if dtype == "float32" else importer.emit("cast", [y], {"dtype": dtype}, name=out)
    state_dtype = importer.type(past).dtype if past is not None else dtype
    present = state if state_dtype == "float32" else importer.emit("cast", [state], {"dtype": state_dtype},
                                                                   name=f"{out}_present")
    return [y, present]
