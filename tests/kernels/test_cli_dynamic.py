"""`opfuse compile MODEL --dynamic batch=1:4,...`: every bucket of the ranges compiled into one package, which loads
and serves sizes between them (interpreter, a tiny factory model)."""

import json

import pytest
import torch

import opfuse
from opfuse.cli import EXIT_USAGE, main
from opfuse.cli_package import dynamic_dims, dynamic_list

FACTORY = """
import torch

class Tokens(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 8)
        self.proj = torch.nn.Linear(8, 3)

    def forward(self, ids):
        return torch.relu(self.proj(self.embed(ids)))

def make(batch=1):
    torch.manual_seed(0)
    return Tokens().eval(), (torch.randint(0, 10, (batch, 5)),)
"""


def test_dynamic_specs_read_conventional_and_placed_dims():
    assert dynamic_list("batch=1:64, seq=1:512") == [("batch", 1, 64, None), ("seq", 1, 512, None)]
    assert dynamic_list("len=2:80@0.2+1.1") == [("len", 2, 80, [(0, 2), (1, 1)])]
    image, mask = torch.zeros(2, 3, 8, 8), torch.zeros(2, 8)
    dims = dynamic_dims(dynamic_list("batch=1:8,seq=1:8"), [image, mask])
    assert [d.uses for d in dims] == [((0, 0), (1, 0)), ((0, 1), (1, 1))]


@pytest.mark.parametrize("spec", ["seq", "batch=0:4", "batch=4:2", "foo=1:4", "batch=1:4,batch=1:8", "x=1:2@0"])
def test_a_dynamic_spec_it_cannot_read_is_a_usage_error(spec, tmp_path):
    with pytest.raises(SystemExit) as raised:
        main(["compile", "resnet18", "-o", str(tmp_path / "x.opfuse"), "--dynamic", spec])
    assert raised.value.code == EXIT_USAGE


def test_compile_dynamic_writes_every_bucket_and_the_package_serves_the_range(tmp_path):
    (tmp_path / "dynamic_tokens.py").write_text(FACTORY)
    out, info = tmp_path / "tokens.opfuse", tmp_path / "info.json"
    code = main(["compile", f"{tmp_path / 'dynamic_tokens.py'}:make", "-o", str(out), "--batch", "2",
                 "--dynamic", "batch=1:4,seq=2:5", "--dtype", "fp32", "--quiet", "--json", str(info)])
    assert code == 0
    data = json.loads(info.read_text())
    assert sorted(map(tuple, data["sizes"])) == [(b, s) for b in (1, 2, 4) for s in (2, 4, 5)]
    loaded = opfuse.load(out, sha256=data["sha256"])
    assert [d.name for d in loaded.dims] == ["batch", "seq"]
    namespace = {}
    exec(FACTORY, namespace)
    model, _ = namespace["make"]()
    for shape in ((3, 3), (1, 5), (4, 2)):
        ids = torch.randint(0, 10, shape)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-4, atol=1e-5)


def test_analyze_dynamic_plans_every_bucket_and_says_what_pads(tmp_path):
    (tmp_path / "dynamic_tokens.py").write_text(FACTORY)
    info = tmp_path / "analysis.json"
    code = main(["analyze", f"{tmp_path / 'dynamic_tokens.py'}:make", "--batch", "2", "--dynamic", "batch=1:4,seq=2:5",
                 "--dtype", "fp32", "--quiet", "--json", str(info)])
    assert code == 0
    buckets = json.loads(info.read_text())["buckets"]
    assert [tuple(b["sizes"]) for b in buckets] == [(b, s) for b in (1, 2, 4) for s in (2, 4, 5)]
    assert all(b["launches"] >= 1 and b["predicted_s"] > 0 for b in buckets)
    assert buckets[-1]["padding"] == {"batch": "pads", "seq": "pads"}       # token by token: both dims pad
    assert buckets[-1]["bytes"] > buckets[0]["bytes"]
