"""`opfuse bench` / `opfuse profile` on the CPU: exit codes, the calibration fit, and the tables from fake timings.

Nothing here needs a GPU: the GPU parts (timers, ceilings, the workload runner) are replaced by fakes, and kernels
run through Triton's interpreter. The real measurements are tests/gpu's business.
"""

from __future__ import annotations

import io
import json
import random
import re
import statistics
from pathlib import Path

import pytest
import torch
from rich.console import Console

from opfuse.bench import calibrate as calibration
from opfuse.bench import cli_bench, harness
from opfuse.bench import profile as profiling
from opfuse.bench.calibrate import Sample, calibrate, median_relative_error, predict
from opfuse.cli import main
from opfuse.codegen.base import import_file
from opfuse.config import FusionConfig
from opfuse.hardware import get_hardware

ROOT = Path(__file__).resolve().parents[2]
H200 = get_hardware("h200").with_calibration(time_factor=1.0)   # the per-kernel fit prices kernels themselves
TRUE = H200.with_calibration(launch_overhead=4.2e-6, memory_efficiency=0.63, matrix_efficiency=0.41)


def render(table) -> str:
    console = Console(record=True, width=250, file=io.StringIO())
    console.print(table)
    return console.export_text()


# ---- exit codes ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["bench", "profile"])
def test_without_a_gpu_exit_code_3_before_loading_anything(command, monkeypatch, capsys):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model must not be loaded without a GPU")

    monkeypatch.setattr(cli_bench, "load_model", no_loading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command, "resnet50", "--quiet"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "" and "needs an NVIDIA GPU: no CUDA device" in captured.err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # a GPU, but kernels would be interpreted
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main([command, "resnet50"]) == 3
    assert "TRITON_INTERPRET=1 is set" in capsys.readouterr().err


def test_usage_errors_come_before_the_gpu_check(tmp_path, capsys):
    assert main(["bench", "resnet50", "--contenders", "eager,warp_drive"]) == 2
    assert "warp_drive" in capsys.readouterr().err
    assert main(["bench", str(tmp_path / "model.onnx")]) == 3                  # an .onnx file is benchmarked too
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
    assert main(["profile", "resnet50", "--json", str(tmp_path / "no" / "such" / "dir" / "p.json")]) == 2
    assert main(["bench"]) == 2
    assert "give a MODEL, or --zoo" in capsys.readouterr().err
    assert main(["bench", "resnet50", "--zoo"]) == 2
    assert "--zoo runs the zoo's models" in capsys.readouterr().err
    assert main(["bench", "--zoo", "--dtype", "bf16", "--no-split-k"]) == 2
    assert "it does not take --dtype, --no-split-k" in " ".join(capsys.readouterr().err.split())
    for argv in (["profile", "resnet50", "--ops", "many"], ["bench", "resnet50", "--tune-top", "x"]):
        with pytest.raises(SystemExit) as usage:
            main(argv)
        assert usage.value.code == 2


def test_the_zoo_needs_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(cli_bench, "gpu_problem", lambda: "no CUDA device")
    assert main(["bench", "--zoo", "--models", "resnet50", "--batches", "1"]) == 3
    assert "--zoo needs an NVIDIA GPU: no CUDA device" in capsys.readouterr().err


def test_help_documents_exit_code_3(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "3 bench or profile on a machine without a usable NVIDIA GPU" in " ".join(capsys.readouterr().out.split())


# ---- calibration -----------------------------------------------------------------------------------------------

def synthetic_samples(profile, count: int = 80, noise: float = 0.0, seed: int = 0) -> list[Sample]:
    """Kernels over four decades of bytes and densities on both sides of the ridge, timed by `profile`."""
    rng = random.Random(seed)
    samples = []
    for i in range(count):
        matrix = i % 2 == 0
        bytes_moved = 10 ** rng.uniform(4, 9)
        density = 10 ** rng.uniform(0, 3.5) if matrix else 10 ** rng.uniform(-1, 1)
        shape = Sample(density * bytes_moved, bytes_moved, matrix, 1.0, rng.choice([1.0, 0.8, 0.5]), f"k{i}")
        measured = predict(shape, profile, "float16") * (1 + noise * rng.gauss(0, 1))
        samples.append(Sample(shape.flops, shape.bytes_moved, matrix, measured, shape.tile_efficiency, shape.name))
    return samples


def test_calibration_recovers_the_factors_of_a_known_profile():
    result = calibrate(synthetic_samples(TRUE), H200, "float16")
    assert result.after["launch_overhead"] == pytest.approx(4.2e-6, rel=1e-6)
    assert result.after["memory_efficiency"] == pytest.approx(0.63, rel=1e-6)
    assert result.after["matrix_efficiency"] == pytest.approx(0.41, rel=1e-6)
    assert result.before == {"launch_overhead": H200.launch_overhead, "memory_efficiency": H200.memory_efficiency,
                             "matrix_efficiency": H200.matrix_efficiency, "time_factor": 1.0}
    assert result.error_before > 0.1 and result.error_after < 1e-9
    assert result.profile == TRUE.with_calibration(**result.after)     # everything else of the profile untouched
    assert median_relative_error(synthetic_samples(TRUE), result.profile, "float16") < 1e-9


def test_calibration_with_noise_and_outliers():
    noisy = synthetic_samples(TRUE, noise=0.03, seed=1)
    for i in (3, 10, 17):                  # three kernels far off the roofline (a bad config, an L2-resident one)
        s = noisy[i]
        noisy[i] = Sample(s.flops, s.bytes_moved, s.matrix, s.measured * (8 if i != 10 else 0.1), s.tile_efficiency,
                          s.name)
    result = calibrate(noisy, H200, "float16")
    for factor in calibration.FITTED:
        assert result.after[factor] == pytest.approx(getattr(TRUE, factor), rel=0.06), factor
    assert {"k3", "k10", "k17"} <= set(result.outliers)
    assert result.error_after < 0.05 < result.error_before


def test_a_factor_no_kernel_constrains_keeps_its_value():
    memory_bound = [s for s in synthetic_samples(TRUE) if not s.matrix]
    result = calibrate(memory_bound, H200, "float16")
    assert result.after["matrix_efficiency"] == H200.matrix_efficiency
    assert result.after["memory_efficiency"] == pytest.approx(0.63, rel=1e-6)
    # kernels faster than any launch: the overhead cannot go negative
    quick = [Sample(0, 1e3, False, 1e-7 * (1 + i)) for i in range(5)]
    assert calibrate(quick, H200, "float16").after["launch_overhead"] >= 0
    with pytest.raises(ValueError, match="at least one"):
        calibrate([], H200, "float16")


def test_a_calibration_of_the_h200_profile_prices_kernels_at_time_factor_1():
    """The per-kernel fit prices the measured kernels themselves: the profile it returns (and the recipe `opfuse
    profile` prints from `after`) has time factor 1, whatever the given profile's."""
    given = get_hardware("h200")
    assert given.time_factor != 1.0
    result = calibrate(synthetic_samples(TRUE), given, "float16")
    assert result.before["time_factor"] == given.time_factor
    assert result.after["time_factor"] == 1.0 == result.profile.time_factor
    assert median_relative_error(synthetic_samples(TRUE), given.with_calibration(**result.after), "float16") < 1e-9


def test_calibration_keeps_efficiencies_physical_and_never_predicts_worse():
    """Kernels that all beat the DRAM roofline (L2-resident, as at batch 1): the fit may not explain them with a
    memory efficiency over 1, and what it returns predicts no worse than the profile it started from."""
    faster_than_dram = TRUE.with_calibration(memory_efficiency=3.0, matrix_efficiency=0.41)
    samples = synthetic_samples(faster_than_dram, noise=0.05)
    unconstrained = calibration._fit(samples, H200, "float16", robust=True)
    assert unconstrained.memory_efficiency > 2      # what the fit alone would have returned
    result = calibrate(samples, H200, "float16")
    assert result.after["memory_efficiency"] == 1.0 and result.after["matrix_efficiency"] <= 1.0
    assert result.error_after < result.error_before / 2      # the capped fit still predicts much better
    bad = [Sample(1e9, 1e6, True, 1e-3 * (1 + 5 * (i % 2))) for i in range(10)]   # no roofline fits these
    worst = calibrate(bad, H200, "float16")
    assert worst.error_after <= worst.error_before


# ---- profile: rows, tables, calibration from fake timings ------------------------------------------------------

def small_cnn():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                torch.nn.Conv2d(16, 16, 3, padding=1, groups=16), torch.nn.ReLU6(),
                                torch.nn.Conv2d(16, 16, 1), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        model[1].running_var.uniform_(0.5, 1.5)
    return model.eval(), (torch.randn(2, 3, 8, 8),)


@pytest.fixture(scope="module")
def profiled():
    """A profile of a small CNN whose 'measured' times are the predictions of TRUE for each row."""
    calls = []

    def fake_timer(fn):
        fn()                       # the row's function really runs (kernel through the interpreter)
        calls.append(fn)
        return 1e-5

    model, inputs = small_cnn()
    profile = profiling.profile_model(model, inputs, FusionConfig(dtype="float32"), timer=fake_timer, name="cnn")
    assert len(calls) == len(profile.eager) + len(profile.opfuse)
    for row in profile.eager + profile.opfuse:
        row.measured = predict(row.sample(), TRUE, "float32")
    return profile


def test_profile_rows_are_the_ops_and_the_kernels(profiled):
    analysis = profiled.compiled.analysis
    assert [r.name for r in profiled.eager] == [m.name for m in analysis.op_rows]
    assert [r.ops for r in profiled.eager][:3] == ["conv2d", "batch_norm", "relu"]
    for row, metrics in zip(profiled.eager, analysis.op_rows):       # the cost model's numbers, not new ones
        assert (row.flops, row.bytes_moved) == (metrics.flops, metrics.bytes_moved)
        assert row.predicted == pytest.approx(metrics.predicted_time)
    kernels = [g for g in analysis.plan.groups if g.launches]
    assert [r.name for r in profiled.opfuse] == [g.name for g in kernels]
    for row, group in zip(profiled.opfuse, kernels):
        assert row.predicted == pytest.approx(group.predicted_time) and row.flops == group.flops
        assert row.runs_as == profiled.compiled.compiled.kernels[group.name].name
    assert profiled.opfuse[0].ops == "conv2d + relu" and profiled.opfuse[0].matrix
    # the roofline terms each row carries reproduce the cost model's prediction (what the calibration fits)
    for row in profiled.eager + profiled.opfuse:
        if row.roofline:
            assert predict(row.sample(), get_hardware("h200"), "float32") == pytest.approx(row.predicted, rel=1e-9), row.name
    assert len(profiled.samples()) == sum(r.roofline for r in profiled.eager + profiled.opfuse)
    assert sum(r.roofline for r in profiled.eager) == len(profiled.eager)     # single ops: always a roofline


def test_profile_rates_errors_and_table(profiled):
    row = profiled.eager[1]                                          # batch norm
    assert row.achieved_bandwidth == pytest.approx(row.bytes_moved / row.measured)
    assert row.achieved_flops == pytest.approx(row.flops / row.measured)
    assert row.error == pytest.approx((row.predicted - row.measured) / row.measured)
    assert profiled.candidate(row) and row.density == pytest.approx(row.flops / row.bytes_moved)
    assert [profiled.candidate(r) for r in profiled.eager] == [r.density < 10 for r in profiled.eager]
    assert profiling.median_error(profiled.eager) == pytest.approx(statistics.median(abs(r.error)
                                                                                     for r in profiled.eager))
    assert profiling.median_error([]) is None
    text = render(cli_bench.profile_table(profiled.eager, "eager", 10.0, limit=3))
    slowest = max(profiled.eager, key=lambda r: r.measured)
    assert text.index(slowest.name) < text.index("faster rows not shown")
    assert f"{len(profiled.eager) - 3} faster rows not shown" in text
    assert f"{row.error * 100:+.0f}%" in render(cli_bench.profile_table(profiled.eager, "eager", 10.0, None))
    data = json.loads(json.dumps(profiled.to_dict()))
    assert data["eager"][1]["candidate"] is True and data["median_error"]["all"] > 0


def test_profile_calibrates_to_the_fake_measurements(profiled, capsys):
    result = profiled.calibrate()
    assert result.samples == len(profiled.samples()) > len(profiled.eager)
    assert result.error_after < 1e-6 < result.error_before
    console = Console(record=True, width=200, file=io.StringIO())
    cli_bench.print_profile(profiled, console)
    text = console.export_text()
    assert "median relative error" in text and "with_calibration(launch_overhead=" in text
    assert profiled.to_dict()["calibration"]["median_error_after"] == result.error_after


# ---- bench: the table, the results file, the command's glue ---------------------------------------------------

def fake_row(opfuse_ms: float = 0.5, failed: str | None = None) -> dict:
    def result(ms: float, kernels: int) -> dict:
        return {"median_ms": ms, "p10_ms": ms * 0.95, "p90_ms": ms * 1.1, "samples": 50, "kernels": kernels,
                "gpu_busy_ms": ms * 0.8, "peak_memory_mb": 100.0, "held_memory_mb": 60.0, "compile_s": 1.0,
                "rel_error": 1e-3}

    row = {"workload": "resnet50 bs1", "model": "resnet50", "batch": 1, "dtype": "float16",
           "eager": result(5.0, 280), "eager_graph": result(1.0, 280), "inductor": result(0.45, 104),
           "opfuse": result(opfuse_ms, 56), "opfuse_replay": {"median_ms": opfuse_ms * 0.9, "p10_ms": opfuse_ms * 0.85,
                                                               "p90_ms": opfuse_ms * 0.95, "samples": 50},
           "plan_launches": 56, "floor_compute_ms": 0.011, "floor_memory_ms": 0.012,
           "fallbacks": {"g55": "view: metadata only, no kernel needed", "g3": "attention (sdpa) runs through ..."}}
    if failed:
        row[failed] = {"error": "TypeError: boom"}
    return row


ENV = {"date": "2026-11-30", "gpu": "NVIDIA H200", "driver": "580", "torch": "2.11.0", "triton": "3.6.0"}
CEILINGS = {"copy_bytes_per_s": 4.16e12, "fp16_matrix_flops": 7.65e14}


def test_bench_table_and_speedups():
    row = fake_row()
    assert harness.speedup(row, "inductor") == pytest.approx(0.9)
    assert harness.speedup(row, "eager_graph") == pytest.approx(2.0)
    text = render(cli_bench.bench_table(row, ENV, CEILINGS))
    assert "0.90x" in text and "2.00x" in text and "10.00x" in text
    caption = " ".join(text.split())           # the caption wraps at the table's width
    assert "floor: compute 0.011 ms" in caption and "1 groups through PyTorch" in caption
    assert "build peak MB" in text and "held MB" in text
    broken = fake_row(failed="inductor")
    assert harness.failed_contenders(broken) == {"inductor": "TypeError: boom"}
    assert harness.speedup(broken, "inductor") is None
    assert "failed" in render(cli_bench.bench_table(broken, ENV, CEILINGS))
    assert harness.geometric_mean([2.0, 0.5, None]) == pytest.approx(1.0)


def test_run_all_markdown_shares_the_numbers():
    run_all = import_file(ROOT / "benchmarks" / "run_all.py", "run_all")
    text = run_all.markdown([fake_row(0.5), fake_row(0.3)], ENV, CEILINGS)
    assert "| resnet50 bs1 | 5.000 (280) | 1.000 | 0.450 (104) | 0.500 | 0.450 (56) | 0.90x / 1.00x | 2.00x | 15% |" \
        in text
    assert "Geometric mean speedup of opfuse over torch.compile + graph: 1.16x (2 workloads)" in text
    assert run_all.run_builtin.__doc__ and run_all.run_workload is harness.run_workload


def test_bench_command_writes_the_results_file(tmp_path, monkeypatch, capsys):
    """The command's glue with the GPU parts faked: model loading, progress, JSON, table, exit code."""
    seen = {}

    def fake_run_workload(model, inputs, workload, ceilings, contenders, config, on_step):
        for label in contenders:
            on_step(label)
        seen.update(workload=workload, contenders=list(contenders), config=config, model=model)
        return {k: v for k, v in fake_row(failed="opfuse").items() if k in ("workload", "dtype", *contenders)}

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(cli_bench, "gpu_problem", lambda: None)
    monkeypatch.setattr(harness, "environment", lambda: ENV)
    monkeypatch.setattr(harness, "measure_ceilings", lambda: CEILINGS)
    monkeypatch.setattr(harness, "run_workload", fake_run_workload)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    out = tmp_path / "bench.json"
    code = main(["bench", "zoo_factory_example:tiny_mlp", "--batch", "3", "--contenders", "opfuse,eager",
                 "--tune-top", "0", "--json", str(out)])
    assert code == 1                                               # opfuse failed: scripts must see it
    captured = capsys.readouterr()
    assert "opfuse failed on zoo_factory_example:tiny_mlp bs3: TypeError: boom" in " ".join(captured.err.split())
    assert "eager" in captured.out
    assert seen["contenders"] == ["opfuse", "eager"] and seen["config"].autotune is False
    data = json.loads(out.read_text())
    assert data["env"] == ENV and data["ceilings"] == CEILINGS and data["tune_top"] == 0
    assert data["results"][0]["model"] == "tiny_mlp" and data["results"][0]["batch"] == 3


def test_profile_command_end_to_end_with_a_fake_clock(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    monkeypatch.setattr(cli_bench, "gpu_problem", lambda: None)
    monkeypatch.setattr(harness, "prepare", lambda model, inputs, dtype: (model.to(dtype), tuple(
        x.to(dtype) if x.is_floating_point() else x for x in inputs), None, None))
    monkeypatch.setattr(profiling, "cuda_graph_time", lambda fn: (fn(), 3e-6)[1])
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    out, page = tmp_path / "profile.json", tmp_path / "profile.html"
    code = main(["profile", "zoo_factory_example:tiny_mlp", "--dtype", "fp32", "--tune-top", "0", "--calibrate",
                 "--json", str(out), "--html", str(page)])
    assert code == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    assert "eager PyTorch: per op" in text and "opfuse: per kernel" in text and "Calibrated" in text
    data = json.loads(out.read_text())
    assert data["model"] == "tiny_mlp" and [r["ops"] for r in data["eager"]] == ["linear", "relu", "linear"]
    assert all(r["measured"] == 3e-6 and r["timing"] == "cuda graph" for r in data["eager"] + data["opfuse"])
    assert data["calibration"]["median_error_after"] <= data["calibration"]["median_error_before"]
    blob = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page.read_text(), re.S)
    measured = json.loads(blob.group(1))["measured"]
    assert measured and all(entry["time"] == 3e-6 for entry in measured.values())


# ---- on the GPU machine: OPFUSE_GPU_TESTS=1 python3 -m pytest -m gpu tests/unit/test_cli_bench_profile.py ----------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_cuda_graph_time_of_a_copy_is_near_the_bandwidth():
    x = torch.randn(1 << 26, device="cuda", dtype=torch.float16)     # 128 MiB
    y = torch.empty_like(x)
    seconds = profiling.cuda_graph_time(lambda: y.copy_(x))
    bandwidth = 2 * x.numel() * 2 / seconds
    assert 0.3 * H200.memory_bandwidth < bandwidth < 1.2 * H200.memory_bandwidth, bandwidth / 1e12


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_bench_command_on_a_gpu(tmp_path):
    out = tmp_path / "bench.json"
    code = main(["bench", "examples/03_conv_bn_relu.py:conv_bn_relu", "--batch", "8", "--tune-top", "0",
                 "--contenders", "eager,eager_graph,opfuse", "--json", str(out)])
    row = json.loads(out.read_text())["results"][0]
    assert code == 0, row
    assert all(row[c]["median_ms"] > 0 and row[c]["rel_error"] < 1e-2 for c in ("eager", "eager_graph", "opfuse"))
    assert row["opfuse"]["kernels"] <= row["plan_launches"] == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("model", ["resnet50", "bert-base"])
def test_profile_command_on_a_gpu(model, tmp_path, capsys):
    """Issue 4's acceptance: `opfuse profile resnet50` prints the per-op table and the cost model's median error."""
    out = tmp_path / "profile.json"
    assert main(["profile", model, "--tune-top", "0", "--calibrate", "--json", str(out),
                 "--html", str(tmp_path / "profile.html")]) == 0
    text = capsys.readouterr().out
    assert "eager PyTorch: per op" in text and "median relative error" in text
    data = json.loads(out.read_text())
    rows = data["eager"] + data["opfuse"]
    assert all(r["measured"] and r["measured"] > 0 for r in rows)
    assert data["calibration"]["median_error_after"] <= data["calibration"]["median_error_before"]


def test_a_model_with_a_kv_cache_profiles_and_keeps_its_cache():
    """A decode step (state nodes: the KV cache) profiles: the eager run starts from copies of the cache, so the
    compiled model's own cache is not written by it."""
    transformers = pytest.importorskip("transformers")
    from opfuse.bench.generation import GENERATION_MODELS
    from opfuse.generate import KVCacheDecoder

    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**GENERATION_MODELS["llama-tiny"])).eval()
    decoder = KVCacheDecoder(llama, 1, 8).eval()
    inputs = (torch.tensor([[5]]), torch.tensor([2]))
    calls = []
    profile = profiling.profile_model(decoder, inputs, FusionConfig(dtype="float32"),
                                      timer=lambda fn: calls.append(fn()) or 1e-5)
    assert len(calls) == len(profile.eager) + len(profile.opfuse)
    assert "index_copy" in [row.ops for row in profile.eager]
    graph = profile.compiled.analysis.captured
    assert graph.state and all(not graph.constants[name].any() for name in graph.state)
