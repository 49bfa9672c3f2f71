"""Deploy a compiled model: `save(compiled, path)` writes one package file, `load(path)` runs it in another process.

A package is a zip file (`model.opfuse`, format `FORMAT`):

    manifest.json          the format, the versions of opfuse, torch and Triton, the GPU, and one profile per batch
                           size (`profile-<i>.json`)
    profile-<i>.json       one compiled model: the prepared graph (its constants named by content key), the fusion
                           groups and decisions, the FusionConfig, each kernel's name, Triton source and chosen
                           config (the form: Triton tile, split-K, library or unfused), the groups run through
                           PyTorch and why, the inputs and the output structure and dtypes
    weights.safetensors    every constant tensor once, keyed by a hash of its contents (profiles share weights)
    triton/<entry>/<file>  Triton's cache entries of the kernels' compiled binaries (`opfuse.runtime.binaries`;
                           none under the interpreter)

It holds data, never pickled objects: graphs, groups and configs are small dataclasses written as JSON. A node
attribute JSON cannot hold (the Python function an opaque op re-runs) makes `save` fail, naming the node.

`load` rebuilds each profile's CompiledModel without capture, planning or tuning: it generates each kernel from
the saved graph and group (code generation is deterministic) and refuses the package if a kernel's source differs
from the saved one, writes the binaries back into Triton's cache so that the first call compiles nothing, and sets
the saved configs. The loaded model computes bit for bit what the saved one did.

A package from another opfuse, torch or Triton version or another GPU is refused with a message naming the
mismatch, unless `recompile=True`: the saved plan is then built again here (code generation and autotuning on
this machine, no capture or planning). A package that is not a zip, is truncated, or whose contents fail their
checksums is refused naming the file. `save` writes to a temp name in the target's folder and renames it into
place, so a failed save leaves no half-written package and an existing one untouched.

Several batch sizes (`save([compiled_b1, compiled_b8], path)`): see `opfuse.runtime.packaged.PackagedModel`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
import zlib
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionDecision, FusionGroup, FusionPlan, GroupKind, ResourceEstimate, Verdict, plain
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, GraphError, Node, TensorType, dtype_name, torch_dtype

FORMAT = 4      # bump when the layout changes: a package of another format is refused, never misread
MANIFEST, WEIGHTS, BINARIES = "manifest.json", "weights.safetensors", "triton/"


class PackageError(GraphError):
    """A package that cannot be written or loaded here; the message names the file and the problem."""


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

def encode_value(value: Any, where: str) -> Any:
    """A node attribute as JSON: tuples, dicts and dtypes tagged so they come back as they were."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [encode_value(v, where) for v in value]
    if isinstance(value, tuple):
        return {"tuple": [encode_value(v, where) for v in value]}
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {"dict": {k: encode_value(v, where) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    kind = "a Python function" if callable(value) else f"a {type(value).__name__}"
    raise PackageError(f"{where} is {kind}, which a package cannot hold (an op that runs by calling back into "
                       "the traced Python code); such a model can be compiled but not saved")


def decode_value(value: Any) -> Any:
    if isinstance(value, list):
        return [decode_value(v) for v in value]
    if isinstance(value, dict):
        if "tuple" in value:
            return tuple(decode_value(v) for v in value["tuple"])
        if "dict" in value:
            return {k: decode_value(v) for k, v in value["dict"].items()}
        if "dtype" in value:
            return torch_dtype(value["dtype"])
    return value


def content_key(tensor: torch.Tensor) -> str:
    """A constant's key in weights.safetensors: sha256 of its dtype, shape and bytes (equal tensors share one)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    digest = hashlib.sha256(f"{tensor.dtype}{list(tensor.shape)}".encode())
    digest.update(flat.numpy().tobytes())
    return digest.hexdigest()[:32]


def encode_graph(graph: Graph, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The graph as JSON; its constants go into `weights` (key -> contiguous CPU tensor), each recorded with its
    strides so it comes back laid out as it was."""
    nodes = [{"name": n.name, "op": n.op, "inputs": n.inputs, "shape": list(n.type.shape), "dtype": n.type.dtype,
              "source": n.source,
              "attrs": {k: encode_value(v, f"node {n.describe()} attribute {k!r}") for k, v in n.attrs.items()}}
             for n in graph]
    constants = {}
    for name, tensor in graph.constants.items():
        key = content_key(tensor)
        weights.setdefault(key, tensor.detach().cpu().contiguous().clone())
        constants[name] = {"key": key, "stride": list(tensor.stride())}
    return {"name": graph.name, "nodes": nodes, "outputs": graph.outputs, "constants": constants}


def decode_graph(data: dict[str, Any], weights: dict[str, torch.Tensor]) -> Graph:
    graph = Graph(data["name"])
    for n in data["nodes"]:
        graph.nodes[n["name"]] = Node(n["name"], n["op"], list(n["inputs"]),
                                      {k: decode_value(v) for k, v in n["attrs"].items()},
                                      TensorType(tuple(n["shape"]), n["dtype"]), n["source"])
    graph.outputs = list(data["outputs"])
    for name, entry in data["constants"].items():
        value = weights[entry["key"]]
        tensor = torch.empty_strided(value.shape, entry["stride"], dtype=value.dtype)
        graph.constants[name] = tensor.copy_(value)
    return graph


def encode_config(config: KernelConfig) -> dict[str, Any]:
    return {"params": [list(p) for p in config.params], "num_warps": config.num_warps,
            "num_stages": config.num_stages, "form": config.form}


def decode_config(data: dict[str, Any]) -> KernelConfig:
    return KernelConfig(tuple((name, value) for name, value in data["params"]), data["num_warps"],
                        data["num_stages"], data["form"])


def decode_group(data: dict[str, Any]) -> FusionGroup:
    data = dict(data, kind=GroupKind(data["kind"]), code=Code(data["code"]))
    if data["resources"] is not None:
        data["resources"] = ResourceEstimate(**data["resources"])
    return FusionGroup(**data)


def decode_decision(data: dict[str, Any]) -> FusionDecision:
    return FusionDecision(**dict(data, verdict=Verdict(data["verdict"]), code=Code(data["code"])))


def decode_fusion_config(data: dict[str, Any]) -> FusionConfig:
    known = {f.name for f in fields(FusionConfig)}
    return FusionConfig(**{k: v for k, v in data.items() if k in known})


# ---- one compiled model as a profile ---------------------------------------------------------------------------

def encode_profile(module: Any, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An OpfuseModule (what opfuse.compile returns) as a profile's JSON."""
    from torch.utils._pytree import treespec_dumps

    compiled = module.compiled
    plan = compiled.plan
    return {
        "name": module.analysis.name,
        "device": compiled.device.type,
        "config": asdict(compiled.config),
        "hardware": plan.hardware,
        "profile": asdict(plan.profile) if plan.profile is not None else None,
        "graph": encode_graph(plan.graph, weights),
        "groups": [plain(asdict(g)) for g in plan.groups],
        "decisions": [plain(asdict(d)) for d in plan.decisions],
        "kernels": {group: {"name": k.name, "source": k.source} for group, k in compiled.kernels.items()},
        "configs": {group: encode_config(c) for group, c in compiled.configs.items()},
        "fallbacks": {group: {"code": r.code.value, "text": r.text} for group, r in compiled.fallbacks.items()},
        # the inputs as the caller passes them (before the cast to the compute dtype), and the outputs as returned
        "inputs": [{"shape": list(shape), "dtype": dtype_name(dtype)} for shape, dtype, _ in module._signature],
        "output_spec": treespec_dumps(module._output_spec),
        "output_dtypes": [dtype_name(d) for d in module._output_dtypes],
        "output_shapes": [list(plan.graph[o].type.shape) for o in plan.graph.outputs],
    }


def build_profile(data: dict[str, Any], weights: dict[str, torch.Tensor], device: torch.device, rebuild: bool,
                  where: str) -> Any:
    """The CompiledModel of a profile, its kernels generated again from its plan: with the saved configs, each
    source checked against the saved one; or (`rebuild`) tuned again here. Either way the groups the saved model
    ran through PyTorch (a kernel that failed verification among them) run through PyTorch."""
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.compiled import CompiledModel

    config = decode_fusion_config(data["config"])
    plan = FusionPlan(decode_graph(data["graph"], weights), [decode_group(g) for g in data["groups"]],
                      [decode_decision(d) for d in data["decisions"]], data["hardware"], config,
                      HardwareProfile(**data["profile"]) if data.get("profile") else None)
    kernels, _ = lower_plan(plan, device)
    for group, saved in data["kernels"].items():
        kernel = kernels.get(group)
        if not rebuild and (kernel is None or kernel.source != saved["source"]):
            made = "no kernel" if kernel is None else f"kernel {kernel.name}"
            raise PackageError(f"{where}: this opfuse generates {made} for group {group}, the package holds "
                               f"{saved['name']}: its code generation changed since the package was written; "
                               "load with recompile=True to build the saved plan again")
    compiled = CompiledModel(plan, {g: kernels[g] for g in data["kernels"] if g in kernels}, device, config=config,
                             fallbacks={g: Reason(r["code"], r["text"]) for g, r in data["fallbacks"].items()})
    if rebuild:
        retune(compiled)
    else:
        compiled.set_configs({group: decode_config(c) for group, c in data["configs"].items()})
    return compiled


def retune(compiled: Any) -> None:
    """Autotune a rebuilt CompiledModel here, as `build_compiled_model` does, on example inputs of its signature
    (nothing to time under the interpreter: each kernel keeps its first config)."""
    from opfuse.runtime.autotune import timing_available, tune
    from opfuse.runtime.binaries import example_inputs
    from opfuse.runtime.cache import TuningCache

    config = compiled.config
    if not (config.autotune and compiled.kernels and timing_available(compiled.device)):
        return
    values = compiled.collect_values(*example_inputs([spec.type for spec in compiled.signature], compiled.device))
    compiled.tuning = tune(compiled.kernels, values, config, TuningCache.for_config(config), quiet=True)
    del values
    compiled.set_configs(dict(compiled.tuning))


# ---- the file ----------------------------------------------------------------------------------------------------

def save(compiled: Any, path: str | os.PathLike[str]) -> Path:
    """Write `compiled` (what opfuse.compile returned, or a list of them for several batch sizes) as one package
    at `path`; see the module docstring. Returns the path."""
    from safetensors.torch import save as safetensors_bytes

    from opfuse.runtime.binaries import collect_binaries
    from opfuse.runtime.packaged import check_profiles

    path = Path(path)
    modules = list(compiled) if isinstance(compiled, (list, tuple)) else [compiled]
    for module in modules:
        if not hasattr(module, "compiled") or not hasattr(module.compiled, "plan"):
            reason = getattr(module, "reason", None)
            raise PackageError(f"cannot save {path}: opfuse.save takes what opfuse.compile returns, got "
                               f"{type(module).__name__}" + (f" (compiling failed: {reason})" if reason else ""))
    weights: dict[str, torch.Tensor] = {}
    profiles = [encode_profile(module, weights) for module in modules]
    batches = check_profiles(profiles, str(path))
    devices = {module.compiled.device for module in modules}
    if len(devices) != 1:
        raise PackageError(f"cannot save {path}: its models are on several devices ({sorted(map(str, devices))})")
    device = devices.pop()
    binaries: dict[str, bytes] = {}
    for module in modules:
        binaries.update(collect_binaries(module.compiled))
    order = sorted(range(len(profiles)), key=lambda i: batches[i] or 0)
    manifest = {"format": FORMAT, **environment(device), "device": device.type,
                "profiles": [{"file": f"profile-{n}.json", "batch": batches[i]} for n, i in enumerate(order)]}
    members: dict[str, bytes] = {MANIFEST: json.dumps(manifest, indent=1).encode()}
    for entry, i in zip(manifest["profiles"], order):
        members[entry["file"]] = json.dumps(profiles[i]).encode()
    members[WEIGHTS] = safetensors_bytes(weights)
    members.update({BINARIES + name: data for name, data in binaries.items()})
    _write_atomically(path, members)
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


class PackageReader:
    """A package opened for reading: every read checks the member's CRC, and every failure is a PackageError
    naming the file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if not self.path.is_file():
            raise PackageError(f"{self.path}: no such package file")
        try:
            self.archive = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, ValueError) as error:
            raise PackageError(f"{self.path}: not a readable opfuse package, truncated or corrupted ({error})"
                               ) from error
        self.manifest = self.json(MANIFEST)
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            found = self.manifest.get("format") if isinstance(self.manifest, dict) else None
            raise PackageError(f"{self.path}: package format {found!r}, this opfuse reads format {FORMAT}; "
                               "compile the model again with this opfuse")

    def read(self, name: str) -> bytes:
        try:
            return self.archive.read(name)
        except KeyError:
            raise PackageError(f"{self.path}: {name} is missing: not a complete opfuse package") from None
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError) as error:
            raise PackageError(f"{self.path}: {name} is corrupted or truncated ({error})") from error

    def json(self, name: str) -> Any:
        try:
            return json.loads(self.read(name))
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise PackageError(f"{self.path}: {name} is corrupted ({error})") from error

    def weights(self) -> dict[str, torch.Tensor]:
        from safetensors import SafetensorError
        from safetensors.torch import load as load_safetensors

        data = self.read(WEIGHTS)
        try:
            return load_safetensors(data)
        except (SafetensorError, ValueError, RuntimeError) as error:
            raise PackageError(f"{self.path}: {WEIGHTS} is corrupted ({error})") from error

    def binaries(self) -> dict[str, bytes]:
        return {name[len(BINARIES):]: self.read(name) for name in self.archive.namelist()
                if name.startswith(BINARIES)}

    def close(self) -> None:
        self.archive.close()

    def __enter__(self) -> "PackageReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def load(path: str | os.PathLike[str], device: str | torch.device | None = None, *,
         recompile: bool = False) -> Any:
    """The model saved at `path`, on `device` (default: the kind it was compiled for, CUDA's current device for a
    GPU package), as a `PackagedModel`; see the module docstring for what is checked and `recompile`."""
    from opfuse.compiler import check_kernels_can_run
    from opfuse.runtime.binaries import restore_binaries
    from opfuse.runtime.compiled import device_key
    from opfuse.runtime.packaged import PackagedModel, Profile

    with PackageReader(path) as package:
        manifest = package.manifest
        device = torch.device(device_key(device if device is not None else manifest.get("device", "cuda")))
        check_kernels_can_run(device)
        here = environment(device)
        problem = mismatch(manifest, here)
        if problem is None and manifest.get("device") != device.type:
            problem = f"compiled for {manifest.get('device')}, loaded on {device.type}"
        if problem is not None and not recompile:
            raise PackageError(f"{package.path}: {problem}; compile the model again here, or load it with "
                               "recompile=True (opfuse bench --recompile) to build its saved plan again here")
        weights = package.weights()
        if problem is None:
            try:
                restore_binaries(package.binaries())
            except ValueError as error:
                raise PackageError(f"{package.path}: {error}: the package is corrupted or not opfuse's") from error
        profiles = []
        for entry in manifest["profiles"]:
            data = package.json(entry["file"])
            try:
                compiled = build_profile(data, weights, device, rebuild=problem is not None, where=str(package.path))
            except PackageError:
                raise
            except (KeyError, TypeError, ValueError) as error:
                raise PackageError(f"{package.path}: {entry['file']} does not describe a model this opfuse can "
                                   f"build ({type(error).__name__}: {error})") from error
            profiles.append(Profile.of(data, entry["batch"], compiled))
    return PackagedModel(profiles, str(package.path), rebuilt_because=problem)
