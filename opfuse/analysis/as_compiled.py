"""What the last compile of a plan runs, so that `opfuse analyze` can say it: `store(...)`, `load(plan, config)`.

A plan's launch count is what its groups launch in their generated forms. On a GPU the autotuner keeps a library
form (the anchor through cuBLAS/cuDNN, its epilogue a kernel of its own) or the unfused form (the group's ops one by
one through PyTorch) where it measures faster, and verification sends a failing kernel's group through PyTorch: the
compiled model then launches more than the plan says. Every compile records what it ended with under the key of the
plan it started from (`plan_key`), in the tuning cache's directory (`compiled/`); `opfuse.analyze` reads the record
of its own plan, and reports those launches, forms and groups through PyTorch as the compiled model's.

The key covers the prepared graph (every node's op and type), the plan (groups and decisions), the tuning settings
(autotune, tune_top, library_anchors, split_k), the torch, Triton and opfuse versions: an analysis finds a record
only of a compile that started from the same plan with the same tuning settings. Records of other GPUs are kept
apart by the plan's hardware profile and named by the GPU that made them.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

TUNING_FIELDS = ("autotune", "tune_top", "library_anchors", "split_k")


@dataclass
class AsCompiled:
    """One compile's outcome: launches per forward and why they differ from the plan's."""

    gpu: str                                # the device the compile ran on, by name
    date: str                               # when (ISO 8601, UTC)
    launches: int                           # the compiled model's kernel launches per forward
    planned: int                            # the plan's (`FusionPlan.kernel_launches`)
    library: dict[str, str] = field(default_factory=dict)        # group -> its library form, and the timings
    unfused: dict[str, str] = field(default_factory=dict)        # group -> unfused by measurement, and the timings
    through_pytorch: dict[str, str] = field(default_factory=dict)  # group -> why it has no kernel (verification...)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line: the launches as compiled and where they differ from the plan's."""
        parts = []
        if self.library:
            parts.append(f"{len(self.library)} groups with the anchor in cuBLAS/cuDNN")
        if self.unfused:
            parts.append(f"{len(self.unfused)} unfused")
        if self.through_pytorch:
            parts.append(f"{len(self.through_pytorch)} through PyTorch")
        why = f" ({', '.join(parts)}, as the autotuner and verification decided)" if parts else ""
        return (f"as compiled on {self.gpu} ({self.date[:10]}): {self.launches} kernel launches per forward, "
                f"planned {self.planned}{why}")


def plan_key(plan: Any, config: Any) -> str:
    """sha256 over the prepared graph, the plan, the tuning settings and the versions (module docstring)."""
    import opfuse
    from opfuse.runtime.cache import software_versions

    payload = {"graph": [[n.name, n.op, str(n.type), list(n.inputs)] for n in plan.graph],
               "plan": plan.to_dict(),
               "tuning": {name: getattr(config, name, None) for name in TUNING_FIELDS},
               "versions": software_versions() | {"opfuse": opfuse.__version__}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _cache(config: Any):
    from opfuse.runtime.cache import TuningCache, default_cache_dir

    return TuningCache(default_cache_dir(config) / "compiled")


def record(compiled: Any, planned: int, device: Any) -> AsCompiled:
    """The outcome of a compiled model (`opfuse.runtime.compiled.CompiledModel`) built from a plan of `planned`
    launches on `device`."""
    import torch

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "the CPU (Triton's interpreter)"
    return AsCompiled(gpu=gpu, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                      launches=compiled.launches, planned=planned, library=dict(compiled.library_anchors),
                      unfused=dict(compiled.unfused),
                      through_pytorch={g: r.text for g, r in compiled.fallbacks.items()})


def store(key: str, config: Any, outcome: AsCompiled) -> None:
    _cache(config).store(key, outcome.to_dict())


def load(plan: Any, config: Any) -> AsCompiled | None:
    """The record of the last compile that started from this plan with this config's tuning settings, or None."""
    entry = _cache(config).load(plan_key(plan, config))
    if entry is None:
        return None
    try:
        return AsCompiled(**entry)
    except TypeError:      # a record of another layout: as if missing
        return None
