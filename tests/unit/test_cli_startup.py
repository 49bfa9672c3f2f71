"""The command line starts without torch: --help, --version and usage errors answer at once; `import opfuse`
loads neither torch nor dynamo, and backend="opfuse" registers itself when dynamo loads."""

import subprocess
import sys
from pathlib import Path

import pytest

from opfuse.cli import main

ROOT = Path(__file__).resolve().parents[2]


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_help_version_and_usage_errors_do_not_import_torch():
    out = python("import sys\n"
                 "from opfuse.cli import build_parser, main\n"
                 "build_parser().format_help()\n"
                 "for argv in (['--version'], ['analyze', 'resnet50', '--batch', '0']):\n"
                 "    try:\n"
                 "        main(argv)\n"
                 "    except SystemExit:\n"
                 "        pass\n"
                 "print('torch' in sys.modules)")
    assert out.splitlines()[-1] == "False"


def test_import_opfuse_leaves_dynamo_alone_and_registers_when_it_loads():
    out = python("import sys\n"
                 "import opfuse\n"
                 "print('torch._dynamo' in sys.modules)\n"
                 "calls = []\n"
                 "register = opfuse._register_backend\n"
                 "opfuse._register_backend = lambda: (calls.append('registered'), register())\n"
                 "import torch._dynamo\n"
                 "from torch._dynamo.backends.registry import lookup_backend\n"
                 "from opfuse.backend import opfuse_backend\n"
                 "print(calls, lookup_backend('opfuse') is opfuse_backend)")
    assert out.splitlines() == ["False", "['registered'] True"]


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == "opfuse 0.1.0"


@pytest.mark.parametrize("batch, why", [("0", "must be at least 1, got 0"), ("-3", "must be at least 1, got -3"),
                                        ("two", "expected a whole number, got 'two'")])
def test_a_bad_batch_is_a_one_line_usage_error(batch, why, capsys):
    with pytest.raises(SystemExit) as done:
        main(["analyze", "resnet50", "--batch", batch])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err == f"opfuse analyze: error: argument --batch: {why} (see opfuse analyze --help)\n"


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--batch N batch size of the built-in model's example inputs" in text and "(default: 1)" in text
    assert "(default: fp16)" in text and "(default: h200)" in text and "(default: None)" not in text
