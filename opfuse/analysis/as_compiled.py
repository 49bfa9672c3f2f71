"""What the last compile of a plan runs, so that `opfuse analyze` can say it: `store(...)`, `load(...)`.

A plan's launch count is what its groups launch in their generated forms. On a GPU the autotuner keeps a library
form (the anchor through cuBLAS/cuDNN, its epilogue a kernel of its own) or the unfused form (the group's ops one by
one through PyTorch) where it measures faster, and verification sends a failing kernel's group through PyTorch: the
compiled model then launches more than the plan says, and cuBLAS/cuDNN add helper kernels of their choosing (a
split-K reduction). Every compile records what it ended with (on a GPU, its launches counted on a CUDA graph
capture of the forward, and a replay of it timed: `CompiledModel.measure_forward`), or that it failed and why,
under the key of the plan it started from (`plan_key`), in the tuning cache's directory (`compiled/`);
`opfuse.analyze` reads the record of its own plan on its device, and reports those launches, forms, groups and that
time as the compiled model's.

The key covers the prepared graph (every node's op and type), the plan (groups and decisions), the settings that
change what a compile of it runs (split_k, verify, dependent_launch, weight_prefetch; and where the build tunes,
autotune, tune_top, tune_cold, library_anchors), the device by name (the GPU's, or the CPU's interpreter: `target`,
one rule for compile and analyze), and the torch, Triton and opfuse versions: an analysis finds the record only of a
compile that started from the same plan with the same settings on the same kind of device.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

SETTINGS = ("autotune", "tune_top", "tune_cold", "library_anchors", "split_k", "split_epilogues", "verify",
            "dependent_launch", "weight_prefetch")
# of SETTINGS: those that matter only where it tunes
TUNING = ("autotune", "tune_top", "tune_cold", "library_anchors", "split_epilogues")


@dataclass
class AsCompiled:
    """One compile's outcome: launches per forward and why they differ from the plan's, or why it failed."""

    gpu: str                                # the device the compile ran on, by name
    date: str                               # when (ISO 8601, UTC)
    launches: int                           # the compiled model's kernel launches per forward (0: it failed)
    planned: int                            # what analyze counts for the plan (`Analysis.fused.kernel_launches`)
    library: dict[str, str] = field(default_factory=dict)        # group -> its library form, and the timings
    unfused: dict[str, str] = field(default_factory=dict)        # group -> unfused by measurement, and the timings
    through_pytorch: dict[str, str] = field(default_factory=dict)  # group -> why it lost its kernel (verification),
                                                                 # beyond the groups analyze lists already
    failed: str = ""                        # why the compile failed ("": it did not)
    forward_ms: float | None = None         # one replay of the forward's CUDA graph, timed at the compile (median;
                                            # `CompiledModel.measure_forward`); None where none was captured

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        """One line: the launches as compiled and where they differ from the plan's."""
        when = f"on {self.gpu} ({self.date[:10]})"
        if self.failed:
            return f"the last compile of this plan {when} failed: {self.failed}"
        parts = []
        if self.library:
            parts.append(f"{len(self.library)} groups with the anchor in cuBLAS/cuDNN")
        if self.unfused:
            parts.append(f"{len(self.unfused)} unfused, as the autotuner measured")
        if self.through_pytorch:
            parts.append(f"{len(self.through_pytorch)} through PyTorch after verification")
        why = f" ({', '.join(parts)})" if parts else ""
        timed = "" if self.forward_ms is None else f", {self.forward_ms:.3f} ms a forward (a graph replay timed there)"
        return f"as compiled {when}: {self.launches} kernel launches per forward{timed}, planned {self.planned}{why}"


@dataclass(frozen=True)
class Target:
    """Where a compile of some example inputs runs, as a record keys it: the device by name, and whether the build
    autotunes there."""

    device: str
    tuning: bool


CPU = "the CPU (Triton's interpreter)"


def target(example_inputs: Sequence[Any] | None, config: Any) -> Target:
    """The device a compile of these inputs runs on, for compile and analyze alike: the GPU of the first input on
    one; else the CPU where the inputs can run there (Triton's interpreter is on) or this machine has no GPU; else
    this machine's GPU (a compile refuses CPU inputs without the interpreter: the model must move to the GPU)."""
    import torch

    from opfuse.environment import triton_interpreter
    from opfuse.runtime.autotune import tunes

    device = next((x.device for x in example_inputs or () if isinstance(x, torch.Tensor) and x.is_cuda), None)
    if device is None and (triton_interpreter() or not torch.cuda.is_available()):
        return Target(CPU, False)
    device = device if device is not None else torch.device("cuda")
    return Target(torch.cuda.get_device_name(device), tunes(config, device))


def plan_key(plan: Any, config: Any, where: Target) -> str:
    """sha256 over the prepared graph, the plan, the settings that take effect on `where` (the tuning ones only
    where it tunes; tune_top 0 and None alike), the device's name and the versions (module docstring)."""
    import opfuse
    from opfuse.runtime.cache import software_versions

    settings = {name: getattr(config, name, None) for name in SETTINGS}
    if not where.tuning:
        settings = {name: value for name, value in settings.items() if name not in TUNING}
    else:
        settings["tune_top"] = settings["tune_top"] or None
    payload = {"graph": [[n.name, n.op, str(n.type), list(n.inputs)] for n in plan.graph],
               "plan": plan.to_dict(),
               "settings": settings,
               "device": where.device,
               "versions": software_versions() | {"opfuse": opfuse.__version__}}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()


def _cache(config: Any):
    from opfuse.runtime.cache import TuningCache, default_cache_dir

    return TuningCache(default_cache_dir(config) / "compiled")


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def record(compiled: Any, analysis: Any, planned: int, device: str) -> AsCompiled:
    """The outcome of a compiled model (`opfuse.runtime.compiled.CompiledModel`) built from `analysis` (the plan it
    ran, after any split_back) on the device named `device`, of a plan analyze counted `planned` launches for."""
    launching = {g.name for g in compiled.plan.groups if g.launches}
    lost = {g: r.text for g, r in compiled.fallbacks.items() if g in launching and g not in analysis.pytorch_groups}
    return AsCompiled(gpu=device, date=_now(), launches=compiled.launches, planned=planned,
                      library=dict(compiled.library_anchors), unfused=dict(compiled.unfused), through_pytorch=lost,
                      forward_ms=compiled.forward_ms)


def failure(analysis: Any, device: str, error: BaseException) -> AsCompiled:
    """The record of a compile of `analysis` that failed with `error`."""
    return AsCompiled(gpu=device, date=_now(), launches=0, planned=analysis.fused.kernel_launches,
                      failed=f"{type(error).__name__}: {error}")


def store(key: str, config: Any, outcome: AsCompiled) -> None:
    _cache(config).store(key, outcome.to_dict())


def load(plan: Any, config: Any, where: Target) -> AsCompiled | None:
    """The record of the last compile that started from this plan with this config's settings on `where`, or
    None."""
    entry = _cache(config).load(plan_key(plan, config, where))
    if entry is None:
        return None
    try:
        return AsCompiled(**entry)
    except TypeError:      # a record of another layout: as if missing
        return None
