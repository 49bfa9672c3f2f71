"""A graph built op by op for kernel tests: all tensors in one dtype, seeded random constants and inputs, and the
FusionGroup of everything computed (what the planner would hand a kernel template)."""

from __future__ import annotations

import torch

from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.ir.graph import Graph, TensorType, torch_dtype
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import FusionKind, infer_type, kind_of


class KernelGraph:
    default_kind = GroupKind.SINGLE

    def __init__(self, dtype: str = "float32", seed: int = 0):
        self.graph = Graph("test")
        self.dtype = dtype
        self.generator = torch.Generator().manual_seed(seed)
        self.feeds: dict[str, torch.Tensor] = {}

    def random(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator)

    def input(self, name: str, shape: tuple[int, ...], value: torch.Tensor | None = None) -> str:
        """A graph input; `value` (any strides) is what the test feeds, default channels-last when 4-D."""
        if value is None:
            value = self.random(*shape)
            if len(shape) == 4:
                value = value.to(memory_format=torch.channels_last)
        self.feeds[name] = value.to(torch_dtype(self.dtype))
        return self.graph.add_input(name, TensorType(shape, self.dtype)).name

    def const(self, name: str, tensor: torch.Tensor) -> str:
        return self.graph.add_constant(name, tensor.to(torch_dtype(self.dtype))).name

    def op(self, op: str, *inputs: str, **attrs) -> str:
        node_type = infer_type(op, [self.graph[i].type for i in inputs], attrs)
        return self.graph.add_node(op, inputs, node_type, attrs).name

    def group(self, outputs: list[str], kind: GroupKind | None = None) -> FusionGroup:
        """One group of every computed node; inputs in first-use order; the anchor, if any, found by kind."""
        self.graph.outputs = list(outputs)
        nodes = [n.name for n in self.graph if n.op not in ("input", "constant")]
        inputs: list[str] = []
        for name in nodes:
            for i in self.graph[name].inputs:
                if i not in nodes and i not in inputs:
                    inputs.append(i)
        anchor = next((n for n in nodes if kind_of(self.graph[n]) is FusionKind.ANCHOR), None)
        return FusionGroup(0, kind or self.default_kind, nodes, anchor=anchor, inputs=inputs,
                           outputs=list(outputs))

    def check(self, outputs: list[str], results: list[torch.Tensor]) -> None:
        """The kernel's results against the float32 reference of the whole graph: shape, dtype, every element
        written (outputs are NaN-poisoned before the kernel runs), relative error 1e-4 (float32) or 1e-2."""
        reference_graph = self.graph.copy()
        reference_graph.constants = {k: v.float() for k, v in self.graph.constants.items()}
        expected = interpret(reference_graph, [self.feeds[n.name].float() for n in self.graph.input_nodes])
        tolerance = 1e-4 if self.dtype == "float32" else 1e-2
        assert len(results) == len(expected) == len(outputs)
        for name, got, want in zip(outputs, results, expected):
            assert got.shape == want.shape, name
            assert got.dtype == torch_dtype(self.graph[name].type.dtype), name
            assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) elements"
            assert rel_err(got, want) < tolerance, (name, rel_err(got, want))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-12))


def with_random_batch_norms(model: torch.nn.Module) -> torch.nn.Module:
    """The model with non-trivial BatchNorm statistics and scales (so folding them matters), changed in place."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.weight.uniform_(0.5, 1.5)
    return model
