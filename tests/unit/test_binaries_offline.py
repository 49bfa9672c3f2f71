"""A package's binaries served to Triton from their private folder (`opfuse.runtime.binaries`), on the CPU: a kernel
compiled for sm_90 by Triton's own compiler (no GPU: benchmarks/sm90_compile.py's offline driver), its device code
and metadata collected as `save` does, checked and restored to a folder of their own, then found there by a fresh
JIT inside `serving_binaries` with Triton's cache empty, and by no lookup outside it."""

import json
import os
import subprocess
import sys

from tests.unit.test_sm90_compile import PREAMBLE, ROOT

SCRIPT = PREAMBLE + '''
from pathlib import Path
import torch
from triton import knobs
from triton.runtime.jit import MockTensor
from opfuse.codegen.base import load_source
from opfuse.runtime.binaries import _folders_of, _kind, check_binaries, restore_binaries, serving_binaries

SOURCE = """
import triton, triton.language as tl

@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
"""


def fresh():
    """The kernel imported anew: a JITFunction with nothing compiled in memory."""
    module = load_source(SOURCE, "offline_binaries")
    del sys.modules[module.__name__]
    return module.add_one


def warm(function):
    return function.warmup(MockTensor(torch.float16), 4096, BLOCK=1024, grid=(1,))


def entries(root):
    return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.exists() else []


root = Path(sys.argv[1])
saved, served, empty = root / "saved", root / "package", root / "empty"
knobs.cache.dir = str(saved)
kernel = warm(fresh())
files = {{f"{{folder.name}}/{{p.name}}": p.read_bytes() for folder in _folders_of(kernel) for p in folder.iterdir()
         if p.is_file() and _kind(p.name)}}
check_binaries(files)
restore_binaries(files, served)
knobs.cache.dir = str(empty)
with serving_binaries(served):
    loaded = warm(fresh())
compiled_while_served = entries(empty)
control = warm(fresh())
print(json.dumps({{"kinds": sorted({{_kind(name.split("/")[1]) for name in files}}),
                  "saved_files": sorted(p.name for folder in _folders_of(kernel) for p in folder.iterdir()),
                  "served_from": sorted({{str(Path(p).parent.parent) for p in loaded.metadata_group.values()}}),
                  "same_cubin": loaded.asm["cubin"] == kernel.asm["cubin"],
                  "compiled_while_served": compiled_while_served,
                  "control_from": sorted({{str(Path(p).parent.parent) for p in control.metadata_group.values()}})}}))
'''


def test_restored_binaries_are_found_in_their_folder_inside_the_scope_only(tmp_path):
    script = tmp_path / "serve.py"
    script.write_text(SCRIPT.format(root=str(ROOT), script=str(ROOT / "benchmarks" / "sm90_compile.py")))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {
        "OPFUSE_KERNEL_DIR": str(tmp_path / "kernels")}
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["kinds"] == ["cubin", "index", "metadata"]     # of everything Triton wrote, device code only
    assert any(name.endswith((".ptx", ".ttir", ".llir")) for name in report["saved_files"])
    assert report["served_from"] == [str(tmp_path / "package")] and report["same_cubin"]
    assert report["compiled_while_served"] == []                   # found, not compiled into Triton's cache
    assert report["control_from"] == [str(tmp_path / "empty")]     # outside the scope, Triton's own cache
