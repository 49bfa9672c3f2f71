"""recognize_attention: softmax(scale * q @ kT + mask) @ v written out becomes one sdpa node."""

from __future__ import annotations

import math

import pytest
import torch

from opfuse.ir.graph import Graph, TensorType
from opfuse.passes import recognize_attention, simplify_attention_masks
from tests.unit.test_passes import assert_same_numerics, const, op, rand, run_pass

F64 = torch.float64
B, H, S, D = 2, 3, 5, 4


def _scalar(graph: Graph, name: str, value: float) -> str:
    return const(graph, name, torch.tensor(value, dtype=F64))


def _written_out(scale_at: str = "qk", mask: str | None = None, reshaped: bool = False, runtime_mask: bool = False,
                 extra_reader: bool = False, softmax_dim: int = 3) -> Graph:
    """q, k, v inputs [B, H, S, D]; k transposed by a permute as models and exporters write it."""
    graph = Graph("attention")
    q, k, v = (graph.add_input(n, TensorType((B, H, S, D), "float64")).name for n in "qkv")
    if runtime_mask:
        m = graph.add_input("m", TensorType((B, 1, 1, S), "float64")).name
    key_t = op(graph, "kt", "permute", [k], dims=(0, 1, 3, 2))
    if scale_at == "qk":        # the ONNX exporter: sqrt(scale) on each side
        q = op(graph, "qs", "mul", [q, _scalar(graph, "sq", 1 / math.sqrt(math.sqrt(D)))])
        key_t = op(graph, "ks", "mul", [key_t, _scalar(graph, "sk", 1 / math.sqrt(math.sqrt(D)))])
    scores = op(graph, "scores", "matmul", [q, key_t])
    if scale_at == "div":       # transformers' eager attention
        scores = op(graph, "scaled", "div", [scores, _scalar(graph, "root", math.sqrt(D))])
    if mask == "bias":
        scores = op(graph, "biased", "add", [scores, const(graph, "bias", rand(1, H, S, S))])
    if reshaped:                # Swin's shifted windows: the mask is added in a view with the windows apart
        wide = op(graph, "wide", "reshape", [scores], shape=(1, B, H, S, S))
        wide = op(graph, "shifted", "add", [wide, const(graph, "shift", -100.0 * (rand(1, B, 1, S, S) > 0))])
        scores = op(graph, "narrow", "reshape", [wide], shape=(B, H, S, S))
    if runtime_mask:
        scores = op(graph, "masked", "add", [scores, m])
    probs = op(graph, "probs", "softmax", [scores], dim=softmax_dim)
    out = op(graph, "context", "matmul", [probs, v])
    graph.outputs = [op(graph, "out", "tanh", [out])] + (["probs"] if extra_reader else [])
    return graph


@pytest.mark.parametrize("variant", [dict(), dict(scale_at="div"), dict(scale_at="none"), dict(mask="bias"),
                                     dict(mask="bias", reshaped=True), dict(runtime_mask=True),
                                     dict(scale_at="div", mask="bias", reshaped=True)])
def test_written_out_attention_is_one_sdpa(variant):
    before = _written_out(**variant)
    after, changes = run_pass(recognize_attention, before)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert [n.op for n in after if n.op not in ("input", "constant")] == ["permute", "permute", "sdpa", "tanh"] \
        or [n.op for n in after if n.op not in ("input", "constant")] == ["permute", "sdpa", "tanh"]
    assert sdpa.attrs["scale"] == pytest.approx(1.0 if variant.get("scale_at") == "none" else 1 / math.sqrt(D))
    masked = variant.get("mask") or variant.get("runtime_mask")
    assert len(sdpa.inputs) == (4 if masked else 3)
    if variant.get("runtime_mask"):
        assert sdpa.inputs[3] == "m"
    assert not [n for n in after if n.op in ("softmax", "matmul")]
    assert len(changes) == 1
    assert_same_numerics(before, after)


@pytest.mark.parametrize("variant", [dict(extra_reader=True), dict(softmax_dim=2),
                                     dict(runtime_mask=True, reshaped=True)])
def test_near_misses_stay_as_they_are(variant):
    before = _written_out(**variant)
    after, changes = run_pass(recognize_attention, before)
    assert changes == [] and not [n for n in after if n.op == "sdpa"]
    assert_same_numerics(before, after)


def test_a_scale_after_the_mask_scales_the_mask_too():
    graph = Graph("attention")
    q, k, v = (graph.add_input(n, TensorType((B, H, S, D), "float64")).name for n in "qkv")
    scores = op(graph, "scores", "matmul", [q, op(graph, "kt", "permute", [k], dims=(0, 1, 3, 2))])
    scores = op(graph, "biased", "add", [scores, const(graph, "bias", rand(1, H, S, S))])
    scores = op(graph, "scaled", "mul", [scores, _scalar(graph, "half", 0.5)])
    graph.outputs = [op(graph, "out", "matmul", [op(graph, "probs", "softmax", [scores], dim=3), v])]
    after, _ = run_pass(recognize_attention, graph)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert sdpa.attrs["scale"] == pytest.approx(0.5)
    assert torch.allclose(after.constants[sdpa.inputs[3]], 0.5 * graph.constants["bias"].expand(B, H, S, S))
    assert_same_numerics(graph, after)


def test_the_mask_is_then_compacted_like_any_compile_time_mask():
    after, _ = run_pass(recognize_attention, _written_out(mask="bias"))
    compact, changes = run_pass(simplify_attention_masks, after)
    (sdpa,) = [n for n in compact if n.op == "sdpa"]
    assert compact[sdpa.inputs[3]].type.shape == (1, H, S, S) and changes


@pytest.mark.parametrize("mask", [None, "bias"])
def test_a_decomposed_batched_matmul_attention_is_one_sdpa(mask):
    """What `q @ k.transpose(-2, -1)` on 4-D tensors becomes when a capture decomposes it: the batch dims merged
    for a bmm and split again after it, the softmax read back through a merge for the second bmm."""
    graph = Graph("attention")
    q, k, v = (graph.add_input(n, TensorType((B, H, S, D), "float64")).name for n in "qkv")
    merged = (B * H, S, D)
    q3 = op(graph, "q3", "reshape", [op(graph, "qs", "mul", [q, _scalar(graph, "c", 0.5)])], shape=merged)
    k3 = op(graph, "k3", "reshape", [op(graph, "kt", "permute", [k], dims=(0, 1, 3, 2))], shape=(B * H, D, S))
    scores = op(graph, "scores4", "reshape", [op(graph, "scores", "matmul", [q3, k3])], shape=(B, H, S, S))
    if mask == "bias":
        scores = op(graph, "biased", "add", [scores, const(graph, "bias", rand(1, H, S, S))])
    probs = op(graph, "probs3", "reshape", [op(graph, "probs", "softmax", [scores], dim=3)], shape=(B * H, S, S))
    out = op(graph, "context", "matmul", [probs, op(graph, "v3", "reshape", [v], shape=merged)])
    graph.outputs = [op(graph, "out", "reshape", [out], shape=(B, H, S, D))]
    after, changes = run_pass(recognize_attention, graph)
    (sdpa,) = [n for n in after if n.op == "sdpa"]
    assert after[sdpa.name].type.shape == (B, H, S, D) and sdpa.attrs["scale"] == pytest.approx(0.5)
    assert not [n for n in after if n.op in ("softmax", "matmul")] and len(changes) == 1
    # the bmm's merges are gone (a copy where the source is permuted, as kT is): sdpa reads q, k, v in 4-D
    for name in sdpa.inputs[:3]:
        node = after[name]
        while node.op in ("permute", "reshape", "mul"):
            assert len(node.type.shape) == 4, node
            node = after[node.inputs[0]]
        assert node.op == "input"
    if mask == "bias":
        assert after[sdpa.inputs[3]].type.shape == (B, H, S, S)
    assert_same_numerics(graph, after)



def _attention_around(graph: Graph, q: str, k: str, v: str, shift=None) -> Graph:
    scores = op(graph, "s", "matmul", [q, op(graph, "kt", "permute", [k], dims=(0, 1, 3, 2))])
    if shift is not None:
        scores = shift(graph, scores)
    graph.outputs = [op(graph, "ctx", "matmul", [op(graph, "probs", "softmax", [scores], dim=3), v])]
    return graph


@pytest.mark.parametrize("order", ["runtime first", "constant first", "runtime then sub"])
def test_a_run_time_mask_with_a_constant_shift_stays_written_out(order):
    """Review: M = f(0) left the run-time mask out, or the run-time mask left the constant out."""
    graph = Graph("attention")
    q, k, v = (graph.add_input(n, TensorType((B, H, S, D), "float64")).name for n in "qkv")
    m = graph.add_input("m", TensorType((B, 1, 1, S), "float64")).name

    def shift(g, scores):
        c = const(g, "c", 3.0 * rand(1, H, S, S))
        if order == "constant first":
            return op(g, "s3", "add", [op(g, "s2", "add", [scores, c]), m])
        return op(g, "s3", "sub" if order == "runtime then sub" else "add", [op(g, "s2", "add", [scores, m]), c])

    before = _attention_around(graph, q, k, v, shift)
    after, changes = run_pass(recognize_attention, before)
    assert changes == [] and not [n for n in after if n.op == "sdpa"]
    assert_same_numerics(before, after)


def test_a_second_matmul_that_broadcasts_the_probabilities_stays_written_out():
    """Review: softmax [6, 1, S, S] @ v [6, S, D] pairs every softmax batch with every v batch: not attention."""
    graph = Graph("attention")
    q, k, v = (graph.add_input(n, TensorType((6, S, D), "float64")).name for n in "qkv")
    scores = op(graph, "s", "matmul", [q, op(graph, "kt", "permute", [k], dims=(0, 2, 1))])
    scores = op(graph, "r", "reshape", [scores], shape=(6, 1, S, S))
    graph.outputs = [op(graph, "ctx", "matmul", [op(graph, "probs", "softmax", [scores], dim=3), v])]
    after, changes = run_pass(recognize_attention, graph)
    assert changes == [] and not [n for n in after if n.op == "sdpa"]


def test_a_scale_that_promotes_the_dtype_is_not_peeled():
    """Review: a float64 [1] scale on a float32 q made q float32 and k, v float64 for the sdpa."""
    graph = Graph("attention")
    q = graph.add_input("q", TensorType((B, H, S, D), "float32")).name
    k, v = (graph.add_input(n, TensorType((B, H, S, D), "float64")).name for n in "kv")
    q = op(graph, "qs", "mul", [q, const(graph, "c", torch.tensor([0.5], dtype=F64))])
    before = _attention_around(graph, q, k, v)
    after, _ = run_pass(recognize_attention, before)
    for sdpa in (n for n in after if n.op == "sdpa"):
        assert len({after[i].type.dtype for i in sdpa.inputs[:3]}) == 1
    assert_same_numerics(before, after)
