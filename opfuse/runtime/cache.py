"""On-disk autotuning cache: `TuningCache(directory)`, one JSON file per key.

A key (`tuning_key`) is the sha256 of everything that can change which config is fastest: the kernel source, the
input shapes, dtypes and strides, the GPU name, and the torch and Triton versions. Writes go to a temp file in the
same directory and are moved into place with `os.replace`, so a reader never sees half a file and two processes
storing the same key both succeed (the last one wins; both wrote a valid entry). An entry that does not parse is
treated as missing and is overwritten by the next store. The cache only saves time: a directory that cannot be
written is reported with a warning, never an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

FORMAT = 1   # bump when the entry layout changes; older entries then read as missing


def default_cache_dir(config: Any = None) -> Path:
    """config.cache_dir if set, else $XDG_CACHE_HOME/opfuse, else ~/.cache/opfuse."""
    configured = getattr(config, "cache_dir", None)
    if configured:
        return Path(configured).expanduser()
    from opfuse.environment import cache_home

    xdg = cache_home()
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "opfuse"


def describe_inputs(tensors: Sequence[torch.Tensor]) -> list[dict[str, Any]]:
    """Shape, dtype and strides of each tensor: the part of a tuning key that comes from the inputs."""
    return [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "strides": list(t.stride())}
            for t in tensors]


def software_versions() -> dict[str, str]:
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version}


# how the autotuner times candidates; part of every key, so a change of method re-tunes instead of reusing choices
# made by another clock (1: do_bench, plain launches; 2: do_bench_cudagraph; 3: clock.graph_time)
TIMING_METHOD = 3
# what the forms other than the Triton configs run (the library forms' epilogue and prologue kernels, the unfused
# ops): part of every key, since a kernel's source does not say, so a change of them re-tunes (1: until 77be925;
# 2: the library forms' prologue as one generated kernel)
FORMS_REVISION = 2


def tuning_key(source: str, inputs: Sequence[torch.Tensor] | Sequence[dict[str, Any]], gpu_name: str,
               versions: dict[str, str] | None = None, candidates: Sequence[dict[str, int]] = (),
               cold: bool = False) -> str:
    """sha256 over the kernel source, the inputs' shapes/dtypes/strides, the GPU name, the software versions, the
    candidate configs timed (a tuning that offered other forms, e.g. without the library form, is another key),
    what those forms run (`FORMS_REVISION`) and the timing method (`cold`: with L2 scrubbed before each call)."""
    described = [item if isinstance(item, dict) else describe_inputs([item])[0] for item in inputs]
    payload = {"source": source, "inputs": described, "gpu": gpu_name,
               "versions": versions if versions is not None else software_versions(),
               "candidates": [dict(c) for c in candidates], "forms": FORMS_REVISION, "timing": TIMING_METHOD}
    if cold:       # (absent otherwise: the keys of warm tunings stay what they were)
        payload["cold"] = True
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


class TuningCache:
    """Tuning results keyed by `tuning_key`; `load(key)` -> dict or None, `store(key, entry)`."""

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self._warned = False

    @classmethod
    def for_config(cls, config: Any) -> "TuningCache":
        return cls(default_cache_dir(config))

    def path(self, key: str) -> Path:
        if not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"tuning cache key {key!r} must be alphanumeric (use tuning_key())")
        return self.directory / f"{key}.json"

    def load(self, key: str) -> dict[str, Any] | None:
        """The stored entry, or None when missing, unreadable, truncated or from another format."""
        try:
            text = self.path(key).read_text(encoding="utf-8")
            data = json.loads(text)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("key") != key:
            return None
        entry = data.get("entry")
        return entry if isinstance(entry, dict) else None

    def store(self, key: str, entry: dict[str, Any]) -> None:
        """Write the entry atomically (temp file in the same directory, then os.replace)."""
        path = self.path(key)
        text = json.dumps({"format": FORMAT, "key": key, "entry": entry}, indent=1, sort_keys=True)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{key[:16]}.", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())   # the rename must not land before the data does
            os.replace(tmp, path)
            tmp = None
        except OSError as error:
            if not self._warned:
                warnings.warn(f"opfuse tuning cache {self.directory} is not writable ({error}); "
                              "tuning results will not be kept", stacklevel=2)
                self._warned = True
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass

    def clear(self) -> int:
        """Remove every entry; returns how many were removed."""
        removed = 0
        for path in self.directory.glob("*.json"):
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
        return removed

    def __repr__(self) -> str:
        return f"TuningCache({str(self.directory)!r})"
