"""Test set-up shared by all tiers: Triton runs through its CPU interpreter unless a GPU test asks otherwise.

TRITON_INTERPRET must be set before triton is imported anywhere, so it is set here, at collection start.
GPU tests (marked `gpu`) run on the device machine with OPFUSE_GPU_TESTS=1, which leaves the interpreter off.

Every test session gets an empty cache home (XDG_CACHE_HOME, removed at exit; subprocesses inherit it), so that
no tuning entry or compile record (opfuse.analysis.as_compiled) of an earlier run, or of the user's own compiles,
changes what a test sees: the tests see a fresh machine, as CI does. COLUMNS is unset for the same reason: the
CLI's tables take their width from it (pytest-xdist's workers set it to 80), and the tests read them piped.
"""

import atexit
import os
import shutil
import sys
import tempfile

import pytest

if os.environ.get("OPFUSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="opfuse-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)
os.environ.pop("COLUMNS", None)


@pytest.fixture
def gpu_tiles(monkeypatch):
    """The GPU's tile rules for one test (`opfuse.hardware.kernel_profile` reads TRITON_INTERPRET); the generated
    kernel modules it imports (compiled for the GPU, not the interpreter) are dropped afterwards so that later tests
    generate their own."""
    before = set(sys.modules)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("opfuse_generated_"):
            del sys.modules[name]
