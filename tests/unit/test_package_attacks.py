"""A package is untrusted input (SECURITY.md): the attacks of issue 53, each refused with a PackageError before any
code of the package runs and before anything is written (no kernel module generated, nothing in opfuse's cache),
and the kernel folder (tests/unit/test_kernel_folder.py).

Every crafted package is signed again (`tests.package_tools.rewrite`): anyone who can write a package can make its
manifest's sizes and sha256s match, so each test reaches the check it means to reach.
"""

import json
import zipfile

import pytest
import torch

import opfuse
from opfuse.runtime.package import MANIFEST, WEIGHTS, PackageError, file_sha256
from tests.package_tools import edit_profile, rewrite

INJECTED = "1 + 0*__import__('os').system('touch {marker}')"


class PoolNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.head = torch.nn.Linear(4 * 3 * 3, 2)

    def forward(self, x):
        y = torch.nn.functional.max_pool2d(torch.relu(self.conv(x)), 2)
        return self.head(y.flatten(1))


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    torch.manual_seed(0)
    compiled = opfuse.compile(PoolNet().eval(), (torch.randn(2, 3, 6, 6),), opfuse.FusionConfig(dtype="float32"))
    return opfuse.save(compiled, tmp_path_factory.mktemp("pkg") / "pool.opfuse")


@pytest.fixture
def clean(tmp_path, monkeypatch):
    """A fresh kernel folder and cache home: what a refused load must leave empty."""
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    yield tmp_path
    for folder in ("kernels", "cache", "triton"):
        written = list((tmp_path / folder).rglob("*")) if (tmp_path / folder).exists() else []
        assert not written, f"a refused load wrote {written}"


def refused(path, match, **kwargs):
    with pytest.raises(PackageError, match=match) as raised:
        opfuse.load(path, "cpu", **kwargs)
    assert str(path) in str(raised.value)
    return raised.value


def pool_node(profile):
    return next(n for n in profile["graph"]["nodes"] if n["op"] == "max_pool2d")


def test_the_untouched_package_loads(package, tmp_path, monkeypatch):
    """The control: what the attacks start from loads (and writes its kernels, which `clean` forbids the others)."""
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))
    x = torch.randn(2, 3, 6, 6)
    assert opfuse.load(package, "cpu")(x).shape == (2, 2)


def test_a_crafted_attribute_is_refused_before_any_code_is_generated(package, clean):
    """Issue 53, attack 1: a max-pool dilation that is Python source, which the pool template pasted into the kernel."""
    marker = clean / "pwned"

    def craft(profile):
        pool_node(profile)["attrs"]["dilation"] = ["1", INJECTED.format(marker=marker)]
    crafted = edit_profile(package, clean / "crafted.opfuse", craft)
    error = refused(crafted, r"\[max_pool2d\].*'dilation'.*must be an integer")
    assert "graph.nodes" in str(error)
    assert not marker.exists()


