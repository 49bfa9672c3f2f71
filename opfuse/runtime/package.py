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
value of the profiles decoded against its type (`opfuse.runtime.package_schema`), every node attribute against its
op's rule (`opfuse.ir.attrs`), every graph through the verifier; every weight against its content key; every
binary as device code with plain metadata. Only then are the kernels generated, here, from the checked plan
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionDecision, FusionGroup, FusionPlan, plain
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, GraphError, Node, TensorType, dtype_name, torch_dtype
from opfuse.runtime import package_schema as schema
from opfuse.runtime.package_schema import SchemaError

FORMAT = 5      # bump when the layout changes: a package of another format is refused, never misread
MANIFEST, WEIGHTS, BINARIES = "manifest.json", "weights.safetensors", "triton/"
MANIFEST_LIMIT = 16 << 20   # bytes the manifest may have (it lists every member: tens of kilobytes)
MAX_MEMBERS = 100_000       # members a package may have (a large model's binaries are a few thousand files)
# a compressed member may inflate to at most this many times its compressed size: the JSON and binaries of real
# packages deflate 3-20x (RESULTS.md), a zip bomb a thousand times
EXPANSION_LIMIT = 100
MACHINE_LOCAL = ("cache_dir", "debug_dir", "compile_workers", "memory_limit")   # FusionConfig fields of this
                                                                                # machine's, never a package's
SHA256 = re.compile(r"[0-9a-f]{64}")


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


