"""Concurrent calls of one compiled model on the CUDA-graph path, emulated on the CPU (`cpu_graphs`): a replay
reads the static input buffers every call copies into and writes the static outputs every call copies out of, so
two calls at once would each get the other's outputs unless calls serialise."""

import copy
import sys
import threading
import time

import pytest
import torch

from opfuse.runtime.gate import INTERPRETER_LOCK, CallLock
from tests.unit.test_call_path import (CpuGraph, cpu_graphs, expected, graphed_model, inputs,  # noqa: F401 (a fixture)
                                       plain_model)

THREADS, CALLS = 4, 6


def call_from_threads(call, seeds: list[list[int]]) -> dict[int, object]:
    """Each thread's calls of `call(seed)`, started together at each round (a barrier) with the interpreter
    switching threads as often as it can, so that unserialised calls interleave; the outputs (or the error)."""
    results: dict[int, object] = {}
    barrier = threading.Barrier(len(seeds))

    def worker(mine: list[int]) -> None:
        for seed in mine:
            barrier.wait()
            try:
                results[seed] = call(seed)
            except Exception as error:   # reported by the test, with every other call's outcome
                results[seed] = error

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=worker, args=(mine,)) for mine in seeds]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    return results


class HostGapGraph(CpuGraph):
    """A CpuGraph whose replay lets other threads run first, as the host does between a call's copies in and its
    replay on a GPU (each only enqueued on the stream)."""

    def replay(self):
        time.sleep(0.001)
        super().replay()


@pytest.fixture
def host_gap_graphs(cpu_graphs, monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", HostGapGraph)


def test_calls_from_several_threads_on_a_captured_graph_each_get_their_own_outputs(host_gap_graphs):
    model, _ = graphed_model()
    seeds = [[100 + thread * CALLS + call for call in range(CALLS)] for thread in range(THREADS)]
    results = call_from_threads(lambda seed: model(*inputs(seed)), seeds)
    wrong = []
    for seed, outputs in sorted(results.items()):
        if isinstance(outputs, Exception):
            wrong.append(f"call {seed}: {type(outputs).__name__}: {outputs}")
            continue
        for out, want in zip(outputs, expected(*inputs(seed))):
            if not torch.allclose(out, want):
                wrong.append(f"call {seed}: another call's outputs")
                break
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls: " + "; ".join(wrong)


def test_a_copy_of_a_compiled_model_gets_a_lock_of_its_own_or_through_the_interpreter_the_shared_one(monkeypatch):
    interpreted = plain_model()       # the tests run Triton's interpreter: every model shares its one lock
    assert interpreted._lock is INTERPRETER_LOCK and copy.deepcopy(interpreted)._lock is INTERPRETER_LOCK
    monkeypatch.delenv("TRITON_INTERPRET")
    model = plain_model()
    copied = copy.deepcopy(model)     # a bare lock cannot be copied
    assert isinstance(copied._lock, CallLock) and copied._lock not in (model._lock, INTERPRETER_LOCK)
    x, y = inputs(7)
    torch.testing.assert_close(copied(x, y), model(x, y))