@pytest.mark.parametrize("change, match", [
    (lambda p: pool_node(p)["attrs"].update(padding={"tuple": [1.0, 1.0]}), "must be an integer, not float"),
    (lambda p: pool_node(p)["attrs"].update(ceil_mode=1), "must be True or False"),
    (lambda p: pool_node(p)["attrs"].update(code="x"), "does not take"),
    (lambda p: pool_node(p).update(op="opaque"), "not an op a package can hold"),
    (lambda p: pool_node(p).update(shape=["2", 4, 3, 3]), "expected a shape"),
    (lambda p: pool_node(p).update(name="p; import os"), "expected a name"),
    (lambda p: pool_node(p)["inputs"].append("later"), "which no node before it defines"),
    (lambda p: p["graph"]["nodes"].insert(0, dict(pool_node(p))), "which no node before it defines"),
    (lambda p: p.update(output_spec=json.dumps([1, {"type": "builtins.tuple", "context": json.dumps(
        {"__enum__": True, "fqn": "antigravity:X", "name": "A"}), "children_spec": []}])), "names an enum"),
    (lambda p: p.update(output_spec=json.dumps([1, {"type": "os.Thing", "context": "null",
                                                    "children_spec": []}])), "not one this process knows"),
    (lambda p: p["configs"][sorted(p["configs"])[0]].update(num_warps=3), "is not a kernel config"),
    (lambda p: p["configs"][sorted(p["configs"])[0]].update(params=[["BLOCK_M", "64"]]), "expected an integer"),
    (lambda p: p["groups"][0].update(nodes=["nowhere"]), "no node of the graph"),
    (lambda p: p["config"].update(dtype="float16; rm"), "expected a dtype"),
    (lambda p: p.update(extra=1), "field 'extra'"),
])
def test_any_value_of_a_profile_that_is_not_what_its_place_holds_is_refused(package, clean, change, match):
    refused(edit_profile(package, clean / "crafted.opfuse", change), match)


def test_a_config_that_is_not_one_of_its_kernels_own_is_refused(package, tmp_path, monkeypatch):
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))

    def change(profile):
        group = next(g for g, c in profile["configs"].items() if c["form"] == "triton")
        profile["configs"][group]["params"] = [["BLOCK_M", 4096], ["BLOCK_N", 4096]]
    refused(edit_profile(package, tmp_path / "odd.opfuse", change), "is not one of its kernel's")


def test_machine_local_settings_of_a_package_are_not_taken(package, tmp_path, monkeypatch):
    """A package's config naming folders (its cache_dir, debug_dir) would make this machine write there."""
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))

    def change(profile):
        profile["config"].update(cache_dir=str(tmp_path / "planted"), debug_dir=str(tmp_path / "planted"),
                                 compile_workers=64, memory_limit=1)
    loaded = opfuse.load(edit_profile(package, tmp_path / "local.opfuse", change), "cpu")
    config = loaded.compiled_for().config
    assert (config.cache_dir, config.debug_dir, config.compile_workers, config.memory_limit) == (None,) * 4


@pytest.mark.parametrize("member, data, match", [
    ("triton/" + "A" * 52 + "/__triton_launcher.cpython-311-x86_64-linux-gnu.so", b"\x7fELF", "not a folder/file"),
    ("triton/" + "A" * 52 + "/k.py", b"import os", "not a folder/file"),
    ("triton/" + "A" * 52 + "/k.cubin", b"#!/bin/sh", "not a cubin"),
    ("triton/" + "A" * 52 + "/k.json", b'{"name": "k\\"); system(\\"id"}', "not plain text"),
    ("triton/" + "A" * 52 + "/k.json", b'{"a b": 1}', "not a name"),
    ("triton/" + "A" * 52 + "/__grp__k.json", b'{"child_paths": {"../k.so": "/x"}}', "child_paths"),
    ("triton/../k.cubin", b"\x7fELF", "not a folder/file"),
])
def test_host_code_and_anything_else_but_device_code_among_the_binaries_is_refused(package, clean, member, data,
                                                                                   match):
    """Issue 53, attack 2: a package planted a launcher module in Triton's cache, which a later compile imported."""
    refused(rewrite(package, clean / "planted.opfuse", add={member: data}), match)


def test_swapped_weights_are_refused(package, clean):
    """Issue 53, attack 4: other weights under the same keys, with valid CRCs, computed other outputs."""
    from safetensors.torch import load as load_safetensors
    from safetensors.torch import save as save_safetensors

    def swap(name, data):
        if name != WEIGHTS:
            return data
        weights = load_safetensors(data)
        key = next(iter(weights))
        weights[key] = weights[key] + 1.0
        return save_safetensors(weights)
    refused(rewrite(package, clean / "swapped.opfuse", swap), "does not hold the tensor its key names")


