"""opfuse as an ONNX backend (`onnx.backend.base.Backend`): what ONNX's own conformance cases run against.

Entry point: `OpfuseBackend.prepare(model, device="CPU") -> OpfuseBackendRep`, whose `run(inputs)` returns the
outputs as numpy arrays (a tuple, also indexable by output name). The model is imported
(`opfuse.frontend.onnx_import.load_onnx`) and run through the reference path: the imported graph node by node
through each op's PyTorch reference (`opfuse.frontend.onnx_module.OnnxModule`), no GPU needed. With
`config=FusionConfig(...)` the rep instead compiles the model with `opfuse.compile` at its first run, taking that
run's inputs as the example inputs, and runs the compiled module (on the CPU its kernels run through Triton's
interpreter).

What opfuse cannot run is refused at `prepare`, never at `run` and never with a wrong result: a node that imports as
an opaque op (an operator without a converter, or a use of a mapped one its converter refuses) raises
`UnsupportedOnnxNode`, which names the operator, the node and the model's opset, and says why.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from onnx.backend.base import Backend, BackendRep, Device, DeviceType, namedtupledict

from opfuse.frontend.onnx_converters import CONVERTERS
from opfuse.frontend.onnx_import import describe_source, load_onnx
from opfuse.frontend.onnx_module import OnnxModule
from opfuse.ir.graph import Graph, GraphError, TensorType, dtype_name


class UnsupportedOnnxNode(GraphError):
    """An ONNX node opfuse imports but cannot run; `op_type`, `node`, `opset` and `reason` say which and why."""

    def __init__(self, where: str, op_type: str, node: str, opset: int, reason: str):
        self.op_type, self.node, self.opset, self.reason = op_type, node, opset, reason
        super().__init__(f"{where}: ONNX operator {op_type} (opset {opset}) at node {node!r} is not supported by "
                         f"opfuse: {reason}")


def standard_opset(model: onnx.ModelProto) -> int:
    """The version of the standard ONNX domain the model imports (1 when it names none, as ONNX defaults)."""
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def check_runnable(graph: Graph, model: onnx.ModelProto, where: str) -> None:
    """Raise `UnsupportedOnnxNode` for the first opaque node of an imported graph: it has no PyTorch reference."""
    for node in graph:
        if node.op != "opaque":
            continue
        op_type = node.attrs.get("target", "onnx::?").removeprefix("onnx::")
        reason = node.attrs.get("reason")
        if reason is None:
            reason = (f"the operator of domain {op_type.rpartition('.')[0]!r} is not supported" if "." in op_type
                      else f"no converter for {op_type}; the supported operators are {', '.join(sorted(CONVERTERS))}")
        raise UnsupportedOnnxNode(where, op_type, node.source or node.name, standard_opset(model), reason)


def _device(device: str) -> torch.device:
    parsed = Device(device)
    return torch.device("cpu") if parsed.type == DeviceType.CPU else torch.device("cuda", parsed.device_id)


def to_tensor(array: Any, name: str, expected: TensorType, where: str) -> torch.Tensor:
    """A run input (an array or a TensorProto) as a tensor of its graph input's type; any other shape or dtype is an
    error naming it."""
    array = numpy_helper.to_array(array) if isinstance(array, onnx.TensorProto) else np.asarray(array)
    if array.dtype.name == "bfloat16":   # ml_dtypes' bfloat16: torch reads its bits
        tensor = torch.from_numpy(np.ascontiguousarray(array).view(np.int16).copy()).view(torch.bfloat16)
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


class OpfuseBackendRep(BackendRep):
    """A prepared model: `run(inputs)` (a sequence in the graph's input order, or a mapping by name) returns its
    outputs as numpy arrays."""

    def __init__(self, module: OnnxModule, model: onnx.ModelProto, device: torch.device, config: Any = None):
        self.module, self.model, self.device, self.config = module.to(device), model, device, config
        self.output_names = [value.name for value in model.graph.output]
        self.compiled: torch.nn.Module | None = None

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        tensors = [x.to(self.device) for x in self.input_tensors(inputs)]
        if self.config is not None and self.compiled is None:
            import opfuse

            self.compiled = opfuse.compile(self.model, tensors, self.config)
        with torch.inference_mode():
            outputs = (self.compiled or self.module)(*tensors)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return namedtupledict("Outputs", self.output_names)(*(to_array(y) for y in outputs))

    def input_tensors(self, inputs: Sequence[Any] | Mapping[str, Any]) -> list[torch.Tensor]:
        nodes = self.module.graph.input_nodes
        if isinstance(inputs, Mapping):
            missing = [node.name for node in nodes if node.name not in inputs]
            if missing:
                raise GraphError(f"{self.module.source}: no value given for input {missing[0]!r}")
            inputs = [inputs[node.name] for node in nodes]
        elif isinstance(inputs, np.ndarray):
            inputs = [inputs]
        if len(inputs) != len(nodes):
            raise GraphError(f"{self.module.source}: the model takes {len(nodes)} inputs "
                             f"({', '.join(node.name for node in nodes)}), {len(inputs)} given")
        return [to_tensor(x, node.name, node.type, self.module.source) for node, x in zip(nodes, inputs)]


class OpfuseBackend(Backend):
    """opfuse behind ONNX's backend interface; CPU always, CUDA where PyTorch has a GPU."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OpfuseBackendRep:
        """Import `model` and check every node can run; `config` (a FusionConfig) compiles it at the first run, and
        `batch` fixes a symbolic first input dimension (default 1)."""
        if not cls.supports_device(device):
            raise GraphError(f"device {device!r} is not available to opfuse")
        where = describe_source(model)
        graph = load_onnx(model, batch=kwargs.get("batch"))
        check_runnable(graph, model, where)
        return OpfuseBackendRep(OnnxModule(graph, where), model, _device(device), kwargs.get("config"))

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
