"""opfuse as an ONNX backend (`onnx.backend.base.Backend`): what ONNX's own conformance cases run against.

Entry point: `OpfuseBackend.prepare(model, device="CPU") -> OpfuseBackendRep`, whose `run(inputs)` returns the
outputs as numpy arrays (a tuple, also indexable by output name). The model is imported
(`opfuse.frontend.onnx_import.load_onnx`) and run through the reference path: the imported graph node by node
through each op's PyTorch reference (`opfuse.frontend.onnx_module.OnnxModule`), no GPU needed. With
`config=FusionConfig(...)` the rep instead compiles the model with `opfuse.compile` at its first run, taking that
run's inputs as the example inputs, and runs the compiled module (on the CPU its kernels run through Triton's
interpreter). opfuse compiles no empty tensor, so a run with an empty input goes through the reference path (there
is nothing for a kernel to compute).

Shape inputs, graph inputs a node reads where its converter needs a constant (a Reshape's shape, a Slice's starts,
`onnx_converters.CONSTANT_INPUTS`), are specialised on: opfuse's shapes are static, so the rep imports the model
for the values each run gives them, as initializers, once per distinct value. So are inputs whose value no node
reads (CastLike's target, Shape's input, an unused input): their value changes nothing. ONNX's conformance cases
pass shapes this way; exported models carry them as constants. `prepare(model, constants=[names])` treats other
inputs so too: weights given as inputs, which opfuse's kernels want as constants (a conv's weight, a batch norm's
scale).

What opfuse cannot run is refused before it runs, never with a wrong result: a node that imports as an opaque op
(an operator without a converter, or a use of a mapped one its converter refuses) raises `UnsupportedOnnxNode`,
which names the operator, the node and the model's opset, and says why. That is at `prepare`; for a model with
inputs read as constants, an operator without a converter is refused at `prepare` and a use its converter refuses at the run
that imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from opfuse.frontend.onnx_converters import CONSTANT_INPUTS, CONVERTERS
from opfuse.frontend.onnx_import import (UnsupportedOnnxNode, describe_source, load_onnx, standard_opset,
                                         supported_operators)
from opfuse.frontend.onnx_module import OnnxModule
from opfuse.ir.graph import GraphError, TensorType, dtype_name


def _device(device: str) -> torch.device:
    parsed = Device(device)
    return torch.device("cpu") if parsed.type == DeviceType.CPU else torch.device("cuda", parsed.device_id)


def to_tensor(array: Any, name: str, expected: TensorType, where: str) -> torch.Tensor:
    """A run input (an array or a TensorProto) as a tensor of its graph input's type; any other shape or dtype is an
    error naming it."""
    array = numpy_helper.to_array(array) if isinstance(array, onnx.TensorProto) else np.asarray(array)
    if array.dtype.name == "bfloat16":   # ml_dtypes' bfloat16: torch reads its bits
        # (np.array keeps a 0-d array 0-d, where np.ascontiguousarray would make it 1-d)
        tensor = torch.from_numpy(np.array(array, copy=True, order="C").view(np.int16)).view(torch.bfloat16)
    else:
        try:
            tensor = torch.from_numpy(np.array(array, copy=True))
        except TypeError as error:
            raise GraphError(f"{where}: input {name!r} has dtype {array.dtype}, which opfuse does not run") from error
    if tuple(tensor.shape) != expected.shape or dtype_name(tensor.dtype) != expected.dtype:
        raise GraphError(f"{where}: input {name!r} is {expected} in the model, got {array.dtype}{list(array.shape)}")
    return tensor


def to_array(tensor: torch.Tensor) -> np.ndarray:
    """An output as a numpy array of its dtype (bfloat16 as ml_dtypes' bfloat16, which onnx uses)."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes   # onnx's own dependency for bfloat16 arrays

        return tensor.view(torch.int16).numpy().copy().view(ml_dtypes.bfloat16)
    return tensor.numpy().copy()


@dataclass
class Imported:
    """The model (with the values of the inputs read as constants as initializers), its graph as a module, and its
    compiled form."""

    model: onnx.ModelProto
    module: OnnxModule
    compiled: torch.nn.Module | None = None


class OpfuseBackendRep(BackendRep):
    """A prepared model: `run(inputs)` (a sequence in the graph's input order, or a mapping by name) returns its
    outputs as numpy arrays. The graph is imported once per value of the inputs read as constants (when there are
    none, at `prepare`)."""

    def __init__(self, model: onnx.ModelProto, device: torch.device, config: Any = None,
                 constant_inputs: Sequence[str] = ()):
        self.model, self.device, self.config = model, device, config
        initializers = {t.name for t in model.graph.initializer}
        self.inputs = {v.name: v for v in model.graph.input if v.name not in initializers}
        self.constant_inputs = tuple(constant_inputs)
        self.output_names = [value.name for value in model.graph.output]
        self.where = describe_source(model)
        self.imported: dict[tuple, Imported] = {}   # the constant inputs' values -> the model imported for them
        if not self.constant_inputs:
            self.imported_for({})

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        arrays = self.named_inputs(inputs)
        imported = self.imported_for({name: arrays[name] for name in self.constant_inputs})
        names = [name for name in self.inputs if name not in self.constant_inputs]
        tensors = [to_tensor(arrays[name], name, node.type, self.where).to(self.device)
                   for name, node in zip(names, imported.module.graph.input_nodes)]
        # opfuse compiles no empty tensor (nothing for a kernel to do): a run with one goes through the graph
        compile = self.config is not None and all(t.numel() for t in tensors)
        if compile and imported.compiled is None:
            import opfuse

            imported.compiled = opfuse.compile(imported.model, tensors, self.config)
        with torch.inference_mode():
            outputs = (imported.compiled if compile else imported.module)(*tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return namedtupledict("Outputs", self.output_names)(*(to_array(y) for y in outputs))

    def named_inputs(self, inputs: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
        if isinstance(inputs, Mapping):
            missing = [name for name in self.inputs if name not in inputs]
            if missing:
                raise GraphError(f"{self.where}: no value given for input {missing[0]!r}")
            return {name: inputs[name] for name in self.inputs}
        if isinstance(inputs, (np.ndarray, onnx.TensorProto)):
            inputs = [inputs]
        if len(inputs) != len(self.inputs):
            raise GraphError(f"{self.where}: the model takes {len(self.inputs)} inputs ({', '.join(self.inputs)}), "
                             f"{len(inputs)} given")
        return dict(zip(self.inputs, inputs))

    def imported_for(self, shape_values: Mapping[str, Any]) -> Imported:
        """The imported graph for these values of the constant inputs, which become initializers of a copy."""
        arrays = {name: numpy_helper.to_array(v) if isinstance(v, onnx.TensorProto) else np.asarray(v)
                  for name, v in shape_values.items()}
        key = tuple((name, a.dtype.str, a.shape, a.tobytes()) for name, a in arrays.items())
        if key not in self.imported:
            model = self.model
            if arrays:
                model = onnx.ModelProto()
                model.CopyFrom(self.model)
                for name, array in arrays.items():
                    check_constant_input(array, self.inputs[name], self.where)
                    model.graph.initializer.append(numpy_helper.from_array(array, name))
            graph = load_onnx(model, runnable=True)
            self.imported[key] = Imported(model, OnnxModule(graph, self.where).to(self.device))
        return self.imported[key]


# the inputs of which a node reads only the type (shape and dtype), never the values
TYPE_ONLY_INPUTS = {"CastLike": (1,), "Shape": (0,), "Size": (0,), "EyeLike": (0,)}


def shape_inputs_of(model: onnx.ModelProto) -> list[str]:
    """The graph inputs some node reads where its converter needs a constant (`CONSTANT_INPUTS`: a Reshape's shape,
    a Slice's starts, ...), directly or through the arithmetic that computes it (a Pad's pads from a target shape),
    and those whose every reader reads only their type (CastLike's target, Shape's input: reading their value as a
    constant changes nothing, and an empty one then needs no run-time tensor)."""
    initializers = {t.name for t in model.graph.initializer}
    readers: dict[str, list[bool]] = {}
    for node in model.graph.node:
        for index, name in enumerate(node.input):
            type_only = node.domain in ("", "ai.onnx") and index in TYPE_ONLY_INPUTS.get(node.op_type, ())
            readers.setdefault(name, []).append(type_only)
    outputs = {v.name for v in model.graph.output}
    typed = {v.name for v in model.graph.input if all(readers.get(v.name, [])) and v.name not in outputs}
    needed = {node.input[i] for node in model.graph.node if node.domain in ("", "ai.onnx")
              for i in CONSTANT_INPUTS.get(node.op_type, ()) if i < len(node.input) and node.input[i]}
    computed = set(needed)
    for node in reversed(model.graph.node):   # a value needed constant needs its node's inputs constant
        if node.op_type not in ("Shape", "Size") and any(o in computed for o in node.output):
            computed |= {name for name in node.input if name}
    integer = (TensorProto.INT64, TensorProto.INT32)   # through arithmetic, only shape-like (integer) inputs
    return [v.name for v in model.graph.input if v.name not in initializers and (
        v.name in needed or v.name in typed or (v.name in computed and v.type.tensor_type.elem_type in integer))]


def check_constant_input(array: np.ndarray, value: onnx.ValueInfoProto, where: str) -> None:
    """The value of an input read as a constant must have the type the model declares for it."""
    declared = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else None for d in declared.shape.dim]
    if helper.np_dtype_to_tensor_dtype(array.dtype) != declared.elem_type or len(dims) != array.ndim or any(
            d is not None and d != n for d, n in zip(dims, array.shape)):
        raise GraphError(f"{where}: input {value.name!r} is {TensorProto.DataType.Name(declared.elem_type)}{dims} "
                         f"in the model, got {array.dtype}{list(array.shape)}")


def check_operators(model: onnx.ModelProto, where: str) -> None:
    """Raise `UnsupportedOnnxNode` for the first node whose operator has no converter (before any import)."""
    for index, node in enumerate(model.graph.node):
        if node.domain not in ("", "ai.onnx"):
            reason = f"the operator of domain {node.domain!r} is not supported"
        elif node.op_type not in CONVERTERS:
            reason = f"no converter for {node.op_type}; the supported operators are {supported_operators()}"
        else:
            continue
        op_type = node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op_type}"
        raise UnsupportedOnnxNode(where, op_type, node.name or f"{node.op_type}#{index}", standard_opset(model),
                                  reason)


class OpfuseBackend(Backend):
    """opfuse behind ONNX's backend interface; CPU always, CUDA where PyTorch has a GPU."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OpfuseBackendRep:
        """Import `model` and check every node can run; `config` (a FusionConfig) compiles it at the first run.

        Shape inputs (graph inputs that fix a shape: a Reshape's shape, a Slice's starts) and the inputs named in
        `constants` are read at each run and the graph imported for their values, as constants: opfuse's shapes
        are static. The model's operators are then checked here, the rest at the first run."""
        if not cls.supports_device(device):
            raise GraphError(f"device {device!r} is not available to opfuse")
        where = describe_source(model)
        initializers = {t.name for t in model.graph.initializer}
        inputs = [v.name for v in model.graph.input if v.name not in initializers]
        constants = set(kwargs.get("constants", ()))
        unknown = sorted(constants - set(inputs))
        if unknown:
            raise GraphError(f"{where}: constants {unknown} are not inputs of the model (it takes {inputs})")
        constants |= set(shape_inputs_of(model))
        constant_inputs = [name for name in inputs if name in constants]
        if constant_inputs:
            check_operators(model, where)
        return OpfuseBackendRep(model, _device(device), kwargs.get("config"), constant_inputs)

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU", outputs_info=None, **kwargs: Any):
        raise NotImplementedError("opfuse runs whole models (prepare / run_model), not single nodes: make a "
                                  "one-node model with onnx.helper")

    @classmethod
    def supports_device(cls, device: str) -> bool:
        try:
            parsed = Device(device)
        except (AttributeError, ValueError):
            return False
        return parsed.type == DeviceType.CPU or (parsed.type == DeviceType.CUDA and torch.cuda.is_available())


prepare = OpfuseBackend.prepare
run_model = OpfuseBackend.run_model
supports_device = OpfuseBackend.supports_device
