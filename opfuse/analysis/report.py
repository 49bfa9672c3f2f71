"""The fusion report: one self-contained HTML page showing what was fused, why, and what it bought.

Entry point: `write_report(analysis, path, measured=None) -> Path` (`render_report` returns the HTML string,
`report_data` the data it embeds).

The page is a template (report_assets/report.html) with its CSS and script (report_assets/*.js) inlined, plus one
JSON blob: the analysis (`Analysis.to_dict()`, the same facts `opfuse analyze --json` writes), the graph's nodes,
edges and layout, per-group before/after numbers, the roofline data and optional GPU measurements. The script
draws everything from that blob, so the page needs no network and no plotting library.

The graph layout is computed here, not in the browser: each fusion group is one block (an input node is a block
of its own), blocks are layered by their longest path from the inputs (top to bottom) and ordered within a layer
by the barycentre of their neighbours, which keeps edges short; inside a block the ops sit in rows by their depth
within the group. The script only turns layers, orders and rows into pixels, so a collapsed group can shrink.
"""

from __future__ import annotations

import html
import json
import math
import re
from enum import Enum
from importlib import resources
from pathlib import Path
from typing import Any, Mapping

from opfuse.analysis.roofline import roofline
from opfuse.analysis.traffic import op_table
from opfuse.fusion.plan import FusionPlan
from opfuse.ir.ops import FusionKind, get_op, kind_of

# the seed's table: (label, TrafficSummary field, unit the page formats it in)
SUMMARY_ROWS = (
    ("bytes read", "bytes_read", "bytes"),
    ("bytes written", "bytes_written", "bytes"),
    ("total traffic", "total_bytes", "bytes"),
    ("kernel launches", "kernel_launches", "count"),
    ("peak intermediate memory", "peak_intermediate_bytes", "bytes"),
    ("compute density (FLOPs/Byte)", "density", "density"),
    ("predicted time", "predicted_time", "seconds"),
)

# the page's script, in order: parts of one function body, so they share helpers and state (see common.js)
SCRIPT_PARTS = ("common.js", "graph.js", "details.js", "roofline.js", "tables.js")

# what a caller may name each measured number (the autotuner and CompiledInfo use the second spellings)
MEASURED_FIELDS = {
    "time": ("time", "seconds", "measured_time"),
    "registers": ("registers", "registers_per_thread"),
    "shared_memory": ("shared_memory", "shared_bytes", "shared_memory_bytes"),
    "spills": ("spills",),
    "config": ("config", "chosen_config"),
}


def write_report(analysis: Any, path: str | Path, measured: Mapping[Any, Any] | None = None) -> Path:
    """Write the HTML report of `analysis` to `path`; `measured` holds per-group GPU numbers (see report_data)."""
    path = Path(path)
    path.write_text(render_report(analysis, measured), encoding="utf-8")
    return path


def render_report(analysis: Any, measured: Mapping[Any, Any] | None = None) -> str:
    """The report as one HTML string: template + inlined CSS and script + the data blob."""
    assets = resources.files("opfuse.analysis") / "report_assets"
    template = (assets / "report.html").read_text(encoding="utf-8")
    parts = {
        "TITLE": html.escape(f"opfuse fusion report: {analysis.name}"),
        "CSS": (assets / "report.css").read_text(encoding="utf-8"),
        "JS": "(function () {\n  \"use strict\";\n" + "\n".join(
            (assets / name).read_text(encoding="utf-8") for name in SCRIPT_PARTS) + "})();\n",
        "DATA": embed_json(report_data(analysis, measured)),
    }
    # one pass, so nothing inserted (a model named "{{JS}}", say) is substituted again
    return re.sub(r"\{\{(TITLE|CSS|JS|DATA)\}\}", lambda m: parts[m.group(1)], template)


def report_data(analysis: Any, measured: Mapping[Any, Any] | None = None) -> dict[str, Any]:
    """Everything the page shows, JSON-ready.

    `measured`: {group id (int) or name ("g3"): {"time": seconds, "registers": per thread, "shared_memory": bytes,
    "spills": count, "config": the chosen config}}; any field may be missing, and a CompiledInfo-like object with
    those attributes works as a value too.
    """
    plan: FusionPlan = analysis.plan
    measured_by_group = normalize_measured(plan, measured)
    return {
        "analysis": analysis.to_dict(),
        "summary": summary_rows(analysis, measured_by_group),
        "graph": graph_layout(plan),
        "groups": group_details(analysis, measured_by_group),
        "roofline": roofline(analysis, measured_by_group),
        "measured": measured_by_group,
        "hardware": {"name": analysis.hardware.name, "memory_bandwidth": analysis.hardware.memory_bandwidth,
                     "launch_overhead": analysis.hardware.launch_overhead},
    }


