"""docs/tutorial.md runs as written, and the examples run on tiny inputs (CPU, Triton interpreter).

Each ```bash block of the tutorial is run from the repository root with bash -e, the venv's bin first on PATH;
the ```text block that follows it is the output the page shows, and every line of it must appear in what the
commands printed, except lines holding a wall-clock time, a relative error or a file size (they vary from run to
run). Blocks marked ```bash gpu need a GPU and are only checked for being there.

When the output changes on purpose (a new cost model, a new table), regenerate the page's output blocks with
`.venv/bin/python tests/unit/test_tutorial.py --update` and read the diff.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from opfuse.codegen.base import import_file

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial.md"
COLUMNS = "120"     # the terminal width the tutorial's output was captured at
VOLATILE = re.compile(r"\d s\b|\de[-+]\d\d|\d KB\)")


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(info string, content) of every fenced code block, in order."""
    blocks, info, lines = [], None, []
    for line in text.splitlines():
        if info is None and line.startswith("```"):
            info, lines = line[3:].strip(), []
        elif info is not None and line.startswith("```"):
            blocks.append((info, "\n".join(lines)))
            info = None
        elif info is not None:
            lines.append(line)
    assert info is None, "unclosed code block in the tutorial"
    return blocks


def tutorial_commands(text: str) -> list[tuple[str, str | None]]:
    """(commands, the output shown after them or None) for each ```bash block."""
    blocks = fenced_blocks(text)
    commands = []
    for index, (info, content) in enumerate(blocks):
        if info == "bash":
            following = blocks[index + 1] if index + 1 < len(blocks) else None
            commands.append((content, following[1] if following and following[0] == "text" else None))
    return commands


def run_shell(commands: str, timeout: float = 120, interpret: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
               COLUMNS=COLUMNS, TRITON_INTERPRET="1" if interpret else "0")
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", commands], cwd=ROOT, env=env, timeout=timeout,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def missing_lines(shown: str, printed: str) -> list[str]:
    """Lines of the documented output (stripped, not volatile) that the commands did not print."""
    actual = {line.strip() for line in printed.splitlines()}
    return [line for line in (raw.strip() for raw in shown.splitlines())
            if line and not VOLATILE.search(line) and line not in actual]


COMMANDS = tutorial_commands(TUTORIAL.read_text())


def test_the_extraction_sees_the_blocks():
    blocks = fenced_blocks("text\n```bash\necho hi\n```\n\n```text\nhi\n```\n```bash gpu\nnvidia-smi\n```\n")
    assert blocks == [("bash", "echo hi"), ("text", "hi"), ("bash gpu", "nvidia-smi")]
    assert tutorial_commands("```bash\necho hi\n```\n```text\nhi\n```\n```bash\nls\n```") == [
        ("echo hi", "hi"), ("ls", None)]
    assert missing_lines("hi\ncapture 1.3 s\nthere", "hi\ncapture 2.0 s\n") == ["there"]
    # the tutorial really has commands, each followed by its output, and GPU commands for bench and profile
    assert len(COMMANDS) >= 6 and all(shown for _, shown in COMMANDS)
    gpu = [content for info, content in fenced_blocks(TUTORIAL.read_text()) if info == "bash gpu"]
    assert any("opfuse bench" in c for c in gpu) and any("opfuse profile" in c for c in gpu)


def remove_written_files(before: set[Path]) -> None:
    """Remove the new files of the repository root that the tutorial's commands name (its reports and JSON);
    nothing else, since other processes may be writing there too."""
    text = TUTORIAL.read_text()
    for path in set(ROOT.iterdir()) - before:
        if path.is_file() and path.name in text:
            path.unlink()


@pytest.fixture(scope="module")
def clean_repository_root():
    before = set(ROOT.iterdir())
    yield
    remove_written_files(before)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the output shown is what the commands print without a GPU")
@pytest.mark.parametrize("commands, shown", COMMANDS, ids=[c.split("\n")[0][:50] for c, _ in COMMANDS])
def test_tutorial_command_runs_as_written(commands, shown, clean_repository_root):
    result = run_shell(commands)
    assert result.returncode == 0, result.stdout
    if shown is not None:
        assert missing_lines(shown, result.stdout) == [], result.stdout


