"""The transformer operators of opsets 23-25 (`opfuse.frontend.onnx_attention`): Attention, RMSNormalization and
RotaryEmbedding built with onnx.helper, imported with no opaque node, run through the IR interpreter and compared
with onnx.reference.ReferenceEvaluator; and the IR ops they become."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from opfuse.frontend.onnx_import import load_onnx
from opfuse.ir.interpret import interpret

rng = np.random.default_rng(0)


def floats(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def run(node: onnx.NodeProto, feeds: dict, opset: int = 23, outputs: int | None = None, tolerance: float = 1e-5):
    """One node as a model (feeds as graph inputs, an empty name an omitted input), imported and interpreted,
    compared output by output with the reference; returns the imported graph."""
    names = [o for o in node.output if o][:outputs]
    inputs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for n, a in feeds.items()]
    probe = helper.make_model(helper.make_graph([node], "probe", inputs, [
        helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in names]),
        opset_imports=[helper.make_opsetid("", opset)])
    expected = ReferenceEvaluator(probe).run(names, feeds)
    typed = helper.make_model(helper.make_graph([node], "typed", inputs, [
        helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(e.dtype), e.shape)
        for n, e in zip(names, expected)]), opset_imports=[helper.make_opsetid("", opset)])
    graph = load_onnx(typed, runnable=True)
    got = interpret(graph, [torch.from_numpy(a) for a in feeds.values()])
    for ours, want in zip(got, expected):
        ours = ours.numpy()
        assert ours.shape == want.shape and ours.dtype == want.dtype
        assert np.array_equal(np.isnan(ours), np.isnan(want))
        error = np.linalg.norm(np.nan_to_num(ours - want)) / max(np.linalg.norm(np.nan_to_num(want)), 1e-30)
        assert error < tolerance, f"relative error {error}"
    return graph


def ops(graph) -> list[str]:
    return [n.op for n in graph if n.op not in ("input", "constant")]


# ---- Attention --------------------------------------------------------------------------------------------

def test_attention_is_an_sdpa_node_with_the_causal_term_as_is_causal():
    q, k, v = floats(2, 3, 4, 8), floats(2, 3, 4, 8), floats(2, 3, 4, 8)
    graph = run(helper.make_node("Attention", ["q", "k", "v"], ["y"], is_causal=1), {"q": q, "k": k, "v": v})
    (sdpa,) = [n for n in graph if n.op == "sdpa"]
    assert ops(graph) == ["sdpa"] and sdpa.attrs["is_causal"] and len(sdpa.inputs) == 3


@pytest.mark.parametrize("mask", ["bool", "float", "short"])
def test_attention_masks_and_unequal_head_sizes(mask):
    """A bool mask (False: -inf), a float one added, one shorter than the keys (padded with -inf); v's head size
    differs from q's and k's."""
    q, k, v = floats(1, 2, 3, 4), floats(1, 2, 5, 4), floats(1, 2, 5, 6)
    value = {"bool": rng.random((3, 5)) > 0.3, "float": floats(1, 2, 3, 5), "short": floats(3, 4)}[mask]
    graph = run(helper.make_node("Attention", ["q", "k", "v", "m"], ["y"]), {"q": q, "k": k, "v": v, "m": value})
    assert "sdpa" in ops(graph)


def test_attention_3d_grouped_heads_with_a_past_gives_the_present_cache():
    """3-D inputs with q_num_heads 4 over kv_num_heads 2 (each key head serves two query heads), a past key and
    value concatenated in front (the present outputs), causal with the past's offset (bottom-right)."""
    feeds = {"q": floats(2, 3, 4 * 8), "k": floats(2, 3, 2 * 8), "v": floats(2, 3, 2 * 8), "m": floats(3, 5),
             "pk": floats(2, 2, 2, 8), "pv": floats(2, 2, 2, 8)}
    node = helper.make_node("Attention", ["q", "k", "v", "m", "pk", "pv"], ["y", "present_k", "present_v"],
                            q_num_heads=4, kv_num_heads=2, is_causal=1)
    run(node, feeds)


@pytest.mark.parametrize("mode, softcap", [(0, 0.0), (1, 2.0), (2, 2.0), (3, 2.0)])
def test_attention_written_out_for_softcap_and_each_qk_matmul_output(mode, softcap):
    """A softcap, or a read qk_matmul_output, needs the scores: matmul, (tanh,) add, softmax, matmul, no sdpa.
    (Mode 0 is the scores before the softcap, as the operator's definition says; onnx 1.23's reference evaluator
    gives them after it, so mode 0 is compared without one.)"""
    feeds = {"q": floats(1, 2, 3, 4), "k": floats(1, 2, 3, 4), "v": floats(1, 2, 3, 4), "m": floats(3, 3)}
    node = helper.make_node("Attention", ["q", "k", "v", "m"], ["y", "", "", "qk"], softcap=softcap,
                            qk_matmul_output_mode=mode, scale=0.3)
    graph = run(node, feeds)
    assert "sdpa" not in ops(graph) and ("tanh" in ops(graph)) == bool(softcap)


def test_attention_zeroes_a_fully_masked_row_and_pads_keys_past_nonpad_kv_seqlen():
    """Opset 24: keys from nonpad_kv_seqlen[b] on are padding, and the causal frontier is offset by
    nonpad_kv_seqlen[b] - q_len per batch (computed at run time); batch 1's first query sees no key: zeros, not
    PyTorch's NaN."""
    feeds = {"q": floats(2, 2, 3, 4), "k": floats(2, 2, 6, 4), "v": floats(2, 2, 6, 4),
             "n": np.array([6, 2], np.int64)}
    node = helper.make_node("Attention", ["q", "k", "v", "", "", "", "n"], ["y"], is_causal=1)
    graph = run(node, feeds, opset=24)
    assert "sdpa" in ops(graph) and "where" in ops(graph)
    (y,) = interpret(graph, [torch.from_numpy(a) for a in feeds.values()])
    assert torch.equal(y[1, :, 0], torch.zeros(2, 4)) and not y.isnan().any()


