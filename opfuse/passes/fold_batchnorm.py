"""Fold eval-mode batch norm, and constant per-channel scale/shift, into the conv2d or linear before it.

Entry point: `fold_batchnorm(graph)`. A follower computing ``y = conv(x)·s + t`` with one constant s and t per
output channel equals a conv with weight ``w·s`` and bias ``b·s + t``; the follower, its kernel and its full
read and write of the activation disappear. Followers and their (s, t):

- batch_norm (eval):                   s = gamma / sqrt(var + eps),  t = beta - mean·s
- mul / add by a per-channel constant:  (c, 0) / (1, c), either operand order
- sub / div by a per-channel constant:  (1, -c) / (1/c, 0), constant second only

The arithmetic runs in float64 and is rounded once to the weight's (and bias's) dtype.
"""

from __future__ import annotations

import torch

from opfuse.ir.graph import Graph, Node
from opfuse.passes.eliminate_dead_code import remove_if_unused

ANCHORS = ("conv2d", "linear")
COMMUTATIVE = ("mul", "add")


def fold_batchnorm(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each foldable follower merged into its conv2d/linear."""
    graph = graph.copy()
    changes = []
    for follower in graph:  # a snapshot: chains (conv, bn, mul, add) fold one after the other
        value = _scaled_value(graph, follower)
        if value is None or not _can_fold_into(graph, graph[value], follower):
            continue
        producer = graph[value]
        affine = _per_channel_affine(graph, follower, producer)
        if affine is None:
            continue
        _fold_into(graph, producer, *affine)
        graph.replace_uses(follower.name, producer.name)
        graph.remove(follower.name)
        for name in follower.inputs:
            if graph.is_constant(name):
                remove_if_unused(graph, name)
        changes.append(f"folded {follower.op} {follower.name} into {producer.op} {producer.name}")
    if changes:
        graph.sort()  # a newly added bias constant sits after its conv
    return graph, changes


def _scaled_value(graph: Graph, node: Node) -> str | None:
    """The non-constant operand a possible follower scales and shifts, or None if `node` is no follower."""
    if node.op == "batch_norm":
        return node.inputs[0] if all(graph.is_constant(p) for p in node.inputs[1:]) else None
    if node.op in COMMUTATIVE + ("sub", "div"):
        x, other = node.inputs
        if graph.is_constant(other):
            return x
        if node.op in COMMUTATIVE and graph.is_constant(x):
            return other
    return None


def _can_fold_into(graph: Graph, producer: Node, follower: Node) -> bool:
    if producer.op not in ANCHORS or not all(graph.is_constant(p) for p in producer.inputs[1:]):
        return False
    if not graph.constants[producer.inputs[1]].is_floating_point():
        return False
    # another reader would still need the unscaled output
    if producer.name in graph.outputs or [u.name for u in graph.users()[producer.name]] != [follower.name]:
        return False
    # a follower that changes the dtype or broadcasts to a larger shape is not a per-channel affine map
    return follower.type == producer.type


def _channel_axis(producer: Node) -> int:
    """Where the output channels are: dim 1 of a conv's NCHW output, the last dim of a linear's."""
    return 1 if producer.op == "conv2d" else len(producer.type.shape) - 1


def batch_norm_affine(graph: Graph, node: Node, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """An eval batch norm of constant statistics as float64 vectors (scale, shift) per channel on `device`:
    y = x * scale + shift, scale = gamma / sqrt(var + eps), shift = beta - mean * scale."""
    gamma, beta, mean, var = (graph.constants[p].double().to(device) for p in node.inputs[1:])
    scale = gamma / torch.sqrt(var + node.attrs["eps"])
    return scale, beta - mean * scale


def _per_channel_affine(graph: Graph, follower: Node, producer: Node
                        ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float64 vectors (scale, shift), one value per output channel of `producer`, or None."""
    axis = _channel_axis(producer)
    channels = producer.type.shape[axis]
    # on the weight's device: a model's parameters may sit on the GPU while constants the frontend made (python
    # scalars, a batch norm's missing affine) are on the CPU
    device = graph.constants[producer.inputs[1]].device
    if follower.op == "batch_norm":
        if axis != 1:  # batch norm normalises dim 1; a linear's features are dim 1 only for 2-D outputs
            return None
        return batch_norm_affine(graph, follower, device)
    constant = next(i for i in follower.inputs if i != producer.name)
    c = _per_channel_vector(graph.constants[constant], producer.type.shape, axis)
    if c is None:
        return None
    if follower.op == "div" and bool((c == 0).any()):  # x / 0 is inf or nan, which no finite weight reproduces
        return None
    c = c.to(device)
    ones = torch.ones(channels, dtype=torch.float64, device=c.device)
    zeros = torch.zeros_like(ones)
    if follower.op == "mul":
        return c, zeros
    if follower.op == "add":
        return ones, c
    if follower.op == "sub":
        return ones, -c
    return 1 / c, zeros


def _per_channel_vector(tensor: torch.Tensor, out_shape: tuple[int, ...], axis: int) -> torch.Tensor | None:
    """`tensor` as a float64 vector over the channels if it broadcasts as one value per channel, else None."""
    if tensor.dim() > len(out_shape) or tensor.dtype == torch.bool:
        return None
    aligned = (1,) * (len(out_shape) - tensor.dim()) + tuple(tensor.shape)
    if any(size != 1 for d, size in enumerate(aligned) if d != axis):
        return None
    if aligned[axis] not in (1, out_shape[axis]):
        return None
    return tensor.double().reshape(-1).expand(out_shape[axis]).clone()  # owned: it may become the bias


def _fold_into(graph: Graph, producer: Node, scale: torch.Tensor, shift: torch.Tensor) -> None:
    """Give `producer` the weight w·scale and the bias b·scale + shift (new tensors, original dtypes)."""
    weight = graph.constants[producer.inputs[1]]
    per_row = scale.reshape((-1,) + (1,) * (weight.dim() - 1))  # output channels are dim 0 of both layouts
    _set_constant(graph, producer, 1, (weight.double() * per_row).to(weight.dtype), "weight")
    if len(producer.inputs) > 2:
        bias = graph.constants[producer.inputs[2]]
        _set_constant(graph, producer, 2, (bias.double().to(scale.device) * scale + shift).to(bias.dtype), "bias")
    else:
        bias = graph.add_constant(graph.unique_name(f"{producer.name}_bias"), shift.to(weight.dtype))
        producer.inputs.append(bias.name)


def _set_constant(graph: Graph, node: Node, index: int, tensor: torch.Tensor, role: str) -> None:
    """Make input `index` of `node` hold `tensor`: swap the tensor if only `node` reads the old one."""
    name = node.inputs[index]
    readers = [u.name for u in graph.users()[name]]
    if readers == [node.name] and name not in graph.outputs:
        graph.constants[name] = tensor  # a new tensor in the copy's dict; the original stays untouched
    else:  # shared with another node: leave it alone, give this node its own
        node.inputs[index] = graph.add_constant(graph.unique_name(f"{node.name}_{role}"), tensor).name
