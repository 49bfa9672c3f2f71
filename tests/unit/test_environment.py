"""Environment switches read in one place, with Triton's meaning; a CPU compile without the interpreter is refused
with the fix, never turned into a model whose every kernel "failed verification"."""

import pytest
import torch

import opfuse
from opfuse.compiler import EagerFallback
from opfuse.environment import triton_interpreter
from opfuse.hardware import get_hardware, kernel_profile
from opfuse.ir.graph import GraphError
from opfuse.runtime.clock import timing_available


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("TRUE", True), ("on", True), ("yes", True),
                                       (" y ", True), ("0", False), ("false", False), ("", False), ("2", False)])
def test_triton_interpret_means_what_it_means_to_triton(value, on, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_interpreter() is on and kernel_profile().interpreted is on
    assert kernel_profile(get_hardware("h100")).interpreted is on        # a given profile, as the interpreter runs it
    assert not timing_available("cpu")


def test_every_reader_agrees_when_unset(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not triton_interpreter() and not kernel_profile().interpreted


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
