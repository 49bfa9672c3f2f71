"""Run a graph node by node through each op's PyTorch reference (`interpret`), or a list of its nodes over values
given by name (`run_nodes`).

This is the semantics every fused kernel is checked against, and the path for anything opfuse runs unfused.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from opfuse.ir.graph import Graph, GraphError, Node
from opfuse.ir.ops import get_op


def interpret(graph: Graph, inputs: Sequence[torch.Tensor], device: torch.device | str | None = None,
              constants: Mapping[str, torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Outputs of `graph` for `inputs` (one per input node, in order); constants (the graph's, or `constants` by
    name) move to the inputs' device."""
    input_nodes = graph.input_nodes
    if len(inputs) != len(input_nodes):
        raise GraphError(f"graph {graph.name} takes {len(input_nodes)} inputs, got {len(inputs)}")
    device = device or (inputs[0].device if inputs else "cpu")
    values: dict[str, torch.Tensor] = {n.name: x for n, x in zip(input_nodes, inputs)}
    remaining_uses = {name: 0 for name in graph.nodes}
    for node in graph.nodes.values():
        for i in node.inputs:
            remaining_uses[i] += 1
    for name in graph.outputs:
        remaining_uses[name] += 1
    for node in graph.nodes.values():
        if node.op == "input":
            continue
        if node.op in ("constant", "state"):
            values[node.name] = (constants if constants is not None else graph.constants)[node.name].to(device)
            continue
        args = [values[i] for i in node.inputs]
        try:
            values[node.name] = get_op(node.op).run(args, node.attrs)
        except GraphError:
            raise
        except Exception as error:
            raise GraphError(f"running node {node.describe()} failed: {error}") from error
        for i in node.inputs:  # free intermediates as soon as their last reader ran
            remaining_uses[i] -= 1
            if remaining_uses[i] == 0:
                values.pop(i, None)
    return [values[name] for name in graph.outputs]


CONV_OPS = ("conv2d", "conv_transpose")


def device_constants(graph: Graph, nodes: Sequence[Node], device: torch.device | str,
                     private: bool = False) -> dict[str, torch.Tensor]:
    """The constants `nodes` read, on `device`, for running them through PyTorch: the graph's own tensors where
    they are there already, or with `private` copies of them. A 4-D conv weight is laid out channels-last, as the
    activations are: cuDNN transposes a mismatched weight on every call (a kernel more per conv; an ONNX model's
    weights come contiguous)."""
    weights = {node.inputs[1] for node in nodes if node.op in CONV_OPS and len(node.inputs) > 1}
    found = {}
    for node in nodes:
        for name in node.inputs:
            if graph.is_constant(name) and name not in found:
                tensor = graph.constants[name].detach().to(device, copy=private)
                if name in weights and tensor.dim() == 4:
                    tensor = tensor.contiguous(memory_format=torch.channels_last)
                found[name] = tensor
    return found


def run_nodes(nodes: Sequence[Node], values: dict[str, torch.Tensor],
              frees: Sequence[Sequence[str]] | None = None, launched: list[int] | None = None
              ) -> dict[str, torch.Tensor]:
    """`values` (by name: every value the nodes read from outside them) with each of `nodes` computed in order
    through its op's PyTorch reference, as eager runs it; `frees`: per node, the values dropped once it has run
    (intermediates no later node reads). Updates `values` and returns it. The kernels' library and unfused forms
    run a group's nodes through it. With `launched`, each node's kernel launches as it ran are appended to it
    (`launches_of`: a view copies or not by the strides its input came with, as its producer wrote them)."""
    for i, node in enumerate(nodes):
        args = [values[name] for name in node.inputs]
        values[node.name] = out = get_op(node.op).run(args, node.attrs)
        if launched is not None:
            launched.append(launches_of(node, args, out))
        for name in frees[i] if frees is not None else ():
            del values[name]
    return values


def launches_of(node: Node, args: Sequence[torch.Tensor], out: torch.Tensor) -> int:
    """Kernel launches of `node` as it just ran through PyTorch on `args` into `out`: one for a computing op; for a
    view, one only where PyTorch copied (its output does not share its input's storage)."""
    op = get_op(node.op)
    if not op.alias:
        return int(op.launches_kernel)
    return int(bool(args) and out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr())
