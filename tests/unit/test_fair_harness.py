"""The benchmark protocol of issue 14 on the CPU: torch.compile compiled once, frozen, under inference mode;
contenders timed in interleaved rounds; medians and spreads."""

import torch
import torch._inductor.config as inductor_config
import torch.nn as nn
from torch._dynamo.testing import CompileCounter

from opfuse.bench import harness
from opfuse.bench.timing import interleaved_samples, summarize
from opfuse.config import FusionConfig


class RecordingBackend(CompileCounter):
    """Counts dynamo's compiles and records the modes each one ran under: (grad on, inductor's freezing on). The
    backend runs inside dynamo's own context, where inference mode reads off; grad off is what inductor's freezing
    needs."""

    def __init__(self):
        super().__init__()
        self.modes = []

    def __call__(self, gm, example_inputs):
        self.modes.append((torch.is_grad_enabled(), inductor_config.freezing))
        return super().__call__(gm, example_inputs)


def tiny_mlp() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    return model, (torch.randn(4, 16),)


def test_torch_compile_is_compiled_once_frozen_under_inference_mode():
    model, inputs = tiny_mlp()
    backend = RecordingBackend()
    steps = []
    row = harness.run_workload(model, inputs, "tiny bs4", {}, ["eager", "inductor", "opfuse"],
                               FusionConfig(dtype="float32"), steps.append, device="cpu",
                               compile_backend=backend, rounds=3, per_round=2)
    assert backend.frame_count == 1, backend.modes       # compiled, warmed, "captured" and timed: one compile
    assert backend.modes == [(False, True)]              # grad off and inductor's freezing on
    assert steps == ["eager", "inductor", "opfuse", "timing"]
    for label in ("eager", "inductor", "opfuse"):
        entry = row[label]
        assert "error" not in entry, entry
        assert entry["samples"] == 6 and 0 < entry["p10_ms"] <= entry["median_ms"] <= entry["p90_ms"]
        assert entry["rel_error"] < 1e-5
    assert row["inductor"]["compile_s"] > 0 and row["opfuse"]["compile_s"] > 0
    assert row["plan_launches"] >= 1 and row["runtime_launches"] >= 1 and "predicted_ms" in row
    assert row["analyze_launches"] == row["runtime_launches"]     # what opfuse.analyze reports after the compile
    linears = [entry for entry in row["tuning"].values() if entry["anchor"] and entry["anchor"]["op"] == "linear"]
    assert linears and all(entry["chosen"] for entry in row["tuning"].values())    # every kernel's form, and
    assert linears[0]["anchor"]["inputs"][0] == list(inputs[0].shape)   # the first linear's shapes (untuned here)
    assert "opfuse_replay" not in row                    # no CUDA graph on the CPU


def test_a_forward_outside_inference_mode_compiles_again():
    """What the old harness did (warm and capture in grad mode): the counting backend sees it, so the test above
    can fail."""
    model, inputs = tiny_mlp()
    backend = RecordingBackend()
    compiled, _ = harness.torch_compiled(model, inputs, backend)
    compiled(*inputs)                                    # outside inference mode, grad on
    assert backend.frame_count == 2
    assert backend.modes[1][0] is True                   # the second compile ran with grad on: inductor would not freeze


def test_a_failing_contender_records_its_error_and_the_others_run():
    model, inputs = tiny_mlp()
    row = harness.run_workload(model, inputs, "tiny bs4", {}, ["eager", "eager_graph"],
                               FusionConfig(dtype="float32"), device="cpu", rounds=1, per_round=1)
    assert "CUDA" in row["eager_graph"]["error"]
    assert row["eager"]["samples"] == 1
    assert harness.failed_contenders(row) == {"eager_graph": row["eager_graph"]["error"]}


