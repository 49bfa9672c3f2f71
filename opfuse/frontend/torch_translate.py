"""The translator of the PyTorch frontend (`opfuse.frontend.torch_export`): walks an exported fx graph once, in
order, building the IR graph (`Translator`).

Every fx node maps to IR nodes through a handler in `opfuse.frontend.aten_ops.HANDLERS`. A handler raises
`Unmapped` when a call has no IR equivalent (or none with these arguments); so does any mapping whose type,
re-derived from the op registry, disagrees with the type torch recorded. Such calls become ``opaque`` nodes that
re-run the original ATen call, so capture never fails on an unknown op; the node's attrs keep the reason.
A region a higher-order op wraps only for a mode inference does not change (autocast turned off, grad mode) is
inlined: its sub-graph's calls are translated as if they stood in the program (`_inline`); one that autocasts runs
as an opaque call. Parameters and buffers become constant nodes only when something reads them: the program's
state dict as it is (the program is exported from the capture's private copy of the model, so nothing the user holds
aliases it), any other tensor constant a clone of its own.
The program's outputs become the graph's, its writes to declared state the graph's state updates; other writes to
the model's state are refused and writes into its inputs warned of (`InputWrittenWarning`), as
`opfuse.frontend.torch_export` describes.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind, OutputKind

from opfuse.frontend.aten_common import MultiOutput, Unmapped, op_name, tensor_value
from opfuse.frontend.aten_fft import FFTS, RealPartOnly, real_part_only
from opfuse.frontend.aten_ops import HANDLERS
from opfuse.frontend.torch_inplace import mutates, out_of_place
from opfuse.ir.graph import DTYPE_BYTES, Graph, GraphError, TensorType, torch_dtype
from opfuse.ir.ops import infer_type


class InputWrittenWarning(UserWarning):
    """The model writes into its input `index` (in call order) in place, which the compiled model does not (see
    `opfuse.frontend.torch_export`)."""

    def __init__(self, message: str, index: int):
        super().__init__(message)
        self.index = index


@dataclass
class _LazyConstant:
    """A parameter, buffer or lifted constant; it becomes a constant node only when something reads it."""

    key: str
    tensor: torch.Tensor
    private: bool = False   # the capture's own tensor (the program's state dict): used as it is, not cloned


@dataclass(frozen=True)
class _Slot:
    """Where input tensor `index` goes when an opaque node re-assembles its call."""

    index: int


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
                tensor = value.tensor.detach() if value.private else value.tensor.detach().clone()
                name = self.graph.add_constant(value.key, tensor, source=arg.name).name
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
        target, writes_first_input = node.target, mutates(node)

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
            private = spec.target in self.program.state_dict
            tensors = self.program.state_dict if private else self.program.constants
            self.env[node] = _LazyConstant(spec.target, tensors[spec.target], private)
        else:  # script objects, effect tokens: plain python values an opaque call passes through
            self.env[node] = self.program.constants.get(spec.target) if spec.target else None

    def _get_attr(self, node: fx.Node) -> None:
        value = self.program.graph_module
        for part in str(node.target).split("."):
            value = getattr(value, part)
        self.env[node] = _LazyConstant(str(node.target), value) if isinstance(value, torch.Tensor) else value

    def _call(self, node: fx.Node) -> str | MultiOutput | RealPartOnly:
        if op_name(node.target) in FFTS:   # complex, but where its real part alone is read: DFT products
            held = real_part_only(node, _bind(node.target, node.args, node.kwargs))
            if held is not None:
                return held
        values = node.meta.get("val")
        for value in values if isinstance(values, (tuple, list)) else [values]:
            dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
            if isinstance(value, torch.Tensor) and dtype not in DTYPE_BYTES:
                raise GraphError(f"node {node.name} ({node.target}) computes a {dtype} tensor, a dtype opfuse's IR "
                                 f"has no values of (it has {', '.join(DTYPE_BYTES)}); compile the parts of the "
                                 "model before and after it")
        if mutates(node):  # only rebindable ones are left (`torch_inplace.rebindable`): run the out-of-place twin
            result = self._translate(node, op_name(node.target)[:-1], out_of_place(node.target))
            root = node.args[0]
            while mutates(root):
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
        if str(node.target) in INLINED_REGIONS:
            return self._inline(node)
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

    def _inline(self, node: fx.Node) -> str | MultiOutput:
        """The region a higher-order op wraps (`INLINED_REGIONS`), translated call by call in its place: its
        outputs are read by getitem as a tuple call's are."""
        body, operands, reason = INLINED_REGIONS[str(node.target)](node.args)
        if reason:
            return self._opaque_call(node, f"{node.target}: {reason}")
        module, outer = self.env[body], self.node
        results: tuple = ()
        for sub in module.graph.nodes:
            if sub.op == "placeholder":
                operand = operands.pop(0)
                self.env[sub] = self.env[operand] if isinstance(operand, fx.Node) else operand
            elif sub.op == "get_attr":
                value = getattr(module, str(sub.target))
                self.env[sub] = _LazyConstant(f"{body.name}.{sub.target}", value) \
                    if isinstance(value, torch.Tensor) else value
            elif sub.op == "call_function" and sub.users:
                self.node = sub
                self.env[sub] = self._call(sub)
            elif sub.op == "output":
                results = tuple(sub.args[0])
        self.node = outer
        return MultiOutput(node, lambda i: self.value(results[i]))

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


def _autocast_region(args: tuple) -> tuple[fx.Node, list, str]:
    device_type, dtype, enabled, cache_enabled, body, *operands = args
    return body, operands, f"autocast to {dtype} on {device_type} casts its operations" if enabled else ""


def _grad_region(args: tuple) -> tuple[fx.Node, list, str]:
    enabled, body, *operands = args
    return body, operands, ""


# higher-order ops whose region is inlined: (sub-graph, its operands, why not: "" where it is inlined)
INLINED_REGIONS: dict[str, Callable[[tuple], tuple[fx.Node, list, str]]] = {
    "wrap_with_autocast": _autocast_region,        # torch.autocast(..., enabled=False): the region as it is
    "wrap_with_set_grad_enabled": _grad_region,     # torch.no_grad() / enable_grad(): nothing differs in inference
}


def _writer(value: fx.Node) -> str:
    """'node NAME: OP' of the call that computes `value` (the call of a getitem: a tuple's owner)."""
    while value.target is operator.getitem and isinstance(value.args[0], fx.Node):
        value = value.args[0]
    return f"node {value.name}: {value.target}"


def _is_deterministic(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.nondeterministic_seeded not in target.tags
