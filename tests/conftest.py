"""Test set-up shared by all tiers: Triton runs through its CPU interpreter unless a GPU test asks otherwise.

TRITON_INTERPRET must be set before triton is imported anywhere, so it is set here, at collection start.
GPU tests (marked `gpu`) run on the device machine with OPFUSE_GPU_TESTS=1, which leaves the interpreter off.
"""

import os

if os.environ.get("OPFUSE_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
