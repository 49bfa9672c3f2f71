"""In-place writes in an exported program (`opfuse.frontend.torch_export`): which ones the translator may take as
their out-of-place twins, and a rewrite of the few others it makes functional without tracing the program again.

In-place ops (``relu_``, ``add_``) on tensors nothing else aliases are translated as their out-of-place twins
(`out_of_place`) whose result replaces the written tensor for later readers (`rebindable`). Fills and copies into
slices of a fresh tensor (Swin's shifted-window mask) become scatters (`functionalise_fresh_writes`). Any other
mutation (through a view, into an input) makes the caller functionalise the whole program with
``run_decompositions({})``, which is exact but costs seconds.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from opfuse.frontend.aten_common import op_name
from opfuse.frontend.aten_ops import HANDLERS


def mutates(node: fx.Node) -> bool:
    """Whether `node` calls an ATen op that writes one of its arguments in place."""
    return isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable


# ops without an alias annotation that may still return their input itself (dropout in eval, a no-op type_as)
_MAY_RETURN_INPUT = {"dropout", "feature_dropout", "alpha_dropout", "type_as"}


def _may_alias_input(node: fx.Node) -> bool:
    """Whether `node`'s result may share memory with one of its inputs (conservative for unknown calls)."""
    if node.op == "output":
        return False
    if node.target is operator.getitem:
        return _may_alias_input(node.args[0])
    if not isinstance(node.target, torch._ops.OpOverload):
        return True
    return (op_name(node.target) in _MAY_RETURN_INPUT
            or any(a.alias_info is not None for a in node.target._schema.arguments))


# in-place ops that write nothing when their `train` argument is False (eval mode): the identity
_NO_WRITE_IN_EVAL = {"dropout_", "feature_dropout_", "alpha_dropout_", "feature_alpha_dropout_"}


def _writes_nothing(node: fx.Node) -> bool:
    """Whether in-place `node` leaves its `self` as it was: a dropout in eval mode."""
    if op_name(node.target) not in _NO_WRITE_IN_EVAL:
        return False
    train = node.kwargs.get("train", node.args[2] if len(node.args) > 2 else None)
    return train is False


def rebindable(node: fx.Node) -> bool:
    """Whether in-place `node` can be translated as its out-of-place twin whose result replaces `self` for later
    readers: the twin is mapped, and either the op writes nothing (`_writes_nothing`: aliases see no change), or
    it writes only `self` and `self` shares memory with no other value (it is no view, nor a model input) but
    `_read_only_view`s taken after every write. Otherwise the graph is functionalised first."""
    if not node.args or op_name(node.target)[:-1] not in HANDLERS:
        return False
    if _writes_nothing(node):
        return True
    arguments = node.target._schema.arguments
    writes = [a.alias_info is not None and a.alias_info.is_write for a in arguments]
    if not writes or not writes[0] or any(writes[1:]):
        return False
    root = node.args[0]
    while isinstance(root, fx.Node) and mutates(root):
        root = root.args[0]
    if not isinstance(root, fx.Node) or root.op != "call_function" or _may_alias_input(root):
        return False
    pending, members, views = [root], [], []
    while pending:  # the root and the in-place results that alias it, and the views read of them
        member = pending.pop()
        members.append(member)
        for user in member.users:
            if mutates(user):  # writes only its own `self` (checked for each mutation): member is read or
                if user.args[0] is member:  # written here, and the result is one more alias of the root
                    pending.append(user)
            elif _may_alias_input(user):
                views.append(user)
    return all(_read_only_view(view, members) for view in views)


def _read_only_view(view: fx.Node, members: list[fx.Node]) -> bool:
    """Whether `view`, an alias of the in-place chain `members` (a root and its in-place results), sees no write:
    it is an ATen view taken after every write of the chain, and no alias of it is written or passed to a call
    that may write it (a no_grad block, whose writes this graph does not show)."""
    writes, node = set(members[1:]), view.next
    while node.op != "root":
        if node in writes:
            return False
        node = node.next
    pending = [view]
    while pending:
        alias = pending.pop()
        if not isinstance(alias.target, torch._ops.OpOverload) or mutates(alias):
            return False
        pending.extend(user for user in alias.users if user.op != "output" and _may_alias_input(user))
    return True


# in-place writes `functionalise_fresh_writes` rewrites, by their functional twins
_FILL_TWINS = {"fill_": "fill", "copy_": "copy"}
# views a write may go through, by the scatter that writes a view's value back into its base
_VIEW_SCATTERS = {"slice": torch.ops.aten.slice_scatter.default, "select": torch.ops.aten.select_scatter.default}


