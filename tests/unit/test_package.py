"""Packages (opfuse.save / opfuse.load, `opfuse.runtime.package`) through Triton's interpreter, on tiny models.

A loaded package computes bit for bit what the compiled model it was saved from computes, and rebuilds it without
capture, planning or tuning; a corrupted, truncated or foreign file, a version mismatch or a changed code generator
is refused naming the file and the problem, and a failed save leaves nothing half-written; two processes load one
package at once. Several batch sizes: the smallest that holds a call's batch runs it, padded.
"""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import opfuse
from opfuse.ir.graph import Graph, GraphError, TensorType
from opfuse.runtime.package import MANIFEST, WEIGHTS, PackageError
from opfuse.runtime.profile_format import encode_graph
from tests.package_tools import rewrite, with_manifest

ROOT = Path(__file__).resolve().parents[2]


class TinyConvNet(torch.nn.Module):
    """Conv + BN + ReLU, a residual add, a pooled head: nested outputs, several kernel kinds."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 1)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.relu(self.conv2(y) + y)
        return {"logits": self.head(y.mean((2, 3))), "features": (y,)}


class TinyEncoder(torch.nn.Module):
    """Integer token ids in, shifted by their row's int64 product times 0 (a product of integers, which a kernel's
    float32 products cannot hold exactly: it runs through PyTorch), then embedding, layer norm, linear, softmax."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, ids):
        return torch.softmax(self.proj(self.norm(self.embed(ids + ids.prod(-1, keepdim=True) * 0 + 1))), -1)


def convnet():
    torch.manual_seed(0)
    model = TinyConvNet().eval()
    with torch.no_grad():        # BN statistics unlike the identity, so folding it changes the weights
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 2.0)
    return model


def images(batch, seed=1):
    return torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


def leaves(output):
    return torch.utils._pytree.tree_flatten(output)[0]


def assert_identical(a, b):
    assert torch.utils._pytree.tree_structure(a) == torch.utils._pytree.tree_structure(b)
    for x, y in zip(leaves(a), leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x, y), (x - y).abs().max()


@pytest.fixture(scope="module")
def compiled_convnet():
    """Compiled, then given other forms than each anchor kernel's default, as tuning on a GPU may choose (the anchor
    through PyTorch's library with its flat generated epilogue, the group unfused): the package must carry the
    chosen configs and forms, not fall back on the defaults."""
    from opfuse.codegen.forms import is_flat, is_library, is_unfused

    compiled = opfuse.compile(convnet(), (images(2),))
    anchors = [(group, kernel) for group, kernel in compiled.compiled.kernels.items() if kernel.alternatives()]
    assert len(anchors) >= 2
    (first, library), (second, unfused) = anchors[:2]
    compiled.compiled.set_configs({first: next(c for c in library.alternatives() if is_library(c) and is_flat(c)),
                                   second: next(c for c in unfused.alternatives() if is_unfused(c))})
    return compiled


@pytest.fixture(scope="module")
def package(compiled_convnet, tmp_path_factory):
    return opfuse.save(compiled_convnet, tmp_path_factory.mktemp("pkg") / "convnet.opfuse")


# ---- round trip --------------------------------------------------------------------------------------------

def test_a_loaded_package_is_bit_identical_to_the_compiled_model(compiled_convnet, package):
    loaded = opfuse.load(package)
    for seed in (1, 2):
        x = images(2, seed)
        assert_identical(loaded(x), compiled_convnet(x))
    assert len(loaded.compiled_for().kernels) == len(compiled_convnet.compiled.kernels) > 0
    assert loaded.compiled_for().configs == compiled_convnet.compiled.configs


