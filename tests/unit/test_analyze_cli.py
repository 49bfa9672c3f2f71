"""`opfuse analyze` end to end on the CPU: issue 2's acceptance on resnet50 and the seed's table on a tiny model."""

import json
import time

import pytest

from opfuse.cli import main


@pytest.mark.slow
def test_analyze_resnet50_batch64_plans_at_most_57_launches_in_under_60s(tmp_path, capsys):
    out = tmp_path / "r50.json"
    start = time.perf_counter()
    assert main(["analyze", "resnet50", "--batch", "64", "--json", str(out)]) == 0
    elapsed = time.perf_counter() - start
    data = json.loads(out.read_text())
    assert elapsed < 60
    # every conv carries its BN, ReLU and residual add: 53 convs + max pool + average pool + fc
    assert data["plan"]["kernel_launches"] <= 57
    assert data["unfused"]["kernel_launches"] > 150
    printed = capsys.readouterr().out
    assert f"unfused: {data['unfused']['kernel_launches']} kernel launches" in printed
    assert "kernel launches" in printed and "total traffic" in printed


def test_analyze_prints_the_seed_table_for_conv_bn_relu(monkeypatch, capsys, tmp_path):
    """The seed's worked example through the CLI: Conv(no bias) -> BN -> ReLU, 3 kernels -> 1, 4·S less traffic
    plus BN's four parameter vectors, minus the bias the folding gives the conv."""
    module = tmp_path / "seed_model.py"
    module.write_text("import torch, torch.nn as nn\n"
                      "def build(batch=1):\n"
                      "    torch.manual_seed(0)\n"
                      "    m = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16),"
                      " nn.ReLU()).eval()\n"
                      "    return m, (torch.randn(batch, 3, 32, 32),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "seed.json"
    assert main(["analyze", "seed_model:build", "--dtype", "fp32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    s = 1 * 16 * 32 * 32 * 4                       # the conv output, float32
    assert data["unfused"]["kernel_launches"] == 3 and data["fused"]["kernel_launches"] == 1
    bn_parameters, folded_bias = 4 * 16 * 4, 16 * 4
    assert data["unfused"]["total_bytes"] - data["fused"]["total_bytes"] == 4 * s + bn_parameters - folded_bias
    printed = capsys.readouterr().out
    for row in ("bytes read", "bytes written", "total traffic", "kernel launches", "peak intermediate memory",
                "compute density", "predicted time"):
        assert row in printed


def test_tables_piped_to_a_file_are_not_wrapped_at_80_columns(monkeypatch, capsys):
    """Redirected output (capsys is not a terminal) gets wide tables, so the same report takes far fewer lines
    than at 80 columns, which COLUMNS (the user's width) still asks for."""
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["analyze", "resnet18", "--refused", "3", "--ops", "0"]) == 0
    wide = capsys.readouterr().out.splitlines()
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["analyze", "resnet18", "--refused", "3", "--ops", "0"]) == 0
    narrow = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in wide) > 80 >= max(len(line) for line in narrow)
    assert len(wide) < 0.75 * len(narrow), (len(wide), len(narrow))


def test_refused_fusions_are_capped_unless_asked_for_all(capsys):
    assert main(["analyze", "resnet18", "--refused", "3", "--ops", "0"]) == 0
    printed = capsys.readouterr().out
    assert "more refusals not shown (--refused all" in printed
    assert main(["analyze", "resnet18", "--refused", "all", "--ops", "0"]) == 0
    assert "more refusals not shown" not in capsys.readouterr().out