def summary_rows(analysis: Any, measured: Mapping[str, Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The seed's table for the whole model, unfused vs fused (plus measured time when there is any, and the
    launches of the last compile of the plan when one is recorded: `Analysis.as_compiled`)."""
    rows = [{"metric": label, "unfused": getattr(analysis.unfused, field), "fused": getattr(analysis.fused, field),
             "unit": unit} for label, field, unit in SUMMARY_ROWS]
    kernels = [g for g in analysis.plan.groups if g.launches]
    timed = [measured[g.name]["time"] for g in kernels if measured.get(g.name, {}).get("time")]
    if timed:
        rows.append({"metric": f"measured time ({len(timed)} of {len(kernels)} kernels)", "unfused": None,
                     "fused": sum(timed), "unit": "seconds"})
    compiled = analysis.as_compiled
    if compiled is not None and not compiled.failed:   # what the last compile of this plan runs
        rows.append({"metric": f"kernel launches as compiled on {compiled.gpu} ({compiled.date[:10]})",
                     "unfused": None, "fused": compiled.launches, "unit": "count"})
        if compiled.forward_ms is not None:
            rows.append({"metric": f"time of a forward as compiled on {compiled.gpu} (a CUDA graph replay)",
                         "unfused": None, "fused": compiled.forward_ms / 1e3, "unit": "seconds"})
    return rows


def normalize_measured(plan: FusionPlan, measured: Mapping[Any, Any] | None) -> dict[str, dict[str, Any]]:
    """{group name: {time, registers, shared_memory, spills, config}} from the caller's spelling of them."""
    if not measured:
        return {}
    names = {g.name for g in plan.groups}
    result: dict[str, dict[str, Any]] = {}
    for key, value in measured.items():
        name = f"g{key}" if isinstance(key, int) or str(key).isdigit() else str(key)
        if name not in names:
            raise ValueError(f"measured numbers given for group {key!r}, which the fusion plan does not have "
                             f"(groups g0..g{len(plan.groups) - 1})")
        entry: dict[str, Any] = {}
        for field, spellings in MEASURED_FIELDS.items():
            for spelling in spellings:
                found = value.get(spelling) if isinstance(value, Mapping) else getattr(value, spelling, None)
                if found is not None:
                    entry[field] = found if isinstance(found, (int, float, str, dict)) else str(found)
                    break
        result[name] = entry
    return result


def group_details(analysis: Any, measured: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per group: what its ops cost as separate kernels (after the passes), and the decisions that touch it."""
    plan = analysis.plan
    alone = {row.name: row for row in op_table(plan.graph, analysis.hardware, analysis.config)}
    group_of = {node: g.name for g in plan.groups for node in g.nodes}
    decisions: dict[str, list[int]] = {g.name: [] for g in plan.groups}
    for index, decision in enumerate(plan.decisions):
        touched = {group_of[n] for n in [*decision.producer, *decision.consumer] if n in group_of}
        for name in sorted(touched):
            decisions[name].append(index)
    details = {}
    for group in plan.groups:
        rows = [alone[n] for n in group.nodes if n in alone]
        details[group.name] = {
            "before": {"bytes_read": sum(r.bytes_read for r in rows),
                       "bytes_written": sum(r.bytes_written for r in rows),
                       "flops": sum(r.flops for r in rows),
                       "predicted_time": sum(r.predicted_time for r in rows),
                       "launches": len(rows)},
            "decisions": decisions[group.name],
            "measured": measured.get(group.name),
        }
    return details


def graph_layout(plan: FusionPlan) -> dict[str, Any]:
    """Nodes (constants left out), edges between them and the block layout: layers, orders, rows."""
    graph = plan.graph
    names = [n.name for n in graph if n.op != "constant"]
    index = {name: i for i, name in enumerate(names)}
    group_of = {node: g for g in plan.groups for node in g.nodes}

    nodes = []
    for name in names:
        node = graph[name]
        group = group_of.get(name)
        nodes.append({"name": name, "op": node.op, "type": str(node.type), "kind": kind_of(node).value,
                      "group": group.name if group else None, "source": node.source,
                      "target": str(node.attrs.get("target", "")), "view": get_op(node.op).alias,
                      "opaque": kind_of(node) is FusionKind.OPAQUE})
    edges = [[index[i], index[n]] for n in names for i in dict.fromkeys(graph[n].inputs) if i in index]

    # blocks: every group, and every drawn node outside a group (graph inputs) alone
    blocks: list[dict[str, Any]] = []
    block_of: dict[str, int] = {}
    for group in plan.groups:
        members = [n for n in group.nodes if n in index]
        if members:
            for n in members:
                block_of[n] = len(blocks)
            blocks.append({"id": group.name, "group": group.name, "kind": group.kind.value, "nodes": members})
    for name in names:
        if name not in block_of:
            block_of[name] = len(blocks)
            blocks.append({"id": f"node:{name}", "group": None, "kind": graph[name].op, "nodes": [name]})

    successors: list[set[int]] = [set() for _ in blocks]
    predecessors: list[set[int]] = [set() for _ in blocks]
    for src, dst in edges:
        a, b = block_of[names[src]], block_of[names[dst]]
        if a != b:
            successors[a].add(b)
            predecessors[b].add(a)
    layer_of = _longest_path_layers(successors, predecessors)
    layers = _order_layers(layer_of, successors, predecessors)
    for layer, members in enumerate(layers):
        for order, b in enumerate(members):
            blocks[b]["layer"], blocks[b]["order"] = layer, order
    for block in blocks:
        block["rows"] = [[index[n] for n in row] for row in _rows_inside(graph, block["nodes"])]
        del block["nodes"]
    return {"nodes": nodes, "edges": edges, "blocks": blocks, "layers": len(layers)}


def _longest_path_layers(successors: list[set[int]], predecessors: list[set[int]]) -> list[int]:
    """Layer of each block: 1 + the deepest predecessor's (Kahn's order; blocks on a cycle keep their index)."""
    waiting = [len(p) for p in predecessors]
    ready = [b for b, w in enumerate(waiting) if w == 0]
    layer = [0] * len(successors)
    placed = 0
    while ready:
        b = ready.pop()
        placed += 1
        for s in successors[b]:
            layer[s] = max(layer[s], layer[b] + 1)
            waiting[s] -= 1
            if waiting[s] == 0:
                ready.append(s)
    if placed != len(successors):   # the planner never makes a cycle; if it did, still draw something
        layer = list(range(len(successors)))
    return layer


def _order_layers(layer_of: list[int], successors: list[set[int]], predecessors: list[set[int]],
                  sweeps: int = 4) -> list[list[int]]:
    """Blocks of each layer, ordered by the mean relative position of their neighbours (down, then up sweeps)."""
    layers: list[list[int]] = [[] for _ in range(max(layer_of, default=-1) + 1)]
    for b, layer in enumerate(layer_of):
        layers[layer].append(b)
    position = {b: (i + 0.5) / len(members) for members in layers for i, b in enumerate(members)}

    def sweep(order: range, neighbours: list[set[int]]) -> None:
        for layer in order:
            members = layers[layer]

            def key(b: int) -> float:
                near = [position[n] for n in neighbours[b]]
                return sum(near) / len(near) if near else position[b]

            members.sort(key=key)   # stable: ties keep the current order
            for i, b in enumerate(members):
                position[b] = (i + 0.5) / len(members)

    for i in range(sweeps):
        if i % 2 == 0:
            sweep(range(1, len(layers)), predecessors)
        else:
            sweep(range(len(layers) - 2, -1, -1), successors)
    return layers


def _rows_inside(graph: Any, members: list[str]) -> list[list[str]]:
    """A block's nodes in rows by their depth inside the block (graph order within a row)."""
    inside = set(members)
    depth: dict[str, int] = {}
    for name in members:   # members are in topological order
        depth[name] = 1 + max((depth[i] for i in graph[name].inputs if i in inside), default=-1)
    rows: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    for name in members:
        rows[depth[name]].append(name)
    return rows


def embed_json(data: Any) -> str:
    """JSON safe inside <script type="application/json">: no '<', '>' or '&' (so no </script> or <!--)."""
    text = json.dumps(_finite(data), allow_nan=False, separators=(",", ":"), default=str)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def _finite(value: Any) -> Any:
    """Infinities and NaNs become null: JSON.parse rejects them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value
