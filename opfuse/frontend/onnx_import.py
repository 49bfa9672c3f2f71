"""ONNX frontend: an ONNX file becomes the same opfuse IR graph the torch.export frontend makes.

Entry point: `load_onnx(source, batch=None, runnable=False)`, the source a path, the file's bytes or an
onnx.ModelProto (never changed); `opfuse.frontend.onnx_module` makes a runnable module of it, which
`opfuse.compile` compiles. With `runnable=True` (the module, the backend) a node opfuse cannot run is an
`UnsupportedOnnxNode` error naming the operator, the node and the opset, and listing the supported operators;
without it (analysis) it stays in the graph as an opaque node.

Steps: read and check the model, fix the symbolic dimensions at the examples' sizes (a dynamic model's: its bucket's),
run ONNX shape inference (strict: a malformed node is reported here, by name), then convert node by node:
- nodes whose inputs are all known at import time (weights, `Shape` of a static tensor, `Constant`) are
  evaluated with ONNX's reference evaluator and become `constant` nodes; this resolves the shape arithmetic
  exporters emit in front of `Reshape`;
- mapped ops become IR ops, typed by `opfuse.ir.ops.infer_type`; each result is checked against ONNX's own
  shape inference, so a mapping that differs from ONNX semantics fails loudly instead of computing wrong values;
- everything else (and a mapped op used in a way the IR cannot express, such as a 3-D pool, or
  carrying an attribute its converter does not understand) becomes an `opaque` node, attrs
  {"target": "onnx::<OpType>", "onnx_attrs": {...}, "reason"?: str}, typed by ONNX shape inference. It can be
  analysed but not run.
Afterwards the Erf form of GELU is rewritten to one `gelu` node and dead nodes are dropped.

Choices worth knowing: MatMul (and Gemm) with a constant 2-D right-hand side become `linear` with the weight
transposed at import ([K, N] -> [N, K], PyTorch's layout), so the planner sees the same op as for nn.Linear.
Convolution is mapped in 1-D (as 2-D, one high) and 2-D, ConvTranspose in 1-D to 3-D, pooling in 1-D, 2-D and
3-D; others are opaque. Resize and Upsample become constant gathers and weights (`onnx_resize`). The converters
live in `onnx_converters` (elementwise, normalisation, reductions, matrix products), `onnx_layout` and
`onnx_spatial` (convolution, pooling).
"""

from __future__ import annotations

import math
import os
import re
from typing import Any, Sequence, Union

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from opfuse.frontend.onnx_converters import CONVERTERS, ONNX_DTYPES, Unsupported, unknown_attributes
from opfuse.ir.graph import Graph, GraphError, TensorType, torch_dtype
from opfuse.ir.ops import infer_type
from opfuse.ir.verify import verify
from opfuse.passes.eliminate_dead_code import eliminate_dead_code

TWO_GIB = 2 ** 31
# Ops never evaluated at import time even when all their inputs are constant: their results are not fixed.
NOT_FOLDABLE = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                "Bernoulli"}


OnnxSource = Union[str, os.PathLike, bytes, onnx.ModelProto]


class UnsupportedOnnxNode(GraphError):
    """An ONNX node opfuse imports but cannot run; `op_type`, `node`, `opset` and `reason` say which and why."""

    def __init__(self, where: str, op_type: str, node: str, opset: int, reason: str):
        self.op_type, self.node, self.opset, self.reason = op_type, node, opset, reason
        super().__init__(f"{where}: ONNX operator {op_type} (opset {opset}) at node {node!r} is not supported by "
                         f"opfuse: {reason}")


