"""Compute the elementwise ops after an anchor before the views the frontend put between them.

Entry point: `elementwise_before_unit_reshapes(graph)`. A 1-D convolution is the 2-D one of [N, C, 1, L] viewed
back as [N, C, L], a causal one is then cut to its first L positions (Mamba's conv, WaveNet's), and a 3-D one is
the 2-D one of [N x D, C, H, W] viewed back to [N, C, D, H, W] (`opfuse.frontend.aten_anchors`,
`opfuse.frontend.conv3d`): the view stood between the conv and the activation, batch norm, scale or residual after
it, and an anchor's epilogue maps no reshape or slice, so none of them joined the conv's kernel (whisper's and
wav2vec2's convs ran alone, their GELUs in kernels of their own). An elementwise op reading such a view at the
view's shape computes the same values before it, and the view moves after it: y = f(V(x), c) -> V(f(x, V^-1(c))).
- A unit reshape (it only inserts or drops size-1 dims): the other operands are viewed alike (a constant reshaped
  in place, anything else through a reshape node; a scalar as it is).
- A slice: only where no other operand varies along the sliced dim (f computes the positions the slice drops as
  well, which cost their arithmetic alone and are never read).
- A permute, or a reshape that regroups dims (`_regroups`): only on a conv3d's way back to rank 5, and only for an
  op whose other operands are constants (permuted or reshaped in place; through a reshape, one that varies only
  along the dims it keeps at its start or end: a per-channel constant). A batch norm there, whose channels the
  permute moves, first becomes a per-channel mul and add (`_as_affine`).
The view must be its source's only reader (a fused QKV projection's output, sliced three ways, keeps its ops
after the slices). The views are followed back from the op to an anchor's output (or a value moved here: a chain
moves op by op), and
`fold_batchnorm` (after this pass) folds a batch norm (or its mul and add) into the conv. A batch norm moves as one
only where its channel dim stays dim 1 and whole. Nothing else changes: views after anything but an anchor, and a
linear's head splits, stay where they are.
"""

from __future__ import annotations

from collections import deque

from opfuse.ir.graph import Graph, Node, TensorType, torch_dtype
from opfuse.ir.ops import FusionKind, kind_of
from opfuse.passes.eliminate_dead_code import remove_if_unused
from opfuse.passes.fold_batchnorm import batch_norm_affine
from opfuse.passes.views_before_prologues import permuted_operand


