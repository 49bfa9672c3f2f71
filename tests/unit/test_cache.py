"""TuningCache: keys, round trip, corrupt/truncated entries, concurrent writers, default directory."""

import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from opfuse.config import FusionConfig
from opfuse.runtime.cache import TuningCache, default_cache_dir, describe_inputs, tuning_key

VERSIONS = {"torch": "2.11.0", "triton": "3.6.0"}


def key_for(source="kernel A", shape=(4, 8), dtype=torch.float16, gpu="NVIDIA H200", transpose=False,
            versions=VERSIONS):
    x = torch.empty(shape, dtype=dtype)
    if transpose:
        x = torch.empty(shape[::-1], dtype=dtype).t()
    return tuning_key(source, [x], gpu, versions)


def test_round_trip(tmp_path):
    cache = TuningCache(tmp_path / "cache")
    key = key_for()
    assert cache.load(key) is None
    entry = {"config": {"BLOCK": 64, "num_warps": 4, "num_stages": 2}, "time_s": 1.5e-5}
    cache.store(key, entry)
    assert cache.load(key) == entry
    assert TuningCache(tmp_path / "cache").load(key) == entry     # a new process would read the same


def test_key_depends_on_everything_that_changes_the_best_config():
    base = key_for()
    assert key_for() == base
    assert len(base) == 64 and int(base, 16) >= 0
    variants = [key_for(source="kernel B"), key_for(shape=(4, 16)), key_for(dtype=torch.float32),
                key_for(gpu="NVIDIA A100"), key_for(transpose=True),
                key_for(versions={"torch": "2.14.1", "triton": "3.6.0"}),
                key_for(versions={"torch": "2.11.0", "triton": "3.8.0"})]
    assert len({base, *variants}) == len(variants) + 1


def test_describe_inputs_records_strides():
    x = torch.empty(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    (described,) = describe_inputs([x])
    assert described == {"shape": [2, 3, 4, 5], "dtype": "float32", "strides": list(x.stride())}
    assert tuning_key("s", [x], "gpu", VERSIONS) != tuning_key("s", [x.contiguous()], "gpu", VERSIONS)
    # another set of candidates (e.g. tuned without the library form) is another key
    offered = [{"BLOCK_M": 32, "num_warps": 4}]
    assert tuning_key("s", [x], "gpu", VERSIONS, offered) != \
        tuning_key("s", [x], "gpu", VERSIONS, offered + [{"num_warps": 4, "form": "library"}])


def test_corrupt_entry_is_ignored_and_rewritten(tmp_path):
    cache = TuningCache(tmp_path)
    key = key_for()
    cache.path(key).write_bytes(b"\x00\xffnot json at all")
    assert cache.load(key) is None
    cache.store(key, {"config": {"BLOCK": 32}})
    assert cache.load(key) == {"config": {"BLOCK": 32}}


def test_truncated_entry_is_ignored(tmp_path):
    cache = TuningCache(tmp_path)
    key = key_for()
    cache.store(key, {"config": {"BLOCK": 32}, "note": "x" * 100})
    text = cache.path(key).read_text()
    cache.path(key).write_text(text[: len(text) // 2])
    assert cache.load(key) is None


def test_entry_of_another_key_or_format_is_ignored(tmp_path):
    cache = TuningCache(tmp_path)
    key, other = key_for(), key_for(source="other")
    cache.store(other, {"config": {}})
    os.replace(cache.path(other), cache.path(key))       # a file renamed by hand: its key does not match
    assert cache.load(key) is None
    cache.path(key).write_text(json.dumps({"format": 999, "key": key, "entry": {}}))
    assert cache.load(key) is None
    cache.path(key).write_text(json.dumps([1, 2, 3]))
    assert cache.load(key) is None


def test_bad_key_is_refused(tmp_path):
    with pytest.raises(ValueError, match="alphanumeric"):
        TuningCache(tmp_path).path("../escape")


def test_unwritable_directory_warns_instead_of_failing(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    cache = TuningCache(blocker / "cache")       # cannot be created: its parent is a file
    with pytest.warns(UserWarning, match="not writable"):
        cache.store(key_for(), {"config": {}})
    assert cache.load(key_for()) is None


def _write_many(directory: str, key: str, writer: int, count: int) -> None:
    cache = TuningCache(directory)
    for i in range(count):
        cache.store(key, {"writer": writer, "i": i, "padding": "p" * 2000})


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded")  # the children only write files
def test_concurrent_writers_leave_a_valid_file(tmp_path):
    key = key_for()
    context = multiprocessing.get_context("fork")  # fork: no second torch import
    workers = [context.Process(target=_write_many, args=(str(tmp_path), key, w, 50)) for w in (1, 2)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    entry = TuningCache(tmp_path).load(key)
    assert entry is not None and entry["writer"] in (1, 2) and entry["i"] == 49
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == [f"{key}.json"]   # no temp files left


def test_default_directory(tmp_path, monkeypatch):
    assert default_cache_dir(FusionConfig(cache_dir=str(tmp_path / "mine"))) == tmp_path / "mine"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir(FusionConfig()) == tmp_path / "xdg" / "opfuse"
    assert TuningCache().directory == tmp_path / "xdg" / "opfuse"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir(None) == tmp_path / "home" / ".cache" / "opfuse"
    assert TuningCache.for_config(FusionConfig(cache_dir=str(tmp_path / "c"))).directory == tmp_path / "c"


def test_key_changes_with_what_the_other_forms_run(monkeypatch):
    """A kernel's source does not say what its library and unfused forms run: FORMS_REVISION does, so a tuning
    that chose between forms that have since changed is done again."""
    from opfuse.runtime import cache

    before = key_for()
    monkeypatch.setattr(cache, "FORMS_REVISION", cache.FORMS_REVISION + 1)
    assert key_for() != before