def test_refusals_and_groups_through_pytorch_carry_their_codes(monkeypatch, capsys, tmp_path):
    """conv -> relu -> logcumsumexp (opaque) -> sigmoid -> + relu: the JSON and the printed tables give each refusal and
    each group run through PyTorch its code (`opfuse.fusion.reasons`) beside the words."""
    (tmp_path / "opaque_model.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv2d(3, 8, 3, padding=1)\n"
        "    def forward(self, x):\n"
        "        y = torch.relu(self.conv(x))\n"
        "        return torch.sigmoid(torch.logcumsumexp(y, 1)) + y\n"
        "def build(batch=1):\n"
        "    torch.manual_seed(0)\n"
        "    return M().eval(), (torch.randn(batch, 3, 8, 8),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "opaque.json"
    assert main(["analyze", "opaque_model:build", "--dtype", "fp32", "--json", str(out), "--ops", "0"]) == 0
    data = json.loads(out.read_text())
    codes = {(d["verdict"], d["code"]) for d in data["plan"]["decisions"]}
    assert codes == {("fused", "fused"), ("illegal", "opaque"), ("illegal", "several-users")}
    (through,) = data["pytorch_groups"].values()
    assert through["code"] == "opaque" and "logcumsumexp" in through["reason"]
    printed = capsys.readouterr().out
    assert "several-users" in printed                              # the refused table's code column
    assert f"{through['reason']} (opaque)" in printed               # the groups run through PyTorch


def test_analyze_captures_a_model_in_the_compute_dtype_as_bench_compiles_it(monkeypatch, tmp_path):
    """A model whose code depends on its dtype (transformers' T5 clamps float16 activations) is planned as
    `opfuse bench` runs it: in the compute dtype, not captured in float32 and cast afterwards."""
    (tmp_path / "dtype_model.py").write_text(
        "import torch, torch.nn as nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        h = self.fc(x)\n"
        "        if h.dtype == torch.float16:\n"
        "            h = torch.clamp(h, -100.0, 100.0)\n"
        "        return torch.tanh(h)\n"
        "def build(batch=1):\n"
        "    torch.manual_seed(0)\n"
        "    return M().eval(), (torch.randn(batch, 8),)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for dtype, clamps in (("fp16", 1), ("fp32", 0)):
        out = tmp_path / f"{dtype}.json"
        assert main(["analyze", "dtype_model:build", "--dtype", dtype, "--json", str(out), "--ops", "0"]) == 0
        ops = [node for group in json.loads(out.read_text())["plan"]["groups"] for node in group["nodes"]]
        assert sum(1 for n in ops if n.startswith("clamp")) == clamps, (dtype, ops)


def test_analyze_decode_reports_a_decode_step_bytes_launches_and_floor(tmp_path, capsys):
    """`opfuse analyze llama-tiny --decode`: the decode step of the built-in decoder (one token for each of --batch
    rows over a cache of --max-seq positions), with its bytes per step, launches and bandwidth floor; another model
    is a one-line error naming the built-in decoders."""
    import torch

    from opfuse.bench.generation import llama

    out = tmp_path / "decode.json"
    assert main(["analyze", "llama-tiny", "--decode", "--batch", "2", "--max-seq", "64", "--dtype", "fp32",
                 "--json", str(out)]) == 0
    assert "Decode step at cache position 63" in capsys.readouterr().out
    decode = json.loads(out.read_text())["decode"]
    weights = sum(p.numel() * 4 for p in llama("llama-tiny", "cpu", torch.float32).parameters())
    assert weights <= decode["weight_bytes"] < weights + 1024     # and small constants: rope's, the mask's range
    per_position = 2 * 2 * 2 * 2 * 16 * 4       # k and v, 2 layers, 2 rows, 2 kv heads, head dim 16, float32
    assert decode["cache_bytes_read"] == per_position * 64 == decode["cache_bytes_needed"]
    assert decode["tokens_per_step"] == 2 and decode["launches"] >= 1 and decode["measured_s"] is None
    kinds = decode["by_kind"]       # where the step's launches and bytes go, by kind of kernel
    assert sum(k["launches"] for k in kinds.values()) == decode["launches"]
    assert sum(k["bytes"] for k in kinds.values()) == decode["plan_bytes"]
    assert kinds["GEMMs"]["bytes"] > 0.7 * decode["plan_bytes"] and kinds["attention"]["launches"] == 2
    assert main(["analyze", "resnet18", "--decode"]) != 0
    assert "--decode analyzes a built-in decoder" in capsys.readouterr().err