# ---- the examples, on tiny inputs ----------------------------------------------------------------------------

def load_example(name: str):
    return import_file(ROOT / "examples" / name, name.removesuffix(".py"))


@pytest.mark.parametrize("n, c_in, c_out, size, dtype", [(1, 3, 5, 5, torch.float32),
                                                         (3, 20, 70, 7, torch.float32),
                                                         (2, 16, 16, 6, torch.float16)])
def test_hand_written_kernel_matches_pytorch(n, c_in, c_out, size, dtype):
    example = load_example("03_conv_bn_relu.py")
    torch.manual_seed(0)
    conv, bn = torch.nn.Conv2d(c_in, c_out, 3, padding=1), torch.nn.BatchNorm2d(c_out)
    with torch.no_grad():
        bn.running_mean.normal_(0, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 1.5)
        x = torch.randn(n, c_in, size, size)
        reference = torch.relu(bn.eval()(conv(x)))
        weight, bias = example.fold_batch_norm(conv, bn)
        out = example.conv_bias_relu(x.to(dtype), weight.to(dtype), bias.to(dtype))
    assert out.is_contiguous(memory_format=torch.channels_last) and out.dtype == dtype
    assert example.relative_error(out.float(), reference) < (1e-2 if dtype == torch.float16 else 1e-5)


def test_conv_bn_relu_factory_is_what_the_cli_loads():
    from opfuse.cli import load_model

    model, inputs, name = load_model("examples/03_conv_bn_relu.py:conv_bn_relu", batch=2)
    assert name == "conv_bn_relu" and inputs[0].shape == (2, 64, 56, 56)
    assert [type(m).__name__ for m in model] == ["Conv2d", "BatchNorm2d", "ReLU"]


def test_every_example_runs_in_the_tutorial():
    """The tutorial's commands run each example (on the CPU: on tiny inputs, through the interpreter), but the
    serving recipe, which tests/kernels/test_ray_serve.py runs under Ray Serve."""
    examples = sorted(p.name for p in (ROOT / "examples").glob("*.py"))
    assert examples == ["01_analyze.py", "02_compile.py", "03_conv_bn_relu.py", "04_ray_serve.py"]
    examples.remove("04_ray_serve.py")
    for name in examples:
        assert any(f"python examples/{name}" in commands for commands, _ in COMMANDS), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_examples_time_their_variants_on_a_gpu():
    """On the GPU machine: OPFUSE_GPU_TESTS=1 python3 -m pytest -m gpu tests/unit/test_tutorial.py"""
    result = run_shell("python examples/03_conv_bn_relu.py --batch 8", timeout=600, interpret=False)
    assert result.returncode == 0, result.stdout
    timed = [line for line in result.stdout.splitlines() if " µs" in line]
    assert [line.split()[0] for line in timed] == ["PyTorch", "opfuse", "hand-written"], result.stdout
    result = run_shell("python examples/02_compile.py", timeout=600, interpret=False)
    assert result.returncode == 0 and "median per forward" in result.stdout, result.stdout


# ---- regenerating the tutorial's output ----------------------------------------------------------------------

def update_tutorial() -> None:
    """Rewrite each ```text block that follows a ```bash block with what the commands print now."""
    lines = TUTORIAL.read_text().splitlines()
    out, i = [], 0
    before = set(ROOT.iterdir())
    while i < len(lines):
        out.append(lines[i])
        if lines[i].strip() != "```bash":
            i += 1
            continue
        end = lines.index("```", i + 1)
        commands = "\n".join(lines[i + 1:end])
        out.extend(lines[i + 1:end + 1])
        i = end + 1
        while i < len(lines) and not lines[i].strip():
            out.append(lines[i])
            i += 1
        if i < len(lines) and lines[i].strip() == "```text":
            result = run_shell(commands)
            print(f"{commands.splitlines()[0]} -> exit code {result.returncode}")
            out += ["```text", *(line.rstrip() for line in result.stdout.rstrip("\n").splitlines()), "```"]
            i = lines.index("```", i + 1) + 1
    TUTORIAL.write_text("\n".join(out) + "\n")
    remove_written_files(before)


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        sys.exit("usage: python tests/unit/test_tutorial.py --update   (rewrites docs/tutorial.md's output blocks)")
    update_tutorial()
