"""fold_view_chains: a reshape/permute chain PyTorch would copy, but which is a view of its source, becomes split,
permute and merge views (nn.MultiheadAttention's head split); any other chain stays as it is."""

import torch

from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import infer_type, view_copies
from opfuse.ir.verify import verify
from opfuse.passes.fold_view_chains import fold_view_chains


def chain(shape, steps, extra_reader=None):
    """A graph: input x of `shape`, then each (op, attrs) of `steps`, then a relu (a non-view reader) as output;
    `extra_reader`: the index of a step whose value a second relu also reads (an output too)."""
    g = Graph("views")
    value = g.add_input("x", TensorType(shape, "float32")).name
    names = []
    for op, attrs in steps:
        value = g.add_node(op, [value], infer_type(op, [g[value].type], attrs), attrs).name
        names.append(value)
    out = g.add_node("relu", [value], g[value].type).name
    g.outputs = [out]
    if extra_reader is not None:
        other = names[extra_reader]
        g.outputs.append(g.add_node("relu", [other], g[other].type, name="other").name)
    verify(g)
    return g


def copies(graph):
    return [n.name for n in graph if n.op == "reshape" and view_copies(graph, n)]


def same_outputs(before, after, shape):
    x = torch.randn(shape)
    for got, want in zip(interpret(after, [x]), interpret(before, [x])):
        assert torch.equal(got, want)


T, N, H, D = 5, 3, 2, 4
# q [N, T, E] made sequence-first [T, N, E] (as nn.MultiheadAttention takes it), then split for its heads
SOURCE = (N, T, H * D)
HEAD_SPLIT = [("permute", {"dims": [1, 0, 2]}), ("reshape", {"shape": [T, N * H, D]}),
              ("permute", {"dims": [1, 0, 2]}), ("reshape", {"shape": [N, H, T, D]})]


def test_a_head_split_that_would_copy_becomes_views_of_its_source():
    before = chain(SOURCE, HEAD_SPLIT)
    assert copies(before)                               # [T, N, E] -> [T, N * H, D] is no view at N > 1
    after, changes = fold_view_chains(before)
    verify(after)
    assert not copies(after) and len(changes) == 1
    assert [n.op for n in after if n.op not in ("input", "relu")] == ["permute", "reshape", "permute", "reshape"]
    same_outputs(before, after, SOURCE)


def test_multi_head_attentions_packed_projection_slice_and_split():
    """ViT's nn.MultiheadAttention: the packed q, k, v projection [T, N, 3E] split by unflatten, permute and a
    slice; q is then reshaped for its heads (the copy) and transposed."""
    steps = [("reshape", {"shape": [T, N, 3, H * D]}), ("permute", {"dims": [2, 0, 1, 3]}),
             ("slice", {"dim": 0, "start": 0, "end": 1, "step": 1}), ("reshape", {"shape": [T, N * H, D]}),
             ("permute", {"dims": [1, 0, 2]}), ("reshape", {"shape": [N, H, T, D]})]
    before = chain((T, N, 3 * H * D), steps)
    assert copies(before)
    after, _ = fold_view_chains(before)
    assert not copies(after)
    same_outputs(before, after, (T, N, 3 * H * D))


def test_a_chain_that_is_no_view_of_its_source_stays():
    # the heads merged in reverse order: no in-order run of one source dim's factors
    reverse = [("reshape", {"shape": [T, N, H, D]}), ("permute", {"dims": [0, 2, 1, 3]}),
               ("reshape", {"shape": [T, H * N, D]})]
    # two source dims merged after a permute: whether that is a view depends on the source's strides
    merged = [("reshape", {"shape": [T * N, H * D]})]
    for steps in (reverse, merged):
        before = chain(SOURCE, [HEAD_SPLIT[0]] + steps)
        assert copies(before)
        after, changes = fold_view_chains(before)
        assert not changes and copies(after) == copies(before)


def test_a_view_read_by_another_node_ends_the_chain():
    """The transposed heads are read by a second relu: the chain stops before it, and [T, N * H, D] alone is no
    view of [T, N, E]; nothing changes."""
    assert copies(chain(SOURCE, HEAD_SPLIT, extra_reader=2))
    before = chain(SOURCE, HEAD_SPLIT, extra_reader=2)
    after, changes = fold_view_chains(before)
    assert not changes and copies(after) == copies(before)


def test_no_rewrite_where_a_reshape_reading_the_end_would_copy_instead():
    """The head-split end flattened by two reshapes: from the strided views each would copy, where the chain
    copied once; the chain stays."""
    before = chain(SOURCE, HEAD_SPLIT)
    end = before["relu"].inputs[0]
    for name in ("flat_a", "flat_b"):
        flat = before.add_node("reshape", [end], TensorType((N * H, T, D), "float32"), {"shape": [N * H, T, D]},
                               name=name)
        before.outputs.append(before.add_node("relu", [flat.name], flat.type, name=f"{name}_out").name)
    verify(before)
    after, changes = fold_view_chains(before)
    verify(after)
    assert not changes and copies(after) == copies(before) == ["reshape"]
    same_outputs(before, after, SOURCE)
