"""The environment variables opfuse reads, each read here and nowhere else, each with one meaning.

- TRITON_INTERPRET: Triton runs kernels through its CPU interpreter (`triton_interpreter`), read as Triton reads
  it (1, true, yes, y or on, in any case; anything else is off). Triton reads it when it is imported, so it must
  be set before.
- OPFUSE_DEBUG_DIR: where each stage of a compile dumps what it made (`debug_dir`; FusionConfig.debug_dir wins).
- OPFUSE_KERNEL_DIR: where generated kernel sources are written (`kernel_dir`; default: a folder in the temp dir).
- OPFUSE_WORKER_LOG: a file each compile worker (`opfuse.runtime.compile_worker`) appends a JSON line to per launch
  it builds, with its seconds (`worker_log`; for benchmarks/compile_time.py).
- XDG_CACHE_HOME: the root of the default tuning cache (`cache_home`; default ~/.cache).
"""

from __future__ import annotations

import os

TRUE_WORDS = ("1", "true", "yes", "y", "on")


def triton_interpreter() -> bool:
    """Whether Triton runs kernels through its CPU interpreter (tests): TRITON_INTERPRET, as Triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in TRUE_WORDS


def debug_dir() -> str | None:
    return os.environ.get("OPFUSE_DEBUG_DIR") or None


def kernel_dir() -> str | None:
    return os.environ.get("OPFUSE_KERNEL_DIR") or None


def worker_log() -> str | None:
    return os.environ.get("OPFUSE_WORKER_LOG") or None


def cache_home() -> str | None:
    return os.environ.get("XDG_CACHE_HOME") or None
