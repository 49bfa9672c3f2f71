"""The HTML fusion report (no browser): embedded data, sections, layout, escaping, roofline, measured numbers, CLI."""

import io
import json
import re
from pathlib import Path

import pytest
from rich.console import Console

from graph_builders import GraphBuilder, resnet_basic_block
from opfuse.analysis.report import graph_layout, render_report, report_data, write_report
from opfuse.analysis.roofline import attainable, ridge_point, roofline
from opfuse.api import analyze
from opfuse.cli import main, refused_table
from opfuse.fusion.plan import Fusion, FusionDecision, Verdict
from opfuse.fusion.reasons import Code
from opfuse.hardware import get_hardware
from opfuse.ir.graph import Node, TensorType
from opfuse.ir.ops import get_op

SECTIONS = ("summary", "graph-section", "roofline", "groups", "refused", "opaque", "passes")
EVIL = "</script><script>window.hacked=1</script><!--"


def embedded_data(page: str) -> dict:
    blobs = re.findall(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S)
    assert len(blobs) == 1
    return json.loads(blobs[0])


@pytest.fixture(scope="module")
def block_analysis():
    return analyze(resnet_basic_block(batch=1, c_in=16, c_out=32, size=16, fold_bn=False))


def evil_graph():
    """relu -> opaque op -> relu, with `</script>` in the graph name, an op name, a source and a target."""
    b = GraphBuilder(f"evil{EVIL}")
    x = b.input("x", (1, 8, 4, 4))
    y = b.unary("relu", x, "relu_in")
    graph = b.graph
    name = f"opaque{EVIL}"
    graph.nodes[name] = Node(name, "opaque", [y], {"target": f"aten.mystery{EVIL}"}, TensorType((1, 8, 4, 4),
                                                                                             "float16"), EVIL)
    z = b.unary("relu", name, "relu_out")
    return b.output(z)


def test_page_embeds_the_analysis_and_has_every_section(block_analysis, tmp_path):
    path = write_report(block_analysis, tmp_path / "report.html")
    page = path.read_text()
    assert page.startswith("<!DOCTYPE html>")
    for section in SECTIONS:
        assert f'id="{section}"' in page
    data = embedded_data(page)
    assert data["analysis"] == json.loads(json.dumps(block_analysis.to_dict(), default=str))
    for group in block_analysis.plan.groups:
        assert f'"{group.name}"' in page
        assert group.name in data["groups"]
    # the seed's table, unfused vs fused, with the numbers of the traffic analysis
    rows = {row["metric"]: row for row in data["summary"]}
    assert rows["total traffic"]["unfused"] == block_analysis.unfused.total_bytes
    assert rows["total traffic"]["fused"] == block_analysis.fused.total_bytes
    assert rows["kernel launches"]["unfused"] == block_analysis.unfused.kernel_launches
    assert rows["kernel launches"]["fused"] == block_analysis.fused.kernel_launches
    assert rows["peak intermediate memory"]["fused"] == block_analysis.fused.peak_intermediate_bytes
    assert rows["predicted time"]["fused"] == pytest.approx(block_analysis.fused.predicted_time)
    assert {"bytes read", "bytes written", "compute density (FLOPs/Byte)"} <= set(rows)


def test_group_before_and_after(block_analysis):
    data = report_data(block_analysis)
    for group in block_analysis.plan.groups:
        before = data["groups"][group.name]["before"]
        graph = block_analysis.plan.graph
        assert before["launches"] == sum(get_op(graph[n].op).launches_kernel for n in group.nodes)
        if len(group.nodes) > 1:   # a fused group moves less than its ops apart
            assert group.bytes_moved < before["bytes_read"] + before["bytes_written"]
    fused = [i for i, d in enumerate(block_analysis.plan.decisions) if d.verdict is Verdict.FUSED]
    touched = {i for extra in data["groups"].values() for i in extra["decisions"]}
    assert set(fused) <= touched


