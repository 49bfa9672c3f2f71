"""Constant folding: compute every node whose inputs are all constants once, at compile time, as a new constant.

Entry point: `fold_constants(graph)`. A node folds when it is a pure function of its inputs (every registered op
but sources, and the ``opaque`` calls the frontend marked ``pure``: a deterministic ATen op) and every input is a
constant; its value is `node_value` of those constants, in the graph's order, so chains (a parameter cast,
transposed, reshaped) fold step by step. Customers: a weight that reaches an anchor through a view (GPT-2's
Conv1D is ``addmm(b, x, W)`` with W stored [K, N], captured as a linear whose weight is ``permute(W)``; folded, the
GEMM and conv templates see a constant weight), and what a model computes from shapes alone (the attention masks
and position ids of transformers' models, T5's relative-position bias: `simplify_attention_masks` reads them).

A graph output is never folded: the compiled model would hand every caller the same tensor, its own.

Rules that keep folding from costing memory or traffic:

- a folded constant is contiguous and holds no more storage than its own elements (a slice of a large weight
  does not keep the weight alive); an input constant nothing else reads any more is dropped, so a transposed
  weight replaces its original instead of doubling it;
- a value a computed node reads that has grown past the constants it is computed from (and `SMALL_BYTES`) is
  stored at its smallest broadcast shape, expanded back by a view (an expand of a bias times 2 is the bias times
  2, broadcast in the kernel that reads it);
- a broadcast (an expand, an elementwise op) whose result would be larger than its largest input and than
  `SMALL_BYTES` stays a node where a computed node reads it: an expand of a bias to an activation's shape is a
  broadcast inside a kernel, materialised it is memory and read traffic. Any other op (a gather, a concat, an
  opaque call), and a broadcast whose every reader folds too (a step of a mask computed from constants, as
  Swin's window mask ``a.unsqueeze(1) - a.unsqueeze(2)``), writes its result at every run anyway: it folds up to
  `GROWTH_BYTES`, past which the memory a constant holds for good outweighs one kernel;
- a folded constant is named after its largest input and the op (GPT-2's ``model_h_0_attn_c_attn_weight_permute``;
  a chain appends one op a step), so names depend on the graph alone; it keeps the folded node's ``source``.

A selection (where) by a constant condition that is one value throughout is the operand it selects: transformers
combine a padding mask with an all-true mask function this way, and the mask then stays the [batch, 1, 1, keys]
broadcast it was instead of a [batch, 1, queries, keys] tensor written at every call.

The arithmetic is the op's own, in the graph's dtypes (run after `cast_precision`, it computes what the unfolded
graph would compute at run time).
"""

from __future__ import annotations

import torch

from opfuse.ir.graph import Graph, Node, TensorType, torch_dtype
from opfuse.ir.ops import FusionKind, get_op
from opfuse.passes.eliminate_dead_code import remove_if_unused

SMALL_BYTES = 64 * 1024          # broadcasts up to this size fold even when they grow (masks, position ids)
GROWTH_BYTES = 16 * 1024 * 1024  # other ops' results up to this size fold even when they grow


def fold_constants(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each node whose inputs are all constants replaced by its value, as a constant."""
    graph = graph.copy()
    changes = []
    frontier, sources = _frontier(graph)
    users = graph.users()
    for node in graph:  # a snapshot in topological order: a folded node makes its readers foldable in turn
        if not _foldable(graph, node, node.name in frontier):
            _select_by_constant(graph, node, changes)
            continue
        value = _evaluate(graph, node)
        if value is None:
            continue
        name = graph.unique_name(f"{_largest_input(graph, node)}_{node.op}")
        compact = value
        grown = value.numel() * value.element_size() > max(sources[node.name], SMALL_BYTES)
        if grown and node.name in frontier and not any(u.name in sources for u in users[node.name]):
            compact = smallest_broadcast(value)    # grown past its sources: perhaps a broadcast of a few values
        graph.add_constant(name, compact, source=node.source)
        if compact.shape != value.shape:
            name = graph.add_node("expand", [name], node.type, {"shape": list(node.type.shape)},
                                  name=f"{name}_expand", source=node.source).name
        graph.replace_uses(node.name, name)
        graph.remove(node.name)
        for i in dict.fromkeys(node.inputs):
            remove_if_unused(graph, i)
        changes.append(f"folded {node.op} {node.name} of constants into constant {name}")
    if changes:
        graph.sort()  # a new constant sits at the end, after its readers
    return graph, changes


def _select_by_constant(graph: Graph, node: Node, changes: list[str]) -> None:
    """A where whose condition is a constant one value throughout is the operand it selects, broadcast to the
    where's shape and cast to its dtype (transformers' padding masks: where(true everywhere, mask, true))."""
    if node.op != "where" or not graph.is_constant(node.inputs[0]) or node.name in graph.outputs:
        return
    condition = graph.constants[node.inputs[0]].reshape(-1)
    if condition.numel() == 0 or not bool((condition == condition[0]).all()):
        return
    chosen = node.inputs[1 if bool(condition[0]) else 2]
    value, shape = graph[chosen].type, node.type.shape
    if value.dtype != node.type.dtype:
        chosen = graph.add_node("cast", [chosen], TensorType(value.shape, node.type.dtype),
                                {"dtype": node.type.dtype}, name=f"{node.name}_cast", source=node.source).name
    if len(value.shape) < len(shape):
        chosen = graph.add_node("reshape", [chosen], TensorType((1,) * (len(shape) - len(value.shape)) + value.shape,
                                                                node.type.dtype),
                                {"shape": [1] * (len(shape) - len(value.shape)) + list(value.shape)},
                                name=f"{node.name}_reshape", source=node.source).name
    if graph[chosen].type.shape != shape:
        chosen = graph.add_node("expand", [chosen], node.type, {"shape": list(shape)}, name=f"{node.name}_expand",
                                source=node.source).name
    graph.replace_uses(node.name, chosen)
    graph.remove(node.name)
    for name in dict.fromkeys(node.inputs):
        remove_if_unused(graph, name)
    changes.append(f"replaced {node.name} by {chosen}: its condition {node.inputs[0]} is "
                   f"{bool(condition[0])} everywhere")


def is_pure(node: Node) -> bool:
    """Whether the node's value is a function of its input values alone (so it may be computed at compile time)."""
    if node.op == "opaque":
        return bool(node.attrs.get("pure")) and callable(node.attrs.get("fn"))
    return get_op(node.op).kind is not FusionKind.SOURCE


