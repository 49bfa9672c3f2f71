"""Recorded kernel launches for the compile workers (`opfuse.runtime.precompile`): each candidate config of a
kernel run once with its launches recorded instead of launched (`opfuse.codegen.base.recording_launches`), and the
launches told apart by what Triton compiles them into (`compile_key`), so that each compile is done once.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Sequence

import torch

from opfuse.codegen.base import GroupKernel, KernelConfig, LaunchRecord, TensorArg, recording_launches, unaligned_params


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
