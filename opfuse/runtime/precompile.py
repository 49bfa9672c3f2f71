"""Compile a model's Triton kernels in parallel while the autotuner times them (`precompile`, `compile_pool`).

Compiling is most of a cold compile: every candidate config of every kernel is a Triton compile of its own, and
the autotuner compiles them one after the other as it first runs each. Here each candidate is run once with its
launches recorded instead of launched (`opfuse.runtime.launch_records`: no generated kernel runs and nothing is
compiled in this process; a library form's cuBLAS/cuDNN call still runs, the unfused form is skipped), and worker
processes compile the recorded launches, one of each `compile_key`, writing Triton's on-disk cache
(`opfuse.runtime.compile_worker`); the tuner's own launches then load the compiled kernels from that cache. It only
warms a cache: a launch a worker could not compile is compiled by the tuner as before, and workers that fail or
outlast `worker_pool.TIMEOUT_S` (killed then) cost time, never a result.

The workers, `compile_workers` of them, each on the caller's GPU, are run by a pool
(`opfuse.runtime.worker_pool.CompilePool`) that hands them launches as callers queue them. `opfuse.compile` starts
its pool before it captures the model (`compile_pool`): the workers import torch and Triton while the model is
captured and planned, and every build of that compile (the build again after a split back too) uses them.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from opfuse.codegen.base import GroupKernel, KernelConfig
from opfuse.runtime.compile_worker import hash_triton
from opfuse.runtime.launch_records import distinct_compiles, record_launches
from opfuse.runtime.worker_pool import CompilePool

MIN_LAUNCHES = 8        # fewer distinct launches than this compile faster in the tuner than workers start


def default_workers() -> int:
    """Half the machine's CPUs, at most 8: each worker holds a CUDA context and a Triton compile at a time."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def workers_of(config) -> int:
    """How many compile workers a compile with FusionConfig `config` runs: `compile_workers`, else
    `default_workers()`."""
    return config.compile_workers if config.compile_workers is not None else default_workers()


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
