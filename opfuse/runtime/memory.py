"""Pre-flight memory check: refuse a compile that would not fit, before anything large is allocated.

Entry point: `check_memory(analysis, example_inputs, device, config)`, which raises GraphError with the breakdown
when `estimate_memory(...)` exceeds `available_memory(device, config)`.

The estimate is what compiling adds on the device, from the plan alone (no tensor is allocated to find it):
- weights: the compiled model's private copies of the constants, in the compute dtype;
- packed weights: what a grouped conv's weight packed block-diagonally for programs of several conv groups takes
  beyond that one copy (`opfuse.codegen.conv_implicit_gemm.packed_weight_extra_bytes`): each kernel's own, and those
  of the configs the autotuner runs for one kernel at a time where it tunes;
- other forms (where it tunes): the library form's copy of one kernel's weights and its unfused form's copies of
  them, made while that kernel is timed and freed once its choice is made (`keep_form`);
- inputs: the example inputs cast to the compute dtype;
- intermediates: the plan's peak of live intermediate buffers (`peak_intermediate_bytes`, the same number the
  report shows), outputs included;
- verification (when config.verify): the most the reference run's values take at once at the reference dtype
  (float64 for float32 models), each kept only until the last node or kernel check that reads it
  (`opfuse.numerics.reference_peak`, the schedule `check_groups` follows; views aside), and the end-to-end check's
  reference-dtype copy of the weights.
The limit is `config.memory_limit` when set, else the free memory CUDA reports (`torch.cuda.mem_get_info`) or, on
the CPU, MemAvailable from /proc/meminfo (no limit where that cannot be read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from opfuse.ir.graph import DTYPE_BYTES, GraphError, dtype_name
from opfuse.ir.ops import launches_kernel

GIB = 1024 ** 3


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a compile needs on its device, by part."""

    weights: int
    inputs: int
    intermediates: int
    verification: int = 0
    packed_weights: int = 0
    other_forms: int = 0

    @property
    def total(self) -> int:
        return (self.weights + self.packed_weights + self.other_forms + self.inputs + self.intermediates
                + self.verification)

    def describe(self) -> str:
        parts = [f"weights {format_bytes(self.weights)}", f"inputs {format_bytes(self.inputs)}",
                 f"peak intermediates {format_bytes(self.intermediates)}"]
        if self.packed_weights:
            parts.insert(1, f"grouped convs' packed weights {format_bytes(self.packed_weights)} more")
        if self.other_forms:
            parts.insert(1, f"the other forms of the kernel being tuned {format_bytes(self.other_forms)}")
        if self.verification:
            parts.append(f"verification's reference values {format_bytes(self.verification)}")
        return ", ".join(parts)


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def estimate_memory(analysis: Any, example_inputs: Sequence[torch.Tensor], verify: bool = True,
                    tuning: bool = False) -> MemoryEstimate:
    """What compiling `analysis.plan` on these inputs needs on the device, autotuning its kernels or not (see module
    docstring)."""
    from opfuse.codegen.conv_implicit_gemm import packed_weight_extra_bytes
    from opfuse.codegen.lower import choose_lowering, plan_hardware
    from opfuse.numerics import check_needs, reference_dtype, reference_peak

    graph = analysis.prepared
    compute_size = DTYPE_BYTES[analysis.config.dtype]
    weights = sum(t.nbytes for t in graph.constants.values())
    plan, hw = analysis.plan, plan_hardware(analysis.plan)
    packings = [packed_weight_extra_bytes(plan.graph, group, hw, tuning, analysis.config.tune_top)
                for group in plan.groups if group.name not in analysis.pytorch_groups
                and choose_lowering(plan.graph, group) == "conv"]
    # every kernel holds its own, and one at a time all of those its configs run
    packed = sum(held for held, _ in packings) + max((tuned - held for held, tuned in packings), default=0)
    # while one kernel is recorded or tuned, its library form's weight (cuDNN's channels-last copy) and its unfused
    # form's constants are made: its constants twice over, at most
    other_forms = 0
    if tuning:
        constants = plan.graph.constants
        other_forms = 2 * compute_size * max((sum(constants[name].numel() for name in group.inputs if name in constants)
                                              for group in plan.groups if group.anchor is not None), default=0)
    inputs = sum(x.numel() * (compute_size if x.is_floating_point() else x.element_size())
                 for x in example_inputs if isinstance(x, torch.Tensor))
    intermediates = analysis.fused.peak_intermediate_bytes
    verification = 0
    if verify:
        reference_size = DTYPE_BYTES[dtype_name(reference_dtype(analysis.config.dtype))]

        def at_reference(t) -> int:
            return t.numel * reference_size if t.is_float else t.nbytes

        def held(node) -> int:       # views share their source's memory
            return at_reference(node.type) if node.op in ("input", "constant") or launches_kernel(graph, node) else 0

        needs = {group.name: check_needs(graph, group) for group in plan.groups
                 if group.launches and group.name not in analysis.pytorch_groups}
        verification = reference_peak(graph, needs, held) + sum(at_reference(n.type) for n in graph
                                                                if n.op == "constant")
    return MemoryEstimate(weights, inputs, intermediates, verification, packed, other_forms)


def host_available_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes, or None where it cannot be read (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: torch.device | str, config: Any = None) -> tuple[int | None, str]:
    """(bytes a compile may use on `device`, where that number comes from); None: no known limit."""
    limit = getattr(config, "memory_limit", None)
    if limit is not None:
        return int(limit), "FusionConfig.memory_limit"
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free memory on {device} (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        return host_available_memory(), "available host memory (MemAvailable in /proc/meminfo)"
    return None, f"no known limit for {device}"


def check_memory(analysis: Any, example_inputs: Sequence[torch.Tensor], device: torch.device | str,
                 config: Any) -> MemoryEstimate:
    """The estimate, or GraphError when it is over what the device has (see module docstring)."""
    from opfuse.runtime.autotune import tunes

    tuning = tunes(config, device)
    estimate = estimate_memory(analysis, example_inputs, verify=getattr(config, "verify", True), tuning=tuning)
    limit, source = available_memory(device, config)
    if limit is not None and estimate.total > limit:
        hints = ["use a smaller batch or input"]
        if estimate.verification:
            hints.append("FusionConfig(verify=False) skips the verification's copies")
        if source == "FusionConfig.memory_limit":
            hints.append("raise FusionConfig.memory_limit")
        raise GraphError(f"{analysis.name} needs about {format_bytes(estimate.total)} on {torch.device(device)} to "
                         f"compile and run ({estimate.describe()}), but only {format_bytes(limit)} is available "
                         f"({source}); refused before allocating it: {'; '.join(hints)}")
    return estimate
