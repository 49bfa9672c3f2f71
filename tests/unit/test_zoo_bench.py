"""The model-zoo benchmark's orchestration on the CPU: child processes per workload (cold, then measured), time
caps and budget, results written as they come, ZOO.md from one or several runs."""

import json
import os
from pathlib import Path

import pytest

from opfuse.bench import zoo_bench
from opfuse.bench.zoo_bench import ZooSettings, parse_workloads, run_zoo, workload_key
from opfuse.bench.zoo_report import cost_model_error, render

HERE = Path(__file__).parent
TINY = "zoo_factory_example:tiny_mlp"
CPU = dict(device="cpu", compile_backend="eager", tune_top=0, rounds=2, per_round=1)


@pytest.fixture
def factory_on_path(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.slow
def test_a_workload_is_compiled_cold_then_measured_in_children(tmp_path, factory_on_path):
    seen = []
    results = run_zoo(tmp_path / "out", [(TINY, 2)], ZooSettings(cold_parallel=2, **CPU), tmp_path / "cache",
                      progress=seen.append)
    entry = results["workloads"][workload_key(TINY, 2)]
    assert entry["cold"]["inductor"]["compile_s"] > 0 and entry["cold"]["opfuse"]["compile_s"] > 0
    stages = entry["cold"]["opfuse"]["stages"]          # where opfuse's cold compile went
    assert {"analyze", "lower", "codegen+tune", "verify"} <= set(stages)
    assert stages["lower"] <= stages["codegen+tune"] < entry["cold"]["opfuse"]["compile_s"]
    # no compile workers on the CPU: none ran, and the entry says so (a GPU's says what they built, and when)
    assert entry["cold"]["opfuse"]["precompiled"] is None and entry["cold"]["opfuse"]["workers_did"] is None
    row = entry["measure"]["row"]
    for label in ("eager", "inductor", "opfuse"):
        assert row[label]["samples"] == 2 and row[label]["rel_error"] < 1e-5
    assert "CUDA" in row["eager_graph"]["error"]                      # no graphs on the CPU: said, not hidden
    key = workload_key(TINY, 2)
    assert [m.split(": ")[0] for m in seen] == [f"{key} cold", f"{key} measure"]
    assert all(m.split(": ")[1].startswith("done in") for m in seen)
    written = json.loads((tmp_path / "out" / "zoo.json").read_text())
    assert written["workloads"] == results["workloads"] and written["settings"]["cold_parallel"] == 2
    page = (tmp_path / "out" / "ZOO.md").read_text()
    assert f"| {workload_key(TINY, 2)} |" in page and "Geometric mean" in page
    assert "eager_graph: RuntimeError: a CUDA graph needs a CUDA device" in page
    assert "==== zoo_factory_example:tiny_mlp-bs2 measure: done" in (tmp_path / "out" / "zoo.log").read_text()


@pytest.mark.slow
def test_a_child_past_its_time_cap_is_stopped_and_reported(tmp_path, factory_on_path):
    settings = ZooSettings(cold_timeout_s=0.5, measure_timeout_s=0.5, **CPU)
    results = run_zoo(tmp_path / "out", [(TINY, 1)], settings, tmp_path / "cache", progress=lambda _: None)
    entry = results["workloads"][workload_key(TINY, 1)]
    assert entry["cold"]["error"].startswith("stopped after its time cap of 0 s") or \
        entry["cold"]["error"].startswith("stopped after its time cap of 1 s")
    assert "time cap" in entry["measure"]["error"]
    assert "time cap" in (tmp_path / "out" / "ZOO.md").read_text()


def test_a_spent_budget_starts_nothing_and_says_so(tmp_path):
    results = run_zoo(tmp_path / "out", parse_workloads(["a", "b"], [1, 64]), ZooSettings(budget_s=0, **CPU),
                      tmp_path / "cache", progress=lambda _: None)
    assert list(results["workloads"]) == ["a-bs1", "a-bs64", "b-bs1", "b-bs64"]
    assert all(entry[stage]["error"].startswith("not run") for entry in results["workloads"].values()
               for stage in ("cold", "measure"))
    assert "a-bs64, measure: not run" in (tmp_path / "out" / "ZOO.md").read_text()


class FakeChild:
    """A child that finishes at once, advancing a fake clock by `seconds`; records what was started, in order."""

    started: list = []
    clock = [0.0]
    seconds = 20.0

    def __init__(self, stage, model, batch, cache, settings, deadline_s=float("inf")):
        self.stage, self.key = stage, zoo_bench.workload_key(model, batch)
        FakeChild.started.append((stage, self.key))
        FakeChild.clock[0] += FakeChild.seconds

    def done(self):
        return True

    def stop(self):
        pass

    def status(self):
        return "done in 20 s"

    def log_tail(self, lines=25):
        return ""

    def result(self):
        return {"row": {}} if self.stage == "measure" else {"opfuse": {"compile_s": 1.0}}


@pytest.fixture
def fake_children(monkeypatch):
    FakeChild.started, FakeChild.clock = [], [0.0]
    monkeypatch.setattr(zoo_bench, "Child", FakeChild)
    monkeypatch.setattr(zoo_bench.time, "monotonic", lambda: FakeChild.clock[0])
    monkeypatch.setattr(zoo_bench.time, "sleep", lambda seconds: None)
    return FakeChild.started


def test_a_chunk_is_measured_before_the_next_chunk_compiles(tmp_path, fake_children):
    run_zoo(tmp_path / "out", parse_workloads(["a", "b", "c"], [1]), ZooSettings(cold_parallel=2, **CPU),
            tmp_path / "cache", progress=lambda _: None)
    assert fake_children == [("cold", "a-bs1"), ("cold", "b-bs1"), ("measure", "a-bs1"), ("measure", "b-bs1"),
                             ("cold", "c-bs1"), ("measure", "c-bs1")]


def test_the_deadline_ends_the_run_with_whole_workloads(tmp_path, fake_children):
    """20 s a child, a 70 s budget, no child started with under MIN_CHILD_S (30 s) left: a measured, b compiled
    but not measured, c not started."""
    results = run_zoo(tmp_path / "out", parse_workloads(["a", "b", "c"], [1]), ZooSettings(budget_s=70, **CPU),
                      tmp_path / "cache", progress=lambda _: None)
    assert fake_children == [("cold", "a-bs1"), ("measure", "a-bs1"), ("cold", "b-bs1")]
    workloads = results["workloads"]
    assert "row" in workloads["a-bs1"]["measure"] and "compile_s" in workloads["b-bs1"]["cold"]["opfuse"]
    assert workloads["b-bs1"]["measure"]["error"].startswith("not run")
    assert workloads["c-bs1"]["cold"]["error"].startswith("not run")


def timed(ms: float, kernels: int = 10) -> dict:
    return {"median_ms": ms, "p10_ms": ms * 0.9, "p90_ms": ms * 1.2, "samples": 50, "kernels": kernels,
            "rel_error": 1e-3, "compile_s": 2.0}


def zoo_run(date: str, rows: dict) -> dict:
    return {"env": {"date": date, "gpu": "NVIDIA H200"}, "settings": {"tune_top": 1, "cold_parallel": 4},
            "workloads": {key: {"model": key.split("-")[0], "batch": 1, "cold": {"opfuse": {"compile_s": 30.0}},
                                "measure": {"row": row} if row else {"error": "failed (exit code 1)"}}
                          for key, row in rows.items()}}


def test_zoo_md_headline_cost_model_and_merging():
    fast = {"inductor": timed(1.0), "opfuse": timed(0.5), "opfuse_replay": timed(0.4), "predicted_ms": 0.3,
            "analyze_launches": 10}
    slow = {"inductor": timed(1.0), "opfuse": timed(2.0), "opfuse_replay": timed(1.0), "predicted_ms": 1.5,
            "analyze_launches": 9}
    assert cost_model_error(fast) == pytest.approx(0.25) and cost_model_error(slow) == pytest.approx(0.5)
    first = zoo_run("2026-12-01", {"a-bs1": fast, "b-bs1": None})
    second = zoo_run("2026-12-02", {"b-bs1": slow, "a-bs1": None})
    page = render([first, second])
    assert "**1.00x** through opfuse's module call" in page      # sqrt(2.0 * 0.5): a from run 1, b from run 2
    assert "Under 1.0x (module call): b-bs1 (0.50x)" in page
    assert ("equals the profiled kernels of a replay in **1 of 2** workloads that record both; not in b-bs1 (9 "
            "against 10).") in page
    assert "over 2 workloads, as predicted when measured: **38%**" in page      # median of 25% and 50%
    assert "| a-bs1 | 1 | - | - | 1.000 | 0.500 | 0.400 | 2.00x / 2.50x | 30% / 30% / 30% |" in page
    assert "tuned in the cold compiles, several at once" in page     # the fake runs' cold_parallel is 4
    runs = page[page.index("## Runs"):]                              # what the runs share, once; then each one's
    assert "- every run: NVIDIA H200 (driver ?)" in runs and "- run 2: 2026-12-02\n" in runs
    assert page.index("## Headline") < page.index("## Runs") and runs.count("NVIDIA H200") == 1
    assert "b-bs1, measure" not in page                           # run 2 measured what run 1 could not
    assert "a-bs1, measure: failed (exit code 1)" not in page     # ... and run 2's failure does not hide run 1's row
    assert "not measured in any run yet (26 of the zoo's 26 workloads): resnet50-bs1, resnet50-bs64," in page
    assert "runs 2 on" not in page
    third = zoo_run("2026-12-01", {"a-bs1": None})
    assert "- runs 1, 3: 2026-12-01\n" in render([first, second, third])      # runs alike: one line
    held_out = render([first, second], held_out_from=2)              # b-bs1 alone was measured in run 2
    assert "over 2 workloads, as predicted when measured: **38%**. Over the 1 workloads of runs 2 on" in held_out
    assert "fitted to the runs before them: **50%**." in held_out


@pytest.mark.slow
def test_a_terminated_run_stops_its_children(tmp_path, factory_on_path):
    """`timeout` sends SIGTERM: the children run in sessions of their own (so a time cap can kill their workers
    too), which a plain exit would leave running on the GPU."""
    import signal
    import subprocess
    import threading
    import time

    before = signal.getsignal(signal.SIGTERM)
    timer = threading.Timer(4, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    with pytest.raises(SystemExit) as done:
        run_zoo(tmp_path / "out", [(TINY, 1)], ZooSettings(**CPU), tmp_path / "cache", progress=lambda _: None)
    assert done.value.code == 128 + signal.SIGTERM
    time.sleep(0.5)
    left = subprocess.run(["pgrep", "-f", f"opfuse.bench.zoo_bench child .* {tmp_path}"], capture_output=True,
                          text=True).stdout.split()
    assert left == []
    assert signal.getsignal(signal.SIGTERM) is before                 # the caller's handler is back


def test_enable_takes_only_switches_that_are_off_by_default():
    assert zoo_bench.enable_switches(["norm_prologue"]) == ("norm_prologue",)
    with pytest.raises(ValueError, match="vertical.*those are: .*norm_prologue"):
        zoo_bench.enable_switches(["vertical"])       # on by default: nothing to enable
    assert zoo_bench.main(["--workloads", "resnet50:1", "--enable", "no_such", "--out", "unused"]) == 2


def test_a_run_with_fusions_enabled_says_so_in_zoo_md():
    settings = ZooSettings(enable=("norm_prologue",), **CPU)
    page = render([{"settings": json.loads(json.dumps(settings.__dict__)), "env": None, "workloads": {}}])
    assert "opfuse with norm_prologue on (off by default)" in page


GENERATED = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "dtype": "torch.float16", "runs": [
    {"batch": 1, "prompt": 128, "new": 64,
     "contenders": {"opfuse": {"ttft_ms": 1.9, "step_ms": 1.6, "tokens_per_s": 600.0, "gb_per_s": 1350.0,
                               "share_of_bandwidth": 0.403, "greedy_equal_eager_tokens": 53},
                    "inductor": {"ttft_ms": 9.0, "step_ms": 2.5, "tokens_per_s": 400.0, "gb_per_s": 860.0,
                                 "share_of_bandwidth": 0.257, "greedy_equal_eager_tokens": 3}},
     "decode_report": {"weight_bytes": 2_069_000_000, "cache_bytes_needed": 6_000_000, "tokens_per_step": 1,
                       "launches": 185}},
    {"batch": 8, "prompt": 128, "new": 64,
     "contenders": {"opfuse": {"ttft_ms": 2.0, "step_ms": 1.7, "tokens_per_s": 4700.0, "gb_per_s": 1300.0,
                               "share_of_bandwidth": None, "greedy_equal_eager_tokens": 6}}}]}


def test_zoo_md_carries_the_text_generation_table_of_a_generate_run():
    """`render(..., generation=)`: a row per contender and run, opfuse's tokens/s over torch.compile's where the run
    timed it ("-" where not), the share of bandwidth in percent, the greedy tokens equal eager's, and under the
    table opfuse's launches and bytes per token."""
    from opfuse.bench.zoo_report import render

    page = render([{"settings": {}, "env": None, "workloads": {}}], generation=GENERATED)
    assert "## Text generation" in page and "NVIDIA H100 80GB HBM3" in page
    rows = [line for line in page.splitlines() if line.startswith("| 1 | 128 |") or line.startswith("| 8 | 128 |")]
    assert rows[0] == ("| 1 | 128 | 64 | opfuse | 1.90 ms | 1.600 ms | 600 | 1350 | 40.3% | 1.50x | 53 of 64 |")
    assert rows[1].startswith("| 1 | 128 | 64 | torch.compile reduce-overhead | 9.00 ms | 2.500 ms | 400 |")
    assert rows[1].endswith("| 25.7% | - | 3 of 64 |")
    assert rows[2].endswith("| - | - | 6 of 64 |")
    assert "- batch 1, prompt 128: opfuse's decode step plans 185 launches and must read 2.075 GB a token" in page
    assert "## Text generation" not in render([{"settings": {}, "env": None, "workloads": {}}])


def test_generate_merge_joins_contenders_timed_in_processes_of_their_own():
    """`generation_report.merge` (`benchmarks.generate --merge`): runs of equal (batch, prompt, new) side by side,
    the first file's eager and decode report kept, and the table says the contenders ran in processes of their
    own."""
    import copy

    from opfuse.bench.generation_report import generation_lines, merge
    from opfuse.bench.zoo_report import render

    opfuse_only, inductor_only = copy.deepcopy(GENERATED), copy.deepcopy(GENERATED)
    for run in opfuse_only["runs"]:
        run["contenders"].pop("inductor", None)
        run["contenders"]["eager"] = {"step_ms": 14.0, "tokens_per_s": 71.0}
    del inductor_only["runs"][1]
    inductor_only["runs"][0]["contenders"] = {"inductor": GENERATED["runs"][0]["contenders"]["inductor"],
                                              "eager": {"step_ms": 13.0, "tokens_per_s": 77.0}}
    inductor_only["runs"][0]["decode_report"] = None
    merged = merge([opfuse_only, inductor_only])
    assert [(run["batch"], sorted(run["contenders"])) for run in merged["runs"]] == [
        (1, ["eager", "inductor", "opfuse"]), (8, ["eager", "opfuse"])]
    assert merged["runs"][0]["contenders"]["eager"]["step_ms"] == 14.0
    assert merged["runs"][0]["decode_report"]["launches"] == 185
    page = render([{"settings": {}, "env": None, "workloads": {}}], generation=merged)
    assert "in 2 processes of their own" in page
    assert merge([merged, inductor_only])["processes"] == 3        # a merged file counts its own processes
    assert "| 1 | 128 | 64 | opfuse | 1.90 ms | 1.600 ms | 600 | 1350 | 40.3% | 1.50x | 53 of 64 |" in page
    assert "- batch 8, prompt 128: no opfuse" not in page
    inductor_only["runs"][0]["batch"] = 32
    assert "- batch 32, prompt 128: no opfuse figures in this run." in generation_lines(merge([opfuse_only,
                                                                                                 inductor_only]))
    inductor_only["device"] = "NVIDIA H200"
    with pytest.raises(ValueError, match="cannot be joined"):
        merge([opfuse_only, inductor_only])
