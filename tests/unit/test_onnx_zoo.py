"""benchmarks/onnx_zoo.py on the CPU: one tiny convnet exported, compiled from PyTorch and from ONNX, compared with
onnxruntime where it is installed; nothing timed (Triton runs in its interpreter)."""

import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from opfuse.codegen.base import import_file
from opfuse.config import FusionConfig

ROOT = Path(__file__).resolve().parents[2]


onnx_zoo = import_file(ROOT / "benchmarks" / "onnx_zoo.py", "onnx_zoo")


def tiny_convnet() -> nn.Module:
    """conv-BN-ReLU twice, global average pool, linear: the shape of the zoo's convnets, a few hundred weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4))
    for module in model:
        if isinstance(module, nn.BatchNorm2d):   # not the unit-scale, zero-statistics BN that folds into nothing
            module.weight.data.uniform_(0.5, 1.0)
            module.running_mean.normal_(0.0, 0.1)
            module.running_var.uniform_(0.5, 2.0)
    return model.eval()


@pytest.fixture(scope="module")
def row(tmp_path_factory):
    inputs = (torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(1)),)
    return onnx_zoo.measure_model("tiny", tiny_convnet(), inputs, FusionConfig(dtype="float32"),
                                  tmp_path_factory.mktemp("onnx_zoo"), device="cpu", timed=False)


def test_the_row_holds_both_compiles_plans(row):
    assert row["exporter"] in ("dynamo", "torchscript") and row["export_s"] > 0
    for frontend in ("pytorch", "onnx"):
        entry = row[frontend]
        assert "error" not in entry, entry
        assert entry["plan_launches"] >= 1 and entry["runtime_launches"] >= 1
        assert isinstance(entry["groups_through_pytorch"], int) and isinstance(entry["fallbacks"], dict)
        assert entry["rel_error_reference"] < 1e-4            # float32 against float64 eager
        assert "replay" not in entry and "kernels" not in entry   # nothing timed on the CPU
    text = onnx_zoo.render({"env": onnx_zoo.environment("cpu"),
                            "settings": {"tune_top": 0, "exporter": "auto", "rounds": 1, "per_round": 1,
                                         "image_size": 8, "timed": False}, "rows": [row]})
    assert f"| tiny | 1 | {row['exporter']} | - / - | - / - |" in text
    if "error" in row["onnxruntime"]:
        assert "not installed" in row["onnxruntime"]["error"] or pytest.fail(row["onnxruntime"]["error"])


def test_the_row_compares_both_compiles_with_onnxruntime(row):
    pytest.importorskip("onnxruntime")
    runtime = row["onnxruntime"]
    assert "error" not in runtime, runtime
    assert runtime["provider"] == "CPUExecutionProvider" and runtime["dtype"] == "float32"
    assert runtime["tolerance"] == 1e-4
    assert runtime["rel_error_pytorch"] < 1e-4 and runtime["rel_error_onnx"] < 1e-4 and runtime["passed"]


def test_a_spent_budget_still_writes_the_report(tmp_path):
    results = onnx_zoo.run(tmp_path, [("resnet50", 1), ("mobilenet_v2", 1)], device="cpu", budget_s=1.0)
    saved = json.loads((tmp_path / "onnx_zoo.json").read_text())
    assert [r["error"] for r in saved["rows"]] == ["not run: the run's time budget was spent"] * 2
    assert saved == json.loads(json.dumps(results, default=str))
    assert "resnet50 bs1: not run" in (tmp_path / "ONNX_ZOO.md").read_text()


def test_the_default_models_are_the_zoos_torchvision_ones():
    models = onnx_zoo.torchvision_zoo_models()
    assert "resnet50" in models and "swin_t" in models and "gpt2" not in models and "bert" not in models


def exported_without_dynamo(monkeypatch):
    """torch.onnx.export as on a machine without onnxscript: the dynamo exporter fails, the TorchScript one works."""
    export = torch.onnx.export

    def without_onnxscript(*args, dynamo=True, **kwargs):
        if dynamo:
            raise ImportError("No module named 'onnxscript'")
        return export(*args, dynamo=False, **kwargs)

    monkeypatch.setattr(torch.onnx, "export", without_onnxscript)


def test_the_torchscript_exporter_takes_over_and_says_why(tmp_path, monkeypatch):
    exported_without_dynamo(monkeypatch)
    result = onnx_zoo.export_onnx(tiny_convnet(), (torch.randn(1, 3, 8, 8),), tmp_path / "tiny.onnx")
    assert result["exporter"] == "torchscript" and (tmp_path / "tiny.onnx").exists()
    assert "dynamo exporter failed (ImportError: No module named 'onnxscript')" in result["note"]
    with pytest.raises(ImportError):
        onnx_zoo.export_onnx(tiny_convnet(), (torch.randn(1, 3, 8, 8),), tmp_path / "tiny.onnx", "dynamo")


def test_onnxruntime_runs_float32_where_it_cannot_run_float16(tmp_path, monkeypatch):
    onnxruntime = pytest.importorskip("onnxruntime")
    exported_without_dynamo(monkeypatch)
    session = onnxruntime.InferenceSession

    def float32_only(path, **kwargs):
        if not path.endswith("-float32.onnx"):
            raise RuntimeError("NOT_IMPLEMENTED: Could not find an implementation for Conv(11)")
        return session(path, **kwargs)

    monkeypatch.setattr(onnxruntime, "InferenceSession", float32_only)
    model, inputs = tiny_convnet().half(), (torch.randn(1, 3, 8, 8).half(),)
    path = tmp_path / "tiny.onnx"
    onnx_zoo.export_onnx(model, inputs, path, "torchscript")
    result = onnx_zoo.onnxruntime_output(model, inputs, path, "torchscript", "cpu")
    assert result["dtype"] == "float32" and "NOT_IMPLEMENTED" in result["note"]
    with torch.no_grad():
        expected = model.float()(inputs[0].float())
    assert torch.allclose(result["output"], expected, atol=1e-5)
