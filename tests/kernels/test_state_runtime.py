"""A compiled model with state (`opfuse.runtime.compiled`): it starts from the state eager starts from (whatever
compiling ran), keeps what each call wrote for the next, writes an `index_copy` update in place, and can be reset or
bound to another model's state tensors (interpreter)."""

import copy

import pytest
import torch

import opfuse
from opfuse.ir.graph import GraphError
from opfuse.frontend.torch_export import mark_state
from tests.unit.test_state import Cache


def test_calls_keep_the_state_as_eager_does_written_in_place():
    model = Cache().eval()
    eager = copy.deepcopy(model)
    compiled = opfuse.compile(model, (torch.randn(2, 4), torch.tensor([1, 3])), opfuse.FusionConfig(dtype="float32"))
    runtime = compiled.compiled
    state = runtime.state["cache"]
    assert torch.equal(state, torch.zeros(6, 4))       # compiling ran the model, but left the state as it was
    for positions in ([1, 3], [0, 5], [3, 2]):
        rows = torch.randn(2, 4)
        with torch.no_grad():
            torch.testing.assert_close(compiled(rows, torch.tensor(positions)), eager(rows, torch.tensor(positions)))
        assert runtime.state["cache"] is state                 # the same tensor, written in place
        torch.testing.assert_close(state, eager.cache)
    assert torch.equal(model.cache, torch.zeros(6, 4))        # the user's model is never written
    runtime.reset_state()
    assert torch.equal(state, torch.zeros(6, 4))


def test_bind_state_shares_tensors_of_the_state_type_only():
    compiled = opfuse.compile(Cache().eval(), (torch.randn(2, 4), torch.tensor([1, 3])),
                              opfuse.FusionConfig(dtype="float32"))
    shared = torch.zeros(6, 4)
    compiled.compiled.bind_state({"cache": shared})
    compiled(torch.ones(2, 4), torch.tensor([0, 1]))
    assert torch.equal(shared[:2], torch.ones(2, 4)) and torch.equal(shared[2:], torch.zeros(4, 4))
    with pytest.raises(GraphError, match="'cache' is no state of .* of shape \\[5, 4\\]"):
        compiled.compiled.bind_state({"cache": torch.zeros(5, 4)})


class RotatedCache(torch.nn.Module):
    """Keys [B, H, T, D] scaled and rotated (an elementwise chain, as a rotary embedding is), then written into a
    [B, H, S, D] cache at positions along dim 2, beside values written as they come; both caches read whole."""

    def __init__(self, slots: int = 7):
        super().__init__()
        self.register_buffer("keys", torch.zeros(2, 3, slots, 5))
        self.register_buffer("values", torch.zeros(2, 3, slots, 5))
        mark_state(self, "keys", "values")

    def forward(self, k, v, positions):
        rotated = torch.cat([-k[..., 3:], k[..., :3]], -1) * 0.5 + k
        self.keys.index_copy_(2, positions, rotated)
        self.values.index_copy_(2, positions, v)
        return self.keys.sum(2) + self.values.sum(2) * 3.0


@pytest.mark.parametrize("positions", [[4], [0, 6, 2]])
def test_a_state_written_in_place_is_a_kernel_that_stores_at_the_positions(positions):
    """An index_copy updating a state is no opaque op: the kernel computing its source (the rotation) stores the
    source's rows into the state's own tensor, the other cache's write sharing that launch, at one or several
    positions along a middle dim, as eager writes them."""
    model = RotatedCache().eval()
    eager = copy.deepcopy(model)
    t = len(positions)
    example = (torch.randn(2, 3, t, 5), torch.randn(2, 3, t, 5), torch.tensor(positions))
    compiled = opfuse.compile(model, example, opfuse.FusionConfig(dtype="float32"))
    plan = compiled.plan
    writes = [g for g in plan.groups if any(plan.graph[n].op == "index_copy" for n in g.nodes)]
    assert len(writes) == 1 and writes[0].kind.value != "opaque"
    assert "cat" in [plan.graph[n].op for n in writes[0].nodes]          # written by the kernel that rotates
    assert [plan.graph[n].op for n in writes[0].nodes].count("index_copy") == 2
    assert all(g.name in compiled.compiled.kernels for g in writes)
    assert not [f for f in compiled.fallbacks if "index_copy" in str(f)]
    runtime = compiled.compiled
    keys, values = runtime.state["keys"], runtime.state["values"]
    for shift in range(3):
        at = torch.tensor([(p + shift) % 7 for p in positions])
        k, v = torch.randn(2, 3, t, 5), torch.randn(2, 3, t, 5)
        with torch.no_grad():
            torch.testing.assert_close(compiled(k, v, at), eager(k, v, at))
        assert runtime.state["keys"] is keys and runtime.state["values"] is values    # written in place
        torch.testing.assert_close(keys, eager.keys)
        torch.testing.assert_close(values, eager.values)


def test_reset_restores_a_state_that_did_not_start_as_zeros():
    """A zero state is zeroed on its device at a reset; any other is copied back from its initial value."""
    model = Cache().eval()
    with torch.no_grad():
        model.cache.copy_(torch.arange(24.0).reshape(6, 4))
    compiled = opfuse.compile(model, (torch.randn(2, 4), torch.tensor([1, 3])), opfuse.FusionConfig(dtype="float32"))
    runtime = compiled.compiled
    compiled(torch.zeros(2, 4), torch.tensor([0, 5]))
    assert not torch.equal(runtime.state["cache"], model.cache)
    runtime.reset_state()
    assert torch.equal(runtime.state["cache"], torch.arange(24.0).reshape(6, 4))


class ProjectedCache(torch.nn.Module):
    """A linear's rows written into a state (a V projection into its cache)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(6, 4))
        mark_state(self, "cache")

    def forward(self, x, positions):
        self.cache.index_copy_(0, positions, self.proj(x))
        return self.cache * 2.0


def test_a_state_write_joins_no_anchors_kernel_and_the_plan_says_why():
    model = ProjectedCache().eval()
    eager = copy.deepcopy(model)
    example = (torch.randn(2, 4), torch.tensor([1, 4]))
    compiled = opfuse.compile(model, example, opfuse.FusionConfig(dtype="float32"))
    plan = compiled.plan
    write = next(g for g in plan.groups if any(plan.graph[n].op == "index_copy" for n in g.nodes))
    assert all(plan.graph[n].op != "linear" for n in write.nodes)
    refusal = next(d for d in plan.decisions if write.nodes[0] in d.consumer and d.verdict.value != "fused")
    assert "writes the model's state" in refusal.reason
    with torch.no_grad():
        torch.testing.assert_close(compiled(*example), eager(*example))
