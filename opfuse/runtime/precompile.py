"""Compile a model's Triton kernels in parallel before the autotuner times them (`precompile`).

Compiling is most of a cold compile: every candidate config of every kernel is a Triton compile of its own, and
the autotuner compiles them one after the other as it first runs each. Here each candidate is run once with its
launches recorded instead of launched (`opfuse.codegen.base.recording_launches`: nothing runs on the GPU and
nothing is compiled in this process), and a pool of worker processes compiles the recorded launches
(`warmup` of the jitted function, on stand-in tensors of the same dtype and alignment, so Triton specialises the
kernel as the real launch will), writing Triton's on-disk cache; the tuner's own launches then load the compiled
kernels from that cache. It only warms a cache: a launch a worker could not compile is compiled by the tuner as
before, and a pool that fails costs time, never a result.

Workers are spawned (CUDA does not survive a fork), `compile_workers` of them, each on the caller's GPU.
"""

from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch

from opfuse.codegen.base import GroupKernel, KernelConfig, LaunchRecord, TensorArg, recording_launches

MIN_LAUNCHES = 8        # fewer distinct launches than this compile faster in the tuner than a pool starts


def default_workers() -> int:
    """Half the machine's CPUs, at most 8: each worker holds a CUDA context and a Triton compile at a time."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass
class Precompiled:
    """What `precompile` did: distinct launches recorded, compiled by the workers, and those that failed there."""

    launches: int = 0
    compiled: int = 0
    failed: int = 0


def record_launches(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]]
                    ) -> list[LaunchRecord]:
    """The distinct launches of running each kernel once with each of its configs (none of them run)."""
    records: dict[LaunchRecord, None] = {}
    for kernel, inputs, configs in jobs:
        for config in configs:
            try:
                with recording_launches() as launches:
                    kernel.run(inputs, config)
            except Exception:   # the tuner runs this config itself and reports what is wrong with it
                continue
            records.update(dict.fromkeys(launches))
    return list(records)


def precompile(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]], workers: int,
               device_index: int) -> Precompiled:
    """Compile every launch of `jobs` (kernel, its runtime inputs, the configs it will be timed with) in `workers`
    processes on GPU `device_index`; see the module docstring."""
    records = record_launches(jobs)
    result = Precompiled(launches=len(records))
    if workers < 2 or len(records) < MIN_LAUNCHES:
        return result
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(workers, len(records)), mp_context=context,
                                 initializer=_start_worker, initargs=(device_index,)) as pool:
            for ok in pool.map(_compile, records, chunksize=1):
                result.compiled += ok
                result.failed += not ok
    except Exception:           # a broken pool (a worker killed, no CUDA there): the tuner compiles as before
        result.failed = result.launches - result.compiled
    return result


# ---- in the workers ------------------------------------------------------------------------------------------

_MODULES: dict[str, object] = {}


def _start_worker(device_index: int) -> None:
    torch.cuda.set_device(device_index)


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


def _compile(record: LaunchRecord) -> bool:
    """Compile one recorded launch into Triton's cache; whether that worked."""
    try:
        module = _MODULES.get(record.path)
        if module is None:
            spec = importlib.util.spec_from_file_location(os.path.basename(record.path)[:-3], record.path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            _MODULES[record.path] = module
        function = getattr(module, record.function)
        args = [_StandIn(a) if isinstance(a, TensorArg) else a for a in record.args]
        function.warmup(*args, grid=(1,), **dict(record.kwargs))
        return True
    except Exception:
        return False
