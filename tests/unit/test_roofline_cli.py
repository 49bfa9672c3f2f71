"""`opfuse bench`'s and `opfuse profile`'s floors from fake measurements (no GPU): each contender's share of the
workload's floor, each kernel's floor and share, the kernels' sum against the workload's floor."""

from __future__ import annotations

import io

import pytest
import torch
from rich.console import Console

from opfuse.analysis.roofline import datasheet_ceilings
from opfuse.bench import cli_bench
from opfuse.bench import profile as profiling
from opfuse.bench.profile import ProfileRow
from opfuse.config import FusionConfig
from opfuse.hardware import get_hardware

H200 = get_hardware("h200")
PEAK, BANDWIDTH, LAUNCH = 989e12, 4.8e12, 2.5e-6          # the H200 SXM datasheet: fp16 dense, HBM3e; a launch


def text_of(table) -> str:
    console = Console(record=True, width=300, file=io.StringIO())
    console.print(table)
    return " ".join(console.export_text().split())


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


def test_bench_table_gives_each_contender_its_share_of_the_floor():
    env = {"date": "2026-12-04", "gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}
    ceilings = {"copy_bytes_per_s": 4.2e12, "fp16_matrix_flops": 7.9e14}
    row = GEMMS_64 | {"workload": "gemms bs64"}
    text = text_of(cli_bench.bench_table(row, env, ceilings))
    assert "% roofline" in text and "% launch floor" in text
    with_launches = 2.0 + 10 * LAUNCH * 1e3
    assert f"│ 4.000 │ 4.000-4.000 │ - │ 50% │ {percent(with_launches / 4.0)} │" in text                  # opfuse
    assert f"│ 5.000 │ 5.000-5.000 │ 1.25x │ 40% │ {percent(with_launches / 5.0)} │" in text              # inductor
    assert ("floor on the NVIDIA H200 SXM datasheet: roofline 2.0000 ms (compute-bound: compute 2.0000 ms, "
            f"compulsory bytes 1.0000 ms), with 10 launches {with_launches:.4f} ms, of opfuse's plan's bytes "
            "3.0000 ms") in text
    # the datasheet of the GPU measured on, whatever profile the command was told to plan for
    on_h100 = text_of(cli_bench.bench_table(row, env | {"gpu": "NVIDIA H100 80GB HBM3"}, ceilings))
    assert "floor on the NVIDIA H100 SXM datasheet" in on_h100
    assert "% roofline" in text_of(cli_bench.bench_table({k: v for k, v in row.items() if k != "work"}, env,
                                                         ceilings))


def test_profile_table_gives_each_kernel_its_floor_and_share():
    ceilings = datasheet_ceilings(H200, "float16")
    gemm = ProfileRow("g0", "linear + relu", "anchor", "fused_linear_relu", flops=round(20e-6 * PEAK),
                      bytes_moved=round(5e-6 * BANDWIDTH), predicted=30e-6, matrix=True, measured=40e-6)
    add = ProfileRow("g1", "add", "pointwise", "fused_add", flops=1000, bytes_moved=round(2e-6 * BANDWIDTH),
                     predicted=4e-6, matrix=False, measured=5e-6)
    for row in (gemm, add):
        row.with_floor(ceilings)
    assert gemm.floor == pytest.approx(20e-6) and gemm.share_of_floor == pytest.approx(0.5)
    assert gemm.launch_floor == pytest.approx(20e-6 + LAUNCH)
    assert add.floor == pytest.approx(2e-6) and add.share_of_launch_floor == pytest.approx((2e-6 + LAUNCH) / 5e-6)
    text = text_of(cli_bench.profile_table([gemm, add], "kernels", 10.0, None))
    assert "floor" in text and "% floor" in text and "% +launch" in text
    assert f"│ 20.0 µs │ 50% │ {percent((20e-6 + LAUNCH) / 40e-6)} │" in text
    assert f"│ 2.0 µs │ 40% │ {percent((2e-6 + LAUNCH) / 5e-6)} │" in text
    assert "floors 22.0 µs" in text
    assert ProfileRow("x", "relu", "pointwise", "pytorch", 1, 1, 1e-6, False).floor is None     # no ceilings


class MLP(torch.nn.Sequential):
    def __init__(self):
        torch.manual_seed(0)
        super().__init__(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def test_profile_sets_the_kernels_sum_against_the_workload_floor():
    """On the CPU (Triton's interpreter, a fake clock) the floors take the config's profile, the H200's."""
    profile = profiling.profile_model(MLP().eval(), (torch.randn(2, 16),), FusionConfig(dtype="float32",
                                                                                        autotune=False),
                                      timer=lambda fn: (fn(), 4e-6)[1], name="mlp")
    ceilings = datasheet_ceilings(H200, "float32")
    assert profile.floor_hardware == H200.name and profile.ceilings == ceilings
    for row in profile.eager + profile.opfuse:
        assert row.floor == pytest.approx(max(row.flops / ceilings.flops, row.bytes_moved / BANDWIDTH))
    # input, both weights and biases, output: float32, each once
    compulsory = (2 * 16 + 32 * 16 + 32 + 4 * 32 + 4 + 2 * 4) * 4
    assert profile.work.compulsory_bytes == compulsory
    workload = profile.workload_floor()
    assert workload.roofline == pytest.approx(max(profile.work.flops / ceilings.flops, compulsory / BANDWIDTH))
    assert workload.launches == profile.work.plan_launches == len(profile.opfuse)
    console = Console(record=True, width=400, file=io.StringIO())
    cli_bench.print_profile(profile, console)
    text = " ".join(console.export_text().split())
    kernels = 4e-6 * len(profile.opfuse)
    assert (f"opfuse's kernels alone sum to {kernels * 1e6:.1f} µs: {percent(workload.roofline / kernels)} of the "
            f"roofline, {percent(workload.launch_and_bandwidth / kernels)} of the launch-and-bandwidth floor") in text
    data = profile.to_dict()
    assert data["floor"]["work"]["compulsory_bytes"] == compulsory
    assert data["opfuse"][0]["share_of_floor"] == pytest.approx(profile.opfuse[0].floor / 4e-6)
