"""PyTorch frontend: capture an `nn.Module` with torch.export and translate its ATen graph into the opfuse IR.

Entry point: `capture_torch(model, example_inputs, name=None) -> Graph`.

The model is exported on a deep copy in eval mode (the user's module is never touched). In-place ops
(``relu_``, ``add_``) on tensors nothing else aliases are translated as their out-of-place twins whose result
replaces the written tensor for later readers (see `_rebindable`); any other mutation (through a view, into an
input) makes us functionalise the program first with ``run_decompositions({})``, which is exact but costs
seconds. Both the high-level ops (``batch_norm``, ``flatten``) and the lower-level ones that appear after
functionalisation or on other torch versions are translated.

Every fx node maps to IR nodes through a handler in `opfuse.frontend.aten_ops.HANDLERS`. A handler raises
`Unmapped` when a call has no IR equivalent (or none with these arguments); so does any mapping whose type,
re-derived from the op registry, disagrees with the type torch recorded. Such calls become ``opaque`` nodes that
re-run the original ATen call, so capture never fails on an unknown op; the node's attrs keep the reason.
Parameters and buffers become constant nodes (private clones) only when something reads them.

opfuse compiles forwards whose only state is declared: a buffer a module marks as state (`mark_state`: a KV cache)
becomes a ``state`` node, and what the forward writes into it becomes its update (`Graph.state`), which the compiled
model keeps for its next call. A forward that writes any other buffer or parameter (a call counter, a batch norm in
training mode) is refused naming it and the node that writes it, as a compiled model that never updates it would
differ from eager from its second call on. A forward that writes into one of its inputs in
place warns (`InputWrittenWarning`, naming the input and the node): the graph computes the same outputs, but the
compiled model leaves the input as it was.
"""

from __future__ import annotations

import contextlib
import copy
import operator
import re
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from opfuse.frontend.aten_ops import HANDLERS, MultiOutput, Unmapped, op_name, tensor_value
from opfuse.ir.graph import Graph, GraphError, TensorType, dtype_name, torch_dtype
from opfuse.ir.ops import infer_type
from opfuse.ir.verify import verify


class InputWrittenWarning(UserWarning):
    """The model writes into its input `index` (in call order) in place, which the compiled model does not (see
    module docstring)."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


FALLBACK_HINT = ('fall back to torch.compile(model, backend="opfuse"), which handles graph breaks, '
                 'or opfuse.compile(..., fallback="eager")')


STATE_MARK = "_opfuse_state"      # the attribute `mark_state` keeps a module's state buffer names in


def mark_state(module: torch.nn.Module, *names: str) -> None:
    """Declare buffers of `module` the model's state: its forward may write them (a KV cache at the call's
    positions), and the compiled model keeps what it wrote for the next call, as eager does."""
    missing = [name for name in names if name not in dict(module.named_buffers(recurse=False))]
    if missing:
        raise GraphError(f"mark_state: {type(module).__name__} has no buffer {missing[0]!r}")
    module.__dict__.setdefault(STATE_MARK, set()).update(names)


def state_buffers(model: torch.nn.Module) -> set[str]:
    """The dotted names of the buffers the modules of `model` marked as state (`mark_state`)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name in module.__dict__.get(STATE_MARK, ())}


