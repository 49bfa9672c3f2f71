"""Output paths on the command line (issue 53, item 10): every path a command writes is checked before any work,
and one that cannot be written (a folder, '', a missing or read-only folder) stops it with exit code 2 and one
line naming the path; `opfuse bench PACKAGE --sha256 HEX` pins the package it loads."""

from __future__ import annotations

import os

import pytest

import opfuse
from opfuse.cli import EXIT_MODEL_ERROR, EXIT_USAGE, main

FACTORY = "import torch\n\ndef make(batch=1):\n    return torch.nn.Tanh(), (torch.randn(batch, 4),)\n"


@pytest.fixture
def model_spec(tmp_path) -> str:
    (tmp_path / "output_paths_model.py").write_text(FACTORY)
    return f"{tmp_path / 'output_paths_model.py'}:make"


@pytest.fixture
def never_compiled(monkeypatch):
    """opfuse.compile fails the test if a command reaches it."""
    def refuse(*args, **kwargs):
        raise AssertionError("compiled before checking its output path")
    monkeypatch.setattr(opfuse, "compile", refuse)


def read_only_folder(tmp_path) -> str:
    """A folder that takes no new file: mode 0555, or /sys for root (which writes past permission bits)."""
    if os.geteuid() == 0:
        return "/sys"
    folder = tmp_path / "read-only"
    folder.mkdir(mode=0o555)
    return str(folder)


def output_cases(tmp_path) -> dict[str, str]:
    (tmp_path / "a-folder").mkdir()
    (tmp_path / "a-file").write_text("")
    return {"a folder": str(tmp_path / "a-folder"), "empty": "", "missing folder": str(tmp_path / "no" / "m.opfuse"),
            "file as folder": str(tmp_path / "a-file" / "m.opfuse"),
            "read-only folder": os.path.join(read_only_folder(tmp_path), "m.opfuse")}


@pytest.mark.parametrize("case", ["a folder", "empty", "missing folder", "file as folder", "read-only folder"])
def test_compile_checks_its_output_before_compiling(case, tmp_path, model_spec, never_compiled, capsys):
    output = output_cases(tmp_path)[case]
    assert main(["compile", model_spec, "--dtype", "fp32", "--quiet", "-o", output]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and "Traceback" not in err
    assert repr(output) in err or (output and output in err)


def test_every_output_path_is_checked_the_same(tmp_path, model_spec, capsys):
    """report's -o and analyze's --json/--html go through the same check."""
    folder = str(tmp_path)
    assert main(["report", model_spec, "--quiet", "-o", folder]) == EXIT_USAGE
    assert main(["analyze", model_spec, "--quiet", "--json", folder]) == EXIT_USAGE
    assert main(["analyze", model_spec, "--quiet", "--html", ""]) == EXIT_USAGE
    assert capsys.readouterr().err.count("is a folder") == 2


def test_a_writable_output_is_left_as_it_was(tmp_path, model_spec):
    """The check creates nothing: the folder holds only what the command itself writes."""
    out = tmp_path / "out"
    out.mkdir()
    assert main(["analyze", model_spec, "--quiet", "--json", str(out / "a.json")]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["a.json"]


def test_bench_of_a_package_forwards_sha256_to_load(tmp_path, monkeypatch, capsys):
    import torch

    import opfuse.bench.cli_bench
    from opfuse.runtime.package import PackageError

    calls = []

    def load(path, device=None, *, recompile=False, sha256=None):
        calls.append((path, recompile, sha256))
        raise PackageError(f"{path}: its sha256 is not {sha256}")

    monkeypatch.setattr(opfuse.bench.cli_bench, "gpu_problem", lambda: None)   # bench needs a GPU: as if one
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(opfuse, "load", load)
    package, digest = str(tmp_path / "m.opfuse"), "AB" * 32
    assert main(["bench", package, "--sha256", digest]) == EXIT_MODEL_ERROR
    assert main(["bench", package, "--recompile"]) == EXIT_MODEL_ERROR
    assert calls == [(package, False, digest.lower()), (package, True, None)]
    assert f"its sha256 is not {digest.lower()}" in capsys.readouterr().err


@pytest.mark.parametrize("digest", ["ab" * 31, "xy" * 32, ""])
def test_sha256_takes_64_hex_digits(digest, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "m.opfuse", "--sha256", digest])
    assert exit_.value.code == EXIT_USAGE
    assert "64 hex digits" in capsys.readouterr().err