def growth_limit(node: Node, read_by_computed_nodes: bool) -> int:
    """The most bytes a folded result of `node` may hold beyond its largest input (module docstring)."""
    definition = get_op(node.op)
    broadcast = definition.alias or definition.kind.elementwise
    return SMALL_BYTES if broadcast and read_by_computed_nodes else GROWTH_BYTES


def _frontier(graph: Graph) -> tuple[set[str], dict[str, int]]:
    """The nodes computable from constants alone that a node not so computable reads (or that are outputs), and
    for each node so computable the bytes of the largest constant it is computed from."""
    sources: dict[str, int] = {}
    for node in graph:
        if graph.is_constant(node.name):
            sources[node.name] = node.type.nbytes
        elif is_pure(node) and node.inputs and all(i in sources for i in node.inputs):
            sources[node.name] = max(sources[i] for i in node.inputs)
    read_outside = {i for node in graph if node.name not in sources for i in node.inputs}
    return {name for name in sources if name in read_outside or name in graph.outputs}, sources


def smallest_broadcast(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with every dim along which it does not change cut to size 1 (it broadcasts back to `tensor`), in
    storage of its own size."""
    for dim in range(tensor.dim()):
        if tensor.shape[dim] > 1:
            first = tensor.narrow(dim, 0, 1)
            if bool((tensor == first).all()):
                tensor = first
    return own_storage(tensor.contiguous())


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in storage no larger than itself: a view into part of a larger tensor would keep all of it alive."""
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size() else tensor


def _foldable(graph: Graph, node: Node, on_frontier: bool) -> bool:
    if not is_pure(node) or not node.inputs:
        return False
    if node.name in graph.outputs:   # an output stays computed: a constant output would be the model's own tensor
        return False
    if not all(graph.is_constant(i) for i in node.inputs):
        return False
    largest = max(graph[i].type.nbytes for i in node.inputs)
    return node.type.nbytes <= max(largest, growth_limit(node, on_frontier))


def _largest_input(graph: Graph, node: Node) -> str:
    """The input the folded constant is named after: the largest (the weight, not the scalar), first on ties."""
    return max(node.inputs, key=lambda i: graph[i].type.numel)


def node_value(node: Node, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """A pure node's value on these input values (moved to the largest one's device: python scalars become CPU
    constants), contiguous. None where the reference cannot run here (a float16 op with no CPU kernel) or gives
    another type than the node's; but an opaque call's floating result is cast to the node's floating dtype, which
    `cast_precision` set (an opaque op follows the compute dtype): a value computed from shapes alone folds whatever
    dtype the call computes it in (EdgeNeXt's positional encoding: a float32 cumsum of a mask, in a float16
    graph)."""
    device = max(tensors, key=lambda t: t.numel()).device
    try:
        with torch.no_grad():
            value = get_op(node.op).run([t.to(device) for t in tensors], node.attrs).contiguous()
    except Exception:  # noqa: BLE001 - an opaque call's failure is PyTorch's: the node stays and runs as it is
        return None
    if node.op == "opaque" and value.is_floating_point() and node.type.is_float \
            and tuple(value.shape) == node.type.shape:
        value = value.to(torch_dtype(node.type.dtype))
    return value if TensorType.of(value) == node.type else None


def _evaluate(graph: Graph, node: Node) -> torch.Tensor | None:
    """The node's value on its constants, its storage no larger than itself (a full view of an input may share
    the input's: constants are never written); None where `node_value` is: the node then stays."""
    value = node_value(node, [graph.constants[i] for i in node.inputs])
    return None if value is None else own_storage(value)
