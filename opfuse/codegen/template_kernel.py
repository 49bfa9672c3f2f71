"""The runtime half the elementwise and reduction kernels share (`TemplateKernel`): constants held on the device,
runtime inputs bound and checked, outputs allocated in the layout of the largest input, and the launch; with the
kernel's tensor parameters (`KernelArgs`: the signature the code generator writes, the values the launch passes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from opfuse.codegen.base import GroupKernel, KernelConfig, compiled_info
from opfuse.codegen.coordinates import is_channels_last
from opfuse.fusion.plan import FusionGroup
from opfuse.ir.graph import Graph, GraphError, TensorType, torch_dtype

INT32_LIMIT = 2**31 - 1


def extent(tensor: torch.Tensor) -> int:
    """Elements of memory `tensor` spans through its strides (its largest offset + 1): the offsets a kernel computes
    for it need int64 past INT32_LIMIT."""
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


# ---- kernel parameters ------------------------------------------------------------------------------

@dataclass
class TensorParam:
    """One tensor argument of the kernel: a pointer `<prefix>_ptr` and strides `<prefix>_s<d>`."""

    value: str
    prefix: str
    type: TensorType

    def stride(self, d: int) -> str:
        return f"{self.prefix}_s{d}"


class KernelArgs:
    """The kernel's tensor parameters in signature order; registered as the code generator first uses them."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.inputs: dict[str, TensorParam] = {}
        self.outputs: dict[str, TensorParam] = {}

    def input(self, name: str) -> TensorParam:
        if name not in self.inputs:
            self.inputs[name] = TensorParam(name, f"in{len(self.inputs)}", self.graph[name].type)
        return self.inputs[name]

    def output(self, name: str) -> TensorParam:
        if name not in self.outputs:
            self.outputs[name] = TensorParam(name, f"out{len(self.outputs)}", self.graph[name].type)
        return self.outputs[name]

    @property
    def params(self) -> list[TensorParam]:
        return list(self.inputs.values()) + list(self.outputs.values())

    def signature(self) -> str:
        names = []
        for p in self.params:
            names.append(f"{p.prefix}_ptr")
            names.extend(p.stride(d) for d in range(len(p.type.shape)))
        return ", ".join(names)

    def describe(self) -> str:
        """Comment lines giving each parameter's type (not the value behind it: `build_kernel`)."""
        return "\n".join(f"# {p.prefix}: {p.type}" for p in self.params)

    def values(self, tensors: dict[str, torch.Tensor]) -> list:
        values: list = []
        for p in self.params:
            tensor = tensors[p.value]
            values.append(tensor)
            values.extend(tensor.stride())
        return values


# ---- runtime ----------------------------------------------------------------------------------------

def held_constants(graph: Graph, group: FusionGroup, device) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The constants the group reads, on the device in their node dtype, and the one-element ones as literals."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, str] = {}
    for name in dict.fromkeys(group.inputs + [i for n in group.nodes for i in graph[n].inputs]):
        node = graph[name]
        if node.op != "constant":
            continue
        tensor = graph.constants[name]
        if tensor.numel() == 1:
            value = float(tensor.reshape(-1)[0])
            scalars[name] = repr(value) if math.isfinite(value) else f"float('{value}')"
        else:
            tensors[name] = tensor.to(device=device, dtype=torch_dtype(node.type.dtype))
    return tensors, scalars


def group_operands(graph: Graph, group: FusionGroup) -> None:
    """Check that every value the group's nodes read is a member or a declared input (clear error otherwise)."""
    members = set(group.nodes)
    declared = set(group.inputs)
    for name in group.nodes:
        for i in graph[name].inputs:
            if i not in members and i not in declared and not graph.is_constant(i):
                raise GraphError(f"node {graph[name].describe()} of group {group.name} reads {i!r}, which is "
                                 "neither in the group nor among its inputs")
    for o in group.outputs:
        if o not in members:
            raise GraphError(f"group {group.name} outputs {o!r}, which is not one of its nodes")