def test_layout_places_every_node_once_and_edges_point_down(block_analysis):
    layout = graph_layout(block_analysis.plan)
    graph = block_analysis.plan.graph
    names = [n["name"] for n in layout["nodes"]]
    assert sorted(names) == sorted(n.name for n in graph if n.op != "constant")
    placed = [i for block in layout["blocks"] for row in block["rows"] for i in row]
    assert sorted(placed) == list(range(len(names)))
    where = {i: (block["layer"], r) for block in layout["blocks"] for r, row in enumerate(block["rows"]) for i in row}
    block_of = {i: block["id"] for block in layout["blocks"] for row in block["rows"] for i in row}
    assert len(layout["edges"]) == sum(len({i for i in graph[n].inputs if graph[i].op != "constant"})
                                       for n in names)
    for src, dst in layout["edges"]:
        if block_of[src] == block_of[dst]:
            assert where[src][1] < where[dst][1]        # a lower row inside the same group box
        else:
            assert where[src][0] < where[dst][0]        # a later layer
    orders = {(b["layer"], b["order"]) for b in layout["blocks"]}
    assert len(orders) == len(layout["blocks"])


def test_no_network_resources(block_analysis):
    page = render_report(block_analysis)
    assert "http://" not in page and "https://" not in page
    assert "<link" not in page and not re.search(r"\bsrc\s*=", page)
    assert page.count("<script") == 2        # the data blob and the inline script, nothing loaded


def test_script_end_tag_in_names_cannot_break_the_page(tmp_path):
    analysis = analyze(evil_graph())
    page = write_report(analysis, tmp_path / "evil.html").read_text()
    assert page.count("</script>") == 2                       # only the two real script elements close
    assert EVIL not in page and "<!--" not in page
    assert "<title>opfuse fusion report: evil&lt;/script&gt;" in page
    data = embedded_data(page)                                # the names survive, unharmed
    assert data["analysis"]["model"] == f"evil{EVIL}"
    assert any(n["name"] == f"opaque{EVIL}" and n["opaque"] and n["source"] == EVIL
               for n in data["graph"]["nodes"])
    assert any(EVIL in op for op in data["analysis"]["opaque_ops"])


def test_roofline_points_roofs_and_ranges(block_analysis):
    hw = get_hardware("h200")
    data = roofline(block_analysis)
    ops = [p for p in data["points"] if p["series"] == "op"]
    groups = [p for p in data["points"] if p["series"] == "group"]
    assert len(ops) + data["skipped"]["op"] == len(block_analysis.op_rows)
    assert len(groups) + data["skipped"]["group"] == sum(1 for g in block_analysis.plan.groups if g.launches)
    row = next(r for r in block_analysis.op_rows if r.op == "conv2d")
    point = next(p for p in ops if p["label"] == row.name)
    assert point["x"] == pytest.approx(row.flops / row.bytes_moved)
    assert point["y"] == pytest.approx(row.flops / row.predicted_time)
    peak = hw.matrix_peak(block_analysis.config.dtype)
    assert data["ceilings"][0]["flops"] == peak
    assert attainable(ridge_point(peak, hw), peak, hw) == pytest.approx(peak)
    assert attainable(1.0, peak, hw) == hw.memory_bandwidth
    for p in data["points"]:       # predicted rates never beat the datasheet roof
        assert p["y"] <= attainable(p["x"], peak, hw) * 1.0001
        assert data["x_range"][0] <= p["x"] <= data["x_range"][1]
        assert data["y_range"][0] <= p["y"] <= data["y_range"][1]


@pytest.mark.parametrize("tf32", [True, False])
def test_a_float32_roofline_has_the_ceilings_its_products_run_at(tf32, monkeypatch):
    """float32 convolutions follow cuDNN's tf32 switch (three tf32 products, else the CUDA cores), GEMMs the float32
    matmul precision ('highest' by default: the CUDA cores)."""
    import torch
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    b = GraphBuilder("conv_fp32", dtype="float32")
    graph = b.output(b.unary("relu", b.conv(b.input("x", (1, 16, 16, 16)), 32, kernel=3, padding=1), "relu"))
    data = roofline(analyze(graph))
    hw = get_hardware("h200")
    expected = ([("tensor cores (tf32x3)", hw.matrix_flops["float32"] / 3)] if tf32 else []) \
        + [("CUDA cores (vector)", hw.vector_flops)]
    assert [(c["name"], c["flops"]) for c in data["ceilings"]] == expected