def test_a_contender_failing_while_timed_records_its_error_and_the_others_are_timed(monkeypatch):
    model, inputs = tiny_mlp()
    calls = []

    def flaky(model, inputs, cuda, **_):
        def forward():
            calls.append(1)
            if len(calls) > 2:
                raise RuntimeError("device lost")
            return model(*inputs)
        return harness.Built({"eager_graph": forward}, forward, forward())

    monkeypatch.setitem(harness.BUILDERS, "eager_graph", flaky)
    row = harness.run_workload(model, inputs, "tiny bs4", {}, ["eager", "eager_graph"],
                               FusionConfig(dtype="float32"), device="cpu", rounds=2, per_round=2)
    assert row["eager_graph"] == {"error": "RuntimeError: failed while timed: RuntimeError: device lost"}
    assert row["eager"]["samples"] == 4


def test_rounds_interleave_the_contenders():
    calls = []
    forwards = {name: (lambda name=name: calls.append(name)) for name in "ABC"}
    samples = interleaved_samples(forwards, rounds=2, per_round=2, warmup_rounds=1, cuda=False)
    assert calls == (["A"] * 3 + ["B"] * 3 + ["C"] * 3) * 3       # each turn: one untimed call, then two timed
    assert {name: len(times) for name, times in samples.items()} == {"A": 4, "B": 4, "C": 4}


def test_summary_is_the_median_and_measured_percentiles():
    timing = summarize([5.0, 1.0, 2.0, 3.0, 4.0, 100.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    assert timing.median_ms == 6.0 and timing.samples == 11
    assert (timing.p10_ms, timing.p90_ms) == (2.0, 10.0)          # nearest rank: values that were measured
    assert timing.spread == (10.0 - 2.0) / 6.0


def test_protocol_form_lays_out_4d_weights_channels_last_and_leaves_a_5d_weight():
    """Module.to(memory_format=channels_last) raises on a 5-D weight ("required rank 4 tensor to use channels_last
    format", naming nothing): the protocol lays out the 4-D parameters and buffers only."""
    import torch
    import torch.nn as nn

    from opfuse.bench.harness import protocol_form

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.volume = nn.Conv3d(1, 2, (1, 3, 3))
            self.register_buffer("table", torch.randn(1, 2, 3, 4))

        def forward(self, x):
            return self.conv(x).mean() + self.volume(x[:, :1, None]).mean() + self.table.sum()

    model, (x,) = protocol_form(Mixed(), (torch.randn(1, 3, 8, 8),), torch.float32, "cpu")
    assert x.is_contiguous(memory_format=torch.channels_last)
    assert model.conv.weight.is_contiguous(memory_format=torch.channels_last) and model.conv.weight.stride(1) == 1
    assert model.table.stride(1) == 1 and model.volume.weight.is_contiguous()
    assert isinstance(model.conv.weight, nn.Parameter)
    model(x)


def test_torch_compile_that_cannot_be_graphed_runs_without_a_graph_and_says_so(monkeypatch):
    """A model that reads a value back to the host cannot be captured; torch.compile is then timed without a CUDA
    graph (not dropped, which would leave plain eager as the best PyTorch path), and the suite names it so."""
    from opfuse.bench.suite import SuiteModel
    from opfuse.bench.suite_gpu import judge

    def uncapturable(fn, inputs, warmup=3):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")

    monkeypatch.setattr(harness, "cuda_graphed", uncapturable)
    model, inputs = tiny_mlp()
    with torch.inference_mode():
        built = harness._build_inductor(model, inputs, cuda=True, backend="eager")
        torch.testing.assert_close(built.forwards["inductor"](), model(*inputs))
    assert built.row == {harness.INDUCTOR_GRAPH_ERROR: "RuntimeError: CUDA error: operation not permitted when "
                                                       "stream is capturing"}
    row = {"opfuse": {"median_ms": 1.0, "rel_error": 1e-4}, "eager": {"median_ms": 4.0, "rel_error": 1e-4},
           "inductor": {"median_ms": 2.0, "rel_error": 1e-4}} | built.row
    result = judge(SuiteModel("tiny", "mlp", "torch", lambda: None), row, "float16", 1.0)
    assert (result.best, result.speedup) == ("inductor without a CUDA graph", 2.0)
