"""A compiled model as a package's profile JSON, both ways: `encode_profile` at save, `decode_profile` at load.

A profile holds data only (`opfuse.runtime.package` lists what): the prepared graph with its constants named by
content key (`encode_graph`, `content_key`), its node attributes as JSON tagged where JSON has no type of its own
(`encode_value`: tuples, string-keyed dicts, dtypes), the groups, decisions and configs as their dataclasses' fields.
Decoding checks every value before anything is built from it (`decode_profile`): against its declared type
(`opfuse.runtime.package_schema`), each node attribute against its op's rule (`opfuse.ir.attrs`), each constant
against its node's type and a dense layout, the graph through the verifier, each output container without importing
anything (`output_spec`); a config's values as a kernel's (`decode_config`). FusionConfig fields that belong to the
machine (`MACHINE_LOCAL`: folders, workers, memory) are never written and never read.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from opfuse.codegen.base import KernelConfig
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionDecision, FusionGroup, FusionPlan, plain
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, GraphError, Node, TensorType, dtype_name, torch_dtype
from opfuse.runtime import package_schema as schema
from opfuse.runtime.package_schema import PackageError, SchemaError

MACHINE_LOCAL = ("cache_dir", "debug_dir", "compile_workers", "memory_limit")   # FusionConfig fields of this
                                                                                # machine's, never a package's


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
        raise SchemaError(f"{where}: weight {key[:40]!r} is not among the package's weights")
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
