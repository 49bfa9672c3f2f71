"""Compile a model's Triton kernels in parallel before the autotuner times them (`precompile`).

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
user's script again in each), `compile_workers` of them, each on the caller's GPU, each given its share of the
launches in a JSON file.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from opfuse.codegen.base import (GroupKernel, KernelConfig, LaunchRecord, TensorArg, import_file,
                                 recording_launches)

MIN_LAUNCHES = 8        # fewer distinct launches than this compile faster in the tuner than workers start
TIMEOUT_S = 300.0       # the workers of one precompile are killed after this long


def default_workers() -> int:
    """Half the machine's CPUs, at most 8: each worker holds a CUDA context and a Triton compile at a time."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@dataclass
class Precompiled:
    """What `precompile` did: distinct compiles recorded (`compile_key`), compiled by the workers, and those that
    failed there."""

    launches: int = 0
    compiled: int = 0
    failed: int = 0

    def __add__(self, other: "Precompiled") -> "Precompiled":
        """Two precompiles' counts together (the tuner's second round: `opfuse.runtime.autotune.next_configs`)."""
        return Precompiled(self.launches + other.launches, self.compiled + other.compiled,
                           self.failed + other.failed)


def record_launches(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]]
                    ) -> list[LaunchRecord]:
    """The distinct launches of running each kernel once with each of its configs but the unfused form (none of
    the generated kernels runs); each kernel then holds its default config's weights only (`keep_default`)."""
    from opfuse.codegen.forms import is_unfused

    records: dict[LaunchRecord, None] = {}
    for kernel, inputs, configs in jobs:
        for config in configs:
            if is_unfused(config):      # PyTorch's ops one by one: nothing to compile
                continue
            try:
                with recording_launches() as launches:
                    kernel.run(inputs, config)
                records.update(dict.fromkeys(launches))
            except Exception:   # the tuner runs this config itself and reports what is wrong with it
                continue
        # what those runs made (other forms' weights, other block sizes' packings) goes before the next kernel's:
        # the tuner makes them again, one kernel at a time
        kernel.keep_default()
    return list(records)


def compile_key(record: LaunchRecord) -> tuple:
    """What Triton compiles a recorded launch into, as far as its arguments decide: each constexpr's value, each
    tensor's dtype and 16-byte alignment, whether an integer is 1, a multiple of 16 and 32-bit, and the launch
    options. Two launches of one kernel with one key (one template at other sizes) are one compile, which two
    workers would otherwise both do at once. A key may separate launches Triton compiles once, never the reverse."""
    module = sys.modules.get(Path(record.path).stem)
    function = getattr(module, record.function, None)
    raw = getattr(function, "fn", None)
    if raw is None:                   # not loaded here: the launch is its own key
        return (record,)
    params = list(inspect.signature(raw).parameters.values())

    def argument(param: inspect.Parameter, value: Any) -> tuple:
        if "constexpr" in str(param.annotation):
            return ("constexpr", value)
        if isinstance(value, TensorArg):
            return ("tensor", value.dtype, value.offset % 16 == 0)
        if isinstance(value, bool) or not isinstance(value, int):
            return (type(value).__name__,)
        return ("int", value == 1, value % 16 == 0, -2 ** 31 <= value < 2 ** 31)

    return (record.path, record.function, tuple(argument(p, a) for p, a in zip(params, record.args)),
            record.kwargs)


def distinct_compiles(records: Sequence[LaunchRecord]) -> list[LaunchRecord]:
    """The first launch of each `compile_key`, in order."""
    first: dict[tuple, LaunchRecord] = {}
    for record in records:
        first.setdefault(compile_key(record), record)
    return list(first.values())


def precompile(jobs: Sequence[tuple[GroupKernel, list[torch.Tensor], Sequence[KernelConfig]]], workers: int,
               device_index: int) -> Precompiled:
    """Compile every distinct launch of `jobs` (kernel, its runtime inputs, the configs it will be timed with) in
    `workers` processes on GPU `device_index`; see the module docstring."""
    records = distinct_compiles(record_launches(jobs))
    result = Precompiled(launches=len(records))
    if workers < 2 or len(records) < MIN_LAUNCHES:
        return result
    count = min(workers, len(records))
    root = str(Path(__file__).resolve().parents[2])      # where the opfuse package is, for the workers' import
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    deadline = time.monotonic() + TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="opfuse-precompile-") as folder:
        processes = []
        for index in range(count):
            share = Path(folder) / f"launches-{index}.json"
            share.write_text(json.dumps([_encode(record) for record in records[index::count]]))
            processes.append(subprocess.Popen([sys.executable, "-m", "opfuse.runtime.precompile", str(share),
                                               str(device_index)], env=env, stdout=subprocess.PIPE,
                                              stderr=subprocess.DEVNULL, text=True))
        for process in processes:
            try:
                output, _ = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
                continue
            last = output.strip().splitlines()[-1:] if output else []    # the count, after anything else printed
            if process.returncode == 0 and last and last[0].isdigit():
                result.compiled += int(last[0])
    result.failed = result.launches - result.compiled
    return result


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


def _compile(record: LaunchRecord, modules: dict[str, object]) -> bool:
    """Compile one recorded launch into Triton's cache; whether that worked."""
    try:
        module = modules.get(record.path)
        if module is None:
            module = modules[record.path] = import_file(record.path, Path(record.path).stem)
        function = getattr(module, record.function)
        function.warmup(*map(stand_in, record.args), grid=(1,),
                        **{name: stand_in(value) for name, value in record.kwargs})
        return True
    except Exception:
        return False


def _worker(share: str, device_index: int) -> int:
    """Compile the launches written to `share`; print how many compiled."""
    torch.cuda.set_device(device_index)
    records = [_decode(item) for item in json.loads(Path(share).read_text())]
    modules: dict[str, object] = {}
    print(sum(_compile(record, modules) for record in records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1], int(sys.argv[2])))
