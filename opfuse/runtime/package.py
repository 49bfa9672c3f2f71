"""Deploy a compiled model: `save(compiled, path)` writes one package file, `load(path)` runs it in another process.

A package is a zip file (`model.opfuse`, format `FORMAT`):

    manifest.json          the format, the versions of opfuse, torch and Triton, the GPU, the dynamic dims (name,
                           range, the inputs' dims they lie in), one entry per compiled model (`profile-<i>.json`,
                           at its sizes of those dims), and the size and sha256 of every other member
    profile-<i>.json       one compiled model: the prepared graph (its constants named by content key), the fusion
                           groups and decisions, the FusionConfig, each kernel's name, Triton source and chosen
                           config (the form: Triton tile, split-K, library or unfused), the groups run through
                           PyTorch and why, the inputs and the output structure and dtypes
    weights.safetensors    every constant tensor once, keyed by a hash of its contents (profiles share weights)
    triton/<entry>/<file>  the kernels' compiled device code and its metadata, as Triton's cache holds them
                           (`opfuse.runtime.binaries`; none under the interpreter)

It holds data, never code and never pickled objects: graphs, groups and configs are small dataclasses written as
JSON, binaries are device code. A node attribute JSON cannot hold (the Python function an opaque op re-runs) makes
`save` fail, naming the node.

A package is untrusted input (SECURITY.md): `load` checks all of it before it builds anything. The file's sha256
first, where the caller pins one (`sha256=`: refused before anything is read); then the zip: every member listed
in the manifest with its size, which bounds what reading it inflates (`EXPANSION_LIMIT`), and its sha256; every
value of the profiles decoded against its type (`opfuse.runtime.profile_format`, `package_schema`), every node
attribute against its op's rule (`opfuse.ir.attrs`), every graph through the verifier; every weight against its
content key; every binary as device code with plain metadata. Only then are the kernels generated, here, from the checked plan
(code generation is deterministic: a kernel whose source differs from the saved one refuses the package), and the
binaries written to a private folder of the package's own, which the model's first run, made at load, compiles its
kernels from (`opfuse.runtime.binaries`). The saved configs are set, each one of its kernel's own candidates. The
loaded model computes bit for bit what the saved one did.

A package from another opfuse, torch or Triton version or another GPU is refused with a message naming the
mismatch, unless `recompile=True`: the saved plan is then built again here (code generation and autotuning on
this machine, no capture or planning, no binary taken). A package that is not a zip, is truncated, or fails any
check is refused naming the file and the problem. `save` writes to a temp name in the target's folder and renames
it into place, so a failed save leaves no half-written package and an existing one untouched.

Dynamic models (`save(opfuse.compile(..., dynamic_shapes=...))`, every bucket it compiled) and several batch sizes
(`save([compiled_b1, compiled_b8], path)`): see `opfuse.runtime.packaged.PackagedModel`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opfuse.ir.graph import GraphError
from opfuse.runtime import package_schema as schema
from opfuse.runtime.package_schema import PackageError, SchemaError
from opfuse.runtime.profile_format import SavedProfile, content_key, decode_profile, encode_profile

FORMAT = 5      # bump when the layout changes: a package of another format is refused, never misread
MANIFEST, WEIGHTS, BINARIES = "manifest.json", "weights.safetensors", "triton/"
MANIFEST_LIMIT = 16 << 20   # bytes the manifest may have (it lists every member: tens of kilobytes)
MAX_MEMBERS = 100_000       # members a package may have (a large model's binaries are a few thousand files)
# a compressed member may inflate to at most this many times its compressed size: real profiles deflate about 20x
# (RESULTS.md, "Packages you can trust"), a zip bomb a thousand times
EXPANSION_LIMIT = 100
SHA256 = re.compile(r"[0-9a-f]{64}")


# ---- what this process is: the versions a package must match ---------------------------------------------------

def environment(device: torch.device) -> dict[str, str]:
    """The versions and the GPU a package records and is checked against at load."""
    import triton

    import opfuse

    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
    else:
        gpu = "none (Triton's CPU interpreter)"
    return {"opfuse": opfuse.__version__, "torch": torch.__version__, "triton": triton.__version__, "gpu": gpu}


def mismatch(saved: dict[str, str], here: dict[str, str]) -> str | None:
    """'compiled with triton 3.6.0, this process has triton 3.8.0' for every version or GPU that differs."""
    problems = [f"{what} {saved.get(what)!s}, this process has {what} {value}"
                for what, value in here.items() if saved.get(what) != value]
    return "compiled with " + "; ".join(problems) if problems else None


# ---- values to JSON and back -----------------------------------------------------------------------------------


def build_profile(saved: SavedProfile, device: torch.device, rebuild: bool, where: str) -> Any:
    """The CompiledModel of a checked profile, its kernels generated again from its plan: with the saved configs
    (each one of its kernel's own), each source checked against the saved one; or (`rebuild`) tuned again here.
    Either way the groups the saved model ran through PyTorch (a kernel that failed verification among them) run
    through PyTorch."""
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.compiled import CompiledModel

    kernels, _ = lower_plan(saved.plan, device)
    for group, (name, source) in saved.kernels.items():
        kernel = kernels.get(group)
        if not rebuild and (kernel is None or kernel.source != source):
            made = "no kernel" if kernel is None else f"kernel {kernel.name}"
            raise PackageError(f"{where}: this opfuse generates {made} for group {group}, the package holds "
                               f"{name}: its code generation changed since the package was written; "
                               "load with recompile=True to build the saved plan again")
    compiled = CompiledModel(saved.plan, {g: kernels[g] for g in saved.kernels if g in kernels}, device,
                             config=saved.plan.config, fallbacks=saved.fallbacks)
    if rebuild:
        retune(compiled)
        return compiled
    for group, config in saved.configs.items():
        kernel = compiled.kernels.get(group)
        if kernel is None or config not in kernel.configs() + kernel.alternatives():
            raise PackageError(f"{where}: the config saved for group {group} ({config.as_dict()}) is not one of "
                               "its kernel's")
    compiled.set_configs(saved.configs)
    return compiled


def retune(compiled: Any) -> None:
    """Autotune a rebuilt CompiledModel here, as `build_compiled_model` does, on example inputs of its signature
    (nothing to time under the interpreter: each kernel keeps its first config)."""
    from opfuse.runtime.autotune import tune
    from opfuse.runtime.binaries import example_inputs
    from opfuse.runtime.cache import TuningCache
    from opfuse.runtime.clock import timing_available

    config = compiled.config
    if not (config.autotune and compiled.kernels and timing_available(compiled.device)):
        return
    values = compiled.collect_values(*example_inputs([spec.type for spec in compiled.signature], compiled.device))
    compiled.tuning = tune(compiled.kernels, values, config, TuningCache.for_config(config), quiet=True)
    del values
    compiled.set_configs(dict(compiled.tuning.configs))


# ---- the file ----------------------------------------------------------------------------------------------------

def save(compiled: Any, path: str | os.PathLike[str]) -> Path:
    """Write `compiled` (what opfuse.compile returned: a compiled model, a DynamicModel with every bucket it has
    compiled, or a list of compiled models at several batch sizes) as one package at `path`; see the module
    docstring. Returns the path."""
    from safetensors.torch import save as safetensors_bytes

    from opfuse.runtime.binaries import collect_binaries
    from opfuse.runtime.dynamic import DynamicModel
    from opfuse.runtime.packaged import batch_dim, check_profiles, warn_if_exact_sizes

    path = Path(path)
    if isinstance(compiled, DynamicModel):
        buckets = sorted(compiled.buckets.values(), key=lambda bucket: bucket.sizes)
        modules, dims = [bucket.model for bucket in buckets], compiled.dims
        sizes, exact = [bucket.sizes for bucket in buckets], [bucket.exact for bucket in buckets]
    else:
        modules = list(compiled) if isinstance(compiled, (list, tuple)) else [compiled]
        dims, sizes, exact = [], [()] * len(modules), [False] * len(modules)
    for module in modules:
        if not hasattr(module, "compiled") or not hasattr(module.compiled, "plan"):
            reason = getattr(module, "reason", None)
            raise PackageError(f"cannot save {path}: opfuse.save takes what opfuse.compile returns, got "
                               f"{type(module).__name__}" + (f" (compiling failed: {reason})" if reason else ""))
    weights: dict[str, torch.Tensor] = {}
    profiles = [encode_profile(module, weights) for module in modules]
    if not dims and len(modules) > 1:      # one model at several batch sizes: dim 0 of every input
        batches = check_profiles(profiles, str(path))
        dims, sizes = [batch_dim(batches, len(profiles[0]["inputs"]))], [(batch,) for batch in batches]
    devices = {module.compiled.device for module in modules}
    if len(devices) != 1:
        raise PackageError(f"cannot save {path}: its models are on several devices ({sorted(map(str, devices))})")
    device = devices.pop()
    warn_if_exact_sizes(dims, [(s, e, m.compiled.plan.graph) for s, e, m in zip(sizes, exact, modules)], str(path))
    binaries: dict[str, bytes] = {}
    for module in modules:
        binaries.update(collect_binaries(module.compiled))
    order = sorted(range(len(profiles)), key=lambda i: sizes[i])
    entries = [{"file": f"profile-{n}.json", "sizes": list(sizes[i]), "exact": exact[i]} for n, i in enumerate(order)]
    members: dict[str, bytes] = {entry["file"]: json.dumps(profiles[i]).encode() for entry, i in zip(entries, order)}
    members[WEIGHTS] = safetensors_bytes(weights)
    members.update({BINARIES + name: data for name, data in binaries.items()})
    manifest = {"format": FORMAT, **environment(device), "device": device.type, "profiles": entries,
                "dims": [{"name": d.name, "min": d.min, "max": d.max, "uses": [list(u) for u in d.uses]}
                         for d in dims],
                "members": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
                            for name, data in members.items()}}
    _write_atomically(path, {MANIFEST: json.dumps(manifest, indent=1).encode()} | members)
    return path


def _write_atomically(path: Path, members: dict[str, bytes]) -> None:
    """The zip written to a temp name in `path`'s folder, synced, then renamed over `path`."""
    if not path.parent.is_dir():
        raise PackageError(f"cannot save {path}: folder {path.parent} does not exist")
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            with zipfile.ZipFile(f, "w") as archive:
                for name, data in members.items():
                    stored = name == WEIGHTS     # weights barely compress; the JSON and the binaries do
                    archive.writestr(name, data, zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@dataclass
class MemberEntry:
    """What the manifest says of one member: its size once inflated, and its sha256."""

    bytes: int
    sha256: str


@dataclass
class ProfileEntry:
    file: str
    sizes: list[int]          # of the dynamic dims, in the manifest's order
    exact: bool               # held for calls at exactly these sizes


@dataclass
class DimEntry:
    name: str
    min: int
    max: int | None
    uses: list[tuple[int, int]]     # (input, dim)


@dataclass
class Manifest:
    format: int
    opfuse: str
    torch: str
    triton: str
    gpu: str
    device: str
    profiles: list[ProfileEntry]
    dims: list[DimEntry]
    members: dict[str, MemberEntry]

    def environment(self) -> dict[str, str]:
        return {"opfuse": self.opfuse, "torch": self.torch, "triton": self.triton, "gpu": self.gpu}


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 of a file's bytes, in hex (what `sha256sum` prints, and `load(..., sha256=)` pins)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class PackageReader:
    """A package opened for reading, its structure checked before any member is read: the file's sha256 (where
    pinned), then a manifest listing exactly the other members, each no larger than `EXPANSION_LIMIT` times what it
    takes in the zip. Every read returns exactly the member's declared bytes and checks their sha256; every failure
    is a PackageError naming the file."""

    def __init__(self, path: str | os.PathLike[str], sha256: str | None = None):
        self.path = Path(path)
        if not self.path.is_file():
            raise PackageError(f"{self.path}: no such package file")
        self.sha256 = file_sha256(self.path)
        if sha256 is not None and self.sha256 != sha256.strip().lower():
            raise PackageError(f"{self.path}: its sha256 is {self.sha256}, not the {sha256.strip()[:64]} it was "
                               "pinned to: refused before reading it")
        try:
            self.archive = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, ValueError) as error:
            raise PackageError(f"{self.path}: not a readable opfuse package, truncated or corrupted ({error})"
                               ) from error
        try:
            self._check_structure()
        except BaseException:
            self.archive.close()
            raise

    def _check_structure(self) -> None:
        infos = self.archive.infolist()
        names = [info.filename for info in infos]
        if len(infos) > MAX_MEMBERS or len(set(names)) != len(names):
            raise PackageError(f"{self.path}: {len(infos)} members, some named twice or too many: not an opfuse "
                               "package")
        self.infos = {info.filename: info for info in infos}
        if MANIFEST not in self.infos:
            raise PackageError(f"{self.path}: {MANIFEST} is missing: not a complete opfuse package")
        raw = self._inflate(MANIFEST, MANIFEST_LIMIT)
        try:
            data = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PackageError(f"{self.path}: {MANIFEST} is corrupted ({error})") from error
        found = data.get("format") if isinstance(data, dict) else None
        if found != FORMAT:
            raise PackageError(f"{self.path}: package format {found!r}, this opfuse reads format {FORMAT}; "
                               "compile the model again with this opfuse")
        try:
            self.manifest: Manifest = schema.dataclass_of(Manifest, data, MANIFEST)
        except SchemaError as error:
            raise PackageError(f"{self.path}: {error}") from None
        if not self.manifest.profiles:
            raise PackageError(f"{self.path}: {MANIFEST} lists no profiles: not a package of a model")
        listed, present = set(self.manifest.members), set(self.infos) - {MANIFEST}
        if listed != present:
            odd = sorted(listed ^ present)[0]
            raise PackageError(f"{self.path}: member {odd[:80]!r} is " + ("missing" if odd in listed else
                               f"not listed in {MANIFEST}") + ": not a complete opfuse package")
        for name, entry in self.manifest.members.items():
            info = self.infos[name]
            if info.file_size != entry.bytes or not SHA256.fullmatch(entry.sha256):
                raise PackageError(f"{self.path}: member {name[:80]!r} is {info.file_size} bytes, {MANIFEST} says "
                                   f"{entry.bytes}: corrupted or not opfuse's")
            if info.compress_type != zipfile.ZIP_STORED and info.file_size > EXPANSION_LIMIT * info.compress_size \
                    + 4096:
                raise PackageError(f"{self.path}: member {name[:80]!r} would inflate from {info.compress_size} to "
                                   f"{info.file_size} bytes, over {EXPANSION_LIMIT} times: refused")
        for entry in self.manifest.profiles:
            if entry.file not in self.manifest.members:
                raise PackageError(f"{self.path}: profile {entry.file[:80]!r} is missing")

    def _inflate(self, name: str, size: int) -> bytes:
        """The member's bytes, read no further than `size` (the zip's CRC checked where it is read to its end)."""
        try:
            with self.archive.open(name) as member:
                data = member.read(size + 1)
        except KeyError:
            raise PackageError(f"{self.path}: {name} is missing: not a complete opfuse package") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, NotImplementedError) as error:
            raise PackageError(f"{self.path}: {name} is corrupted or truncated ({error})") from error
        if len(data) > size:
            raise PackageError(f"{self.path}: {name} is larger than {size} bytes: refused")
        return data

    def read(self, name: str) -> bytes:
        entry = self.manifest.members.get(name)
        if entry is None:
            raise PackageError(f"{self.path}: {name} is missing: not a complete opfuse package")
        data = self._inflate(name, entry.bytes)
        if len(data) != entry.bytes or hashlib.sha256(data).hexdigest() != entry.sha256:
            raise PackageError(f"{self.path}: {name} does not match its sha256 in {MANIFEST}: corrupted or altered")
        return data

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
            raise PackageError(f"{self.path}: {name} is corrupted ({error})") from error

    def weights(self) -> dict[str, torch.Tensor]:
        """The weights by content key, each checked to be the tensor its key names (`content_key`)."""
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        data = self.read(WEIGHTS)
        try:
            weights = load_safetensors(data)
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise PackageError(f"{self.path}: {WEIGHTS} is corrupted ({error})") from error
        for key, tensor in weights.items():
            if content_key(tensor) != key:
                raise PackageError(f"{self.path}: weight {key[:40]!r} does not hold the tensor its key names: "
                                   "the weights were altered")
        return weights

    def binaries(self) -> dict[str, bytes]:
        return {name[len(BINARIES):]: self.read(name) for name in self.manifest.members if name.startswith(BINARIES)}

    def close(self) -> None:
        self.archive.close()

    def __enter__(self) -> "PackageReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(path: str | os.PathLike[str], device: str | torch.device | None = None, *, recompile: bool = False,
         sha256: str | None = None) -> Any:
    """The model saved at `path`, on `device` (default: the kind it was compiled for, CUDA's current device for a
    GPU package), as a `PackagedModel`. `sha256`: the file's hash (`sha256sum`, `file_sha256`) it must have, checked
    before anything is read, as pip's --require-hashes. See the module docstring for what is checked, and
    `recompile`."""
    from opfuse.runtime.binaries import check_binaries
    from opfuse.runtime.packaged import PackagedModel, Profile

    if sha256 is not None and not SHA256.fullmatch(str(sha256).strip().lower()):
        raise PackageError(f"{path}: sha256 must be 64 hex digits, got {str(sha256)[:80]!r}")
    with PackageReader(path, sha256) as package:
        manifest = package.manifest
        device = _device(device, manifest.device, package.path)
        here = environment(device)
        problem = mismatch(manifest.environment(), here)
        if problem is None and manifest.device != device.type:
            problem = f"compiled for {manifest.device}, loaded on {device.type}"
        if problem is not None and not recompile:
            raise PackageError(f"{package.path}: {problem}; compile the model again here, or load it with "
                               "recompile=True (opfuse bench --recompile) to build its saved plan again here")
        weights = package.weights()
        try:      # every check before anything is built from the package
            saved = [decode_profile(package.json(entry.file), weights, entry.file) for entry in manifest.profiles]
            binaries = package.binaries() if problem is None else {}
            check_binaries(binaries)
        except (SchemaError, ValueError) as error:
            raise PackageError(f"{package.path}: {error}") from None
        dims = _dims(manifest, saved, package.path)
        compiled = []
        for entry, profile in zip(manifest.profiles, saved):
            try:
                compiled.append(build_profile(profile, device, rebuild=problem is not None,
                                              where=f"{package.path}: {entry.file}"))
            except PackageError:
                raise
            except (KeyError, TypeError, ValueError) as error:
                raise PackageError(f"{package.path}: {entry.file} does not describe a model this opfuse can "
                                   f"build ({type(error).__name__}: {error})") from error
        if binaries:
            _serve_binaries(binaries, package.sha256, compiled)
    profiles = [Profile.of(s, entry.sizes, entry.exact, c) for s, entry, c in zip(saved, manifest.profiles, compiled)]
    return PackagedModel(profiles, str(package.path), dims, rebuilt_because=problem)