def capture_torch(model: torch.nn.Module, example_inputs: tuple, name: str | None = None) -> Graph:
    """Export `model` (a copy of it, in eval mode) on `example_inputs` and return the verified IR graph."""
    inputs = tuple(example_inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"example input {i} is a {type(x).__name__}; capture_torch takes tensors only")
    name = name or type(model).__name__
    try:
        private = copy.deepcopy(model).eval()
    except Exception as error:
        raise GraphError(f"cannot copy model {name} for capture ({type(error).__name__}: {error}); "
                         f"{FALLBACK_HINT}") from error
    narrow = None
    try:
        program = _export(private, inputs)
    except Exception as error:
        narrow = _narrow_dtype(private, inputs)
        program = _export_wide(private, inputs, narrow) if narrow is not None else None
        if program is None:
            raise GraphError(f"torch.export could not capture model {name}: {_describe_export_error(error)}; "
                             f"{FALLBACK_HINT}") from error
        warnings.warn(CapturedWideWarning(
            f"opfuse: torch.export could not capture {name} in {narrow} ({_describe_export_error(error)}); it was "
            f"captured in float32 and cast to {narrow}: what the model does only in {narrow} (transformers' BART "
            "clamps infinite float16 activations) is not in the graph"))
    graph = Translator(program, name, state_buffers(private)).run()
    if narrow is not None:
        from opfuse.passes.cast_precision import cast_precision

        graph, _ = cast_precision(graph, narrow)
    verify(graph)
    return graph


class CapturedWideWarning(UserWarning):
    """A float16 or bfloat16 model torch.export could not capture was captured in float32, then cast."""


def _export(module: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """torch.export of `module` on `inputs`, its in-place writes made functional where they must be."""
    with _no_stack_traces():
        program = torch.export.export(module, inputs, strict=False)
    refused = [node for node in program.graph.nodes if _mutates(node) and not _rebindable(node)]
    if refused and not _functionalise_fresh_writes(program.graph, refused):
        program = program.run_decompositions({})  # functionalise only (seconds): keeps high-level ops
    return program


NARROW_FLOATS = (torch.float16, torch.bfloat16)


def _narrow_dtype(module: torch.nn.Module, inputs: tuple) -> str | None:
    """The one float16 or bfloat16 dtype of the model's floating parameters, buffers and inputs, or None (float32
    already, mixed, or no floating tensor)."""
    tensors = [*module.parameters(), *module.buffers(), *inputs]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in NARROW_FLOATS:
        return None
    return dtype_name(next(iter(dtypes)))


def _export_wide(private: torch.nn.Module, inputs: tuple, narrow: str) -> torch.export.ExportedProgram | None:
    """The program of `private` (the capture's own copy, made float32 in place) on `inputs` made float32, or None
    where that fails too: a branch a model takes only in its narrow dtype (BART's ``if hidden_states.dtype ==
    torch.float16 and (isinf(...).any() ...)``, a data-dependent guard torch.export cannot take) is not taken in
    float32. The graph is cast back to `narrow` after translation."""
    wide = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    try:
        return _export(private.float(), wide)
    except Exception:   # noqa: BLE001 - the caller reports the narrow dtype's failure, the one the user met
        return None


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export without the Python stack trace it records of every node (`torch.fx.config.
    do_not_emit_stack_traces`): opfuse names nodes, never their source lines, and the traces cost a quarter of
    analyzing resnet50 (RESULTS.md run 85). A torch without the switch records them."""
    config = getattr(torch.fx, "config", None)
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _mutates(node: fx.Node) -> bool:
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


def _rebindable(node: fx.Node) -> bool:
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
    while isinstance(root, fx.Node) and _mutates(root):
        root = root.args[0]
    if not isinstance(root, fx.Node) or root.op != "call_function" or _may_alias_input(root):
        return False
    pending, members, views = [root], [], []
    while pending:  # the root and the in-place results that alias it, and the views read of them
        member = pending.pop()
        members.append(member)
        for user in member.users:
            if _mutates(user):  # writes only its own `self` (checked for each mutation): member is read or
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
        if not isinstance(alias.target, torch._ops.OpOverload) or _mutates(alias):
            return False
        pending.extend(user for user in alias.users if user.op != "output" and _may_alias_input(user))
    return True


# in-place writes `_functionalise_fresh_writes` rewrites, by their functional twins
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
    if not views or not isinstance(view, fx.Node) or view.op != "call_function" or _mutates(view) \
            or _may_alias_input(view):
        return None
    return view, _FreshWrite(views, node)


def _functionalise_fresh_writes(graph: fx.Graph, refused: list[fx.Node]) -> bool:
    """Rewrite, in place, the mutations `_rebindable` refused into functional ops, where each is a `_fresh_write`
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
                                                          and not _mutates(node)))


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


