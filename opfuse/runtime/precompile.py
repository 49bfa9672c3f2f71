"""Compile a model's Triton kernels in parallel while the autotuner times them (`CompilePool`, `precompile`).

Compiling is most of a cold compile: every candidate config of every kernel is a Triton compile of its own, and
the autotuner compiles them one after the other as it first runs each. Here each candidate is run once with its
launches recorded instead of launched (`opfuse.codegen.base.recording_launches`: no generated kernel runs and
nothing is compiled in this process; a library form's cuBLAS/cuDNN call still runs, the unfused form is skipped),
and worker processes compile the recorded launches, one of each `compile_key` (`warmup` of the jitted function, on
stand-in tensors of the same dtype and alignment, so Triton specialises the kernel as the real launch will), writing
Triton's on-disk cache; the tuner's own launches then load the compiled kernels from that cache. It only warms a
cache: a launch a worker could not compile is compiled by the tuner as before, and workers that fail or outlast
`TIMEOUT_S` (killed then) cost time, never a result.

Workers are `python -m opfuse.runtime.precompile` processes (not multiprocessing's spawn, which would run the
user's script again in each), `compile_workers` of them, each on the caller's GPU (`CompilePool`). A dispatcher
thread hands each worker one launch at a time, as JSON on its stdin, once the worker says it is ready (`READY`:
importing torch takes it seconds) and the next queued when it answers, so that one slow compile holds one worker
and not a share of the others' work; callers queue launches and wait for the ones they need next
(`opfuse.runtime.autotune.Compiling`: the tuner times a kernel once its own candidates are built, while the
workers build the next kernels'). A caller waiting for launches no worker has taken yet builds them itself
meanwhile (`CompilePool.wait`, `build_here`): while the workers start, and where they are all busy, the compiling
process is one more worker, not an idle one. A worker that dies or outlasts its caller's deadline is
replaced while the pool's restarts last (as many as it started workers). A worker makes its CUDA context when its
first launch comes: a compile whose every kernel is cached leaves the GPU's memory to the model while it is checked
and verified. `opfuse.compile` starts its pool before it captures the model (`compile_pool`): the workers import
torch and Triton while the model is captured and planned, and every build of that compile (the build again after
a split back too) uses them.
"""

from __future__ import annotations

import inspect
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence

import torch

from opfuse.codegen.base import (GroupKernel, KernelConfig, LaunchRecord, TensorArg, import_kernel,
                                 recording_launches, unaligned_params)
from opfuse.environment import worker_log

MIN_LAUNCHES = 8        # fewer distinct launches than this compile faster in the tuner than workers start
TIMEOUT_S = 300.0       # what a build waits for its launches at most; those left are given up on (workers killed)
REPLY = b"opfuse-compiled "  # a worker's answer to one launch: this, then 1 (compiled) or 0, on a line of its own
READY = b"opfuse-ready"       # a worker's first line: its imports are done, it takes launches from now on


def default_workers() -> int:
    """Half the machine's CPUs, at most 8: each worker holds a CUDA context and a Triton compile at a time."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def workers_of(config) -> int:
    """How many compile workers a compile with FusionConfig `config` runs: `compile_workers`, else
    `default_workers()`."""
    return config.compile_workers if config.compile_workers is not None else default_workers()


def hash_triton() -> None:
    """Compute `triton.runtime.cache.triton_key()` now: the hash of Triton's own sources and libtriton that keys
    its on-disk cache, computed once per process (lru_cache) and otherwise paid by the first kernel looked up
    (0.35 s on the H200 machine, 1.2 s on the 2-core one; RESULTS.md run 83). Nothing where this Triton has no
    such function."""
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return
    triton_key()


def prefetch_triton_hash() -> threading.Thread:
    """`hash_triton` in a thread of its own, so that the hashing (file reads and sha256, which let go of the GIL)
    overlaps what the caller does meanwhile (a compile: capturing the model). A failure here is left for the
    first kernel's own lookup to raise."""
    def run() -> None:
        try:
            hash_triton()
        except Exception:
            pass

    thread = threading.Thread(target=run, name="opfuse-hash-triton", daemon=True)
    thread.start()
    return thread


