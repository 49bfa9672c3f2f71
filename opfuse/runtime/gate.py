"""What keeps a compiled model's calls apart: each model's call lock (`call_lock`: one for every model through Triton's
CPU interpreter), and the process-wide gate between CUDA graph captures and every other call (`CAPTURE_GATE`)."""

from __future__ import annotations

import _thread
import contextlib
import threading
from collections import Counter
from typing import Any

from opfuse.environment import triton_interpreter


class CaptureGate:
    """Process-wide: a CUDA graph capture runs while no compiled model of this process runs anything on the GPU
    (exclusive), and calls run side by side while none captures (shared). Another thread's CUDA work during a
    capture (an allocation, a synchronize, a launch on the default stream) invalidates it. Work outside opfuse's
    models is not held back: a program capturing graphs of its own in other threads keeps them apart itself.

    A thread holding the gate exclusively may take it again either way; one holding it shared cannot then take it
    exclusively (it would wait for itself): that raises instead of hanging."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._readers: Counter[int] = Counter()
        self._writer: int | None = None
        self._depth = 0

    @contextlib.contextmanager
    def shared(self):
        me = threading.get_ident()
        with self._condition:
            if self._writer == me:        # inside this thread's own capture
                self._depth += 1
            else:
                while self._writer is not None:
                    self._condition.wait()
                self._readers[me] += 1
        try:
            yield
        finally:
            self._release(me)

    @contextlib.contextmanager
    def exclusive(self):
        me = threading.get_ident()
        with self._condition:
            if self._writer == me:
                self._depth += 1
            else:
                if self._readers[me]:
                    raise RuntimeError("opfuse: a CUDA graph capture inside a call of a compiled model on the same "
                                       "thread (it would wait for itself)")
                while self._writer is not None or self._readers:
                    self._condition.wait()
                self._writer, self._depth = me, 1
        try:
            yield
        finally:
            self._release(me)

    def _release(self, me: int) -> None:
        with self._condition:
            if self._writer == me:
                self._depth -= 1
                if self._depth == 0:
                    self._writer = None
            else:
                self._readers[me] -= 1
                if not self._readers[me]:
                    del self._readers[me]
            self._condition.notify_all()


CAPTURE_GATE = CaptureGate()


class CallLock(_thread.RLock):
    """The lock a compiled model's calls take (reentrant: a thread holding it may call a model that takes it again,
    as a compile through the interpreter does); a copy of the model (deepcopy, pickle) gets a lock of its own, as a
    lock cannot be copied."""

    def __reduce__(self):
        return CallLock, ()


class _InterpreterLock(CallLock):
    """The one lock of every model whose kernels Triton's CPU interpreter runs; a copy of a model shares it too."""

    def __reduce__(self):
        return "INTERPRETER_LOCK"     # a module global: copy and pickle keep the object itself


# Triton's interpreter patches triton.language's globals around every kernel it runs, so two kernels interpreted at
# once break each other ("Did you forget to add @triton.jit ?") whichever models they belong to
INTERPRETER_LOCK = _InterpreterLock()


def call_lock() -> CallLock:
    """A new model's call lock: its own, or `INTERPRETER_LOCK` where Triton's CPU interpreter runs the kernels."""
    return INTERPRETER_LOCK if triton_interpreter() else CallLock()


def interpreter_alone() -> Any:
    """A context in which no other thread runs kernels through Triton's CPU interpreter (a compile's tuning and
    verification run kernels outside any model's call); nothing where the interpreter is off."""
    return INTERPRETER_LOCK if triton_interpreter() else contextlib.nullcontext()