class TemplateKernel(GroupKernel):
    """The shared runtime half of pointwise and reduction kernels."""

    def __init__(self, graph: Graph, group: FusionGroup, name: str, source: str, device,
                 args: KernelArgs, constants: dict[str, torch.Tensor], function):
        super().__init__(graph, group, name, source)
        self.device = torch.device(device)
        self.args = args
        self.constants = constants
        self.function = function            # the triton.jit function
        self.output_fill: float | None = None   # tests set NaN so an element the kernel misses shows

    def bind(self, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Runtime inputs (in `runtime_inputs` order) plus held constants, by value name, checked against types."""
        names = self.runtime_inputs
        if len(inputs) != len(names):
            raise GraphError(f"kernel {self.name} (group {self.group.name}) takes {len(names)} inputs "
                             f"({', '.join(names)}), got {len(inputs)}")
        tensors = dict(self.constants)
        for name, tensor in zip(names, inputs):
            expected = self.graph[name].type
            if tuple(tensor.shape) != expected.shape:
                raise GraphError(f"kernel {self.name}: input {name} should be {expected}, got "
                                 f"{list(tensor.shape)}")
            tensors[name] = tensor
        return tensors

    def _allocate_outputs(self, tensors: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """New outputs; a state written in place (`Graph.writes_state_in_place`) is the state's own tensor."""
        return [self._output(name, tensors) for name in self.group.outputs]

    def _output(self, name: str, tensors: dict[str, torch.Tensor], given: torch.Tensor | None = None
                ) -> torch.Tensor:
        """The tensor output `name` is written to: for an index_copy, its state's own (the kernels store one only
        where it updates a state in place: `Graph.writes_state_in_place`); else `given`, or a new one."""
        if self.graph[name].op == "index_copy":
            return tensors[self.graph[name].inputs[0]]
        return given if given is not None else self.allocate(name, self.output_channels_last(name, tensors))

    def output_channels_last(self, name: str, tensors: dict[str, torch.Tensor]) -> bool:
        """Outputs take the layout of the largest input: channels-last if that input is channels-last 4-D."""
        candidates = [tensors[i] for i in self.group.inputs if i in tensors]
        if not candidates:
            return False
        largest = max(candidates, key=lambda t: t.numel())   # max keeps the first of equals
        return is_channels_last(largest)

    def allocate(self, name: str, channels_last: bool) -> torch.Tensor:
        type = self.graph[name].type
        memory_format = torch.channels_last if channels_last and len(type.shape) == 4 else torch.contiguous_format
        tensor = torch.empty(type.shape, dtype=torch_dtype(type.dtype), device=self.device,
                             memory_format=memory_format)
        return tensor if self.output_fill is None else tensor.fill_(self.output_fill)

    def outputs_for(self, tensors: dict[str, torch.Tensor],
                    outputs: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor]:
        """The caller's preallocated outputs (any strides), or new ones in the default layout; either way a state
        written in place (`Graph.writes_state_in_place`) is the state's own tensor."""
        if outputs is None:
            return self._allocate_outputs(tensors)
        if len(outputs) != len(self.group.outputs):
            raise GraphError(f"kernel {self.name} writes {len(self.group.outputs)} outputs, got {len(outputs)}")
        return [self._output(name, tensors, output) for name, output in zip(self.group.outputs, outputs)]

    def launch(self, grid: tuple[int, ...], config: KernelConfig, tensors: dict[str, torch.Tensor],
               index_space: int, **constexprs) -> None:
        """Run the kernel; offsets switch to int64 when any tensor's extent or the index space passes int32."""
        widest = max([index_space] + [extent(t) for t in tensors.values() if t.numel()])
        handle = self.function[grid](*self.args.values(tensors), **dict(config.params), **constexprs,
                                     INT64=widest > INT32_LIMIT, num_warps=config.num_warps,
                                     num_stages=config.num_stages)
        self.last_compiled = compiled_info(handle)
