"""The compiled Triton binaries of a model's kernels, as files a package carries: `collect_binaries(compiled)` at
save; `check_binaries(files)`, `restore_binaries(files, folder)` and `serving_binaries(folder)` at load.

Triton keeps each compiled kernel in its on-disk cache (`triton.knobs.cache.dir`: TRITON_CACHE_DIR, default
~/.triton/cache) as a folder named by the hash of everything the compile depended on (the source, the arguments'
specialisation, the options, Triton's own version), and the JIT looks there before it compiles. A package stores,
of the folders of the binaries the model launches with its chosen configs, the device code and its metadata only:
`<name>.cubin`, `<name>.json` and the folder's index `__grp__<name>.json`. Host code never travels: Triton's
launchers (a C module built per kernel signature in Triton 3.6) and the kernels' Python modules are built on the
machine that loads. Under the interpreter there are no binaries, and nothing is stored.

At load, every file is checked before anything is written (`check_binaries`: a Triton cache folder's name, one of
those three kinds of file, an ELF cubin, metadata that is plain JSON holding no string that could be code), then
written to a private folder of the package's own (`restore_binaries`), never to Triton's shared cache: a package
cannot plant a binary where another model's compile would find it. The loader then runs the model once inside
`serving_binaries(folder)`, in which Triton's cache lookups find that folder's entries first (this thread only),
so the kernels' first compile reads the package's binaries into the JIT's memory instead of compiling them.

Which binaries: every kernel is run once with its chosen config with its launches recorded
(`opfuse.codegen.base.recording_launches`, as the compile workers do), and each recorded launch is handed to
`JITFunction.warmup` on stand-in tensors (`opfuse.runtime.compile_worker.warmup`), which returns the CompiledKernel
the real launch uses, from the JIT's memory, without compiling again. Collecting is best effort: a binary that
cannot be found is compiled at the first call after the load, as it would be without a package.
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch

from opfuse.codegen.base import import_kernel, recording_launches
from opfuse.files import write_atomically

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
            if path.is_file() and _kind(path.name) is not None:
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
    from opfuse.runtime.compile_worker import warmup
    from opfuse.runtime.launch_records import loaded_module

    module = loaded_module(record) or import_kernel(record.path)
    kernel = warmup(getattr(module, record.function), record)
    if hasattr(kernel, "result"):        # a compile future (Triton's async compile mode)
        kernel = kernel.result()
    if kernel is None or not getattr(kernel, "metadata_group", None):
        raise LookupError(f"no compiled kernel for {record.function}")
    return kernel


def _folders_of(kernel: Any) -> set[Path]:
    """The cache folders a CompiledKernel was loaded from."""
    return {Path(path).parent for path in kernel.metadata_group.values()}


# what a package may hold of a Triton cache folder: its device code, the code's metadata, and the folder's index
# (file names are Triton's: the kernel's function name and a suffix)
_FILE_KINDS = {"cubin": re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}\.cubin"),
               "metadata": re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}\.json"),
               "index": re.compile(GROUP_PREFIX + r"[A-Za-z_][A-Za-z0-9_]{0,200}\.json")}
_FOLDER = re.compile(r"[A-Za-z0-9_-]{16,128}")      # a cache key: base32 (Triton 3.x) or hex of a sha256
# a string of a kernel's metadata: names, versions, dtypes, paths of Triton's libraries; no quote, brace,
# semicolon or control character, so none can end a literal in code Triton generates from the metadata
_SAFE_TEXT = re.compile(r"[A-Za-z0-9_.,:+\-/ =@\[\]()]{0,4096}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")
_CHILD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}\.[a-z0-9]{1,16}")   # a file an index lists: name.cubin, name.ptx
_JSON_DEPTH = 8


def _kind(file_name: str) -> str | None:
    """Which kind of file a package may hold this is (index before metadata: an index is a .json too), or None."""
    for kind in ("index", "cubin", "metadata"):
        if _FILE_KINDS[kind].fullmatch(file_name):
            return kind
    return None


def check_binaries(files: Mapping[str, bytes]) -> None:
    """ValueError naming the first file that is not what a package may carry of Triton's cache: "<folder>/<file>"
    with a cache key for folder, a cubin (an ELF file), the kernel's metadata (plain JSON: identifier keys, numbers,
    and strings of `_SAFE_TEXT`), or the folder's index (JSON whose `child_paths` name files: `restore_binaries`
    writes it anew, pointing at the files restored)."""
    for name, data in files.items():
        folder, _, file_name = name.partition("/")
        kind = _kind(file_name)
        if not _FOLDER.fullmatch(folder) or kind is None:
            raise ValueError(f"binary entry {name!r} is not a folder/file name of Triton's cache holding device code "
                             "(a .cubin, its .json metadata, or the folder's index)")
        if kind == "cubin":
            if not data.startswith(b"\x7fELF"):
                raise ValueError(f"binary entry {name!r} is not a cubin (an ELF file)")
            continue
        try:
            value = json.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"binary entry {name!r} is not JSON ({error})") from None
        if kind == "index":     # its paths are the saving machine's, never read: each file's name must be one
            children = value.get("child_paths") if isinstance(value, dict) else None
            plain = isinstance(children, dict) and all(_CHILD.fullmatch(c) for c in children)
            problem = None if plain else "an index whose child_paths are not the files of a Triton cache folder"
        else:
            problem = _plain_json_problem(value, _JSON_DEPTH)
        if problem is not None:
            raise ValueError(f"binary entry {name!r} holds {problem}")


def _plain_json_problem(value: Any, depth: int) -> str | None:
    """What in a parsed JSON value is not plain data (see `check_binaries`), or None."""
    if depth < 0:
        return "JSON nested too deep"
    if value is None or isinstance(value, (bool, int, float)):
        return None
    if isinstance(value, str):
        return None if _SAFE_TEXT.fullmatch(value) else f"the string {value[:60]!r}, which is not plain text"
    if isinstance(value, list):
        return next((p for p in (_plain_json_problem(v, depth - 1) for v in value) if p), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if not _KEY.fullmatch(key):
                return f"the key {key[:60]!r}, which is not a name"
            problem = _plain_json_problem(item, depth - 1)
            if problem:
                return problem
        return None
    return f"a {type(value).__name__}"


def restore_binaries(files: Mapping[str, bytes], folder: str | Path) -> int:
    """Write a package's Triton cache entries (`check_binaries` passed them) into `folder`, a private folder of
    the package's own (entries already there are kept); the number of files written. Each index is written last
    and names exactly the files of its folder written here, so Triton never takes an entry for complete that is
    not (a concurrent reader, another process loading the same package, sees a complete entry or none)."""
    root = Path(folder)
    written = 0
    ordered = sorted(files, key=lambda name: (_kind(name.partition("/")[2]) == "index", name))
    for name in ordered:
        folder_name, _, file_name = name.partition("/")
        target = root / folder_name / file_name
        if target.exists():
            continue
        data = files[name]
        if _kind(file_name) == "index":     # its paths name the cache it was saved from: point them here
            children = json.loads(data)["child_paths"]
            present = {child: str(root / folder_name / child) for child in children
                       if f"{folder_name}/{child}" in files}
            data = json.dumps({"child_paths": present}).encode()
        target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_atomically(target, data)
        written += 1
    return written


_SERVING: ContextVar[Path | None] = ContextVar("opfuse_serving_binaries", default=None)


@contextlib.contextmanager
def serving_binaries(folder: str | Path) -> Iterator[None]:
    """Inside, Triton's cache lookups in this thread find the entries of `folder` (`restore_binaries`) before its
    own cache's; every other lookup, and every lookup of another thread, is Triton's as ever."""
    from triton import knobs
    from triton.runtime.cache import FileCacheManager

    base = knobs.cache.manager_class or FileCacheManager

    class PackageFirst(base):
        def __init__(self, key: str, override: bool = False, dump: bool = False):
            served = _SERVING.get()
            if served is not None and not (override or dump) and (served / key).is_dir():
                super().__init__(key, override=True)        # sets the fields; the folder is set below
                self.cache_dir = str(served / key)
                self.lock_path = str(served / key / "lock")
            else:
                super().__init__(key, override, dump)

    token = _SERVING.set(Path(folder))
    try:
        with knobs.cache.scope():
            knobs.cache.manager_class = PackageFirst
            yield
    finally:
        _SERVING.reset(token)