def test_loading_captures_plans_and_tunes_nothing(package, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("load must not capture, plan or tune")

    import opfuse.api
    import opfuse.fusion.planner
    import opfuse.runtime.compiled

    for module, name in ((opfuse.api, "capture"), (opfuse.api, "analyze"), (opfuse.fusion.planner, "plan_fusion"),
                         (opfuse.runtime.compiled, "tune")):
        monkeypatch.setattr(module, name, forbidden)
    loaded = opfuse.load(package)
    assert leaves(loaded(images(2)))[0].shape == (2, 4)


def test_the_package_holds_versions_plan_sources_configs_and_weights(compiled_convnet, package):
    import triton
    from safetensors.torch import load as load_safetensors

    with zipfile.ZipFile(package) as archive:
        manifest = json.loads(archive.read(MANIFEST))
        profile = json.loads(archive.read(manifest["profiles"][0]["file"]))
        weights = load_safetensors(archive.read(WEIGHTS))
    assert manifest["torch"] == torch.__version__ and manifest["triton"] == triton.__version__
    assert manifest["opfuse"] == opfuse.__version__ and manifest["device"] == "cpu"
    kernels = compiled_convnet.compiled.kernels
    assert {g: k["source"] for g, k in profile["kernels"].items()} == {g: k.source for g, k in kernels.items()}
    assert len(profile["groups"]) == len(compiled_convnet.plan.groups)
    graph = compiled_convnet.plan.graph
    assert set(profile["graph"]["constants"]) == set(graph.constants)
    for name, entry in profile["graph"]["constants"].items():
        assert torch.equal(weights[entry["key"]], graph.constants[name])
    with zipfile.ZipFile(package) as archive:       # the interpreter compiles no binaries
        assert not [name for name in archive.namelist() if name.startswith("triton/")]


def test_restored_binaries_land_in_their_private_folder_with_their_index_pointing_there(tmp_path):
    from opfuse.runtime.binaries import check_binaries, restore_binaries

    key = "A" * 52
    index = {"child_paths": {"k.json": f"/elsewhere/{key}/k.json", "k.cubin": f"/elsewhere/{key}/k.cubin",
                             "k.ptx": f"/elsewhere/{key}/k.ptx"}}
    files = {f"{key}/__grp__k.json": json.dumps(index).encode(), f"{key}/k.json": b'{"name": "k"}',
             f"{key}/k.cubin": b"\x7fELF"}
    check_binaries(files)
    folder = tmp_path / "package" / key
    assert restore_binaries(files, tmp_path / "package") == 3
    assert (folder / "k.cubin").read_bytes() == b"\x7fELF"
    assert json.loads((folder / "__grp__k.json").read_text())["child_paths"] == {     # the ptx did not travel
        "k.json": str(folder / "k.json"), "k.cubin": str(folder / "k.cubin")}
    assert restore_binaries(files, tmp_path / "package") == 0           # already there: kept, not rewritten
    assert sorted(p.name for p in folder.iterdir()) == ["__grp__k.json", "k.cubin", "k.json"]   # no temp files


def test_a_binary_entry_naming_a_path_outside_the_cache_is_refused(package, tmp_path, monkeypatch):
    """A member "triton/../x" would be written outside the package's folder: refused, nothing written, even where
    the manifest lists it."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    evil = rewrite(package, tmp_path / "evil.opfuse", add={"triton/../outside.txt": b"x"})
    with pytest.raises(PackageError, match="evil.opfuse.*not a folder/file name"):
        opfuse.load(evil, "cpu")
    assert not (tmp_path / "outside.txt").exists()
    unlisted = rewrite(package, tmp_path / "unlisted.opfuse", add={"triton/../outside.txt": b"x"}, sign=False)
    with pytest.raises(PackageError, match="not listed in manifest.json"):
        opfuse.load(unlisted, "cpu")


def test_a_package_of_one_model_takes_exactly_its_shapes(tmp_path):
    """Nobody declared a batch: dim 0 may be tokens, and padding a (4, 3) softmax over dim 0 would change it."""
    class Tokens(torch.nn.Module):
        def forward(self, x):
            return x.softmax(0) * 2.0

    compiled = opfuse.compile(Tokens(), (torch.randn(4, 3),), opfuse.FusionConfig(dtype="float32"))
    opfuse.save(compiled, tmp_path / "tokens.opfuse")
    loaded = opfuse.load(tmp_path / "tokens.opfuse", "cpu")
    assert loaded.batch_sizes == []
    with pytest.raises(GraphError, match="compiled for"):
        loaded(torch.randn(2, 3))


def test_integer_inputs_and_groups_run_through_pytorch_round_trip(tmp_path):
    torch.manual_seed(0)
    ids = torch.randint(0, 10, (2, 3), generator=torch.Generator().manual_seed(3))
    compiled = opfuse.compile(TinyEncoder().eval(), (ids,))
    assert compiled.fallbacks      # the int64 product runs through PyTorch: its reason travels with the package
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "encoder.opfuse"))
    assert_identical(loaded(ids), compiled(ids))
    assert loaded.compiled_for().fallbacks == compiled.compiled.fallbacks


def test_a_split_k_plan_round_trips_and_its_kernels_run_the_saved_slices(tmp_path):
    """The planner's K slices per tile (`FusionGroup.split_k`) travel with the plan: the loaded kernels split as the
    saved ones did, and compute the same bits."""
    from opfuse.codegen.split_k import slices_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(600, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)).eval()
    x = torch.randn(2, 600)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(autotune=False))
    (group,) = [g for g in compiled.plan.groups if g.split_k]
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "split.opfuse")).compiled_for()
    assert [g.split_k for g in loaded.plan.groups] == [g.split_k for g in compiled.plan.groups]
    assert loaded.kernels[group.name].configs() == compiled.compiled.kernels[group.name].configs()
    kernel = loaded.kernels[group.name]
    assert slices_of(kernel.configs()[0]) > 1 and kernel.launches() == 1     # the interpreter's tile splits, as planned
    assert_identical(loaded(x), compiled(x))


def test_a_group_blocked_config_round_trips_and_runs_its_blocks(tmp_path):
    """A grouped conv tuned to compute several conv groups a program (BLOCK_G): the loaded model runs that config
    (packing its block-diagonal weight again) and computes the same bits."""
    from opfuse.codegen.conv_implicit_gemm import ConvKernel, group_block_of

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(10, 10, 3, padding=1, groups=5), torch.nn.ReLU()).eval()
    x = torch.randn(1, 10, 5, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(autotune=False))
    (name,) = [g for g, k in compiled.compiled.kernels.items() if isinstance(k, ConvKernel)]
    blocked = next(c for c in compiled.compiled.kernels[name].configs() if group_block_of(c) > 1)
    compiled.compiled.set_configs({name: blocked})
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "grouped.opfuse")).compiled_for()
    assert loaded.configs[name] == blocked and group_block_of(loaded.configs[name]) == 5
    assert list(loaded.kernels[name]._packed) == [5]      # set_configs packed the blocked form's weight, only it
    assert_identical(loaded(x), compiled(x))


# ---- refusals ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("what", ["torch", "triton", "gpu", "opfuse"])
def test_a_version_mismatch_is_refused_naming_it(package, tmp_path, what):
    foreign = with_manifest(package, tmp_path / "foreign.opfuse", **{what: "0.0.1-elsewhere"})
    with pytest.raises(PackageError) as raised:
        opfuse.load(foreign)
    message = str(raised.value)
    assert str(foreign) in message and f"{what} 0.0.1-elsewhere" in message and "recompile=True" in message


def test_recompile_builds_the_saved_plan_again(compiled_convnet, package, tmp_path):
    foreign = with_manifest(package, tmp_path / "foreign.opfuse", triton="0.0.1-elsewhere")
    loaded = opfuse.load(foreign, recompile=True)
    assert "triton 0.0.1-elsewhere" in loaded.rebuilt_because
    x = images(2, 5)
    for got, want in zip(leaves(loaded(x)), leaves(compiled_convnet(x))):
        torch.testing.assert_close(got, want)


def test_a_package_of_another_format_is_refused(package, tmp_path):
    newer = with_manifest(package, tmp_path / "newer.opfuse", format=99)
    with pytest.raises(PackageError, match="format 99"):
        opfuse.load(newer)


def test_a_truncated_package_is_refused(package, tmp_path):
    data = package.read_bytes()
    truncated = tmp_path / "truncated.opfuse"
    truncated.write_bytes(data[:len(data) // 2])
    with pytest.raises(PackageError, match="truncated or corrupted") as raised:
        opfuse.load(truncated)
    assert str(truncated) in str(raised.value)


def test_a_corrupted_package_is_refused(package, tmp_path):
    data = bytearray(package.read_bytes())
    with zipfile.ZipFile(package) as archive:
        info = archive.getinfo(WEIGHTS)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)   # the member's stored bytes
    data[start + info.compress_size // 2] ^= 0xFF
    corrupted = tmp_path / "corrupted.opfuse"
    corrupted.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="corrupted") as raised:
        opfuse.load(corrupted)
    assert str(corrupted) in str(raised.value) and WEIGHTS in str(raised.value)


def test_a_file_that_is_no_package_is_refused(tmp_path):
    text = tmp_path / "notes.opfuse"
    text.write_text("not a package")
    with pytest.raises(PackageError, match="not a readable opfuse package"):
        opfuse.load(text)
    with pytest.raises(PackageError, match="no such package file"):
        opfuse.load(tmp_path / "missing.opfuse")


def test_a_kernel_this_opfuse_generates_differently_is_refused(package, tmp_path):
    def edit(name, data):
        if not name.startswith("profile-"):
            return data
        profile = json.loads(data)
        group = sorted(profile["kernels"])[0]
        profile["kernels"][group]["source"] += "\n# edited\n"
        return json.dumps(profile).encode()

    changed = rewrite(package, tmp_path / "changed.opfuse", edit)
    with pytest.raises(PackageError, match="code generation changed"):
        opfuse.load(changed)


def test_a_failed_save_leaves_the_old_package_and_no_temp_file(compiled_convnet, package, tmp_path, monkeypatch):
    target = tmp_path / "model.opfuse"
    target.write_bytes(package.read_bytes())
    before = target.read_bytes()
    written = zipfile.ZipFile.writestr

    def fail_on_weights(self, name, data, *args, **kwargs):
        if getattr(name, "filename", name) == WEIGHTS:
            raise OSError("disk full")
        return written(self, name, data, *args, **kwargs)

    monkeypatch.setattr(zipfile.ZipFile, "writestr", fail_on_weights)
    with pytest.raises(OSError, match="disk full"):
        opfuse.save(compiled_convnet, target)
    assert target.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.opfuse"]


def test_save_refuses_an_op_that_calls_back_into_python(tmp_path):
    graph = Graph("g")
    graph.add_input("x", TensorType((2,), "float32"))
    graph.add_node("opaque", ["x"], TensorType((2,), "float32"), {"target": "aten.cumsum", "fn": lambda xs: xs[0]},
                   name="cumsum")
    with pytest.raises(PackageError, match=r"node cumsum \[opaque\] attribute 'fn' is a Python function"):
        encode_graph(graph, {})


def test_save_refuses_what_compile_did_not_compile(tmp_path):
    from opfuse.compiler import EagerFallback

    with pytest.raises(PackageError, match="compiling failed: it broke"):
        opfuse.save(EagerFallback(torch.nn.ReLU(), "it broke"), tmp_path / "x.opfuse")


# ---- two processes -------------------------------------------------------------------------------------------

LOADER = """
import sys, torch, opfuse
loaded = opfuse.load(sys.argv[1])
x, expected = torch.load(sys.argv[2])
got = loaded(x)
assert torch.equal(got["logits"], expected["logits"]) and torch.equal(got["features"][0], expected["features"][0])
print("identical")
"""


def test_two_processes_load_one_package_at_once(compiled_convnet, package, tmp_path):
    x = images(2, 7)
    reference = tmp_path / "reference.pt"
    torch.save((x, compiled_convnet(x)), reference)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), OPFUSE_KERNEL_DIR=str(tmp_path / "kernels"))
    processes = [subprocess.Popen([sys.executable, "-c", LOADER, str(package), str(reference)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for process in processes:
        out, err = process.communicate(timeout=240)
        assert process.returncode == 0, err[-2000:]
        assert out.strip().endswith("identical")


# ---- several batch sizes -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def batches_package(tmp_path_factory):
    model = convnet()
    one, three = (opfuse.compile(model, (images(b),)) for b in (1, 3))
    path = opfuse.save([three, one], tmp_path_factory.mktemp("batches") / "convnet.opfuse")
    return path, {1: one, 3: three}


def test_each_batch_size_held_runs_unpadded_and_bit_identical(batches_package):
    path, compiled = batches_package
    loaded = opfuse.load(path)
    assert loaded.batch_sizes == [1, 3]
    for batch, model in compiled.items():
        x = images(batch, 11)
        assert loaded.compiled_for(batch) is not None
        assert_identical(loaded(x), model(x))


def test_a_smaller_batch_runs_on_the_smallest_size_that_holds_it_padded(batches_package):
    path, compiled = batches_package
    loaded = opfuse.load(path)
    assert loaded.compiled_for(2) is loaded.compiled_for(3) is not loaded.compiled_for(1)
    x = images(2, 12)
    padded = torch.cat([x, x[-1:]])               # padded with copies of the last row, then cut back
    want = compiled[3](padded)
    got = loaded(x)
    assert leaves(got)[0].shape[0] == 2 and leaves(got)[1].shape[0] == 2
    for g, w in zip(leaves(got), leaves(want)):
        assert torch.equal(g, w[:2])
    with torch.no_grad():
        eager = convnet()(x)
    for g, e in zip(leaves(got), leaves(eager)):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-4)


def test_a_batch_larger_than_every_size_held_is_refused(batches_package):
    path, _ = batches_package
    loaded = opfuse.load(path)
    with pytest.raises(GraphError, match=r"batch 4 is larger than the largest batch size .* \(3; it holds 1, 3\)"):
        loaded(images(4))
    with pytest.raises(GraphError, match=r"input 0 has 5 along dim 2, which is fixed at 6: only batch \(input 0 "
                                         r"dim 0\) may vary"):
        loaded(torch.randn(2, 3, 5, 5))


def test_save_refuses_models_that_are_not_one_model_at_several_batch_sizes(compiled_convnet, batches_package,
                                                                           tmp_path):
    _, compiled = batches_package
    with pytest.raises(PackageError, match="same batch size"):
        opfuse.save([compiled[1], compiled[1]], tmp_path / "twice.opfuse")
    ids = torch.zeros(3, 3, dtype=torch.long)
    encoder = opfuse.compile(TinyEncoder().eval(), (ids,))
    with pytest.raises(PackageError, match="not model 0 at another batch size"):
        opfuse.save([compiled_convnet, encoder], tmp_path / "mixed.opfuse")
    assert list(tmp_path.iterdir()) == []


# ---- the command line ----------------------------------------------------------------------------------------

FACTORY = """
import torch

def make(batch=1):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 2))
    return model.eval(), (torch.randn(batch, 3, 6, 6),)