def _dims(manifest: Manifest, saved: list[SavedProfile], path: Path) -> list[Any]:
    """The package's dynamic dims, checked against its profiles: each profile's inputs hold its listed sizes where
    the dims lie and agree with every other profile's elsewhere, its outputs likewise in dtype and structure, its
    sizes distinct and inside the ranges; so that a call padded to a profile's sizes is exactly what it takes."""
    from opfuse.runtime.dynamic import DynamicDim

    first = saved[0]
    dims = []
    for entry in manifest.dims:
        uses = tuple((int(i), int(d)) for i, d in entry.uses)
        if not schema.NAME.fullmatch(entry.name) or entry.min < 1 or (entry.max is not None and entry.max < entry.min) \
                or not uses or any(not 0 <= i < len(first.inputs) or not 0 <= d < len(first.inputs[i][0])
                                   for i, d in uses):
            raise PackageError(f"{path}: dynamic dim {entry.name[:40]!r} is not a dim of the model's inputs")
        dims.append(DynamicDim(entry.name, entry.min, entry.max, uses))
    where = {use: n for n, dim in enumerate(dims) for use in dim.uses}
    if len(saved) > 1 and not dims:
        raise PackageError(f"{path}: several profiles and no dynamic dim to choose between them")
    held = set()
    for entry, profile in zip(manifest.profiles, saved):
        sizes = tuple(entry.sizes)
        bad = len(sizes) != len(dims) or sizes in held or any(
            s < d.min or (d.max is not None and s > d.max) for s, d in zip(sizes, dims))
        for i, ((shape, dtype), (first_shape, first_dtype)) in enumerate(zip(profile.inputs, first.inputs)):
            bad |= dtype != first_dtype or len(shape) != len(first_shape)
            for d, (size, first_size) in enumerate(zip(shape, first_shape)):
                bad |= size != (sizes[where[i, d]] if (i, d) in where and len(sizes) == len(dims) else first_size)
        bad |= (len(profile.inputs) != len(first.inputs) or profile.output_dtypes != first.output_dtypes
                or profile.output_spec != first.output_spec)
        if bad:
            raise PackageError(f"{path}: {entry.file} is listed at sizes {list(sizes)}, which its inputs or outputs "
                               "do not match (or another profile holds them)")
        held.add(sizes)
    return dims