def decode_value(value: Any, where: str) -> Any:
    """A node attribute from its JSON (`encode_value`'s tags: {"tuple": [...]}, {"dict": {...}}, {"dtype": name});
    SchemaError for anything else (an untagged object, a tag with more beside it, a dtype name not the IR's)."""
    if isinstance(value, list):
        return [decode_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        if len(value) == 1 and isinstance(value.get("tuple"), list):
            return tuple(decode_value(v, f"{where}[{i}]") for i, v in enumerate(value["tuple"]))
        if len(value) == 1 and isinstance(value.get("dict"), dict):
            return {k: decode_value(v, f"{where}[{k!r}]") for k, v in value["dict"].items()}
        if len(value) == 1 and "dtype" in value:
            return torch_dtype(schema.dtype(value["dtype"], where))
        raise SchemaError(f"{where}: an object that is not a tagged tuple, dict or dtype")
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise SchemaError(f"{where}: {type(value).__name__} is not an attribute value")


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


def decode_graph(data: Any, weights: dict[str, torch.Tensor], where: str) -> Graph:
    """The graph of a profile's JSON, checked: exactly its fields; nodes with identifier names, in topological order,
    of registered ops other than the opaque one (whose Python function no package holds), typed, with attributes as
    their op declares them (`opfuse.ir.attrs`); constants that are weights of the package of their node's type,
    laid out densely; then the verifier (every type re-derived from its op)."""
    from opfuse.ir.attrs import check_attrs
    from opfuse.ir.ops import REGISTRY
    from opfuse.ir.verify import verify

    fields = _fields(data, {"name", "nodes", "outputs", "constants"}, where)
    graph = Graph(schema.decoded(fields["name"], str, f"{where}.name"))
    for index, n in enumerate(schema.decoded(fields["nodes"], list, f"{where}.nodes")):
        at = f"{where}.nodes[{index}]"
        n = _fields(n, {"name", "op", "inputs", "shape", "dtype", "source", "attrs"}, at)
        name = schema.name(n["name"], f"{at}.name")
        op = schema.decoded(n["op"], str, f"{at}.op")
        if op not in REGISTRY or op == "opaque":
            raise SchemaError(f"{at}: op {op[:60]!r} is not an op a package can hold")
        if name in graph.nodes:
            raise SchemaError(f"{at}: a second node named {name}")
        inputs = [schema.name(i, f"{at}.inputs") for i in schema.decoded(n["inputs"], list, f"{at}.inputs")]
        for i in inputs:
            if i not in graph.nodes:
                raise SchemaError(f"{at}: node {name} reads {i!r}, which no node before it defines")
        attrs = schema.decoded(n["attrs"], dict, f"{at}.attrs")
        node = Node(name, op, inputs, {k: decode_value(v, f"{at}.attrs[{k!r}]") for k, v in attrs.items()},
                    TensorType(schema.shape(n["shape"], f"{at}.shape"), schema.dtype(n["dtype"], f"{at}.dtype")),
                    schema.decoded(n["source"], str, f"{at}.source")[:1000])
        try:
            check_attrs(node, REGISTRY[op].attrs)
        except GraphError as error:
            raise SchemaError(f"{at}: {error}") from None
        graph.nodes[name] = node
    graph.outputs = [schema.name(o, f"{where}.outputs") for o in schema.decoded(fields["outputs"], list,
                                                                                f"{where}.outputs")]
    constants = schema.decoded(fields["constants"], dict, f"{where}.constants")
    for name, node in graph.nodes.items():
        if node.op == "constant":
            if name not in constants:
                raise SchemaError(f"{where}: constant node {name} has no entry in constants")
            graph.constants[name] = _constant(node, constants[name], weights, f"{where}.constants[{name!r}]")
    unknown = set(constants) - set(graph.constants)
    if unknown:
        raise SchemaError(f"{where}.constants: {sorted(unknown)[0]!r} is not a constant node")
    try:
        verify(graph)
    except GraphError as error:
        raise SchemaError(f"{where}: {error}") from None
    return graph


def _constant(node: Node, entry: Any, weights: dict[str, torch.Tensor], where: str) -> torch.Tensor:
    """A constant node's tensor: the package's weight of its key, of the node's shape and dtype, laid out with the
    saved strides where those are a dense layout of it (a permutation of its dims, nothing overlapping)."""
    entry = _fields(entry, {"key", "stride"}, where)
    key = schema.decoded(entry["key"], str, f"{where}.key")
    if key not in weights:
        raise SchemaError(f"{where}: weight {key[:40]!r} is not in {WEIGHTS}")
    value = weights[key]
    if TensorType.of(value) != node.type:
        raise SchemaError(f"{where}: weight {key} is {TensorType.of(value)}, node {node.name} is {node.type}")
    stride = schema.decoded(entry["stride"], list[int], f"{where}.stride")
    if not _dense(node.type.shape, stride):
        raise SchemaError(f"{where}: strides {stride} are not a dense layout of shape {list(node.type.shape)}")
    tensor = torch.empty_strided(value.shape, stride, dtype=value.dtype)
    return tensor.copy_(value)


def _dense(shape: tuple[int, ...], stride: list[int]) -> bool:
    """Whether `stride` lays out `shape` densely: dims in some order, each stepping over all the dims inside it."""
    if len(stride) != len(shape) or any(s < 0 for s in stride):
        return False
    if 0 in shape:
        return True
    step = 1
    for size, s in sorted(zip(shape, stride), key=lambda pair: (pair[1], pair[0])):
        if size != 1 and s != step:
            return False
        step *= size
    return True


def _fields(data: Any, names: set[str], where: str) -> dict[str, Any]:
    """`data` as an object with exactly these fields."""
    if not isinstance(data, dict):
        raise SchemaError(f"{where}: expected an object, found {type(data).__name__}")
    if set(data) != names:
        odd = sorted(set(data) ^ names)[0]
        raise SchemaError(f"{where}: field {odd!r} " + ("is missing" if odd in names else "is not one it has"))
    return data


def encode_config(config: KernelConfig) -> dict[str, Any]:
    return {"params": [list(p) for p in config.params], "num_warps": config.num_warps,
            "num_stages": config.num_stages, "form": config.form}


PARAM = re.compile(r"[A-Z][A-Z0-9_]{0,31}")


def decode_config(data: Any, where: str) -> KernelConfig:
    """A kernel config: constexpr parameters that are upper-case names with integer values, a power-of-two number
    of warps, a small number of stages and a form's name. Whether it is one of its kernel's own configs is checked
    once the kernel is built (`build_profile`)."""
    from opfuse.codegen.base import FORM_LIBRARY, FORM_SEPARATE, FORM_TRITON, FORM_UNFUSED

    data = _fields(data, {"params", "num_warps", "num_stages", "form"}, where)
    params = []
    for index, pair in enumerate(schema.decoded(data["params"], list[tuple[str, int]], f"{where}.params")):
        if not PARAM.fullmatch(pair[0]) or not 0 <= pair[1] <= 1 << 20:
            raise SchemaError(f"{where}.params[{index}]: {pair[0][:40]!r} = {pair[1]} is not a kernel parameter")
        params.append(pair)
    warps = schema.decoded(data["num_warps"], int, f"{where}.num_warps")
    stages = schema.decoded(data["num_stages"], int, f"{where}.num_stages")
    form = schema.decoded(data["form"], str, f"{where}.form")
    if warps not in (1, 2, 4, 8, 16, 32) or not 1 <= stages <= 16 or form not in (FORM_TRITON, FORM_LIBRARY,
                                                                                   FORM_UNFUSED, FORM_SEPARATE):
        raise SchemaError(f"{where}: {warps} warps, {stages} stages, form {form[:40]!r} is not a kernel config")
    return KernelConfig(tuple(params), warps, stages, form)


def encode_profile(module: Any, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """An OpfuseModule (what opfuse.compile returns) as a profile's JSON."""
    from torch.utils._pytree import treespec_dumps

    compiled = module.compiled
    plan = compiled.plan
    return {
        "name": module.analysis.name,
        "device": compiled.device.type,
        # this machine's folders, workers and memory are no part of the model
        "config": asdict(replace(compiled.config, **{field: None for field in MACHINE_LOCAL})),
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


PROFILE_FIELDS = {"name", "device", "config", "hardware", "profile", "graph", "groups", "decisions", "kernels",
                  "configs", "fallbacks", "inputs", "output_spec", "output_dtypes", "output_shapes"}


@dataclass
class SavedProfile:
    """A profile of a package, checked and decoded (`decode_profile`): what `build_profile` builds a model from and
    `opfuse.runtime.packaged.Profile` checks calls against."""

    name: str
    device: str
    plan: FusionPlan
    kernels: dict[str, tuple[str, str]]         # group -> (kernel name, Triton source)
    configs: dict[str, KernelConfig]
    fallbacks: dict[str, Reason]
    inputs: list[tuple[tuple[int, ...], str]]    # (shape, dtype) of each input as the caller passes it
    output_spec: Any                            # a TreeSpec
    output_dtypes: list[str]
    output_shapes: list[tuple[int, ...]]


def decode_profile(data: Any, weights: dict[str, torch.Tensor], where: str) -> SavedProfile:
    """A profile's JSON checked against what each of its values must be (module docstring); SchemaError naming the
    first that is not."""
    data = _fields(data, PROFILE_FIELDS, where)
    config = schema.dataclass_of(FusionConfig, data["config"], f"{where}.config",
                                 **{field: None for field in MACHINE_LOCAL})
    if config.dtype is not None:
        schema.dtype(config.dtype, f"{where}.config.dtype")
    graph = decode_graph(data["graph"], weights, f"{where}.graph")
    groups = [schema.dataclass_of(FusionGroup, g, f"{where}.groups[{i}]")
              for i, g in enumerate(schema.decoded(data["groups"], list, f"{where}.groups"))]
    names = {group.name for group in groups}
    for group in groups:
        for node in group.nodes + group.inputs + group.outputs + ([group.anchor] if group.anchor else []):
            if node not in graph.nodes:
                raise SchemaError(f"{where}: group {group.name} names {node[:60]!r}, which is no node of the graph")
    decisions = [schema.dataclass_of(FusionDecision, d, f"{where}.decisions[{i}]")
                 for i, d in enumerate(schema.decoded(data["decisions"], list, f"{where}.decisions"))]
    profile = data["profile"]
    hardware = None if profile is None else schema.dataclass_of(HardwareProfile, profile, f"{where}.profile")
    plan = FusionPlan(graph, groups, decisions, schema.decoded(data["hardware"], str, f"{where}.hardware"), config,
                      hardware)

    def by_group(field: str, decode: Any) -> dict[str, Any]:
        entries = schema.decoded(data[field], dict, f"{where}.{field}")
        unknown = set(entries) - names
        if unknown:
            raise SchemaError(f"{where}.{field}: {sorted(unknown)[0][:60]!r} is not a group of the plan")
        return {group: decode(entry, f"{where}.{field}[{group!r}]") for group, entry in entries.items()}

    kernels = by_group("kernels", lambda e, at: tuple(schema.decoded(_fields(e, {"name", "source"}, at)[k], str,
                                                                     f"{at}.{k}") for k in ("name", "source")))
    configs = by_group("configs", decode_config)
    fallbacks = by_group("fallbacks", lambda e, at: Reason(schema.decoded(_fields(e, {"code", "text"}, at)["code"],
                                                                          Code, f"{at}.code"),
                                                           schema.decoded(e["text"], str, f"{at}.text")))
    inputs = [(schema.shape(_fields(i, {"shape", "dtype"}, f"{where}.inputs")["shape"], f"{where}.inputs"),
               schema.dtype(i["dtype"], f"{where}.inputs")) for i in schema.decoded(data["inputs"], list,
                                                                                   f"{where}.inputs")]
    return SavedProfile(schema.decoded(data["name"], str, f"{where}.name"),
                        schema.decoded(data["device"], str, f"{where}.device"), plan, kernels, configs, fallbacks,
                        inputs, output_spec(data["output_spec"], f"{where}.output_spec"),
                        [schema.dtype(d, f"{where}.output_dtypes") for d in schema.decoded(data["output_dtypes"], list,
                                                                                          f"{where}.output_dtypes")],
                        [schema.shape(o, f"{where}.output_shapes") for o in schema.decoded(data["output_shapes"], list,
                                                                                        f"{where}.output_shapes")])


# the containers an output may be built of: Python's own, and pytree node types this process has registered
# (a transformers ModelOutput, once transformers is imported); never a type named by an import path
BUILTIN_NODES = {"builtins.tuple", "builtins.list", "builtins.dict", "collections.OrderedDict"}


def output_spec(text: Any, where: str) -> Any:
    """The output structure (`treespec_dumps`'s JSON) as a TreeSpec, read without importing anything: every node's
    type is a built-in container or one registered with torch's pytree in this process, and no context holds the
    tagged enum torch's reader would import a module for."""
    from torch.utils import _pytree as pytree

    spec = schema.decoded(text, str, where)
    try:
        protocol, tree = json.loads(spec)
    except (ValueError, TypeError):
        raise SchemaError(f"{where}: not an output structure") from None
    registered = set(getattr(pytree, "SERIALIZED_TYPE_TO_PYTHON_TYPE", {})) | BUILTIN_NODES
    stack = [tree]
    while stack:
        node = _fields(stack.pop(), {"type", "context", "children_spec"}, where)
        if node["type"] is not None and node["type"] not in registered:
            raise SchemaError(f"{where}: output container {str(node['type'])[:60]!r} is not one this process knows")
        if "__enum__" in str(node["context"]):
            raise SchemaError(f"{where}: an output container's context names an enum type")
        stack.extend(schema.decoded(node["children_spec"], list, where))
    try:
        return pytree.treespec_loads(spec)
    except Exception as error:
        raise SchemaError(f"{where}: not an output structure ({type(error).__name__}: {error})") from None


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