"""


def test_opfuse_compile_writes_a_package_of_several_batch_sizes(tmp_path):
    from opfuse.cli import main

    (tmp_path / "tiny.py").write_text(FACTORY)
    out = tmp_path / "tiny.opfuse"
    code = main(["compile", f"{tmp_path / 'tiny.py'}:make", "-o", str(out), "--batches", "2,1", "--dtype", "fp32",
                 "--quiet", "--json", str(tmp_path / "info.json")])
    assert code == 0
    info = json.loads((tmp_path / "info.json").read_text())
    assert info["batch_sizes"] == [1, 2]
    loaded = opfuse.load(out, sha256=info["sha256"])      # what compile printed pins the file it wrote
    assert loaded.batch_sizes == [1, 2]
    sys.path.insert(0, str(tmp_path))
    try:
        from tiny import make
    finally:
        sys.path.remove(str(tmp_path))
    model, _ = make()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images(2)), model(images(2)), rtol=1e-4, atol=1e-4)


def test_opfuse_bench_of_a_package_needs_a_gpu(package, capsys):
    from opfuse.cli import EXIT_NEEDS_GPU, main

    assert main(["bench", str(package)]) == EXIT_NEEDS_GPU
    assert "needs an NVIDIA GPU" in capsys.readouterr().err