def _describe_export_error(error: Exception) -> str:
    """The exception's type and first line, plus the user's source line when torch names it."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    user_frames = [m for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', str(error))
                   if "/torch/" not in m.group(1)]
    if user_frames:
        file, line, function = user_frames[-1].groups()
        text += f" (at {file}:{line} in {function})"
    return text


# ---- translation machinery ------------------------------------------------------------------------

@dataclass
class _LazyConstant:
    """A parameter, buffer or lifted constant; it becomes a constant node only when something reads it."""

    key: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class _Slot:
    """Where input tensor `index` goes when an opaque node re-assembles its call."""

    index: int


def _out_of_place(target: torch._ops.OpOverload) -> torch._ops.OpOverload | None:
    """The out-of-place twin of an in-place overload (aten.dropout_.default -> aten.dropout.default), if any."""
    packet = getattr(torch.ops.aten, op_name(target)[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _bind(target: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, Any]:
    """Arguments by schema name, defaults filled in."""
    bound = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            bound[arg.name] = args[i]
        elif arg.name in kwargs:
            bound[arg.name] = kwargs[arg.name]
        else:
            bound[arg.name] = arg.default_value if arg.has_default_value() else None
    return bound


class Translator:
    """Walks the exported fx graph once, in order, building the IR graph."""

    def __init__(self, program: torch.export.ExportedProgram, name: str, state: set[str] = frozenset()):
        self.program = program
        self.graph = Graph(name)
        self.state = state                 # buffers marked as state (`mark_state`): their writes are kept
        self.env: dict[fx.Node, Any] = {}  # IR node name, _LazyConstant, MultiOutput or a plain python object
        self.constant_names: dict[fx.Node, str] = {}
        self.node: fx.Node | None = None   # the fx node being translated
        self.op_name = ""                  # its ATen op's name, 'relu' for relu_ too
        self.aliases: dict[fx.Node, list[fx.Node]] = {}  # a tensor written in place -> the nodes naming it

    # ---- reading values ----
    def value(self, arg: Any) -> str:
        """IR node name of a tensor argument (an fx node or an IR name)."""
        if isinstance(arg, str):
            return arg
        if not isinstance(arg, fx.Node):
            raise Unmapped(f"expected a tensor, got {type(arg).__name__}")
        value = self.env[arg]
        if isinstance(value, _LazyConstant):
            name = self.constant_names.get(arg)
            if name is None or name not in self.graph.nodes:  # not made yet, or removed by a rollback
                name = self.graph.add_constant(value.key, value.tensor.detach().clone(), source=arg.name).name
                self.constant_names[arg] = name
            return name
        if not isinstance(value, str):
            raise Unmapped(f"argument {arg.name} is a {type(value).__name__}, not a tensor")
        return value

    def operand(self, arg: Any, dtype: str | None = None) -> str:
        """A tensor argument, or a python scalar made into a 0-d constant (of the call's output dtype)."""
        if isinstance(arg, (bool, int, float)):
            tensor = torch.tensor(arg, dtype=torch_dtype(dtype or self.out_type.dtype))
            return self.graph.add_constant(f"{self.node.name}_scalar", tensor, source=self.node.name).name
        return self.value(arg)

    def type_of(self, name: str) -> TensorType:
        return self.graph[name].type

    def rank(self, arg: Any) -> int:
        return len(self.type_of(self.value(arg)).shape)

    @property
    def out_type(self) -> TensorType:
        val = tensor_value(self.node)
        if val is None:
            raise Unmapped("torch recorded no tensor output for this call")
        return TensorType.of(val)

    # ---- emitting ----
    def emit(self, op: str, inputs: list[Any], attrs: dict[str, Any] | None = None) -> str:
        """Add an IR node typed by the op registry, named `<fx node>_<op>` until `take_name` renames it."""
        names = [self.value(i) for i in inputs]
        attrs = attrs or {}
        type = infer_type(op, [self.type_of(n) for n in names], attrs)
        return self.graph.add_node(op, names, type, attrs, name=f"{self.node.name}_{op}",
                                   source=self.node.name).name

    def take_name(self, name: str) -> str:
        """Rename `name`, the last node emitted for the current fx node, to that fx node's name."""
        wanted = self.node.name
        if (name.startswith(wanted + "_") and wanted not in self.graph.nodes
                and next(reversed(self.graph.nodes)) == name):  # nothing reads the last node yet
            node = self.graph.nodes.pop(name)
            node.name = wanted
            self.graph.nodes[wanted] = node
            return wanted
        return name

    def constant(self, suffix: str, tensor: torch.Tensor) -> str:
        return self.graph.add_constant(f"{self.node.name}_{suffix}", tensor, source=self.node.name).name

    def opaque(self, node: fx.Node, reason: str, index: int | None = None, type_node: fx.Node | None = None
               ) -> str:
        """An opaque node that re-runs the original call (output `index` of it for tuple-valued calls)."""
        val = tensor_value(type_node or node)
        if val is None:
            raise GraphError(f"fx node {(type_node or node).name} ({node.target}) produces "
                             f"{type((type_node or node).meta.get('val')).__name__}, which the IR cannot hold")
        inputs: list[str] = []
        slots: dict[fx.Node, _Slot] = {}

        def slot(arg: fx.Node) -> Any:
            value = self.env[arg]
            if isinstance(value, MultiOutput):
                raise GraphError(f"fx node {node.name} ({node.target}) reads the whole tuple {arg.name}, "
                                 "which the IR cannot express")
            if not isinstance(value, (str, _LazyConstant)):
                return value  # a python object (a sub-graph of a higher-order op, a script object)
            if arg not in slots:
                slots[arg] = _Slot(len(inputs))
                inputs.append(self.value(arg))
            return slots[arg]

        args, kwargs = fx.node.map_arg((node.args, node.kwargs), slot)
        target, writes_first_input = node.target, _mutates(node)

        def run(xs: list[torch.Tensor]) -> torch.Tensor:
            if writes_first_input:  # never write into the interpreter's values (constants, user inputs)
                xs = [xs[0].clone(), *xs[1:]]
            def fill(v: Any) -> Any:
                if isinstance(v, _Slot):
                    return xs[v.index]
                if isinstance(v, torch.device) and xs:  # run where the inputs are, not where it was traced
                    return xs[0].device
                return v
            call_args, call_kwargs = fx.node.map_aggregate((args, kwargs), fill)
            result = target(*call_args, **call_kwargs)
            return result if index is None else result[index]

        label = str(target) if index is None else f"{target}[{index}]"
        name = (type_node or node).name
        return self.graph.add_node("opaque", inputs, TensorType.of(val), {"target": label, "fn": run,
                                   "reason": reason, "pure": _is_deterministic(target)},
                                   name=name, source=name).name

    # ---- the walk ----
    def run(self) -> Graph:
        signature = self.program.graph_signature
        placeholders = [n for n in self.program.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, signature.input_specs):
            self._placeholder(node, spec)
        for node in self.program.graph.nodes:
            if node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "call_function" and node.users:  # calls nobody reads (asserts) are dropped
                self.node = node
                self.env[node] = self._call(node)
            elif node.op == "output":
                self._outputs(node, signature)
        self._remove_unused()
        return self.graph

    def _placeholder(self, node: fx.Node, spec: Any) -> None:
        if spec.kind == InputKind.USER_INPUT:
            val = tensor_value(node)
            if val is None:
                raise GraphError(f"model input {node.name} is not a tensor; capture_torch takes tensors only")
            self.env[node] = self.graph.add_input(node.name, TensorType.of(val)).name
        elif spec.kind == InputKind.BUFFER and spec.target in self.state:
            tensor = self.program.state_dict[spec.target].detach().clone()
            self.env[node] = self.graph.add_state(spec.target, tensor, source=node.name).name
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            tensors = self.program.state_dict if spec.target in self.program.state_dict else self.program.constants
            self.env[node] = _LazyConstant(spec.target, tensors[spec.target])
        else:  # script objects, effect tokens: plain python values an opaque call passes through
            self.env[node] = self.program.constants.get(spec.target) if spec.target else None

    def _get_attr(self, node: fx.Node) -> None:
        value = self.program.graph_module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        self.env[node] = _LazyConstant(str(node.target), value) if isinstance(value, torch.Tensor) else value

    def _call(self, node: fx.Node) -> str | MultiOutput:
        if _mutates(node):  # only rebindable ones are left (see _rebindable): run the out-of-place twin
            result = self._translate(node, op_name(node.target)[:-1], _out_of_place(node.target))
            root = node.args[0]
            while _mutates(root):
                root = root.args[0]
            for alias in self.aliases.setdefault(root, [root]):
                self.env[alias] = result  # later readers of any alias see the new value
            self.aliases[root].append(node)
            return result
        return self._translate(node, op_name(node.target))

    def _translate(self, node: fx.Node, name: str, schema: torch._ops.OpOverload | None = None
                   ) -> str | MultiOutput:
        """`node` in IR, mapped by the handler of op `name` with its arguments bound by `schema`'s names (default
        the node's own op: an in-place op is mapped as its out-of-place twin, whose argument names may differ)."""
        if node.target is operator.getitem:
            return self._getitem(node)
        if not node.all_input_nodes and _is_deterministic(node.target):
            return self._fold(node)
        handler = HANDLERS.get(name)
        self.op_name = name
        if handler is None:
            return self._opaque_call(node, f"no IR mapping for {node.target}")
        return self._attempt(node, lambda: handler(self, _bind(schema or node.target, node.args, node.kwargs)),
                             lambda reason: self._opaque_call(node, f"{node.target}: {reason}"))

    def _attempt(self, node: fx.Node, mapping: Callable[[], Any], fallback: Callable[[str], Any],
                 strict: bool = True) -> Any:
        """Run a mapping and check its type against torch's. A mapping that declines (`Unmapped`: an op or a
        setting the IR does not cover) is undone and `fallback` runs the call as an opaque op, with the reason; any
        other failure of an op's mapping (`strict`) is a bug of the mapping and an error naming the node, never
        silently an opaque op. Folding a call and unpacking a tuple are not mappings: they fall back on any error."""
        count = len(self.graph.nodes)
        try:
            result = mapping()
            if isinstance(result, str):
                if self.type_of(result) != self.out_type:
                    raise Unmapped(f"the IR mapping gives {self.type_of(result)}, torch gives {self.out_type}")
                result = self.take_name(result)
            return result
        except Exception as error:
            if strict and not isinstance(error, Unmapped):
                raise GraphError(f"capturing node {node.name} ({node.target}): its IR mapping failed with "
                                 f"{type(error).__name__}: {error}; please report this model") from error
            for name in list(self.graph.nodes)[count:]:  # nodes are only appended: undo what it added
                self.graph.remove(name)
            return fallback(str(error) if isinstance(error, Unmapped)
                            else f"{type(error).__name__}: {error}")

    def _opaque_call(self, node: fx.Node, reason: str) -> str | MultiOutput:
        if tensor_value(node) is None and isinstance(node.meta.get("val"), (tuple, list)):
            return MultiOutput(node, lambda i: self.opaque(node, reason, i, self.node))
        return self.opaque(node, reason)

    def _getitem(self, node: fx.Node) -> str:
        source, index = node.args
        multi = self.env.get(source)
        if not isinstance(multi, MultiOutput):
            return self.opaque(node, "getitem on a value that is not a tuple")
        return self._attempt(node, lambda: multi.item(index),
                             lambda reason: self.opaque(multi.node, f"{multi.node.target}[{index}]: {reason}",
                                                        index, node), strict=False)

    def _fold(self, node: fx.Node) -> str:
        """A call that reads no tensor (arange, zeros, full) is computed now and kept as a constant."""
        return self._attempt(node, lambda: self.graph.add_constant(node.name, node.target(*node.args, **node.kwargs),
                                                                   source=node.name).name,
                             lambda reason: self.opaque(node, f"{node.target} not folded: {reason}"), strict=False)

    def _outputs(self, node: fx.Node, signature: Any) -> None:
        """The user outputs become the graph's outputs; a write to the model's state is refused, a write into an
        input warns (see module docstring). torch.export lists both as outputs once the program is functional."""
        specs = list(zip(node.args[0], signature.output_specs))
        holders = {spec.target: self.env[placeholder] for placeholder, spec in
                   zip([n for n in self.program.graph.nodes if n.op == "placeholder"], signature.input_specs)
                   if spec.kind == InputKind.BUFFER and spec.target in self.state}
        for arg, spec in specs:
            if spec.kind == OutputKind.BUFFER_MUTATION and spec.target in holders:   # declared state: kept
                self.graph.state[holders[spec.target]] = self.value(arg)
        state = {OutputKind.BUFFER_MUTATION: "buffer", OutputKind.PARAMETER_MUTATION: "parameter"}
        written = [f"{state[spec.kind]} {spec.target} ({_writer(arg)})" for arg, spec in specs
                   if spec.kind in state and spec.target not in holders]
        if written:
            raise GraphError(f"model {self.graph.name} writes its {', '.join(written)} in forward; opfuse compiles "
                             "stateless forwards, and a compiled model that never updates that state would differ "
                             "from eager from its second call on. Keep such state out of forward (a batch norm in "
                             "training mode updates its running statistics: call model.eval() first), or compile "
                             "with fallback='eager' to run the model eagerly")
        inputs = [spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT]
        for arg, spec in specs:
            if spec.kind == OutputKind.USER_INPUT_MUTATION:
                warnings.warn(InputWrittenWarning(
                    f"opfuse: {self.graph.name} writes into its input {spec.target} in place ({_writer(arg)}); the "
                    f"compiled model computes the same outputs but leaves {spec.target} as it was",
                    inputs.index(spec.target)))
            if spec.kind != OutputKind.USER_OUTPUT:
                continue  # gradients, effect tokens: not outputs of an inference graph
            if not isinstance(arg, fx.Node) or not isinstance(self.env.get(arg), (str, _LazyConstant)):
                raise GraphError(f"model output {getattr(arg, 'name', arg)!r} is not a tensor; "
                                 "the IR takes tensor outputs only")
            self.graph.outputs.append(self.value(arg))

    def _remove_unused(self) -> None:
        """Drop nodes no output or state update depends on (unread parameters, dead getitems); inputs stay."""
        live = set(self.graph.observed) | set(self.graph.state)
        for node in reversed(list(self.graph.nodes.values())):
            if node.name in live:
                live.update(node.inputs)
        for node in list(self.graph.nodes.values()):
            if node.name not in live and node.op != "input":
                self.graph.remove(node.name)


def _writer(value: fx.Node) -> str:
    """'node NAME: OP' of the call that computes `value` (the call of a getitem: a tuple's owner)."""
    while value.target is operator.getitem and isinstance(value.args[0], fx.Node):
        value = value.args[0]
    return f"node {value.name}: {value.target}"


def _is_deterministic(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags
