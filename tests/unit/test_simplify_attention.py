"""simplify_attention_masks: compile-time attention masks dropped, made causal or compacted."""

from __future__ import annotations

import pytest
import torch

import opfuse
from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.interpret import interpret
from opfuse.passes import simplify_attention_masks
from tests.unit.test_passes import assert_same_numerics, const, op, run_pass

L, S = 6, 6


def _attention(mask: torch.Tensor | None, batch: int = 2, heads: int = 2, queries: int = L, keys: int = S,
               mask_from_input: bool = False, is_causal: bool = False) -> Graph:
    graph = Graph("attention")
    q = graph.add_input("q", TensorType((batch, heads, queries, 4), "float64")).name
    k = graph.add_input("k", TensorType((batch, heads, keys, 4), "float64")).name
    v = graph.add_input("v", TensorType((batch, heads, keys, 4), "float64")).name
    inputs = [q, k, v]
    if mask_from_input:
        inputs.append(graph.add_input("m", TensorType(tuple(mask.shape), "float64")).name)
    elif mask is not None:
        inputs.append(const(graph, "mask", mask))
    graph.outputs = [op(graph, "attn", "sdpa", inputs, is_causal=False, scale=None)]
    return graph


def _causal(dtype=torch.bool, blocked=float("-inf"), queries: int = L, keys: int = S) -> torch.Tensor:
    triangle = torch.ones(queries, keys, dtype=torch.bool).tril()
    if dtype == torch.bool:
        return triangle
    return torch.zeros(queries, keys, dtype=dtype).masked_fill(~triangle, blocked)


@pytest.mark.parametrize("mask", [torch.ones(2, 1, L, S, dtype=torch.bool), torch.zeros(1, 1, L, S, dtype=torch.float64)],
                         ids=["bool all true", "additive zeros"])
def test_a_mask_that_masks_nothing_is_dropped(mask):
    before = _attention(mask)
    after, changes = run_pass(simplify_attention_masks, before)
    assert after["attn"].inputs == ["q", "k", "v"] and after["attn"].attrs["is_causal"] is False
    assert "mask" not in after.nodes and changes == ["dropped attn's mask mask: it masks nothing"]
    assert_same_numerics(before, after)


@pytest.mark.parametrize("mask", [_causal(), _causal(torch.float64), _causal(torch.float64, torch.finfo(torch.float64).min),
                                  _causal().expand(2, 2, L, S), _causal(queries=4, keys=S)],
                         ids=["bool", "additive -inf", "additive lowest", "broadcast", "fewer queries"])
def test_the_causal_triangle_becomes_is_causal(mask):
    before = _attention(mask.contiguous(), queries=mask.shape[-2])
    after, changes = run_pass(simplify_attention_masks, before)
    assert after["attn"].inputs == ["q", "k", "v"] and after["attn"].attrs["is_causal"] is True
    assert changes == ["made attn causal: its mask mask is the causal triangle"]
    assert_same_numerics(before, after)


def test_near_misses_of_the_causal_triangle_stay_masks():
    shifted = torch.ones(L, S, dtype=torch.bool).tril(diagonal=1)
    weak = torch.zeros(L, S, dtype=torch.float64).masked_fill(~_causal(), -1e4)   # not low enough to be -inf
    bottom_right = torch.ones(4, S, dtype=torch.bool).tril(diagonal=S - 4)       # a decode step's alignment
    for mask in (shifted, weak, bottom_right):
        before = _attention(mask, queries=mask.shape[0])
        after, changes = run_pass(simplify_attention_masks, before)
        assert changes == [] and after["attn"].inputs[3] == "mask" and not after["attn"].attrs["is_causal"]


def test_a_batch_uniform_bias_is_stored_once_and_shared():
    """T5: each layer copies one relative-position bias, broadcast over the batch."""
    bias = torch.randn(1, 2, L, S, dtype=torch.float64)
    graph = Graph("shared")
    q, k, v = (graph.add_input(n, TensorType((3, 2, L, 4), "float64")).name for n in "qkv")
    table = const(graph, "bias", bias)
    outputs = []
    for i in range(2):
        wide = op(graph, f"wide{i}", "expand", [table], shape=(3, 2, L, S))
        copy = op(graph, f"copy{i}", "mul", [wide, const(graph, f"one{i}", torch.tensor(1.0, dtype=torch.float64))])
        outputs.append(op(graph, f"attn{i}", "sdpa", [q, k, v, copy], is_causal=False, scale=None))
    graph.outputs = outputs
    after, changes = run_pass(simplify_attention_masks, graph)
    masks = {after[o].inputs[3] for o in outputs}
    assert len(masks) == 1
    (mask,) = masks
    assert after.is_constant(mask) and after.constants[mask].shape == (1, 2, L, S)
    assert torch.equal(after.constants[mask], bias)
    stored = after.constants[mask]
    assert stored.untyped_storage().nbytes() == stored.numel() * stored.element_size()   # not the wide one's
    assert not {"wide0", "copy0", "wide1", "copy1"} & set(after.nodes)    # nothing left computing it per call
    assert len(changes) == 2 and "not computed at every call" in changes[0] and "as another mask" in changes[1]
    assert_same_numerics(graph, after)


def test_a_mask_read_from_an_input_is_left_alone():
    before = _attention(torch.zeros(2, 2, L, S), mask_from_input=True)
    after, changes = run_pass(simplify_attention_masks, before)
    assert changes == [] and after["attn"].inputs == ["q", "k", "v", "m"]


# ---- on transformers' models --------------------------------------------------------------------------

@pytest.mark.parametrize("name, expected", [("bert", "no mask"), ("gpt2", "causal"), ("t5_encoder", "one bias")])
def test_transformers_masks_are_known_at_compile_time(name, expected):
    pytest.importorskip("transformers")
    from opfuse.bench.zoo import build_seeded, token_inputs
    from opfuse.bench.zoo_models import build_text_model
    from tests.unit.test_zoo import TINY_TEXT_CONFIGS

    model = build_seeded(lambda: build_text_model(name, **TINY_TEXT_CONFIGS[name]))
    inputs = token_inputs(2, 12, model.config.vocab_size)
    analysis = opfuse.analyze(model, inputs, opfuse.FusionConfig(dtype="float64"))
    graph = analysis.prepared
    attention = [n for n in graph if n.op == "sdpa"]
    assert len(attention) == 2
    assert [n.describe() for n in graph if n.op == "opaque"] == []   # the mask code folded away
    if expected == "no mask":
        assert all(len(n.inputs) == 3 and not n.attrs["is_causal"] for n in attention)
    elif expected == "causal":
        assert all(len(n.inputs) == 3 and n.attrs["is_causal"] for n in attention)
    else:
        masks = {n.inputs[3] for n in attention}
        assert len(masks) == 1 and graph.is_constant(masks.pop())
    want = interpret(analysis.captured, list(inputs))[0]     # (eager in float64 is not: T5 norms in float32)
    got = interpret(graph, list(inputs))[0]
    # PyTorch's CPU kernel for is_causal is less exact in float64 than its masked one (gpt2: 1.4e-9)
    assert ((got - want).norm() / want.norm()).item() < 1e-8


def test_a_mask_computed_from_a_deep_chain_of_activations_costs_no_recursion():
    graph = Graph("deep")
    q, k, v = (graph.add_input(n, TensorType((1, 1, L, 4), "float64")).name for n in "qkv")
    mask = graph.add_input("m", TensorType((L, S), "float64")).name
    for i in range(3000):                              # deeper than Python's recursion limit
        mask = op(graph, f"step{i}", "tanh", [mask])
    graph.outputs = [op(graph, "attn", "sdpa", [q, k, v, mask], is_causal=False, scale=None)]
    after, changes = run_pass(simplify_attention_masks, graph)
    assert changes == [] and after["attn"].inputs[3] == mask
