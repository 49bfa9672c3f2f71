"""Constant folding: compute every node whose inputs are all constants once, at compile time, as a new constant.

Entry point: `fold_constants(graph)`. A node folds when its op has a reference implementation that is a pure
function of its inputs (every registered op but sources and ``opaque``, whose PyTorch call may be anything) and
every input is a constant; its value is `get_op(op).run` on those constants, in the graph's order, so chains
(a parameter cast, transposed, reshaped) fold step by step. The main customer is a weight that reaches an anchor
through a view: GPT-2's Conv1D is ``addmm(b, x, W)`` with W stored [K, N], captured as a linear whose weight is
``permute(W)``; folded, the GEMM and conv templates see a constant weight.

A graph output is never folded: the compiled model would hand every caller the same tensor, its own.

Rules that keep folding from costing memory or traffic:

- a folded constant is contiguous and holds no more storage than its own elements (a slice of a large weight
  does not keep the weight alive); an input constant nothing else reads any more is dropped, so a transposed
  weight replaces its original instead of doubling it;
- a node whose result would be larger than its largest input and than `SMALL_BYTES` stays a node: an expand of
  a bias to an activation's shape is a broadcast inside a kernel, materialised it is memory and read traffic;
- a folded constant is named after its largest input and the op (GPT-2's ``model_h_0_attn_c_attn_weight_permute``;
  a chain appends one op a step), so names depend on the graph alone; it keeps the folded node's ``source``.

The arithmetic is the op's own, in the graph's dtypes (run after `cast_precision`, it computes what the unfolded
graph would compute at run time).
"""

from __future__ import annotations

import torch

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.ir.ops import FusionKind, get_op
from opfuse.passes.eliminate_dead_code import remove_if_unused

SMALL_BYTES = 64 * 1024   # results up to this size fold even when they grow (masks, position ids)


def fold_constants(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each node whose inputs are all constants replaced by its value, as a constant."""
    graph = graph.copy()
    changes = []
    for node in graph:  # a snapshot in topological order: a folded node makes its readers foldable in turn
        if not _foldable(graph, node):
            continue
        value = _evaluate(graph, node)
        if value is None:
            continue
        name = graph.unique_name(f"{_largest_input(graph, node)}_{node.op}")
        graph.add_constant(name, value, source=node.source)
        graph.replace_uses(node.name, name)
        graph.remove(node.name)
        for i in dict.fromkeys(node.inputs):
            remove_if_unused(graph, i)
        changes.append(f"folded {node.op} {node.name} of constants into constant {name}")
    if changes:
        graph.sort()  # a new constant sits at the end, after its readers
    return graph, changes


def _foldable(graph: Graph, node: Node) -> bool:
    if node.op == "opaque" or get_op(node.op).kind is FusionKind.SOURCE or not node.inputs:
        return False
    if node.name in graph.outputs:   # an output stays computed: a constant output would be the model's own tensor
        return False
    if not all(graph.is_constant(i) for i in node.inputs):
        return False
    largest = max(graph[i].type.nbytes for i in node.inputs)
    return node.type.nbytes <= max(largest, SMALL_BYTES)


def _largest_input(graph: Graph, node: Node) -> str:
    """The input the folded constant is named after: the largest (the weight, not the scalar), first on ties."""
    return max(node.inputs, key=lambda i: graph[i].type.numel)


def _evaluate(graph: Graph, node: Node) -> torch.Tensor | None:
    """The node's value on its constants (on the largest one's device), contiguous, its storage no larger than
    itself (a full view of an input may share the input's: constants are never written). None where the reference
    cannot run here (a float16 op with no CPU kernel) or gives another type than the node's: the node then stays."""
    tensors = [graph.constants[i] for i in node.inputs]
    device = graph.constants[_largest_input(graph, node)].device  # python scalars become CPU constants
    try:
        with torch.no_grad():
            value = get_op(node.op).run([t.to(device) for t in tensors], node.attrs).contiguous()
    except (RuntimeError, NotImplementedError):
        return None
    if TensorType.of(value) != node.type:
        return None
    if value.untyped_storage().nbytes() > value.numel() * value.element_size():
        value = value.clone()  # a view into part of an input: it would keep the whole input alive
    return value
