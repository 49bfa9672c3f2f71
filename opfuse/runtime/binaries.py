"""The compiled Triton binaries of a model's kernels, as files a package carries: `collect_binaries(compiled)` at
save, `restore_binaries(files)` at load.

Triton keeps each compiled kernel in its on-disk cache (`triton.knobs.cache.dir`: TRITON_CACHE_DIR, default
~/.triton/cache) as a folder named by the hash of everything the compile depended on (the source, the arguments'
specialisation, the options, Triton's own version), and the JIT looks there before it compiles. A package stores
the folders of the binaries the model launches with its chosen configs; `restore_binaries` writes them back into
this machine's cache, so a loaded model's first call loads binaries instead of compiling them. Where Triton's
launcher is a C module built per kernel signature (Triton 3.6), the launcher's cache folder is stored with the
kernel's. Under the interpreter there are no binaries, and nothing is stored.

Which binaries: every kernel is run once with its chosen config with its launches recorded
(`opfuse.codegen.base.recording_launches`, as the compile workers do), and each recorded launch is handed to
`JITFunction.warmup` on stand-in tensors (`opfuse.runtime.precompile.warmup`), which returns the CompiledKernel
the real launch uses, from the JIT's memory, without compiling again. Collecting is best effort: a binary that
cannot be found is compiled at the first call after the load, as it would be without a package.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from opfuse.codegen.base import import_file, recording_launches

GROUP_PREFIX = "__grp__"    # Triton's name for a cache folder's index file: {"child_paths": {file: absolute path}}


def collect_binaries(compiled: Any) -> dict[str, bytes]:
    """{"<cache folder>/<file>": contents} of every Triton cache entry `compiled` (a CompiledModel) launches with
    its chosen configs; empty on the CPU (the interpreter compiles nothing)."""
    from opfuse.codegen.forms import is_unfused
    from opfuse.environment import triton_interpreter
    from opfuse.runtime.autotune import kernel_inputs

    if compiled.device.type != "cuda" or triton_interpreter() or not compiled.kernels:
        return {}
    values = compiled.collect_values(*example_inputs([spec.type for spec in compiled.signature], compiled.device))
    records: dict[Any, None] = {}
    for name, kernel in compiled.kernels.items():
        config = compiled.configs.get(name)
        if is_unfused(config):       # PyTorch's ops one by one: no generated kernel runs
            continue
        with recording_launches() as launches:
            kernel.run(kernel_inputs(kernel, values), config)
        records.update(dict.fromkeys(launches))
    del values
    folders: set[Path] = set()
    missed = 0
    for record in records:
        try:
            folders |= _folders_of(_compiled_kernel(record))
        except Exception:            # best effort: this kernel compiles at the first call after a load
            missed += 1
    if missed:
        warnings.warn(f"opfuse: {missed} of {len(records)} Triton binaries could not be found in Triton's cache; "
                      "a loaded package compiles those at its first call", stacklevel=3)
    files = {}
    for folder in sorted(folders):
        for path in sorted(folder.iterdir()):
            if path.is_file() and not path.name.startswith(("tmp.", "lock")):
                files[f"{folder.name}/{path.name}"] = path.read_bytes()
    return files


def example_inputs(types: Sequence[Any], device: torch.device) -> list[torch.Tensor]:
    """Tensors of these TensorTypes: seeded normal floats, zeros for integers and bools (a valid index for every
    embedding). What the kernels are specialised on is all that matters here: dtypes, shapes and alignment."""
    from opfuse.ir.graph import torch_dtype

    generator = torch.Generator().manual_seed(0)
    tensors = []
    for type_ in types:
        dtype = torch_dtype(type_.dtype)
        if dtype.is_floating_point:
            tensors.append(torch.randn(type_.shape, generator=generator).to(device, dtype))
        else:
            tensors.append(torch.zeros(type_.shape, dtype=dtype, device=device))
    return tensors


def _compiled_kernel(record: Any) -> Any:
    """The CompiledKernel of a recorded launch (from the JIT's memory when the model has launched it)."""
    from opfuse.runtime.precompile import loaded_module, warmup

    module = loaded_module(record) or import_file(record.path, Path(record.path).stem)
    kernel = warmup(getattr(module, record.function), record)
    if hasattr(kernel, "result"):        # a compile future (Triton's async compile mode)
        kernel = kernel.result()
    if kernel is None or not getattr(kernel, "metadata_group", None):
        raise LookupError(f"no compiled kernel for {record.function}")
    return kernel


def _folders_of(kernel: Any) -> set[Path]:
    """The cache folders a CompiledKernel was loaded from: its own, and its launcher's where Triton builds one per
    signature (found by building the launcher again, which only reads the cache, under a recording manager)."""
    folders = {Path(path).parent for path in kernel.metadata_group.values()}
    from triton import knobs
    from triton.runtime.cache import FileCacheManager
    from triton.runtime.driver import driver

    class Recording(FileCacheManager):
        def get_file(self, filename):
            path = super().get_file(filename)
            if path is not None:
                folders.add(Path(path).parent)
            return path

    try:
        with knobs.cache.scope():
            knobs.cache.manager_class = Recording
            driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:    # no per-signature launcher to find: the kernel's own folder is all there is
        pass
    return folders


def restore_binaries(files: Mapping[str, bytes]) -> int:
    """Write a package's Triton cache entries into this machine's Triton cache (entries already there are kept);
    the number of files written. Each file is written to a temp name and renamed, and a folder's index file last,
    so a concurrent reader (another process loading the same package) sees a complete entry or none."""
    if not files:
        return 0
    from triton import knobs

    root = knobs.cache.dir
    if not root:
        warnings.warn("opfuse: Triton has no cache directory (TRITON_CACHE_DIR); the package's binaries are not "
                      "restored and its kernels compile at the first call", stacklevel=3)
        return 0
    written = 0
    ordered = sorted(files, key=lambda name: (Path(name).name.startswith(GROUP_PREFIX), name))
    for name in ordered:
        folder_name, _, file_name = name.partition("/")
        if not _plain(folder_name) or not _plain(file_name):
            raise ValueError(f"binary entry {name!r} is not a folder/file name inside Triton's cache")
        folder = Path(root) / folder_name
        target = folder / file_name
        if target.exists():
            continue
        data = files[name]
        if file_name.startswith(GROUP_PREFIX):     # its paths name the cache it was saved from: point them here
            index = json.loads(data)
            index["child_paths"] = {child: str(folder / Path(path).name)
                                    for child, path in index.get("child_paths", {}).items()}
            data = json.dumps(index).encode()
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(target, data)
        written += 1
    return written


def _plain(name: str) -> bool:
    """A single path component: no separator, not '.' or '..', not empty (a package names entries, never paths)."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and not name.startswith("~")


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name[:40]}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
