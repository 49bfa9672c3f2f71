"""The coverage suite's machinery (`opfuse.bench.suite`) on tiny models: what it records per model, the suite-wide
share, skipping a library that is not installed, and a model that fails or kills its process."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

from opfuse.bench import suite
from opfuse.bench.suite import SuiteModel, analyze_model, at_batch, hf_model, markdown, run_suite, summarize


class ConvRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.conv(x))


class KthValues(nn.Module):
    """A linear, then a kthvalue (no IR mapping: an opaque op), then an add."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return torch.kthvalue(self.linear(x), 2, dim=-1).values + 1.0


def _image() -> tuple:
    return (torch.randn(1, 3, 8, 8),)


CLEAN = SuiteModel("conv_relu", "cnn", "torch", lambda: (ConvRelu(), _image()))
OPAQUE = SuiteModel("kth", "encoder", "torch", lambda: (KthValues(), (torch.randn(1, 4, 16),)))


def _raises():
    raise RuntimeError("this model cannot be built\nsecond line")


def _dies():
    os._exit(3)


def test_a_clean_model_and_one_with_an_opaque_op():
    clean, opaque = (analyze_model(entry) for entry in (CLEAN, OPAQUE))
    assert clean.status == "clean" and clean.launches == 1 and not clean.opaque and not clean.no_kernel
    assert opaque.status == "pytorch"
    assert opaque.opaque == {"aten.kthvalue.default[0]": 1}
    assert opaque.pytorch_launches == 1
    assert opaque.launches >= 2          # the linear's kernel, the kthvalue, the add after it


def test_a_batch_repeats_the_examples_first_row_and_is_analysed_at_that_size():
    """`at_batch` gives every input the batch, row 0 repeated; the suite captures the model at it."""
    image = _image()[0]
    [three] = at_batch((image,), 3)
    assert three.shape == (3, *image.shape[1:]) and torch.equal(three[2], image[0])
    assert at_batch((image,), 1)[0] is image
    seen = []

    class Records(ConvRelu):
        def forward(self, x):
            seen.append(x.shape[0])
            return super().forward(x)

    [result] = run_suite([SuiteModel("records", "cnn", "torch", lambda: (Records(), _image()))], workers=0, batch=3)
    assert result.status == "clean" and result.launches == 1 and seen and set(seen) == {3}


def test_failures_and_skips_are_results_and_the_share_counts_only_models_tried():
    entries = [CLEAN, OPAQUE, SuiteModel("broken", "cnn", "torch", lambda: _raises()),
               SuiteModel("elsewhere", "cnn", "no_such_library_for_opfuse", lambda: _raises())]
    results = run_suite(entries, workers=0)
    assert [r.status for r in results] == ["clean", "pytorch", "failed", "skipped"]
    assert results[2].error == "RuntimeError: this model cannot be built"
    assert "no_such_library_for_opfuse is not installed" in results[3].error
    summary = summarize(results)
    assert (summary["tried"], summary["analysed"], summary["clean"], summary["skipped"]) == (3, 2, 1, 1)
    assert summary["clean_percent"] == pytest.approx(33.3)
    assert list(summary["opaque"].values()) == [[1, 1]]        # one model, one node
    table = markdown(results)
    assert "1 of 3 models (33.3%)" in table and "| kth | encoder | pytorch |" in table
    assert "kthvalue" in table.split("| kth |")[1].splitlines()[0]


def test_forked_runs_survive_a_process_that_dies():
    results = run_suite([SuiteModel("dies", "cnn", "torch", _dies), CLEAN], workers=2)
    assert results[0].status == "failed" and "died (exit code 3)" in results[0].error
    assert results[1].status == "clean" and results[1].launches == 1


@pytest.mark.slow
def test_a_tiny_transformers_model_through_the_config_builder():
    pytest.importorskip("transformers")
    entry = hf_model("tiny_bert", "encoder", "BertModel", "BertConfig",
                     dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                          vocab_size=64, max_position_embeddings=32), seq=8)
    model, (ids,) = entry.build()
    assert ids.shape == (1, 8) and int(ids.max()) < 64
    assert model(ids).shape == (1, 8, 32)
    result = analyze_model(entry)
    assert result.status in ("clean", "pytorch"), result.error
    assert result.launches > 0


def test_the_suite_spans_the_families_and_skips_timm_when_absent(monkeypatch):
    families = {m.family for m in suite.SUITE}
    assert {"cnn", "vit", "hybrid", "mlp", "encoder", "decoder", "audio", "moe", "ssm"} <= families
    assert len(suite.SUITE) >= 60 and len({m.name for m in suite.SUITE}) == len(suite.SUITE)
    timm_entry = next(m for m in suite.SUITE if m.library == "timm")
    monkeypatch.setattr(suite, "library_problem", lambda library: "timm is not installed (test)"
                        if library == "timm" else None)
    result = analyze_model(timm_entry)
    assert result.status == "skipped" and "timm is not installed" in result.error