def elementwise_before_unit_reshapes(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each elementwise op after a unit reshape or slice of an anchor's output computed
    before it."""
    graph = graph.copy()
    changes: list[str] = []
    moved: dict[str, str] = {}    # values this pass computes before a view, and their anchor's op: chains go on
    made: set[str] = set()        # the views of other operands it adds: never moved through (they would go back)
    pending = deque(graph.nodes)
    users = graph.users()       # read again only after a change
    while pending:
        node = graph.nodes.get(pending.popleft())
        if node is None or not kind_of(node).elementwise:
            continue
        view = next((graph[i] for i in node.inputs
                     if i not in made and _movable(graph, users, graph[i], node, moved)), None)
        if view is None:
            first = graph[node.inputs[0]]
            root = _root(graph, first.name, moved) if first.op in VIEWS else None
            if node.op == "batch_norm" and root == "conv2d" and len(first.type.shape) == 5:
                affine = _as_affine(graph, node)        # its channels move: as a per-channel mul and add, they can
                if affine is not None:
                    graph.sort()
                    users = graph.users()
                    pending.extendleft(reversed(affine))
                    changes.append(f"batch_norm {node.name} as a per-channel mul and add ({', '.join(affine)})")
            continue
        source = view.inputs[0]
        inner = tuple(graph[source].type.shape)
        if node.op == "batch_norm":       # its statistics are per channel, dim 1 on both sides
            inputs = [source] + node.inputs[1:]
        else:
            inputs = [source if i == view.name else _viewed(graph, i, view) for i in node.inputs]
            made.update(i for i in inputs if i not in node.inputs and i != source)
        before = graph.add_node(node.op, inputs, TensorType(inner, node.type.dtype), node.attrs,
                                name=f"{node.name}_before_view", source=node.source)
        attrs = {"shape": list(node.type.shape)} if view.op == "reshape" else dict(view.attrs)
        after = graph.add_node(view.op, [before.name], node.type, attrs, name=f"{node.name}_view",
                               source=node.source)
        graph.replace_uses(node.name, after.name)
        graph.remove(node.name)
        remove_if_unused(graph, view.name)      # so that a batch norm's conv has no other reader left
        graph.sort()
        users = graph.users()
        moved[before.name] = _root(graph, source, moved)
        pending.extendleft(user.name for user in users.get(after.name, []))
        pending.appendleft(before.name)         # it may move before the view its source is read through
        changes.append(f"{node.op} {node.name} computed before {view.op} {view.name} of {source} "
                       f"(as {before.name})")
    return graph, changes


def unit_reshape(before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """Whether a reshape from `before` to `after` only inserts or drops size-1 dims."""
    return before != after and [s for s in before if s != 1] == [s for s in after if s != 1]


VIEWS = ("reshape", "slice", "permute")


def _root(graph: Graph, name: str, moved: dict[str, str]) -> str | None:
    """The op of the anchor `name` is computed from through views (`VIEWS`) and ops moved here, or None; through a
    view that regroups dims (`_regroups`) only a conv2d."""
    node, regrouped = graph[name], False
    while node.op in VIEWS and node.name not in moved:
        source = graph[node.inputs[0]]
        regrouped |= _regroups(node, tuple(source.type.shape), tuple(node.type.shape))
        node = source
    root = node.op if kind_of(node) is FusionKind.ANCHOR else moved.get(node.name)
    return None if regrouped and (root != "conv2d" or len(graph[name].type.shape) != 5) else root


def _movable(graph: Graph, users: dict[str, list[Node]], view: Node, reader: Node, moved: dict[str, str]) -> bool:
    """Whether `reader` may be computed before `view`: a view (`VIEWS`) of a value from an anchor (`_root`; one
    that regroups dims only on a conv3d's way back, `_regroups`), read at the reader's own shape, every other
    operand viewable (`_target`; through a regrouping view only constants); a batch norm only where its channels
    stay dim 1 and whole."""
    if view.op not in VIEWS or tuple(view.type.shape) != tuple(reader.type.shape):
        return False
    if [user.name for user in users.get(view.inputs[0], [])] != [view.name]:
        return False        # a QKV projection's slices: the op would compute on what the other readers read
    root = _root(graph, view.inputs[0], moved)
    before, after = tuple(graph[view.inputs[0]].type.shape), tuple(view.type.shape)
    if root is None or (_regroups(view, before, after) and (root != "conv2d" or len(after) != 5)):
        return False
    if _regroups(view, before, after) and not all(graph.is_constant(name) or not graph[name].type.shape
                                                  for name in reader.inputs if name != view.name):
        return False        # a tensor operand would be regrouped too, a copy: the op stays (a residual stream)
    if reader.op == "batch_norm":
        if reader.inputs[0] != view.name or len(before) < 2 or before[:2] != after[:2]:
            return False
        return view.op != "permute" or list(view.attrs["dims"][:2]) == [0, 1]
    return all(_target(graph, name, view) is not None for name in reader.inputs if name != view.name)


def _regroups(view: Node, before: tuple[int, ...], after: tuple[int, ...]) -> bool:
    """A permute, or a reshape that is no unit reshape: an op moves through these only on a conv3d's way back to
    [N, Co, D, H, W] (a conv2d's output viewed at rank 5). Elsewhere they split a linear's heads or flatten a patch
    embedding, and ops moved there left kernels they had joined (llama 18 -> 22, eva02 124 -> 148, hiera 94 -> 97
    launches when any anchor's were allowed)."""
    return view.op == "permute" or (view.op == "reshape" and not unit_reshape(before, after))


def _target(graph: Graph, name: str, view: Node) -> tuple[int, ...] | None:
    """The shape operand `name` of an op reading `view` takes for the same op before the view, or None where none
    gives the same values. A scalar as it is. Through a slice, as it is, where it does not vary along the sliced
    dim. Through a permute, permuted back. Through a unit reshape, each dim of more than one element keeps its size
    and every other is 1; through any other reshape, where the operand varies only along the dims the reshape
    keeps at the start or at the end (a per-channel constant after a conv3d's view back to 5-D)."""
    shape = tuple(graph[name].type.shape)
    before, after = tuple(graph[view.inputs[0]].type.shape), tuple(view.type.shape)
    if not shape:
        return shape
    aligned = (1,) * (len(after) - len(shape)) + shape
    if view.op == "slice":
        return shape if aligned[view.attrs["dim"] % len(after)] == 1 else None
    if view.op == "permute":
        return tuple(aligned[k] for k in _inverse(view.attrs["dims"]))
    if unit_reshape(before, after):
        sizes = iter(size for size, full in zip(aligned, after) if full != 1)
        return tuple(next(sizes) if full != 1 else 1 for full in before)
    prefix = next((k for k in range(min(len(before), len(after))) if before[k] != after[k]),
                  min(len(before), len(after)))
    suffix = next((k for k in range(min(len(before), len(after)) - prefix) if before[-1 - k] != after[-1 - k]),
                  min(len(before), len(after)) - prefix)
    middle = aligned[prefix:len(after) - suffix]
    if any(size != 1 for size in middle):
        return None
    return aligned[:prefix] + (1,) * (len(before) - prefix - suffix) + aligned[len(after) - suffix:]


def _viewed(graph: Graph, name: str, view: Node) -> str:
    """Operand `name` of an op reading `view`, in the shape `_target` gives it: itself where that is its shape;
    through a permute, `permuted_operand` by the inverse permutation; else a constant reshaped in place, anything
    else through a reshape node, a view."""
    shape, target = tuple(graph[name].type.shape), _target(graph, name, view)
    if target == shape:
        return name
    if view.op == "permute":
        return permuted_operand(graph, name, _inverse(view.attrs["dims"]), len(view.type.shape))
    source, dtype = graph[name].source, graph[name].type.dtype
    if graph.is_constant(name) and name in graph.constants:
        return graph.add_constant(f"{name}_viewed", graph.constants[name].reshape(target), source=source).name
    return graph.add_node("reshape", [name], TensorType(target, dtype), {"shape": list(target)},
                          name=f"{name}_viewed", source=source).name


def _inverse(dims) -> list[int]:
    """The permutation that undoes `dims`."""
    return [list(dims).index(d) for d in range(len(dims))]


def _as_affine(graph: Graph, node: Node) -> list[str] | None:
    """A batch norm of constant statistics as x * scale + shift, its constants [1, C, 1, ...] of x's dtype (scale
    and shift computed in float64): what moves through a view that moves its channels (a conv3d's), where the batch
    norm itself cannot. The names of the mul and the add, or None."""
    x, *params = node.inputs
    if not all(graph.is_constant(p) and p in graph.constants for p in params):
        return None
    # on the running mean's device (the model's): constants the frontend made may sit on the CPU
    scale, shift = batch_norm_affine(graph, node, graph.constants[node.inputs[3]].device)
    shape = (1, -1) + (1,) * (len(node.type.shape) - 2)
    dtype = torch_dtype(node.type.dtype)
    scale_name = graph.add_constant(f"{node.name}_scale", scale.to(dtype).reshape(shape), source=node.source).name
    shift_name = graph.add_constant(f"{node.name}_shift", shift.to(dtype).reshape(shape), source=node.source).name
    scaled = graph.add_node("mul", [x, scale_name], node.type, name=f"{node.name}_scaled", source=node.source)
    shifted = graph.add_node("add", [scaled.name, shift_name], node.type, name=f"{node.name}_shifted",
                             source=node.source)
    graph.replace_uses(node.name, shifted.name)
    graph.remove(node.name)
    return [scaled.name, shifted.name]