def _device(device: str | torch.device | None, saved: str, path: Path) -> torch.device:
    """The device a package loads on: `device`, else the kind it was saved for; a PackageError where its kernels
    could not run there."""
    from opfuse.compiler import check_kernels_can_run
    from opfuse.runtime.compiled import device_key

    wanted = device if device is not None else saved
    try:
        device = torch.device(wanted)
    except (RuntimeError, TypeError) as error:
        raise PackageError(f"{path}: cannot load on device {wanted!r} ({error})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PackageError(f"{path}: cannot load on {device}: this machine has no CUDA GPU (torch.cuda.is_available() "
                           "is False); load it on a GPU machine, or pass device='cpu' with TRITON_INTERPRET=1 to run "
                           "its kernels through Triton's interpreter (recompile=True for a GPU package)")
    device = torch.device(device_key(device))
    try:
        check_kernels_can_run(device)
    except PackageError:
        raise
    except GraphError as error:
        raise PackageError(f"{path}: {error}") from None
    return device


def binaries_folder(sha256: str) -> Path:
    """The private folder of one package's binaries (`opfuse.runtime.binaries.restore_binaries`), named by the
    package file's hash, in opfuse's cache."""
    from opfuse.files import private_dir
    from opfuse.runtime.cache import default_cache_dir

    return private_dir(default_cache_dir() / "packages") / sha256[:32]


def _serve_binaries(binaries: dict[str, bytes], sha256: str, compiled: list[Any]) -> None:
    """Write the package's binaries to its private folder, then run each model once on example inputs with Triton
    finding them there (`serving_binaries`): its kernels' binaries are then in the JIT's memory, and no call
    compiles them. The run is the model's own warm-up; a model that fails it keeps its binaries unread (its first
    call compiles them, or fails as it would)."""
    import warnings

    from opfuse.runtime.binaries import example_inputs, restore_binaries, serving_binaries

    folder = binaries_folder(sha256)
    folder.mkdir(mode=0o700, exist_ok=True)
    restore_binaries(binaries, folder)
    with serving_binaries(folder), torch.no_grad():
        for model in compiled:
            try:
                model.run_matching(example_inputs([spec.type for spec in model.signature], model.device))
            except Exception as error:
                warnings.warn(f"opfuse: the package's binaries were not read ({type(error).__name__}: {error}); "
                              "its kernels compile at the first call", stacklevel=3)
            model.set_cuda_graph(model.use_cuda_graph)    # a user's first call is the compiled model's first
