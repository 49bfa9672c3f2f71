"""unshare_views: a view PyTorch would copy reads a chain of views of its own, so its reader's kernel can map the
whole chain (TinyViT's NHWC permute read by its window partition and its residual add)."""

from __future__ import annotations

import torch

from opfuse.config import FusionConfig
from opfuse.fusion.planner import plan_fusion
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.ops import view_copies
from opfuse.passes import unshare_views
from tests.unit.test_passes import assert_same_numerics, op, run_pass


def _window_partition(shared: bool = True) -> Graph:
    """x NCHW -> permute to NHWC (read by the partition and, where `shared`, an add) -> windows -> layer norm."""
    graph = Graph("windows")
    x = graph.add_input("x", TensorType((1, 4, 6, 6), "float64")).name
    act = op(graph, "act", "relu", [x])
    nhwc = op(graph, "nhwc", "permute", [act], dims=(0, 2, 3, 1))
    split = op(graph, "split", "reshape", [nhwc], shape=(1, 2, 3, 2, 3, 4))
    moved = op(graph, "moved", "permute", [split], dims=(0, 1, 3, 2, 4, 5))
    windows = op(graph, "windows", "reshape", [moved], shape=(4, 9, 4))
    normed = op(graph, "normed", "layer_norm", [windows], normalized_shape=[4], eps=1e-5)
    graph.outputs = [normed] + ([op(graph, "skip", "add", [nhwc, nhwc])] if shared else [])
    return graph


def test_a_copying_view_gets_views_of_its_own_from_the_shared_one():
    before = _window_partition()
    assert view_copies(before, before["windows"])
    after, changes = run_pass(unshare_views, before)
    assert len(changes) == 1 and "nhwc" in changes[0] and "skip" in changes[0]
    chain, value = [], after["normed"].inputs[0]
    while after[value].op in ("reshape", "permute"):
        chain.append(value)
        value = after[value].inputs[0]
    assert value == "act" and len(chain) == 4 and not {"nhwc", "split", "moved", "windows"} & set(chain)
    assert [u.name for u in after.users()["nhwc"]] == ["skip", "skip"]
    assert_same_numerics(before, after)


def test_views_after_the_copy_that_two_readers_share_are_given_to_each():
    """MobileViT: the unfolded patches (a copy, then views) read by a layer norm and by the residual add."""
    graph = Graph("patches")
    x = graph.add_input("x", TensorType((1, 4, 4, 4), "float64")).name
    act = op(graph, "act", "relu", [x])
    split = op(graph, "split", "reshape", [act], shape=(1, 4, 2, 2, 2, 2))
    moved = op(graph, "moved", "permute", [split], dims=(0, 3, 5, 1, 2, 4))
    patches = op(graph, "patches", "reshape", [moved], shape=(1, 4, 4, 4))
    tokens = op(graph, "tokens", "reshape", [patches], shape=(4, 4, 4))
    normed = op(graph, "normed", "layer_norm", [tokens], normalized_shape=[4], eps=1e-5)
    graph.outputs = [op(graph, "residual", "add", [tokens, normed])]
    assert view_copies(graph, graph["patches"])
    after, changes = run_pass(unshare_views, graph)
    assert len(changes) == 1
    users = after.users()
    for name in ("normed", "residual"):     # each reads a chain no other node reads, back to the ReLU
        value = after[name].inputs[0]
        while after[value].op in ("reshape", "permute"):
            assert len({u.name for u in users[value]}) == 1
            value = after[value].inputs[0]
        assert value == "act"
    assert_same_numerics(graph, after)


def test_nothing_is_shared_nothing_changes():
    before = _window_partition(shared=False)
    after, changes = run_pass(unshare_views, before)
    assert changes == [] and after.format() == before.format()


def test_the_reader_of_the_copy_maps_its_own_chain():
    """Planned after the pass, the layer norm's kernel reads the ReLU's output through the windows' views: no copy
    through PyTorch; the add keeps the shared permute."""
    graph, _ = unshare_views(_window_partition())
    for node in graph:
        if node.type.dtype == "float64":
            node.type = TensorType(node.type.shape, "float32")
    plan = plan_fusion(graph, FusionConfig(dtype="float32"))
    assert not [g for g in plan.groups if g.code is Code.VIEW_COPY]
    assert {"reshape", "permute"} <= {graph[n].op for n in plan.group_of("normed").nodes}
