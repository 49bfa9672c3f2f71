"""The pool of compile workers (`CompilePool`) that `opfuse.runtime.precompile` hands recorded launches to.

A dispatcher thread hands each worker (`opfuse.runtime.compile_worker`) one launch at a time, once the worker says it
is ready and the next queued when it answers, so that one slow compile holds one worker and not a share of the
others' work; callers queue launches and wait for the ones they need next (`opfuse.runtime.autotune.Compiling`: the
tuner times a kernel once its own candidates are built, while the workers build the next kernels'). A caller waiting
for launches no worker has taken yet builds them itself meanwhile (`CompilePool.wait`, `build_here`): while the
workers start, and where they are all busy, the compiling process is one more worker, not an idle one. A worker that
dies or outlasts its caller's deadline is replaced while the pool's restarts last (as many as it started workers).
"""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Callable, Sequence

from opfuse.codegen.base import LaunchRecord
from opfuse.runtime.compile_worker import READY, REPLY, build_here, encode_launch
from opfuse.runtime.launch_records import compile_key

TIMEOUT_S = 300.0       # what a build waits for its launches at most; those left are given up on (workers killed)


class CompilePool:
    """`workers` compile processes on GPU `device_index`, started by `start` (at once, not waiting for them to be
    ready) with a dispatcher thread that hands each ready and idle worker the next queued launch. `submit` queues
    launches and returns at once, `wait` blocks until given ones are compiled or given up on, building those still
    queued itself meanwhile (with `build`, e.g. `build_here`; None: the workers' alone), `compile` does both; a
    caller may wait for its first launches while the workers go on with the rest (`opfuse.runtime.autotune`
    times each kernel as soon as its own candidates are built). Each `compile_key` is compiled once: one compiled
    before or queued already is not queued again, one that failed is tried again. A worker that dies, or whose
    launch a waiter gave up on (`give_up`: past its deadline), is replaced by a new one while `restarts` lasts (as
    many as `workers`), else gone for the rest of the pool's life; the launch it held is left to the tuner, and so
    is every launch queued once no worker is left. `close` ends the dispatcher and the workers."""

    def __init__(self, workers: int, device_index: int, command: Sequence[str] | None = None,
                 build: Callable[[LaunchRecord], bool] | None = build_here):
        self.workers, self.device_index = workers, device_index
        # what a worker runs (tests give a stand-in that answers as a worker does)
        self.command = list(command or [sys.executable, "-m", "opfuse.runtime.compile_worker", "--serve",
                                        str(device_index)])
        self.build = build
        self.built_here: set[tuple] = set()   # the keys `wait` built in the caller's process
        self.processes: list[subprocess.Popen] = []
        self.restarts = workers
        self.started = False
        self.done: set[tuple] = set()     # the `compile_key`s compiled: never handed out again
        self.failed: set[tuple] = set()   # those given up on since they were last queued
        self._queue: deque[tuple[tuple, LaunchRecord]] = deque()
        self._open: set[tuple] = set()    # keys queued or held by a worker
        self._abandoned: set[tuple] = set()   # keys whose worker the dispatcher is to kill
        self._state = threading.Condition()
        self._closing = False
        self._dispatcher: threading.Thread | None = None
        self._wake_read = self._wake_write = -1

    def start(self) -> "CompilePool":
        if self.started:
            return self
        self.started = True
        self.processes = [self._spawn() for _ in range(self.workers)]
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_write, False)      # a full pipe has woken the dispatcher already
        self._dispatcher = threading.Thread(target=self._dispatch, name="opfuse-compile-pool", daemon=True)
        self._dispatcher.start()
        return self

    def _spawn(self) -> subprocess.Popen:
        """A worker, importing this opfuse: `python -m` puts its working directory ahead of PYTHONPATH, so it runs
        where this opfuse package is (a checkout of another opfuse in the caller's directory would be imported
        instead, and its workers might not serve; RESULTS.md, run 101)."""
        root = str(Path(__file__).resolve().parents[2])      # where the opfuse package is, for the workers' import
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        return subprocess.Popen(self.command, env=env, cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, bufsize=0)

    def submit(self, records: Sequence[LaunchRecord], first: bool = False) -> list[tuple]:
        """Queue `records` (at the back, or with `first` ahead of everything queued) and return their compile keys
        at once, in order."""
        self.start()
        keys = [compile_key(record) for record in records]
        with self._state:
            new = []
            for key, record in zip(keys, records):
                if key in self.done or key in self._open:
                    continue
                if self._closing:
                    self.failed.add(key)
                    continue
                self.failed.discard(key)
                self._open.add(key)
                new.append((key, record))
            if first:
                self._queue.extendleft(reversed(new))
            else:
                self._queue.extend(new)
        self._wake()
        return keys

    def wait(self, keys: Sequence[tuple], timeout: float | None = None) -> bool:
        """Block until each of `keys` is compiled or given up on, at most `timeout` seconds; whether they all are.
        Meanwhile those of them still queued (no worker ready and idle to take them) are built here, one at a time,
        with `build` (the deadline checked between builds: one build is not interrupted)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.build is not None and (deadline is None or time.monotonic() < deadline):
            taken = self._take(keys)
            if taken is None:
                break
            key, record = taken
            compiled = self.build(record)
            with self._state:
                if compiled:
                    self.built_here.add(key)
                self._finish(key, compiled)
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        with self._state:
            return self._state.wait_for(lambda: self._open.isdisjoint(keys), left)

    def _take(self, keys: Sequence[tuple]) -> tuple[tuple, LaunchRecord] | None:
        """The first queued launch among `keys`, out of the queue (it stays open until `_finish`ed), or None."""
        wanted = set(keys)
        with self._state:
            for item in self._queue:
                if item[0] in wanted:
                    self._queue.remove(item)
                    return item
        return None

    def give_up(self, keys: Sequence[tuple]) -> None:
        """Compile none of `keys` any more: those queued leave the queue, the workers holding one are killed (and
        replaced); each counts as failed."""
        keys = set(keys)
        with self._state:
            for item in [item for item in self._queue if item[0] in keys]:
                self._queue.remove(item)
                self._finish(item[0], False)
            self._abandoned |= keys & self._open
        self._wake()
        self.wait(list(keys), timeout=10.0)

    def compile(self, records: Sequence[LaunchRecord], timeout: float | None = None) -> int:
        """Compile `records` in the workers and return how many are compiled (those the pool compiled before
        included); after `timeout` seconds (default `TIMEOUT_S`) those left are given up on (`give_up`)."""
        keys = self.submit(records)
        if not self.wait(keys, TIMEOUT_S if timeout is None else timeout):
            self.give_up(keys)
        with self._state:
            return sum(key in self.done for key in keys)

    def _finish(self, key: tuple, compiled: bool) -> None:
        """With `_state` held: `key` is compiled, or not."""
        self._open.discard(key)
        if compiled:            # built here after the pool gave it up (closing) counts as built
            self.failed.discard(key)
        (self.done if compiled else self.failed).add(key)
        self._state.notify_all()

    def _wake(self) -> None:
        if self._wake_write >= 0:
            try:
                os.write(self._wake_write, b"!")
            except OSError:
                pass

    def _dispatch(self) -> None:
        """The dispatcher thread (`_serve`); however it ends (`close`, an error), nothing is left for a waiter to
        wait for."""
        try:
            with selectors.DefaultSelector() as selector:
                self._serve(selector)
        finally:
            with self._state:
                self._closing = True         # a later submit gives its launches to the tuner at once
                self._queue.clear()
                for key in list(self._open):
                    self._finish(key, False)

    def _serve(self, selector: selectors.BaseSelector) -> None:
        """Hand out queued launches to ready idle workers, read their answers, replace the dead, until `close`."""
        selector.register(self._wake_read, selectors.EVENT_READ, None)
        workers = _Workers(selector, lambda process: self._drop(process))     # (looked up at each use)
        for process in self.processes:
            workers.started(process)
        while True:
            with self._state:
                if self._closing:
                    break
                self._hand_out(workers)
            for event, _ in selector.select():
                if event.data is None:
                    os.read(self._wake_read, 4096)
                    continue
                self._read(workers, event.data)

    def _hand_out(self, workers: "_Workers") -> None:
        """With `_state` held: replace the workers whose launch was given up on, hand the queue to the idle ones."""
        for process in [p for p, key in workers.held.items() if key in self._abandoned]:
            key = workers.release(process)
            workers.replace(process)
            self._finish(key, False)
        self._abandoned.clear()
        while self._queue and workers.idle:
            process = workers.idle.pop()
            if process.poll() is not None:       # died while idle (between rounds)
                workers.replace(process)
                continue
            key, record = self._queue.popleft()
            try:
                line = (json.dumps(encode_launch(record)) + "\n").encode()
            except Exception:                    # not data a worker can read: the tuner's
                workers.idle.append(process)
                self._finish(key, False)
                continue
            try:
                process.stdin.write(line)
            except OSError:                      # it died: the launch goes to the tuner
                workers.replace(process)
                self._finish(key, False)
                continue
            workers.held[process], workers.busy[process] = key, b""
            workers.selector.register(process.stdout, selectors.EVENT_READ, process)
        if not self.processes:                   # no worker left: what is queued goes to the tuner
            while self._queue:
                self._finish(self._queue.popleft()[0], False)

    def _read(self, workers: "_Workers", process: subprocess.Popen) -> None:
        """What `process` printed: its READY (idle from now on), its answer to its launch, or its death."""
        data = os.read(process.stdout.fileno(), 65536)
        with self._state:
            if process in workers.starting:
                workers.starting[process] += data
                if not data or READY in workers.starting[process].split(b"\n"):   # died starting, or ready
                    workers.selector.unregister(process.stdout)
                    del workers.starting[process]
                    if data:
                        workers.idle.append(process)
                    else:
                        workers.replace(process)
                return
            if not data:                         # it died with the launch
                key = workers.release(process)
                workers.replace(process)
                self._finish(key, False)
                return
            workers.busy[process] += data
            answers = [line for line in workers.busy[process].split(b"\n")[:-1] if line.startswith(REPLY)]
            if answers:                          # anything else it printed is not ours
                key = workers.release(process)
                workers.idle.append(process)
                self._finish(key, answers[-1][len(REPLY):].strip() == b"1")

    def _drop(self, process: subprocess.Popen) -> subprocess.Popen | None:
        """Kill `process`; its replacement, if `restarts` lasts."""
        process.kill()
        process.wait()
        self.processes.remove(process)
        if self.restarts <= 0:
            return None
        self.restarts -= 1
        self.processes.append(fresh := self._spawn())
        return fresh

    def close(self) -> None:
        """End the dispatcher and the workers now, not waiting for any still starting (a compile whose every
        kernel was cached is done before its workers are ready): between launches a worker holds nothing a kill
        could leave half done (Triton writes its cache entries under a temporary name, then renames them). What
        was still queued or compiling counts as failed (the dispatcher's end, `_dispatch`)."""
        with self._state:
            self._closing = True
        self._wake()
        if self._dispatcher is not None:
            self._dispatcher.join()
            self._dispatcher = None
        for process in self.processes:
            try:
                process.stdin.close()
            except OSError:
                pass
            process.kill()
        for process in self.processes:
            process.wait()
        self.processes = []
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        self._wake_read = self._wake_write = -1


class _Workers:
    """The dispatcher's view of the worker processes (`CompilePool._serve`): starting, idle, or busy with a launch
    whose key it holds; `drop` ends one and returns its replacement, if the pool's restarts allow one."""

    def __init__(self, selector: selectors.BaseSelector,
                 drop: Callable[[subprocess.Popen], subprocess.Popen | None]):
        self.selector, self.drop = selector, drop
        self.idle: list[subprocess.Popen] = []
        self.starting: dict[subprocess.Popen, bytes] = {}     # a worker not yet `READY` -> what it has printed
        self.busy: dict[subprocess.Popen, bytes] = {}         # a worker with a launch out -> what it has printed since
        self.held: dict[subprocess.Popen, tuple] = {}         # -> the key of that launch

    def started(self, process: subprocess.Popen) -> None:
        self.starting[process] = b""
        self.selector.register(process.stdout, selectors.EVENT_READ, process)

    def replace(self, process: subprocess.Popen) -> None:
        fresh = self.drop(process)
        if fresh is not None:
            self.started(fresh)

    def release(self, process: subprocess.Popen) -> tuple:
        """`process`'s launch key; it is no longer read nor busy."""
        self.selector.unregister(process.stdout)
        self.busy.pop(process)
        return self.held.pop(process)