def test_attention_sliding_window_of_opset_25():
    feeds = {"q": floats(1, 2, 5, 4), "k": floats(1, 2, 5, 4), "v": floats(1, 2, 5, 4)}
    run(helper.make_node("Attention", ["q", "k", "v"], ["y"], left_window_size=1, right_window_size=2), feeds,
        opset=25)


def test_attention_in_float16_with_softmax_in_float32():
    feeds = {k: floats(1, 2, 3, 8, dtype=np.float16) for k in "qkv"}
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], softmax_precision=TensorProto.FLOAT)
    graph = run(node, feeds, opset=23, tolerance=1e-3)
    assert "cast" in ops(graph) and "softmax" in ops(graph)


# ---- RMSNormalization and RotaryEmbedding -----------------------------------------------------------------

def test_rms_normalization_over_the_last_dim_is_one_rms_norm_with_its_scale():
    graph = run(helper.make_node("RMSNormalization", ["x", "scale"], ["y"], epsilon=1e-3),
                {"x": floats(2, 3, 8), "scale": floats(8)})
    (norm,) = [n for n in graph if n.op == "rms_norm"]
    assert ops(graph) == ["rms_norm"] and len(norm.inputs) == 2 and norm.attrs["eps"] == pytest.approx(1e-3)


@pytest.mark.parametrize("axis, scale_shape", [(1, (3, 4, 5)), (-2, (1, 5)), (0, (5,))])
def test_rms_normalization_over_several_dims_and_broadcast_scales(axis, scale_shape):
    run(helper.make_node("RMSNormalization", ["x", "scale"], ["y"], axis=axis),
        {"x": floats(2, 3, 4, 5), "scale": floats(*scale_shape)})


def test_rms_normalization_in_float16_computes_in_float32():
    run(helper.make_node("RMSNormalization", ["x", "scale"], ["y"]),
        {"x": floats(2, 16, dtype=np.float16) * 30, "scale": floats(16, dtype=np.float16)}, tolerance=1e-3)


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 4])
def test_rotary_embedding_with_position_ids(interleaved, rotary_dim):
    """A 4-D [batch, heads, sequence, size] input, caches [positions, half] read at position_ids (a take), the pairs
    split in halves or interleaved, all of the head or its first rotary_dim values rotated."""
    half = (rotary_dim or 8) // 2
    feeds = {"x": floats(2, 3, 4, 8), "cos": floats(10, half), "sin": floats(10, half),
             "positions": rng.integers(0, 10, (2, 4)).astype(np.int64)}
    attrs = {"interleaved": interleaved} | ({"rotary_embedding_dim": rotary_dim} if rotary_dim else {})
    graph = run(helper.make_node("RotaryEmbedding", ["x", "cos", "sin", "positions"], ["y"], **attrs), feeds)
    assert ops(graph).count("take") == 2 and "cat" in ops(graph)


def test_rotary_embedding_of_a_3d_input_without_position_ids():
    feeds = {"x": floats(2, 4, 3 * 6), "cos": floats(2, 4, 3), "sin": floats(2, 4, 3)}
    run(helper.make_node("RotaryEmbedding", ["x", "cos", "sin"], ["y"], num_heads=3), feeds)


# ---- LinearAttention --------------------------------------------------------------------------------------

@pytest.mark.parametrize("rule, decay_width, beta_width", [("linear", None, None), ("gated", "head", None),
                                                           ("gated", "key", None), ("delta", None, "head"),
                                                           ("gated_delta", "head", "one")])
def test_linear_attention_rules_with_grouped_heads_and_a_past_state(rule, decay_width, beta_width):
    """Opset 27: the recurrence unrolled over 3 tokens; 4 query heads read 2 key heads' states."""
    b, t, heads, kv_heads, d_k, d_v = 2, 3, 4, 2, 4, 5
    feeds = {"q": floats(b, t, heads * d_k), "k": floats(b, t, kv_heads * d_k) * 0.5,
             "v": floats(b, t, kv_heads * d_v), "past": floats(b, kv_heads, d_k, d_v) * 0.1}
    inputs = ["q", "k", "v", "past", "", ""]
    if decay_width:
        feeds["decay"] = -np.abs(floats(b, t, kv_heads * (d_k if decay_width == "key" else 1)))
        inputs[4] = "decay"
    if beta_width:
        feeds["beta"] = rng.random((b, t, kv_heads if beta_width == "head" else 1)).astype(np.float32)
        inputs[5] = "beta"
    node = helper.make_node("LinearAttention", inputs, ["y", "state"], q_num_heads=heads, kv_num_heads=kv_heads,
                            update_rule=rule)
    graph = run(node, feeds, opset=27)
    assert ops(graph).count("matmul") >= 2 * t


def test_linear_attention_in_float16_without_a_past():
    feeds = {"q": floats(1, 2, 8, dtype=np.float16), "k": floats(1, 2, 8, dtype=np.float16),
             "v": floats(1, 2, 6, dtype=np.float16)}
    node = helper.make_node("LinearAttention", ["q", "k", "v"], ["y", "state"], q_num_heads=2, kv_num_heads=2,
                            update_rule="linear", scale=0.5)
    run(node, feeds, opset=27, tolerance=1e-3)