def standard_opset(model: onnx.ModelProto) -> int:
    """The version of the standard ONNX domain the model imports (1 when it names none, as ONNX defaults)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def supported_operators() -> str:
    """The standard-domain operators opfuse converts, for messages."""
    return ", ".join(sorted(CONVERTERS))


def check_runnable(graph: Graph, opset: int, where: str) -> None:
    """Raise `UnsupportedOnnxNode` for the first opaque node of an imported graph: it has no PyTorch reference."""
    for node in graph:
        if node.op != "opaque":
            continue
        op_type = node.attrs.get("target", "onnx::?").removeprefix("onnx::")
        reason = node.attrs.get("reason")
        if reason is None:
            reason = (f"the operator of domain {op_type.rpartition('.')[0]!r} is not supported" if "." in op_type
                      else f"no converter for {op_type}; the supported operators are {supported_operators()}")
        raise UnsupportedOnnxNode(where, op_type, node.source or node.name, opset, reason)


def load_onnx(source: OnnxSource, batch: int | None = None, runnable: bool = False,
              shapes: Sequence[Sequence[int]] | None = None) -> Graph:
    """The IR graph of an ONNX model (a file's path, its bytes or an onnx.ModelProto); a symbolic first dim of an
    input becomes `batch` (default 1), or, with `shapes` (one per graph input that is no initializer: the example
    inputs'), every symbolic dim becomes the example's size (`_pin_dims`). With `runnable`, a node opfuse cannot
    run is an `UnsupportedOnnxNode` error; without, an opaque node (it can be analysed)."""
    path = describe_source(source)
    batch = 1 if batch is None else int(batch)
    model = _read_model(source)
    if shapes is not None:
        _pin_dims(model, path, shapes)
    else:
        _fix_batch_dim(model, path, batch)
    model = _infer_shapes(model, path)
    graph = Importer(model, path).run()
    if runnable:
        check_runnable(graph, standard_opset(model), path)
    _rewrite_erf_gelu(graph)
    graph, _ = eliminate_dead_code(graph)
    try:
        verify(graph)
    except GraphError as error:
        raise GraphError(f"{path}: imported graph is malformed: {error}") from error
    return graph


def _infer_shapes(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """The model with ONNX's inferred shapes, strictly: a malformed node is an error naming it. Two errors are
    ONNX's own, not the model's, and the shapes are then inferred without strict mode, each converter's result still
    checked against them (`Importer.check_types`): one inside the function body ONNX defines an operator by
    (MeanVarianceNormalization's in onnx 1.23), and a declared shape that ONNX's inference of an operator opfuse
    converts disagrees with (onnx 1.23 infers STFT's bins as if onesided defaulted to 0; its definition and
    reference say 1): the converter computes the operator's definition, which the declared shape must then match."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=True, data_prop=True)
    except Exception as error:  # InferenceError names the op type and node
        message = str(error)
        nested = message.count("Inference error(s): (op_type:") >= 2
        disputed = re.fullmatch(r".*\(op_type:(\w+)(?:, node name: [^)]*)?\): \[ShapeInferenceError\] Inferred shape "
                                r"and existing shape differ in dimension \d+: \(\d+\) vs \(\d+\)\s*", message, re.S)
        if not nested and not (disputed and disputed.group(1) in CONVERTERS and message.count("(op_type:") == 1):
            raise GraphError(f"{path}: ONNX shape inference failed: {message}".strip()) from error
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)


def describe_source(source: OnnxSource) -> str:
    """How messages name an ONNX source: its path, or what it is."""
    if isinstance(source, onnx.ModelProto):
        return f"ONNX model {source.graph.name or '(unnamed)'}"
    if isinstance(source, (bytes, bytearray)):
        return f"ONNX model of {len(source)} bytes"
    return os.fspath(source)


def _read_model(source: OnnxSource) -> onnx.ModelProto:
    """The parsed and checked model (a copy: the caller's ModelProto is never changed); any problem becomes a
    GraphError naming the file."""
    path = describe_source(source)
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
    else:
        if not isinstance(source, (bytes, bytearray)):
            if not os.path.exists(path):
                raise GraphError(f"{path}: no such ONNX file")
            if not os.path.isfile(path):
                raise GraphError(f"{path}: not a file, so not an ONNX model")
        try:
            if isinstance(source, (bytes, bytearray)):
                model = onnx.load_from_string(bytes(source))
            else:
                model = onnx.load(path, load_external_data=False)
                _check_external_files(model, path)
                onnx.load_external_data_for_model(model, os.path.dirname(os.path.abspath(path)))
        except GraphError:
            raise
        except Exception as error:  # DecodeError for truncated or garbage files, OSError, bad external data
            raise GraphError(f"{path}: not a readable ONNX model ({type(error).__name__}: {error})") from error
    if model.ByteSize() >= TWO_GIB:
        raise GraphError(f"{path}: models of 2 GiB or more are not supported (protobuf limit)")
    try:
        onnx.checker.check_model(model)
    except Exception as error:  # ValidationError: messages name the bad node and field
        raise GraphError(f"{path}: invalid ONNX model: {error}".strip()) from error
    return model


def _check_external_files(model: onnx.ModelProto, path: str) -> None:
    """A tensor whose data lives in a missing external file is an error naming the tensor and the file (one
    outside the model's directory is left to onnx's loader, which refuses it)."""
    directory = os.path.dirname(os.path.abspath(path))
    attribute_tensors = [a.t for n in model.graph.node for a in n.attribute if a.HasField("t")]
    for tensor in [*model.graph.initializer, *attribute_tensors]:
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        full = os.path.normpath(os.path.join(directory, location))
        if os.path.dirname(full).startswith(directory) and not os.path.isfile(full):
            raise GraphError(f"{path}: tensor {tensor.name!r} keeps its data in the external file {location!r}, "
                             f"which is missing (looked for {full}); copy it next to the model")


def runtime_inputs(model: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """The graph inputs a call passes: those that are no initializers, in order."""
    initializers = {t.name for t in model.graph.initializer}
    return [v for v in model.graph.input if v.name not in initializers]


def _name_dims(model: onnx.ModelProto, sizes: dict[str, int]) -> None:
    """Outputs and value_info naming a symbolic dim of `sizes` take its size, so that they agree with the inputs."""
    for value in [*model.graph.output, *model.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in sizes:
                dim.dim_value = sizes[dim.dim_param]


def _fix_batch_dim(model: onnx.ModelProto, path: str, batch: int) -> None:
    """Give every graph input a static shape: a symbolic first dim becomes `batch`; any other is an error."""
    batch_names: set[str] = set()
    for value in runtime_inputs(model):
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            raise GraphError(f"{path}: input {value.name!r} has no tensor shape; export it with a fixed shape")
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                continue
            if i != 0:
                raise GraphError(f"{path}: input {value.name!r} has symbolic dim {i} "
                                 f"({dim.dim_param or 'unnamed'}); only the first (batch) dim may be dynamic: "
                                 "export the model with a fixed shape for it")
            if batch < 1:   # only a symbolic batch dim takes it: a fixed one may be anything, 0 included
                raise GraphError(f"{path}: batch must be at least 1, got {batch}")
            if dim.dim_param:
                batch_names.add(dim.dim_param)
            dim.dim_value = batch
    _name_dims(model, dict.fromkeys(batch_names, batch))   # exporters repeat the batch name in outputs, value_info


def _pin_dims(model: onnx.ModelProto, path: str, shapes: Sequence[Sequence[int]]) -> None:
    """Give every symbolic dim of the graph inputs the size of their examples' (`shapes`, in the order of the
    inputs that are no initializers); inputs naming one symbolic dim (dim_param) must agree on it, and outputs and
    value_info naming it take it too. Fixed dims are left for the caller to compare with the examples."""
    inputs = runtime_inputs(model)
    if len(shapes) != len(inputs):
        raise GraphError(f"{path}: the model takes {len(inputs)} inputs ({', '.join(v.name for v in inputs)}), "
                         f"{len(shapes)} example inputs given")
    sizes: dict[str, int] = {}
    for value, shape in zip(inputs, shapes):
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            raise GraphError(f"{path}: input {value.name!r} has no tensor shape; export it with a fixed shape")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            continue            # the caller compares the example with the input's type, and names both
        for axis, (dim, size) in enumerate(zip(dims, shape)):
            if dim.HasField("dim_value"):
                continue
            if dim.dim_param:
                if sizes.setdefault(dim.dim_param, size) != size:
                    raise GraphError(f"{path}: inputs disagree on {dim.dim_param!r}: {sizes[dim.dim_param]} and "
                                     f"{size} (input {value.name!r} dim {axis})")
            dim.dim_value = int(size)
    _name_dims(model, sizes)


def _static_type(value: onnx.ValueInfoProto) -> TensorType | None:
    """The TensorType of a value ONNX fully knows (static shape, dtype opfuse supports), else None."""
    tensor_type = value.type.tensor_type
    if tensor_type.elem_type not in ONNX_DTYPES or not tensor_type.HasField("shape"):
        return None
    dims = tensor_type.shape.dim
    if not all(d.HasField("dim_value") for d in dims):
        return None
    return TensorType(tuple(d.dim_value for d in dims), ONNX_DTYPES[tensor_type.elem_type])


def _to_torch(array: np.ndarray, what: str) -> torch.Tensor:
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: reinterpret the bits, numpy cannot convert it
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    if array.dtype.name not in ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8",
                                "bool"):
        raise GraphError(f"{what} has dtype {array.dtype}, which opfuse does not support")
    return torch.from_numpy(np.array(array, copy=True))


def _attribute_values(node: onnx.NodeProto) -> dict[str, Any]:
    """The node's attributes as plain Python values (strings decoded, tensors as lists, graphs by name)."""
    values: dict[str, Any] = {}
    for attribute in node.attribute:
        value = helper.get_attribute_value(attribute)
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, TensorProto):
            value = numpy_helper.to_array(value).tolist()
        elif isinstance(value, onnx.GraphProto):
            value = f"<graph {value.name}>"
        elif isinstance(value, list):
            value = [v.decode() if isinstance(v, bytes) else v for v in value]
            if any(isinstance(v, (onnx.GraphProto, TensorProto)) for v in value):
                value = f"<{len(value)} {type(value[0]).__name__}>"
        values[attribute.name] = value
    return values


class Importer:
    """Walks the ONNX graph once, in order, keeping `env`: ONNX value name -> IR node name."""

    def __init__(self, model: onnx.ModelProto, path: str):
        self.model, self.path = model, path
        self.opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
        stem = os.path.splitext(os.path.basename(path))[0]
        self.graph = Graph(name=model.graph.name or stem)
        self.env: dict[str, str] = {}
        self.onnx_types: dict[str, TensorType] = {}
        for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
            t = _static_type(value)
            if t is not None:
                self.onnx_types[value.name] = t
        self.used = {i for n in model.graph.node for i in n.input if i} | {o.name for o in model.graph.output}
        self.transposed: dict[str, str] = {}   # constant name -> its transposed copy, shared by all readers
        self.where, self.source, self.node = "", "", None

    # ---- driving --------------------------------------------------------------------------------
    def run(self) -> Graph:
        initializers = {t.name for t in self.model.graph.initializer}
        for tensor in self.model.graph.initializer:
            data = _to_torch(numpy_helper.to_array(tensor), f"{self.path}: initializer {tensor.name!r}")
            self.env[tensor.name] = self.graph.add_constant(tensor.name, data, source=tensor.name).name
        for value in self.model.graph.input:
            if value.name not in initializers:
                t = _static_type(value)
                if t is None:
                    raise GraphError(f"{self.path}: input {value.name!r} has a dtype opfuse does not support")
                self.env[value.name] = self.graph.add_input(value.name, t).name
        for index, node in enumerate(self.model.graph.node):
            self.convert(index, node)
        for value in self.model.graph.output:
            if value.name not in self.env:
                raise GraphError(f"{self.path}: graph output {value.name!r} is produced by no node")
            self.graph.outputs.append(self.env[value.name])
        return self.graph

    def convert(self, index: int, node: onnx.NodeProto) -> None:
        self.node = node
        self.source = node.name or f"{node.op_type}#{index}"
        self.where = f"{node.name!r} ({node.op_type})" if node.name else f"#{index} ({node.op_type})"
        for name in node.input:
            if name and name not in self.env:
                raise self.error(f"reads {name!r}, which nothing defines before it")
        inputs = [self.env[name] if name else None for name in node.input]
        attrs = _attribute_values(node)
        outputs = None
        if node.domain in ("", "ai.onnx"):
            outputs = self.fold(node, inputs)
            converter = CONVERTERS.get(node.op_type)
            if outputs is None and converter is not None:
                try:
                    unknown = unknown_attributes(node.op_type, attrs)
                    if unknown:   # ignoring an attribute could change the result silently
                        raise Unsupported(f"attribute {', '.join(map(repr, unknown))} of {node.op_type} is not "
                                          "understood by opfuse's converter")
                    outputs = converter(self, node, inputs, attrs)
                    missing = [o for i, o in enumerate(node.output) if o in self.used and
                               (i >= len(outputs) or outputs[i] is None)]
                    if missing:
                        raise Unsupported(f"output {missing[0]!r} has no IR equivalent")
                    self.check_types(node, outputs)
                except Unsupported as reason:
                    outputs = self.opaque(node, inputs, attrs, str(reason))
        if outputs is None:
            outputs = self.opaque(node, inputs, attrs)
        for name, ir_name in zip(node.output, outputs):
            if name and ir_name is not None:
                self.env[name] = ir_name

    def check_types(self, node: onnx.NodeProto, outputs: list[str | None]) -> None:
        """A mapped op must give the type ONNX infers, or its semantics differ from ONNX's."""
        for name, ir_name in zip(node.output, outputs):
            expected = self.onnx_types.get(name)
            if ir_name is not None and expected is not None and self.graph[ir_name].type != expected:
                raise self.error(f"output {name!r} maps to {self.graph[ir_name].type} but ONNX infers {expected}; "
                                 "this attribute combination is not supported")

    def error(self, message: str) -> GraphError:
        return GraphError(f"{self.path}: ONNX node {self.where}: {message}")

    # ---- building blocks for converters ---------------------------------------------------------
    def emit(self, op: str, inputs: list[str], attrs: dict | None = None, name: str | None = None) -> str:
        """Add an IR node typed by the op's reference; returns its name."""
        attrs = attrs or {}
        try:
            result = infer_type(op, [self.graph[i].type for i in inputs], attrs)
        except GraphError as error:
            raise self.error(str(error)) from error
        name = name or next((o for o in self.node.output if o), op)
        return self.graph.add_node(op, inputs, result, attrs, name=name, source=self.source).name

    def constant(self, name: str | None) -> torch.Tensor | None:
        """The tensor of IR node `name` if it is a constant."""
        if name is None or self.graph[name].op != "constant":
            return None
        return self.graph.constants[name]

    def add_constant(self, tensor: torch.Tensor, name: str) -> str:
        return self.graph.add_constant(name, tensor, source=self.source).name

    def scalar(self, value: float, like: str) -> str:
        """A 0-d constant with the dtype of `like`, for mul/add by a number."""
        return self.add_constant(torch.tensor(value, dtype=torch_dtype(self.type(like).dtype)), f"{like}_scalar")

    def type(self, name: str) -> TensorType:
        return self.graph[name].type

    def ints(self, node: onnx.NodeProto, inputs: list, attrs: dict, attr: str, index: int) -> list[int] | None:
        """An int list given as attribute `attr` (older opsets) or as constant input `index` (newer)."""
        if attr in attrs:
            return [int(v) for v in attrs[attr]]
        if index < len(inputs) and inputs[index] is not None:
            value = self.constant(inputs[index])
            if value is None:
                raise Unsupported(f"input {index} ({attr}) is not a constant")
            return [int(v) for v in value.reshape(-1).tolist()]
        return None

    def transposed_constant(self, name: str) -> str:
        if name not in self.transposed:
            tensor = self.constant(name)
            self.transposed[name] = self.add_constant(tensor.t().contiguous(), f"{name}_t")
        return self.transposed[name]

    # ---- constant folding and opaque nodes ------------------------------------------------------
    def fold(self, node: onnx.NodeProto, inputs: list) -> list[str] | None:
        """Constant IR nodes for the outputs of a node computable now, else None."""
        present = [self.constant(i) for i in inputs if i is not None]
        computable = node.op_type == "Constant" or (present and all(t is not None for t in present))
        # bfloat16 would reach the reference evaluator as float32 and come back with the wrong dtype
        if not computable or node.op_type in NOT_FOLDABLE or any(t.dtype == torch.bfloat16 for t in present):
            return None
        from onnx.reference import ReferenceEvaluator  # imported lazily: it is slow to import
        feeds = {name: self.constant(i).numpy() for name, i in zip(node.input, inputs) if name}
        try:
            opsets = {o.domain: o.version for o in self.model.opset_import}
            results = ReferenceEvaluator(node, opsets=opsets).run(None, feeds)
            tensors = [_to_torch(np.asarray(r), "result") for r in results]
        except Exception:  # the reference cannot evaluate it, or its result has no IR dtype: convert as usual
            return None
        return [self.add_constant(t, name) if name else None for name, t in zip(node.output, tensors)]

    def opaque(self, node: onnx.NodeProto, inputs: list, attrs: dict, reason: str | None = None) -> list:
        """One opaque node per used output, typed by ONNX shape inference."""
        domain = "" if node.domain in ("", "ai.onnx") else node.domain + "."
        outputs: list[str | None] = []
        for index, name in enumerate(node.output):
            if not name or name not in self.used:
                outputs.append(None)
                continue
            result = self.onnx_types.get(name)
            if result is None:
                raise self.error(f"ONNX shape inference gives no static type (of a supported dtype) for output "
                                 f"{name!r} of this op, which opfuse cannot map; add a value_info entry with a "
                                 "fixed shape for it")
            op_attrs: dict[str, Any] = {"target": f"onnx::{domain}{node.op_type}", "onnx_attrs": attrs}
            if reason:
                op_attrs["reason"] = reason
            if len(node.output) > 1:
                op_attrs["output_index"] = index
            outputs.append(self.graph.add_node("opaque", [i for i in inputs if i is not None], result, op_attrs,
                                               name=name, source=self.source).name)
        return outputs


# ---- the Erf form of GELU --------------------------------------------------------------------------

def _erf_argument(graph: Graph, erf_input: str) -> str | None:
    """x when `erf_input` is x / sqrt(2) or x * (1 / sqrt(2)), else None."""
    node = graph[erf_input]
    if node.op == "div" and math.isclose(graph.scalar_value(node.inputs[1]) or 0, math.sqrt(2), rel_tol=1e-4):
        return node.inputs[0]
    if node.op == "mul":
        for x, c in (node.inputs, node.inputs[::-1]):
            if math.isclose(graph.scalar_value(c) or 0, math.sqrt(0.5), rel_tol=1e-4):
                return x
    return None


def _mul_factors(graph: Graph, users: dict, name: str) -> list[str]:
    """The leaves of the tree of single-use muls rooted at `name` (which is a mul)."""
    factors = []
    for i in graph[name].inputs:
        if graph[i].op == "mul" and len(users[i]) == 1:
            factors.extend(_mul_factors(graph, users, i))
        else:
            factors.append(i)
    return factors


def _rewrite_erf_gelu(graph: Graph) -> int:
    """Rewrite x * 0.5 * (1 + erf(x / sqrt 2)), factors in any order and grouping, into gelu(x)."""
    rewritten = 0
    for erf in [node for node in graph if node.op == "erf"]:
        users = graph.users()  # recomputed: a rewrite changes the inputs of the node it rewrites
        x = _erf_argument(graph, erf.inputs[0])
        if x is None or len(users[erf.name]) != 1:
            continue
        plus_one = users[erf.name][0]
        one = [i for i in plus_one.inputs if i != erf.name]
        if plus_one.op != "add" or len(one) != 1 or graph.scalar_value(one[0]) != 1.0:
            continue
        candidate = plus_one
        for _ in range(2):  # the product's root is at most two muls above 1 + erf
            if len(users[candidate.name]) != 1 or users[candidate.name][0].op != "mul":
                break
            candidate = users[candidate.name][0]
            factors = _mul_factors(graph, users, candidate.name)
            others = [f for f in factors if f not in (x, plus_one.name)]
            if (len(factors) == 3 and x in factors and plus_one.name in factors and len(others) == 1
                    and math.isclose(graph.scalar_value(others[0]) or 0, 0.5, rel_tol=1e-6)
                    and graph[x].type == candidate.type):
                candidate.op, candidate.inputs, candidate.attrs = "gelu", [x], {"approximate": "none"}
                rewritten += 1
                break
    return rewritten