def test_measured_numbers_are_rendered(block_analysis):
    kernel = next(g for g in block_analysis.plan.groups if g.launches)
    measured = {kernel.id: {"time": 1e-5, "registers": 96, "shared_bytes": 4096, "spills": 0, "config": "BLOCK_M=64"}}
    data = report_data(block_analysis, measured)
    assert data["measured"] == {kernel.name: {"time": 1e-5, "registers": 96, "shared_memory": 4096, "spills": 0,
                                              "config": "BLOCK_M=64"}}
    assert data["groups"][kernel.name]["measured"]["registers"] == 96
    point = next(p for p in data["roofline"]["points"] if p["group"] == kernel.name)
    assert point["source"] == "measured" and point["y"] == pytest.approx(kernel.flops / 1e-5)
    assert data["summary"][-1]["fused"] == 1e-5 and "measured" in data["summary"][-1]["metric"]
    with pytest.raises(ValueError, match="g999"):
        report_data(block_analysis, {"g999": {"time": 1.0}})


def test_the_launches_of_the_last_compile_are_a_summary_row(block_analysis):
    """Where a compile of the plan is recorded (`Analysis.as_compiled`), the page's table shows its launches beside
    the plan's; a failed compile adds no row."""
    from dataclasses import replace

    from opfuse.analysis.as_compiled import AsCompiled

    assert not any("as compiled" in row["metric"] for row in report_data(block_analysis)["summary"])
    compiled = AsCompiled(gpu="NVIDIA H200", date="2026-12-01T18:00:00+00:00", launches=7,
                          planned=block_analysis.fused.kernel_launches)
    row = report_data(replace(block_analysis, as_compiled=compiled))["summary"][-1]
    assert row == {"metric": "kernel launches as compiled on NVIDIA H200 (2026-12-01)", "unfused": None,
                   "fused": 7, "unit": "count"}
    failed = replace(compiled, launches=0, failed="GraphError: out of memory")
    assert report_data(replace(block_analysis, as_compiled=failed))["summary"] == report_data(block_analysis)["summary"]


def test_cli_report_writes_the_page(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    out, js = tmp_path / "mlp.html", tmp_path / "mlp.json"
    assert main(["report", "zoo_factory_example:tiny_mlp", "-o", str(out), "--json", str(js), "--quiet"]) == 0
    assert capsys.readouterr().out == ""
    data = embedded_data(out.read_text())
    assert data["analysis"]["model"] == "tiny_mlp"
    assert json.loads(js.read_text())["fused"] == data["analysis"]["fused"]
    assert main(["report", "zoo_factory_example:tiny_mlp", "-o", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out


def test_cli_exit_codes(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.onnx"), "-o", str(tmp_path / "r.html")]) == 1
    assert "missing.onnx" in capsys.readouterr().err
    assert main(["report", "no_such_model", "-o", str(tmp_path / "r.html")]) == 1
    assert main(["report", "resnet18", "-o", str(tmp_path / "no" / "dir" / "r.html")]) == 2
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(SystemExit) as usage:
        main(["report"])
    assert usage.value.code == 2


def test_cli_prints_brackets_in_reasons_literally(block_analysis):
    plan = block_analysis.plan
    decision = FusionDecision(["conv[0]"], ["add"], Fusion.VERTICAL, Verdict.ILLEGAL, "needs [bold]x[/bold] and [red]",
                              Code.SEVERAL_USERS)
    original = plan.decisions
    plan.decisions = [*original, decision]
    try:
        console = Console(record=True, width=200, file=io.StringIO())
        console.print(refused_table(plan))
    finally:
        plan.decisions = original
    text = console.export_text()
    assert "needs [bold]x[/bold] and [red]" in text and "conv[0]" in text
