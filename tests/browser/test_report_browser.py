"""The HTML report in a real browser: headless Debian Chromium draws it without errors, and bert-base's in < 5 s.

Each test writes a report, lets Chromium load it (`--dump-dom` prints the DOM after the page's script ran) and
checks what the script drew: the graph's group boxes and ops, the summary rows, the roofline's points, the
#report-rendered marker, and no #report-error marker (the page adds it on any script error) nor an "Uncaught"
console message. The resnet18 screenshot is kept in the test's tmp dir and copied to /tmp for people to look at.
"""

import re
import shutil
import subprocess
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from graph_builders import conv_bn_relu
from opfuse.analysis.report import render_report, write_report
from opfuse.api import analyze

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]
SCREENSHOT_COPY = Path("/tmp/opfuse_report_resnet18.png")

pytestmark = pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium "
                                "(.ci/run installs it: apt-get install -y chromium)")


class Elements(HTMLParser):
    """Every start tag of a document as (tag, attributes)."""

    def __init__(self, text: str):
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, {k: v or "" for k, v in attrs}))

    def with_class(self, name: str, tag: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.found if name in a.get("class", "").split() and (tag is None or t == tag)]

    def by_id(self, element_id: str) -> dict[str, str] | None:
        return next((a for _, a in self.found if a.get("id") == element_id), None)


def chromium(page: Path, profile: Path, *args: str, fragment: str = "") -> tuple[subprocess.CompletedProcess, float]:
    """Run headless Chromium on `page` (#fragment appended); returns the process and its wall-clock seconds."""
    start = time.perf_counter()
    done = subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", *args, page.as_uri() + fragment],
                          capture_output=True, text=True, timeout=120)
    return done, time.perf_counter() - start


def load(page: Path, tmp_path: Path, fragment: str = "") -> tuple[Elements, str, float]:
    done, seconds = chromium(page, tmp_path / "profile", "--dump-dom", fragment=fragment)
    assert done.returncode == 0, done.stderr[-2000:]
    dom = Elements(done.stdout)
    dom.text = done.stdout
    return dom, done.stderr, seconds


def assert_no_script_errors(dom: Elements, log: str) -> None:
    error = dom.by_id("report-error")
    assert error is None, "the page's script failed (see #report-error)"
    assert "Uncaught" not in log, [line for line in log.splitlines() if "Uncaught" in line]
    assert dom.by_id("report-rendered") is not None


def test_a_script_error_would_be_caught(tmp_path):
    """The detector itself: a page whose data blob is broken shows #report-error and logs an Uncaught error."""
    page = render_report(analyze(conv_bn_relu(batch=1, c_in=4, c_out=8, size=8)))
    start = page.index('id="report-data">') + len('id="report-data">')
    end = page.index("</script>", start)
    broken = tmp_path / "broken.html"
    broken.write_text(page[:start] + '{"analysis": {}}' + page[end:])
    dom, log, _ = load(broken, tmp_path)
    assert dom.by_id("report-error") is not None and dom.by_id("report-rendered") is None
    assert "Uncaught" in log


@pytest.mark.slow
def test_resnet18_report_renders_graph_table_and_roofline(tmp_path):
    from opfuse.bench.zoo import resolve_model

    model, inputs, name = resolve_model("resnet18", batch=1)
    analysis = analyze(model, inputs, name=name)
    page = write_report(analysis, tmp_path / "resnet18.html")
    residual = next(g for g in analysis.plan.groups if g.kind.value == "residual")
    dom, log, _ = load(page, tmp_path, fragment=f"#{residual.name}")   # opens with that group selected
    assert_no_script_errors(dom, log)
    details = re.search(r'<aside id="details">(.*?)</aside>', dom.text, re.S).group(1)
    assert f"{residual.name} · residual" in details and "Before and after fusion" in details
    assert all(f"{n} [" in details for n in residual.nodes)
    assert len(dom.with_class("selected", "g")) == 1

    # the graph: one coloured box per kernel, every op (constants aside) drawn once, edges between them
    boxed = [g for g in analysis.plan.groups if g.kind.value != "view"]
    assert len(dom.with_class("group-box", "rect")) == len(boxed) > 10
    drawn = {a["data-node"] for a in dom.with_class("node", "g")}
    assert drawn == {n.name for n in analysis.prepared if n.op != "constant"}
    assert {a["data-group"] for a in dom.with_class("group", "g")} == {g.name for g in boxed}
    assert len(dom.with_class("edge", "path")) >= len(drawn) - 1
    # the summary table: the seed's seven rows
    assert len(dom.with_class("summary-row", "tr")) == 7
    # the roofline: a point per op with FLOPs before fusion, per kernel after
    flop_ops = [r for r in analysis.op_rows if r.flops > 0]
    kernels = [g for g in analysis.plan.groups if g.launches and g.flops > 0]
    assert len(dom.with_class("pt-op", "circle")) == len(flop_ops) + 1          # + the legend's
    assert len([a for a in dom.with_class("pt-group", "circle") if "data-group" in a]) == len(kernels)
    assert len(dom.with_class("roof", "polyline")) == 2
    # the lists
    assert len([a for a in dom.with_class("clickable", "tr") if "data-group" in a]) == len(
        [g for g in analysis.plan.groups if g.launches])

    shot = tmp_path / "report.png"
    done, _ = chromium(page, tmp_path / "profile", f"--screenshot={shot}", "--window-size=1400,1000")
    assert done.returncode == 0 and shot.exists() and shot.stat().st_size > 20_000
    try:
        shutil.copyfile(shot, SCREENSHOT_COPY)
    except OSError:
        pass   # the copy is a convenience for people; the test's own copy stays in tmp_path


@pytest.mark.slow
def test_bert_base_report_renders_within_five_seconds(tmp_path):
    from opfuse.bench.zoo import resolve_model

    model, inputs, name = resolve_model("bert-base", batch=1)
    assert inputs[0].shape == (1, 128)
    analysis = analyze(model, inputs, name=name)
    page = write_report(analysis, tmp_path / "bert.html")
    dom, log, seconds = load(page, tmp_path)
    assert_no_script_errors(dom, log)
    in_page_ms = float(dom.by_id("report-rendered")["data-ms"])
    print(f"bert-base report: headless Chromium run {seconds:.2f} s, in-page rendering {in_page_ms:.0f} ms, "
          f"{page.stat().st_size / 1e3:.0f} KB")
    assert seconds < 5.0
    assert in_page_ms < 5000
    assert len(dom.with_class("node", "g")) == sum(1 for n in analysis.prepared if n.op != "constant")
