"""An ONNX model as a PyTorch module: what `opfuse.compile` compiles from an .onnx file (`onnx_module`), and the
eager reference it is verified against.

`OnnxModule` holds the imported IR graph (`opfuse.frontend.onnx_import.load_onnx`) and runs it node by node through
each op's PyTorch reference (`opfuse.ir.interpret`), which is how onnxruntime-free "eager" runs an ONNX model. Its
weights are registered buffers, so `.to(device)` and `.to(dtype)` move and cast them like any module's (the
verification casts the reference to float64, and runs its Casts to floating types in float64 too, through
`opfuse.numerics.float_casts_to`: a Cast(to=FLOAT) before a MatMul would otherwise mix float32 and float64).
`opfuse.api.capture` takes its graph as it is, so compiling it never goes through torch.export.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.frontend.onnx_import import OnnxSource, describe_source, load_onnx
from opfuse.ir.graph import Graph, GraphError, dtype_name, torch_dtype
from opfuse.ir.interpret import interpret


class OnnxModule(torch.nn.Module):
    """An imported ONNX graph, run through PyTorch; outputs as the graph lists them (one tensor, or a tuple)."""

    def __init__(self, graph: Graph, source: str):
        super().__init__()
        self.graph = graph
        self.source = source
        self._buffer_names = {}
        for index, name in enumerate(graph.constants):
            self._buffer_names[name] = f"constant_{index}"
            self.register_buffer(f"constant_{index}", graph.constants[name])

    def forward(self, *inputs: torch.Tensor):
        constants = {name: getattr(self, buffer) for name, buffer in self._buffer_names.items()}
        outputs = interpret(self.graph, inputs, constants=constants)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def extra_repr(self) -> str:
        return f"{self.source}, {len(self.graph.input_nodes)} inputs, {len(self.graph.outputs)} outputs"


def onnx_module(source: OnnxSource, example_inputs: Sequence[torch.Tensor] = (), batch: int | None = None
                ) -> OnnxModule:
    """The module of an ONNX model (path, bytes or ModelProto); every symbolic dim of its inputs takes the size of
    the example inputs' (without them, a symbolic first dim takes `batch`), and the example inputs must match the
    model's inputs, each named where not."""
    where = describe_source(source)
    shapes = None
    if example_inputs:
        for index, x in enumerate(example_inputs):
            if not isinstance(x, torch.Tensor):
                raise GraphError(f"{where}: example input {index} must be a tensor, got {type(x).__name__}")
        shapes = [tuple(x.shape) for x in example_inputs]
    graph = load_onnx(source, batch=batch, runnable=True, shapes=shapes)   # a node it cannot run: an error naming it
    expected = graph.input_nodes
    if example_inputs:
        if len(example_inputs) != len(expected):
            raise GraphError(f"{where}: the model takes {len(expected)} inputs "
                             f"({', '.join(n.name for n in expected)}), {len(example_inputs)} example inputs given")
        for node, x in zip(expected, example_inputs):
            if not isinstance(x, torch.Tensor):
                raise GraphError(f"{where}: example input {node.name!r} must be a tensor, got {type(x).__name__}")
            want = node.type
            got = (tuple(x.shape), dtype_name(x.dtype))
            if got[0] != tuple(want.shape) or (x.is_floating_point() != want.is_float) or \
                    (not x.is_floating_point() and got[1] != want.dtype):
                raise GraphError(f"{where}: input {node.name!r} is {want} in the model, the example input is "
                                 f"{got[1]}{list(got[0])}")
    return OnnxModule(graph, where)


def example_inputs_of(module: OnnxModule, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs for `module`'s graph: seeded normal values for floating inputs, zeros for integer ones (an index's
    valid range is not in the model)."""
    generator = torch.Generator().manual_seed(seed)
    inputs = []
    for node in module.graph.input_nodes:
        shape, dtype = node.type.shape, torch_dtype(node.type.dtype)
        inputs.append(torch.randn(shape, generator=generator).to(dtype) if node.type.is_float
                      else torch.zeros(shape, dtype=dtype))
    return tuple(inputs)
