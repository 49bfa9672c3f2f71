"""Concurrent calls of compiled models through Triton's interpreter: calls serialise, so each thread gets its own
call's outputs. The interpreter patches triton.language's globals around every kernel it runs, so two kernels run
at once break each other (\"Did you forget to add @triton.jit ?\"), whichever models they belong to."""

import threading

import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig

from tests.unit.test_threads_call_path import CALLS, THREADS, call_from_threads


def tiny_mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4), nn.Sigmoid()).eval()


def batch(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randn(rows, 8, generator=torch.Generator().manual_seed(seed))


def wrong_calls(results: dict[int, object], reference) -> list[str]:
    """The calls whose outcome is an error or differs from `reference(seed)`, each in words."""
    wrong = []
    for seed, out in sorted(results.items()):
        if isinstance(out, Exception):
            wrong.append(f"call {seed}: {type(out).__name__}: {str(out)[:120]}")
        elif not torch.allclose(out, reference(seed), rtol=1e-5, atol=1e-5):
            wrong.append(f"call {seed}: differs from eager")
    return wrong


def test_calls_of_one_compiled_model_from_several_threads_each_match_eager():
    model = tiny_mlp(0)
    compiled = opfuse.compile(model, (batch(0),), FusionConfig(dtype="float32"))
    assert compiled.compiled.kernels          # the calls run generated kernels, through the interpreter
    seeds = [[100 + thread * CALLS + call for call in range(CALLS)] for thread in range(THREADS)]
    results = call_from_threads(lambda seed: compiled(batch(seed)), seeds)
    with torch.no_grad():
        wrong = wrong_calls(results, lambda seed: model(batch(seed)))
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls: " + "; ".join(wrong)


def test_two_compiled_models_called_from_several_threads_each_match_eager():
    models = [tiny_mlp(1), tiny_mlp(2)]
    compiled = [opfuse.compile(m, (batch(0),), FusionConfig(dtype="float32")) for m in models]
    seeds = [[200 + thread * CALLS + call for call in range(CALLS)] for thread in range(THREADS)]
    which = lambda seed: (seed - 200) // CALLS % 2      # noqa: E731 (threads 0 and 2 call model 0, 1 and 3 model 1)
    results = call_from_threads(lambda seed: compiled[which(seed)](batch(seed)), seeds)
    with torch.no_grad():
        wrong = wrong_calls(results, lambda seed: models[which(seed)](batch(seed)))
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls: " + "; ".join(wrong)


def test_threads_calling_with_a_new_shape_compile_it_once(monkeypatch):
    model = tiny_mlp(3)
    compiled = opfuse.compile(model, (batch(0),), FusionConfig(dtype="float32", recompile=True))
    compiles = []
    real_compile = opfuse.compiler.compile
    monkeypatch.setattr(opfuse.compiler, "compile",
                        lambda *args, **kwargs: compiles.append(threading.get_ident()) or real_compile(*args, **kwargs))
    seeds = [[300 + thread] for thread in range(3)]
    results = call_from_threads(lambda seed: compiled(batch(seed, rows=3)), seeds)
    with torch.no_grad():
        wrong = wrong_calls(results, lambda seed: model(batch(seed, rows=3)))
    assert not wrong, "; ".join(wrong)
    assert len(compiles) == 1 and len(compiled._variants) == 1


def test_a_compile_in_one_thread_while_others_call_a_compiled_model():
    model, other = tiny_mlp(4), tiny_mlp(5)
    compiled = opfuse.compile(model, (batch(0),), FusionConfig(dtype="float32"))
    done = threading.Event()
    callers = [401, 402, 403, 404]

    def compile_other() -> object:
        try:
            return opfuse.compile(other, (batch(0),), FusionConfig(dtype="float32"))
        finally:
            done.set()

    def call_until_compiled(seed: int) -> dict[int, object]:
        outcomes = {}
        while not done.is_set():
            try:
                outcomes[len(outcomes)] = compiled(batch(seed))
            except Exception as error:
                outcomes[len(outcomes)] = error
        return outcomes

    results = call_from_threads(lambda seed: call_until_compiled(seed) if seed in callers else compile_other(),
                                [[400]] + [[seed] for seed in callers])
    with torch.no_grad():
        wrong = [w for seed in callers for w in wrong_calls(results[seed], lambda _: model(batch(seed)))]
    assert not wrong, "; ".join(wrong)
    # the compile's kernel checks ran alone too: a kernel that failed its check would run through PyTorch
    assert results[400].checks and all(check.passed for check in results[400].checks), results[400].checks
