"""ZOO.md's roofline columns and its headline's geometric mean share of the floor per batch, rendered from fake
stored measurements (no GPU), and the work of rows that recorded none counted again."""

from __future__ import annotations

import statistics

from opfuse.bench.zoo_report import render

PEAK, BANDWIDTH, LAUNCH = 989e12, 4.8e12, 2.5e-6          # the H200 SXM datasheet: fp16 dense, HBM3e; a launch


def percent(share: float) -> str:
    """How the reports print a share (one decimal under 10%, "<0.1%" under that)."""
    if share < 0.001:
        return "<0.1%"
    return f"{share * 100:.1f}%" if share < 0.1 else f"{share * 100:.0f}%"


def timed(ms: float, kernels: int | None = None) -> dict:
    return {"median_ms": ms, "p10_ms": ms, "p90_ms": ms, "samples": 5} | ({"kernels": kernels} if kernels else {})


def work(compute_ms: float, memory_ms: float, plan_ms: float, launches: int) -> dict:
    """Work whose floor on the H200 takes these times: FLOPs and bytes from the datasheet's rates."""
    return {"flops": round(compute_ms * 1e-3 * PEAK), "compulsory_bytes": round(memory_ms * 1e-3 * BANDWIDTH),
            "plan_bytes": round(plan_ms * 1e-3 * BANDWIDTH), "plan_launches": launches}


GEMMS_64 = {"dtype": "float16", "plan_launches": 10, "work": work(2.0, 1.0, 3.0, 10),      # compute-bound: 2 ms
            "eager": timed(9.0, 30), "eager_graph": timed(8.0, 30), "inductor": timed(5.0, 20),
            "opfuse": timed(4.0, 10), "opfuse_replay": timed(3.2)}
STREAM_64 = {"dtype": "float16", "plan_launches": 12, "work": work(1.0, 2.0, 4.0, 11),     # memory-bound: 2 ms
             "inductor": timed(10.0, 30), "opfuse": timed(8.0, 12), "opfuse_replay": timed(8.0)}
SMALL_1 = {"dtype": "float16", "plan_launches": 40, "work": work(0.001, 0.1, 0.2, 40),     # memory-bound: 0.1 ms
           "inductor": timed(0.5, 100), "opfuse": timed(0.4, 40), "opfuse_replay": timed(0.38)}


def zoo_run(gpu: str, rows: dict[str, dict]) -> dict:
    return {"env": {"date": "2026-12-04", "gpu": gpu}, "settings": {"tune_top": 4, "cold_parallel": 1},
            "workloads": {key: {"model": key.rsplit("-bs", 1)[0], "batch": int(key.rsplit("-bs", 1)[1]),
                                "measure": {"row": row}} for key, row in rows.items()}}


def row_line(page: str, key: str) -> str:
    return next(line for line in page.splitlines() if line.startswith(f"| {key} |"))


def test_zoo_md_gives_each_row_its_floors_and_shares():
    page = render([zoo_run("NVIDIA H200", {"gemms-bs64": GEMMS_64, "stream-bs64": STREAM_64,
                                           "small-bs1": SMALL_1})], work_of=None)
    assert "floor ms: roofline (bound) / plan's bytes / with launches (launches)" in page
    with_launches = 2.0 + 10 * LAUNCH * 1e3                   # opfuse's 10 kernels, the fewest of the row
    assert row_line(page, "gemms-bs64").endswith(
        f"| 2.0000 (compute) / 3.0000 / {with_launches:.4f} (10) | 50% / 40% (torch.compile) | "
        f"{percent(with_launches / 4.0)} / {percent(with_launches / 5.0)} |")
    # the plan measured launched 12 kernels, the plan counted 11: no plan floor for a plan not measured
    assert "| 2.0000 (memory) / - / " in row_line(page, "stream-bs64")
    assert "| 25% / 20% (torch.compile) |" in row_line(page, "stream-bs64")
    small = row_line(page, "small-bs1")
    launch_floor = 0.1 + 40 * LAUNCH * 1e3                    # 0.2 ms: the weights and 40 launches
    assert f"| 0.1000 (memory) / 0.2000 / {launch_floor:.4f} (40) | 25% / 20% (torch.compile) |" in small
    assert small.endswith(f"| {percent(launch_floor / 0.4)} / {percent(launch_floor / 0.5)} |")


def test_zoo_md_headline_shows_the_geometric_mean_share_per_batch_beside_the_speedup():
    page = render([zoo_run("NVIDIA H200", {"gemms-bs64": GEMMS_64, "stream-bs64": STREAM_64,
                                           "small-bs1": SMALL_1})], work_of=None)
    headline = page[page.index("## Headline"):page.index("## Per workload")]
    speedup, roofline = headline.index("Geometric mean of opfuse"), headline.index("Roofline, geometric mean")
    assert speedup < roofline < headline.index("Under 1.0x")          # right after the speedup
    opfuse_64 = statistics.geometric_mean([2.0 / 4.0, 2.0 / 8.0])
    replay_64 = statistics.geometric_mean([2.0 / 3.2, 2.0 / 8.0])
    best_64 = statistics.geometric_mean([2.0 / 5.0, 2.0 / 10.0])     # torch.compile, the faster baseline of both
    assert (f"batch 64 (2 workloads): **{percent(opfuse_64)}** of the roofline through opfuse's module call "
            f"({percent(replay_64)} as its bare replay), {percent(best_64)} by the best baseline") in headline
    launch_floor = 0.1 + 40 * LAUNCH * 1e3
    assert (f"batch 1 (1 workloads): **25%** of the roofline through opfuse's module call ("
            f"{percent(0.1 / 0.38)} as its bare replay), 20% by the best baseline; of the launch-and-bandwidth floor "
            f"**{percent(launch_floor / 0.4)}**, {percent(launch_floor / 0.38)}, {percent(launch_floor / 0.5)}") \
        in headline
    # where the times and the rates come from, and that the floors were taken offline
    assert "NVIDIA H200 SXM 989 TFLOP/s float16, 4.80 TB/s, 2.5 us a launch" in headline
    assert "Computed offline, when this page was rendered, against the times measured on NVIDIA H200 (2026-12-04)" \
        in headline
    assert "every row's work recorded by its run" in headline


def test_zoo_md_counts_the_work_of_rows_that_recorded_none():
    seen = []

    def work_of(model: str, batch: int, dtype: str):
        seen.append((model, batch, dtype))
        from opfuse.analysis.roofline import Work

        return Work(**GEMMS_64["work"])

    old = {k: v for k, v in GEMMS_64.items() if k != "work"}
    page = render([zoo_run("NVIDIA H200", {"gemms-bs64": old})], work_of=work_of)
    assert seen == [("gemms", 64, "float16")]
    assert "| 2.0000 (compute) / 3.0000 /" in row_line(page, "gemms-bs64")
    assert "the work of 1 of the 1 rows counted by the analysis of the current code" in page
    unknown = render([zoo_run("NVIDIA H200", {"gemms-bs64": old})], work_of=None)
    assert row_line(unknown, "gemms-bs64").endswith("| - | - | - |")
    assert "Roofline: no measured workload has a floor" in unknown
    # a GPU without a profile: no datasheet, no floor, even with the work recorded
    elsewhere = render([zoo_run("NVIDIA L4", {"gemms-bs64": GEMMS_64})], work_of=work_of)
    assert row_line(elsewhere, "gemms-bs64").endswith("| - | - | - |") and len(seen) == 1


