"""The front half of the pipeline as one call: `analyze(model_or_path, ...) -> Analysis`.

capture (torch.export | ONNX) -> IR graph -> cast to the compute dtype -> passes (fold constants and BN, DCE, verify)
    -> fusion plan -> analysis (per-op table, traffic unfused vs fused)

`Analysis` holds every stage's product, so `opfuse analyze`, `opfuse.compile` and the report all read the same facts.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from opfuse.config import FusionConfig, for_graph, resolve_dtype
from opfuse.fusion.plan import FusionPlan
from opfuse.fusion.reasons import Reason
from opfuse.hardware import HardwareProfile, get_hardware
from opfuse.ir.graph import Graph


@dataclass
class Analysis:
    """What opfuse found out about one model, stage by stage."""

    name: str
    config: FusionConfig
    hardware: HardwareProfile
    captured: Graph                 # as captured, cast to the compute dtype: the unfused baseline
    prepared: Graph                 # after the passes: what the planner and the kernels see
    pass_records: list[Any]
    plan: FusionPlan
    op_rows: list[Any]              # opfuse.analysis.traffic.OpMetrics per kernel-launching op of `captured`
    unfused: Any                    # TrafficSummary of `captured`, one kernel per op
    fused: Any                      # TrafficSummary of what the compiled model runs: a kernel per group, node by
                                    # node for the groups in `pytorch_groups`
    seconds: dict[str, float] = field(default_factory=dict)
    pytorch_groups: dict[str, Reason] = field(default_factory=dict)    # groups without an opfuse kernel, and why
    library_calls: dict[str, str] = field(default_factory=dict)  # group -> what it runs, where its kernel is a library
                                                                 # call alone (torch's attention: head dims untiled)
    as_compiled: Any = None         # opfuse.analysis.as_compiled.AsCompiled: what the last compile of this plan
                                    # runs on this device (launches, forms, groups through PyTorch) or why it
                                    # failed; None if none was made

    @property
    def opaque_ops(self) -> list[str]:
        """Ops that run through PyTorch because opfuse has no kernel for them."""
        return [n.describe() + (f": {n.attrs['target']}" if "target" in n.attrs else "")
                for n in self.prepared if n.op == "opaque"]

    def to_dict(self) -> dict[str, Any]:
        from opfuse.analysis.traffic import compare

        return {
            "model": self.name,
            "dtype": self.config.dtype,
            "hardware": self.hardware.name,
            "density_threshold": self.config.density_threshold,
            "ops": [asdict(row) for row in self.op_rows],
            "plan": self.plan.to_dict(),
            "opaque_ops": self.opaque_ops,
            "pytorch_groups": {group: reason.to_dict() for group, reason in self.pytorch_groups.items()},
            "library_calls": dict(self.library_calls),
            "passes": [{"name": r.name, "changes": r.changes} for r in self.pass_records],
            "unfused": asdict(self.unfused),
            "fused": asdict(self.fused),
            "savings": compare(self.unfused, self.fused),
            "seconds": self.seconds,
            "as_compiled": None if self.as_compiled is None else self.as_compiled.to_dict(),
        }


def capture(model: Any, example_inputs: Sequence[Any] | None = None, batch: int | None = None,
            name: str | None = None) -> Graph:
    """An IR graph from an nn.Module (+ example inputs), an .onnx path, or an IR Graph (returned as is)."""
    if isinstance(model, Graph):
        return model
    onnx_module = sys.modules.get("opfuse.frontend.onnx_module")    # no OnnxModule exists before it is imported
    if onnx_module is not None and isinstance(model, onnx_module.OnnxModule):
        return model.graph          # imported already: its graph, not a trace of the interpreter running it
    if isinstance(model, (str, os.PathLike)) and str(model).endswith(".onnx"):
        from opfuse.frontend.onnx_import import load_onnx

        return load_onnx(model, batch=batch)
    if isinstance(model, torch.nn.Module):
        from opfuse.frontend.torch_export import capture_torch

        if example_inputs is None:
            raise TypeError("capturing an nn.Module needs example_inputs")
        return capture_torch(model, tuple(example_inputs), name=name)
    raise TypeError(f"cannot capture {type(model).__name__}: pass an nn.Module, an .onnx path or an opfuse Graph")


def analyze(model: Any, example_inputs: Sequence[Any] | None = None, config: FusionConfig = FusionConfig(),
            batch: int | None = None, name: str | None = None) -> Analysis:
    """Capture, prepare and plan `model`; quantify traffic and launches before and after fusion; and read what the
    last compile of this plan with this config's settings runs on this device, if one was made (`as_compiled`)."""
    from opfuse.analysis import as_compiled
    from opfuse.analysis.traffic import op_table, summarize_plan, summarize_unfused
    from opfuse.codegen.lower import lowered_outcome
    from opfuse.fusion.planner import plan_fusion
    from opfuse.passes.cast_precision import cast_precision
    from opfuse.passes.manager import prepare_graph

    seconds: dict[str, float] = {}
    start = time.perf_counter()
    graph = capture(model, example_inputs, batch=batch, name=name)
    seconds["capture"] = time.perf_counter() - start
    config = resolve_dtype(config, example_inputs) if example_inputs else for_graph(config, graph)
    hardware = get_hardware(config.hardware)

    start = time.perf_counter()
    captured, _ = cast_precision(graph, config.dtype)
    prepared, records = prepare_graph(graph, config.dtype, debug_dir=_debug_dir(config, "passes"))
    seconds["passes"] = time.perf_counter() - start

    start = time.perf_counter()
    plan = plan_fusion(prepared, config, hardware)
    seconds["plan"] = time.perf_counter() - start

    start = time.perf_counter()
    pytorch_groups, library = lowered_outcome(plan)
    seconds["lower"] = time.perf_counter() - start
    display_name = name or graph.name
    return Analysis(display_name, config, hardware, captured, prepared, records, plan,
                    op_table(captured, hardware, config), summarize_unfused(captured, hardware, config),
                    summarize_plan(plan, hardware, pytorch_groups), seconds, pytorch_groups, library,
                    as_compiled.load(plan, config, as_compiled.target(example_inputs, config)))


def _debug_dir(config: FusionConfig, stage: str) -> str | None:
    from opfuse.environment import debug_dir

    root = config.debug_dir or debug_dir()
    if not root:
        return None
    path = Path(root) / stage
    path.mkdir(parents=True, exist_ok=True)
    return str(path)
