"""A compile worker (`python -m opfuse.runtime.compile_worker --serve DEVICE`), and what it shares with the pool
that runs it (`opfuse.runtime.worker_pool.CompilePool`): the protocol and the compile of one launch.

A worker is a process of its own, not multiprocessing's spawn (which would run the user's script again in each). It
says `READY` once its imports are done (importing torch takes it seconds), then reads one launch at a time as a JSON
line on its stdin (`encode_launch`: the workers read data, never code) and compiles it into Triton's on-disk cache
(`warmup` of the jitted function on stand-in tensors of the same dtype and alignment, so Triton specialises the
kernel as the real launch will), answering each with `answer`. It makes its CUDA context when its first launch
comes: a compile whose every kernel is cached leaves the GPU's memory to the model while it is checked and verified.
The compiling process builds launches the same way while it waits for them (`build_here`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from opfuse.codegen.base import LaunchRecord, TensorArg, import_kernel
from opfuse.environment import worker_log
from opfuse.runtime.launch_records import loaded_module

REPLY = b"opfuse-compiled "  # a worker's answer to one launch: this, then 1 (compiled) or 0, on a line of its own
READY = b"opfuse-ready"       # a worker's first line: its imports are done, it takes launches from now on


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


def encode_launch(record: LaunchRecord) -> dict:
    """A launch record as JSON (the workers read data, never code): a tensor argument as {"tensor": [dtype,
    offset]}, every other argument (ints, floats, bools, strings, None) as it is."""
    def value(arg):
        return {"tensor": [arg.dtype, arg.offset]} if isinstance(arg, TensorArg) else arg

    return {"path": record.path, "function": record.function, "args": [value(a) for a in record.args],
            "kwargs": [[name, value(v)] for name, v in record.kwargs]}


def decode_launch(item: dict) -> LaunchRecord:
    def value(arg):
        return TensorArg(*arg["tensor"]) if isinstance(arg, dict) else arg

    return LaunchRecord(item["path"], item["function"], tuple(value(a) for a in item["args"]),
                        tuple((name, value(v)) for name, v in item["kwargs"]))


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


def build_here(record: LaunchRecord) -> bool:
    """Compile one recorded launch in this process, as a worker would (`_compile`), with the jitted function of the
    kernel's loaded module where it is loaded (its own cache then holds the kernel too); whether that worked."""
    module = loaded_module(record)
    return _compile(record, {record.path: module} if module is not None else {})


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


def serve(device_index: int) -> int:
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
        record = decode_launch(json.loads(line))
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
    """What the compile workers did, from their log (`worker_log`, as `serve` writes it), in seconds from `began`
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
    sys.exit(serve(int(sys.argv[2])))
