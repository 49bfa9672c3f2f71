"""benchmarks/compile_time.py's table, and the summary of the compile workers' log (OPFUSE_WORKER_LOG) it and the
zoo's cold compiles keep."""

from __future__ import annotations

import json
from pathlib import Path

from opfuse.codegen.base import import_file
from opfuse.runtime.compile_worker import summarize_worker_log

ROOT = Path(__file__).resolve().parents[2]


def test_the_workers_log_sums_to_when_they_were_ready_and_what_they_built(tmp_path):
    began = 1000.0
    rows = [{"pid": 1, "ready": 1004.0, "came": 1004.5, "done": 1005.5, "ok": True, "compile_s": 0.8,
             "launcher_s": 0.2},
            {"pid": 2, "ready": 1006.0, "came": 1006.0, "done": 1007.0, "ok": False},
            {"pid": 1, "ready": 1004.0, "came": 1005.5, "done": 1009.0, "ok": True, "compile_s": 3.0,
             "launcher_s": 0.1}]
    log = tmp_path / "workers.jsonl"
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = summarize_worker_log(str(log), began)
    assert summary == {"workers": 2, "ready_s": [4.0, 6.0], "first_launch_s": [4.5, 6.0], "launches": 3,
                       "failed": 1, "compile_s": 3.8, "launcher_s": 0.3, "busy_s": 5.5, "last_done_s": 9.0}
    assert summarize_worker_log(str(tmp_path / "none.jsonl"), began) is None
    assert summarize_worker_log(None, began) is None


def test_the_table_pairs_each_workloads_compilers():
    compile_time = import_file(ROOT / "benchmarks" / "compile_time.py", "compile_time")
    rows = [{"workload": "gpt2-bs1", "workers": "inductor", "compile_s": 12.0, "warm": False},
            {"workload": "gpt2-bs1", "workers": 8, "compile_s": 9.0, "warm": False},
            {"workload": "gpt2-bs1", "workers": 8, "compile_s": 2.0, "warm": True},
            {"workload": "resnet50-bs64", "workers": 8, "compile_s": 11.0, "warm": False}]
    table = compile_time.markdown(rows).splitlines()
    assert table[0] == "| workload | torch.compile s | opfuse s (8 workers) / torch.compile |"
    assert table[2] == "| gpt2-bs1 | 12.0 | 9.0 (0.75x) |" and table[3] == "| resnet50-bs64 | - | 11.0 |"
    assert len(compile_time.workloads("zoo")) == 26 and compile_time.workloads("a:1,b:64") == ["a:1", "b:64"]