@dataclass
class _FreshWrite:
    """A fill_ or copy_ of slices/selects of a fresh tensor: `views` from the root outwards, then `write`."""

    views: list[fx.Node]
    write: fx.Node


def _fresh_write(node: fx.Node) -> tuple[fx.Node, _FreshWrite] | None:
    """(root, the write) where in-place `node` is a fill_ or copy_ that nothing reads, into a chain of slice and
    select views each read by the next alone, of a value `root` that no input or other value aliases."""
    if op_name(node.target) not in _FILL_TWINS or node.users or not node.args:
        return None
    views: list[fx.Node] = []
    view = node.args[0]
    while (isinstance(view, fx.Node) and view.op == "call_function" and op_name(view.target) in _VIEW_SCATTERS
           and len(view.users) == 1):
        views.insert(0, view)
        view = view.args[0]
    if not views or not isinstance(view, fx.Node) or view.op != "call_function" or mutates(view) \
            or _may_alias_input(view):
        return None
    return view, _FreshWrite(views, node)


def functionalise_fresh_writes(graph: fx.Graph, refused: list[fx.Node]) -> bool:
    """Rewrite, in place, the mutations `rebindable` refused into functional ops, where each is a `_fresh_write`
    (Swin's shifted-window mask: a new_zeros whose slices are filled) and the root's other readers are
    `_plain_reader`s after its last write: each write becomes the twin of its slices (``fill``, ``copy``)
    scattered back into the root (``slice_scatter``, ``select_scatter``), and those readers read the last scatter.
    What run_decompositions({}) makes of such writes, without tracing the whole program again. False (nothing
    changed) where any mutation is of another kind: the caller functionalises the whole program then."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    writes: dict[fx.Node, list[_FreshWrite]] = {}
    for node in refused:
        found = _fresh_write(node)
        if found is None:
            return False
        writes.setdefault(found[0], []).append(found[1])
    readers: dict[fx.Node, list[fx.Node]] = {}
    for root, found in writes.items():
        chained = {write.views[0] for write in found}
        last = max(order[write.write] for write in found)
        readers[root] = [user for user in root.users if user not in chained]
        if not all(_plain_reader(user, order[user] > last) for user in readers[root]):
            return False
    for root, found in writes.items():
        current = root
        for write in found:
            current = _scatter_write(graph, current, write)
        for reader in readers[root]:
            reader.replace_input_with(root, current)
    graph.lint()
    return True


def _plain_reader(node: fx.Node, after_the_writes: bool) -> bool:
    """Whether `node` may read a fresh root's written value in place of the root: it comes after the writes and is
    the output or an ATen call that writes nothing (not a higher-order call, whose body this graph does not show)."""
    return after_the_writes and (node.op == "output" or (isinstance(node.target, torch._ops.OpOverload)
                                                          and not mutates(node)))


def _scatter_write(graph: fx.Graph, base: fx.Node, write: _FreshWrite) -> fx.Node:
    """Insert, before `write.write`, its views of `base`, the written value and the scatters back into `base`; erase
    the in-place write and its views; return the new value of the base."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([base.meta.get("val")])

    def call(target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
        node = graph.call_function(target, args, kwargs or {})
        values, kw = fx.node.map_arg((args, kwargs or {}), lambda n: n.meta["val"])
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            node.meta["val"] = target(*values, **kw)
        return node

    with graph.inserting_before(write.write):
        bases = [base]
        for view in write.views:             # the same views, of the current value
            bases.append(call(view.target, (bases[-1], *view.args[1:]), dict(view.kwargs)))
        twin = getattr(torch.ops.aten, _FILL_TWINS[op_name(write.write.target)])
        twin = getattr(twin, write.write.target._overloadname)
        value = call(twin, (bases[-1], *write.write.args[1:]), dict(write.write.kwargs))
        for view, inner in zip(reversed(write.views), reversed(bases[:-1])):
            value = call(_VIEW_SCATTERS[op_name(view.target)], (inner, value, *view.args[1:]), dict(view.kwargs))
    graph.erase_node(write.write)
    for view in reversed(write.views):
        graph.erase_node(view)
    return value


def out_of_place(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an in-place overload (aten.dropout_.default -> aten.dropout.default), if any."""
    packet = getattr(torch.ops.aten, op_name(target)[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None
