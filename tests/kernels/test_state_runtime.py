"""A compiled model with state (`opfuse.runtime.compiled`): it starts from the state eager starts from (whatever
compiling ran), keeps what each call wrote for the next, writes an `index_copy` update in place, and can be reset or
bound to another model's state tensors (interpreter)."""

import copy

import pytest
import torch

import opfuse
from opfuse.ir.graph import GraphError
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
