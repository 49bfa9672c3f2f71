"""Environment switches read in one place, with Triton's meaning; a CPU compile without the interpreter is refused
with the fix, never turned into a model whose every kernel "failed verification"."""

import pytest
import torch

import opfuse
from opfuse.compiler import EagerFallback
from opfuse.environment import triton_interpreter
from opfuse.fusion.tiles import interpreting
from opfuse.ir.graph import GraphError
from opfuse.runtime.autotune import timing_available


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True),
                                       (" y ", True), ("0", False), ("false", False), ("", False), ("2", False)])
def test_triton_interpret_means_what_it_means_to_triton(value, on, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreter() is on and interpreting() is on
    assert not timing_available("cpu")


def test_every_reader_agrees_when_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_interpreter() and not interpreting()


def tiny() -> tuple[torch.nn.Module, tuple]:
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval(), (torch.randn(2, 4),)


def test_a_cpu_compile_without_the_interpreter_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model, inputs = tiny()
    with pytest.raises(GraphError, match="move the model and its inputs to a CUDA device, or set TRITON_INTERPRET=1"):
        opfuse.compile(model, inputs)
    fallback = opfuse.compile(model, inputs, opfuse.FusionConfig(fallback="eager"))
    assert isinstance(fallback, EagerFallback) and "TRITON_INTERPRET=1" in fallback.reason
    assert torch.equal(fallback(*inputs), model(*inputs))