@dataclass
class Precompiled:
    """What the compile workers did with a build's launches (`precompile`, `autotune.Compiling.counts`): distinct
    compiles (`compile_key`), compiled (by the workers, or of them `here`: by the compiling process while it waited,
    `CompilePool.wait`), and those that failed or were given up on there."""

    launches: int = 0
    compiled: int = 0
    failed: int = 0
    here: int = 0


def record_launches(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]]
                    ) -> list[LaunchRecord]:
    """The distinct launches of running each kernel once with each of its configs but the unfused and fused library
    forms (none of the generated kernels runs); each kernel then holds its default config's weights only
    (`keep_default`)."""
    records: dict[LaunchRecord, None] = {}
    for kernel, inputs, configs in jobs:
        for launches in launches_by_config(kernel, inputs, configs).values():
            records.update(dict.fromkeys(launches))
    return list(records)


def launches_by_config(kernel: GroupKernel, inputs: list[torch.Tensor], configs: Sequence[KernelConfig]
                       ) -> dict[KernelConfig, list[LaunchRecord]]:
    """{config: its launches} of running `kernel` once with each config but the unfused and fused library forms and
    those that fail to record; the kernel then holds its default config's weights only (`keep_default`)."""
    from opfuse.codegen.forms import is_library_fused, is_unfused

    recorded: dict[KernelConfig, list[LaunchRecord]] = {}
    for config in configs:
        if is_unfused(config) or is_library_fused(config):    # PyTorch's ops, one library call: no kernel
            continue
        try:
            with recording_launches() as launches:
                kernel.run(inputs, config)
        except Exception:   # the tuner runs this config itself and reports what is wrong with it
            continue
        recorded[config] = list(launches)
    # what those runs made (other forms' weights, other block sizes' packings) goes before the next kernel's: the
    # tuner makes them again, one kernel at a time
    kernel.keep_default()
    return recorded


def loaded_module(record: LaunchRecord) -> ModuleType | None:
    """The module of a recorded launch's kernel where this process has loaded it (`load_source`), else None."""
    return sys.modules.get(Path(record.path).stem)


def compile_key(record: LaunchRecord) -> tuple:
    """What Triton compiles a recorded launch into, as far as its arguments decide: each constexpr's value, each
    tensor's dtype and 16-byte alignment, whether an integer is 1, a multiple of 16 (unless the kernel's decorator
    says not to specialise it on alignment: `opfuse.codegen.base.rows_jit`) and 32-bit, and the launch options.
    Two launches of one kernel with one key (one template at other sizes) are one compile, which two workers would
    otherwise both do at once. A key may separate launches Triton compiles once, never the reverse."""
    module = loaded_module(record)
    function = getattr(module, record.function, None)
    raw = getattr(function, "fn", None)
    if raw is None:                   # not loaded here: the launch is its own key
        return (record,)
    params = list(inspect.signature(raw).parameters.values())
    unaligned = unaligned_params(function)

    def argument(param: inspect.Parameter, value: Any) -> tuple:
        if "constexpr" in str(param.annotation):
            return ("constexpr", value)
        if isinstance(value, TensorArg):
            return ("tensor", value.dtype, value.offset % 16 == 0)
        if isinstance(value, bool) or not isinstance(value, int):
            return (type(value).__name__,)
        aligned = value % 16 == 0 and param.name not in unaligned
        return ("int", value == 1, aligned, -2 ** 31 <= value < 2 ** 31)

    return (record.path, record.function, tuple(argument(p, a) for p, a in zip(params, record.args)),
            record.kwargs)