def test_a_weight_of_another_shape_or_layout_than_its_node_is_refused(package, clean):
    def change(profile):
        name, entry = next(iter(profile["graph"]["constants"].items()))
        entry["stride"] = [0] * len(entry["stride"])
    refused(edit_profile(package, clean / "strided.opfuse", change), "not a dense layout")


def test_a_member_that_inflates_past_the_limit_is_refused_unread(package, clean, monkeypatch):
    """Issue 53, attack 5: a 1 MB package that inflated to 1 GB was read whole. Here 64 MiB of zeros in 64 KiB."""
    bomb = clean / "bomb.opfuse"
    member = "triton/" + "B" * 52 + "/k.json"
    rewrite(package, bomb, add={member: b"\0" * (64 << 20)})
    assert bomb.stat().st_size < package.stat().st_size + (1 << 20)
    read = zipfile.ZipExtFile.read

    def never_the_bomb(self, n=-1):
        assert self.name != member, "the bomb was read"
        return read(self, n)
    monkeypatch.setattr(zipfile.ZipExtFile, "read", never_the_bomb)
    refused(bomb, "would inflate from .* over 100 times")


def test_a_member_larger_than_the_manifest_says_is_refused(package, clean):
    def grow(name, data):
        return data + b" " * 10 if name == "profile-0.json" else data
    refused(rewrite(package, clean / "grown.opfuse", grow, sign=False), "manifest.json says")


def test_a_manifest_without_profiles_or_with_a_bad_field_is_refused(package, clean):
    def drop(field):
        def edit(name, data):
            return json.dumps({k: v for k, v in json.loads(data).items() if k != field}).encode() \
                if name == MANIFEST else data
        return edit
    refused(rewrite(package, clean / "noprofiles.opfuse", drop("profiles")), "'profiles' of a Manifest is missing")

    def empty(name, data):
        return json.dumps(json.loads(data) | {"profiles": []}).encode() if name == MANIFEST else data
    refused(rewrite(package, clean / "empty.opfuse", empty), "lists no profiles")


def test_a_pinned_hash_refuses_any_other_file_before_reading_it(package, clean, monkeypatch):
    digest = file_sha256(package)
    other = rewrite(package, clean / "other.opfuse")      # the same model, repacked: another file
    assert file_sha256(other) != digest

    def no_zip(*args, **kwargs):
        raise AssertionError("the zip was opened")
    with monkeypatch.context() as patch:
        patch.setattr(zipfile, "ZipFile", no_zip)
        refused(other, "pinned to: refused before reading it", sha256=digest)
    refused(package, "64 hex digits", sha256="abc")


def test_a_pinned_hash_loads_its_file(package, tmp_path, monkeypatch):
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(tmp_path / "kernels"))
    assert opfuse.load(package, "cpu", sha256=file_sha256(package).upper()).batch_sizes == []


def test_loading_on_a_gpu_this_machine_lacks_is_a_package_error(package, clean):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(PackageError, match="no CUDA GPU"):
        opfuse.load(package, "cuda")


def test_dynamic_dims_that_do_not_match_the_profiles_are_refused(package, clean):
    def listed_at(dims, sizes):
        def edit(name, data):
            if name != MANIFEST:
                return data
            manifest = json.loads(data)
            manifest["dims"] = dims
            manifest["profiles"][0]["sizes"] = sizes
            return json.dumps(manifest).encode()
        return edit
    batch = {"name": "batch", "min": 1, "max": 8, "uses": [[0, 0]]}
    refused(rewrite(package, clean / "wrong.opfuse", listed_at([batch], [3])), "listed at sizes \\[3\\]")
    refused(rewrite(package, clean / "outside.opfuse", listed_at([batch | {"uses": [[0, 7]]}], [2])),
            "not a dim of the model's inputs")
    refused(rewrite(package, clean / "nosizes.opfuse", listed_at([batch], [])), "listed at sizes \\[\\]")