def distinct_compiles(records: Sequence[LaunchRecord]) -> list[LaunchRecord]:
    """The first launch of each `compile_key`, in order."""
    first: dict[tuple, LaunchRecord] = {}
    for record in records:
        first.setdefault(compile_key(record), record)
    return list(first.values())


def build_here(record: LaunchRecord) -> bool:
    """Compile one recorded launch in this process, as a worker would (`_compile`), with the jitted function of the
    kernel's loaded module where it is loaded (its own cache then holds the kernel too); whether that worked."""
    module = loaded_module(record)
    return _compile(record, {record.path: module} if module is not None else {})


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
        self.command = list(command or [sys.executable, "-m", "opfuse.runtime.precompile", "--serve",
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
        idle: list[subprocess.Popen] = []
        starting: dict[subprocess.Popen, bytes] = {}     # a worker not yet `READY` -> what it has printed
        busy: dict[subprocess.Popen, bytes] = {}         # a worker with a launch out -> what it has printed since
        held: dict[subprocess.Popen, tuple] = {}          # -> the key of that launch

        def started(process: subprocess.Popen) -> None:
            starting[process] = b""
            selector.register(process.stdout, selectors.EVENT_READ, process)

        def replace(process: subprocess.Popen) -> None:
            fresh = self._drop(process)
            if fresh is not None:
                started(fresh)

        for process in self.processes:
            started(process)

        def release(process: subprocess.Popen) -> tuple:
            selector.unregister(process.stdout)
            busy.pop(process)
            return held.pop(process)

        while True:
            with self._state:
                if self._closing:
                    break
                for process in [p for p, key in held.items() if key in self._abandoned]:
                    key = release(process)
                    replace(process)
                    self._finish(key, False)
                self._abandoned.clear()
                while self._queue and idle:
                    process = idle.pop()
                    if process.poll() is not None:       # died while idle (between rounds)
                        replace(process)
                        continue
                    key, record = self._queue.popleft()
                    try:
                        line = (json.dumps(_encode(record)) + "\n").encode()
                    except Exception:                    # not data a worker can read: the tuner's
                        idle.append(process)
                        self._finish(key, False)
                        continue
                    try:
                        process.stdin.write(line)
                    except OSError:                      # it died: the launch goes to the tuner
                        replace(process)
                        self._finish(key, False)
                        continue
                    held[process], busy[process] = key, b""
                    selector.register(process.stdout, selectors.EVENT_READ, process)
                if not self.processes:                   # no worker left: what is queued goes to the tuner
                    while self._queue:
                        self._finish(self._queue.popleft()[0], False)
            for event, _ in selector.select():
                if event.data is None:
                    os.read(self._wake_read, 4096)
                    continue
                process = event.data
                data = os.read(process.stdout.fileno(), 65536)
                with self._state:
                    if process in starting:
                        starting[process] += data
                        if not data or READY in starting[process].split(b"\n"):   # died starting, or ready
                            selector.unregister(process.stdout)
                            del starting[process]
                            if data:
                                idle.append(process)
                            else:
                                replace(process)
                        continue
                    if not data:                         # it died with the launch
                        key = release(process)
                        replace(process)
                        self._finish(key, False)
                        continue
                    busy[process] += data
                    answers = [line for line in busy[process].split(b"\n")[:-1] if line.startswith(REPLY)]
                    if answers:                          # anything else it printed is not ours
                        key = release(process)
                        idle.append(process)
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


_POOL: ContextVar[CompilePool | None] = ContextVar("opfuse_compile_pool", default=None)


def gpu_index(device: Any) -> int | None:
    """The index of GPU `device` (the current one where it names none); None for a device other than a GPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def active_pool(device: Any) -> CompilePool | None:
    """The `compile_pool` running for `device`, if one is."""
    pool = _POOL.get()
    return pool if pool is not None and pool.device_index == gpu_index(device) else None


@contextmanager
def compile_pool(workers: int, device: Any) -> Iterator[CompilePool | None]:
    """Inside, `precompile` on `device` uses one pool: the one running already for it, else `workers` started
    now (none for fewer than 2 workers or a device other than a GPU)."""
    running = active_pool(device)
    if running is not None or workers < 2 or gpu_index(device) is None:
        yield running
        return
    pool = CompilePool(workers, gpu_index(device)).start()
    token = _POOL.set(pool)
    try:
        yield pool
    finally:
        _POOL.reset(token)
        pool.close()


def precompile(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]], workers: int,
               device_index: int) -> Precompiled:
    """Compile every distinct launch of `jobs` (kernel, its runtime inputs, the configs it will be timed with) in
    the running `compile_pool` on GPU `device_index`, else in a pool of `workers` of its own; see the module
    docstring."""
    records = distinct_compiles(record_launches(jobs))
    result = Precompiled(launches=len(records))
    pool = _POOL.get()
    if pool is not None and pool.device_index == device_index:
        result.compiled = pool.compile(records) if records else 0
    else:
        pool = pool_of_its_own(workers, len(records), device_index)
        if pool is None:
            return result
        try:
            result.compiled = pool.compile(records)
        finally:
            pool.close()
    result.failed = result.launches - result.compiled
    return result


def pool_of_its_own(workers: int, launches: int, device_index: int) -> CompilePool | None:
    """A started pool for a build that runs in no `compile_pool`: `workers` at most, none idle from the start
    (`launches`: its distinct compiles); None for fewer than 2 workers or `MIN_LAUNCHES` launches."""
    if workers < 2 or launches < MIN_LAUNCHES:
        return None
    return CompilePool(min(workers, launches), device_index).start()


def _encode(record: LaunchRecord) -> dict:
    """A launch record as JSON (the workers read data, never code): a tensor argument as {"tensor": [dtype,
    offset]}, every other argument (ints, floats, bools, strings, None) as it is."""
    def value(arg):
        return {"tensor": [arg.dtype, arg.offset]} if isinstance(arg, TensorArg) else arg

    return {"path": record.path, "function": record.function, "args": [value(a) for a in record.args],
            "kwargs": [[name, value(v)] for name, v in record.kwargs]}


def _decode(item: dict) -> LaunchRecord:
    def value(arg):
        return TensorArg(*arg["tensor"]) if isinstance(arg, dict) else arg

    return LaunchRecord(item["path"], item["function"], tuple(value(a) for a in item["args"]),
                        tuple((name, value(v)) for name, v in item["kwargs"]))


# ---- in the workers ------------------------------------------------------------------------------------------

class _StandIn:
    """A tensor as Triton's launcher sees it when it specialises a kernel: a dtype and an aligned or not pointer."""

    def __init__(self, arg: TensorArg):
        self.dtype = getattr(torch, arg.dtype)
        self.offset = arg.offset
        self.shape = [1]

    def data_ptr(self) -> int:
        return self.offset

    def stride(self) -> list[int]:
        return [1]


def stand_in(value):
    """A recorded launch argument as the launch passes it: a `_StandIn` for a tensor, any other value as it is."""
    return _StandIn(value) if isinstance(value, TensorArg) else value


def warmup(function: Any, record: LaunchRecord) -> Any:
    """The jitted `function` compiled for a recorded launch (or loaded from Triton's cache), on stand-in values and
    not launched: Triton's CompiledKernel."""
    return function.warmup(*map(stand_in, record.args), grid=(1,),
                           **{name: stand_in(value) for name, value in record.kwargs})


def _compile(record: LaunchRecord, modules: dict[str, object], seconds: dict[str, float] | None = None) -> bool:
    """Compile one recorded launch into Triton's cache; whether that worked. `seconds` gets the compile's and the
    launcher build's."""
    start = time.perf_counter()
    try:
        module = modules.get(record.path)
        if module is None:
            module = modules[record.path] = import_kernel(record.path)
        compiled = warmup(getattr(module, record.function), record)
    except Exception:
        return False
    built = time.perf_counter()
    build_launcher(compiled)
    if seconds is not None:
        seconds.update(compile=built - start, launcher=time.perf_counter() - built)
    return True


def build_launcher(compiled) -> None:
    """Build a compiled kernel's launcher as loading it would, into Triton's cache: Triton 3.6 compiles a C launcher
    per kernel signature with the system's C compiler (a quarter of a second each, cached on disk), which the
    compiling process would otherwise build one after the other as it loads the kernels; Triton 3.8's launcher is
    generic, and this costs nothing. A launcher that fails here is built (or fails) again where the kernel loads."""
    from triton.runtime.driver import driver

    try:
        driver.active.launcher_cls(compiled.src, compiled.metadata)
    except Exception:
        pass


def answer(ok: bool) -> bytes:
    """A worker's reply to one launch: `REPLY` on a line of its own, even after output that ended mid-line."""
    return b"\n" + REPLY + (b"1" if ok else b"0") + b"\n"


def _serve(device_index: int) -> int:
    """Say `READY` on stdout once imported, then compile each launch read from stdin (one JSON line each) and
    `answer` each on stdout, until the input ends; the CUDA context is made when the first launch comes. With
    OPFUSE_WORKER_LOG set (`worker_log`), each launch also appends a JSON line there: when the worker was ready (its
    imports done), when the launch came and was answered, whether it compiled, its compile and launcher seconds."""
    modules: dict[str, object] = {}
    hash_triton()        # while the caller captures the model, before the first launch comes
    log_path = worker_log()
    ready = time.time()
    sys.stdout.buffer.write(READY + b"\n")
    sys.stdout.buffer.flush()
    for count, line in enumerate(sys.stdin.buffer):
        came = time.time()
        if count == 0:
            torch.cuda.set_device(device_index)
        record = _decode(json.loads(line))
        seconds: dict[str, float] = {}
        ok = _compile(record, modules, seconds)
        if log_path:    # one line, appended whole (the workers share the file), before the answer ends a wait
            entry = {"pid": os.getpid(), "ready": ready, "came": came, "done": time.time(), "ok": ok,
                     "kernel": record.function, **{f"{k}_s": round(v, 4) for k, v in seconds.items()}}
            with open(log_path, "a") as log:
                log.write(json.dumps(entry) + "\n")
        sys.stdout.buffer.write(answer(ok))
        sys.stdout.buffer.flush()
    return 0


def summarize_worker_log(log: str | None, began: float) -> dict | None:
    """What the compile workers did, from their log (`worker_log`, as `_serve` writes it), in seconds from `began`
    (a compile's start, `time.time()`): when they were ready (imports done) and got their first launch, how many
    launches they built and how many failed, their compile and launcher seconds in sum, the last answer. None
    without a log or with an empty one (no worker took a launch)."""
    if not log or not os.path.exists(log):
        return None
    rows = [json.loads(line) for line in Path(log).read_text().splitlines() if line.strip()]
    if not rows:
        return None
    first: dict[int, dict] = {}
    for row in sorted(rows, key=lambda r: r["came"]):
        first.setdefault(row["pid"], row)
    ready = sorted(r["ready"] - began for r in first.values())
    came = sorted(r["came"] - began for r in first.values())
    return {"workers": len(first), "ready_s": [round(ready[0], 2), round(ready[-1], 2)],
            "first_launch_s": [round(came[0], 2), round(came[-1], 2)], "launches": len(rows),
            "failed": sum(not r["ok"] for r in rows),
            "compile_s": round(sum(r.get("compile_s", 0) for r in rows), 2),
            "launcher_s": round(sum(r.get("launcher_s", 0) for r in rows), 2),
            "busy_s": round(sum(r["done"] - r["came"] for r in rows), 2),
            "last_done_s": round(max(r["done"] for r in rows) - began, 2)}


if __name__ == "__main__":
    sys.exit(_serve(int(sys.argv[2])))
