"""`torch.compile(model, backend="opfuse")`: the dynamo backend.

Dynamo hands over an FX GraphModule whose parameters and buffers arrive as extra inputs. For inference they are
constants: they are bound into a small wrapper module (so torch.export lifts them as constants and BN folding
and weight packing apply), and the opfuse-compiled wrapper is called with the user's inputs only. A graph opfuse
cannot compile runs as dynamo gave it (the reason is kept in `last_fallback_reasons`), never wrongly.

Dynamo does not recompile when a weight's values change (`load_state_dict`, an in-place update, `.data = ...`),
and the compiled kernels hold the weights they were built with: each call compares the weights dynamo passes with
the bound ones (storage and version counter, no data read) and runs a graph whose weights changed as dynamo gave it.

With `dynamic=True` (or `torch._dynamo.mark_dynamic`), dynamo's graph takes symbolic sizes: each symbol that is a
dim of the inputs becomes a dynamic dim of one `opfuse.runtime.dynamic.DynamicModel` (its range from mark_dynamic's
min and max, else unbounded), whose buckets serve every size without dynamo compiling again; the size inputs are
read off the tensors that hold them, and a float attribute dynamo lifts into a tensor (a norm's eps) is bound as
its value, compared at each call. A dim that is an expression of sizes (2 * s0) runs as dynamo gave it.

What `opfuse.compile` warns about or refuses reaches torch.compile's users too, as dynamo's graph has it: the graph
holds the model's mode (a batch norm in training mode writes its running statistics, which `opfuse.compile` refuses,
so such a graph runs as dynamo gave it, updating them); a graph that writes into a runtime input in place also runs
as dynamo gave it, since torch.compile promises eager's semantics (the compiled one would leave the input as it
was); and a graph compiled in grad mode whose inputs or weights require grad warns that its outputs carry no
autograd graph (dynamo compiles again when grad mode changes).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from opfuse.config import FusionConfig
from opfuse.ir.graph import GraphError

last_fallback_reasons: list[str] = []


def _is_weight(placeholder: torch.fx.Node, value: Any) -> bool:
    """Parameters, buffers and other attributes of the model dynamo lifted into inputs (named L_self_... by dynamo:
    L_self_modules_lin_parameters_weight_, and with dynamic=True a float attribute as a tensor,
    L_self_modules_norm_eps), not the forward's own arguments (L_x_)."""
    name = str(placeholder.target)
    return isinstance(value, torch.nn.Parameter) or name.startswith("L_self_") or "_parameters_" in name \
        or "_buffers_" in name


def _stamp(weight: torch.Tensor) -> tuple:
    """What changes when a weight's values may have: its storage, and its version counter (bumped by every
    in-place write; inference tensors have none)."""
    try:
        version = weight._version
    except RuntimeError:
        version = None
    return weight.data_ptr(), version


class _BoundWeights(torch.nn.Module):
    """The GraphModule with its weight inputs bound as buffers; forward takes only the runtime inputs."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]):
        super().__init__()
        self.gm = gm
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.slots: list[tuple[str, Any]] = []
        runtime = 0
        tensors = [i for i, value in enumerate(example_inputs) if isinstance(value, torch.Tensor)
                   and not _is_weight(placeholders[i], value)]
        for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if isinstance(value, torch.Tensor) and _is_scalar_attribute(node, value):
                self.slots.append(("scalar", (value.item(), value.dtype)))
            elif isinstance(value, torch.Tensor) and _is_weight(node, value):  # named as dynamo names them, so that
                name = str(node.target) if str(node.target).isidentifier() else f"w{index}"   # a refusal does too
                self.register_buffer(name, value.detach().clone())
                self.slots.append(("weight", name))
            elif isinstance(value, torch.SymInt):     # a dynamic size (dynamic=True): read off the tensor holding it
                self.slots.append(("size", _holder(value, [placeholders[i] for i in tensors])))
            else:
                self.slots.append(("input", runtime))
                runtime += 1
        self.runtime_positions = [i for i, (kind, _) in enumerate(self.slots) if kind == "input"]
        self.input_names = [str(placeholders[i].target) for i in self.runtime_positions]    # as dynamo names them
        self.dims = _dynamic_dims([placeholders[i] for i in self.runtime_positions])

    def forward(self, *inputs: Any) -> Any:
        args = [getattr(self, ref) if kind == "weight" else inputs[ref[0]].shape[ref[1]] if kind == "size"
                else torch.tensor(ref[0], dtype=ref[1]) if kind == "scalar" else inputs[ref]
                for kind, ref in self.slots]
        return self.gm(*args)


def _is_scalar_attribute(placeholder: torch.fx.Node, value: torch.Tensor) -> bool:
    """A float attribute of the model (a norm's eps) that dynamo lifted into a 0-d CPU tensor (dynamic=True):
    bound as its value, a constant of the graph opfuse captures (a lifted tensor's .item() would be data-dependent
    to torch.export)."""
    return (str(placeholder.target).startswith("L_self_") and not isinstance(value, torch.nn.Parameter)
            and "_parameters_" not in str(placeholder.target) and "_buffers_" not in str(placeholder.target)
            and value.dim() == 0 and value.device.type == "cpu")


def _fake_shape(placeholder: torch.fx.Node) -> tuple:
    value = placeholder.meta.get("example_value")
    return tuple(value.shape) if isinstance(value, torch.Tensor) else ()


def _holder(size: torch.SymInt, tensors: Sequence[torch.fx.Node]) -> tuple[int, int]:
    """(runtime input, dim) of the first tensor input whose traced shape holds the symbolic size `size` as a dim."""
    for position, node in enumerate(tensors):
        for dim, extent in enumerate(_fake_shape(node)):
            if isinstance(extent, torch.SymInt) and extent.node.expr == size.node.expr:
                return position, dim
    raise GraphError(f"the dynamic size {size.node.expr} is no dim of any input")


def _dynamic_dims(tensors: Sequence[torch.fx.Node]) -> list[Any]:
    """The dynamic dims of dynamo's graph: each symbol that is a dim of the runtime inputs, its range from dynamo's
    shape environment (mark_dynamic's min and max), and the inputs' dims that hold it; GraphError where a dim is an
    expression of symbols (2 * s0), which buckets cannot follow."""
    from opfuse.runtime.dynamic import DynamicDim

    uses: dict[str, list[tuple[int, int]]] = {}
    ranges: dict[str, tuple[int, int | None]] = {}
    for position, node in enumerate(tensors):
        for dim, extent in enumerate(_fake_shape(node)):
            if not isinstance(extent, torch.SymInt):
                continue
            expr = extent.node.expr
            if expr.is_number:        # a fixed size dynamo keeps symbolic
                continue
            if not expr.is_Symbol:
                raise GraphError(f"input {node.target} has dim {dim} = {expr}, an expression of dynamic sizes")
            uses.setdefault(str(expr), []).append((position, dim))
            bounds = extent.node.shape_env.var_to_range.get(expr)
            low, high = (_finite(bounds.lower), _finite(bounds.upper)) if bounds is not None else (None, None)
            ranges[str(expr)] = (max(1, low or 1), high)
    return [DynamicDim(name, *ranges[name], tuple(spots)) for name, spots in uses.items()]


def _finite(bound: Any) -> int | None:
    """A range bound of dynamo's shape environment as an int, None where it is infinite."""
    try:
        value = int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None
    return value if abs(value) < 2 ** 62 else None


def opfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """Compile one dynamo graph with opfuse; options may carry `config=FusionConfig(...)`."""
    config = options.get("config") or options.get("options", {}).get("config") or FusionConfig()
    try:
        bound = _BoundWeights(gm, example_inputs)
        runtime_examples = [example_inputs[i] for i in bound.runtime_positions]
        compiled = _compile_bound(bound, runtime_examples, config)
    except Exception as error:   # graph breaks give odd graphs: run them as dynamo made them, and say so
        reason = f"{type(error).__name__}: {error}"
        last_fallback_reasons.append(reason)
        warnings.warn(f"opfuse backend: running this graph unfused through PyTorch: {reason}", stacklevel=2)
        return gm.forward

    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    wants_grad = next((name for name, x in zip(placeholders, example_inputs)
                       if isinstance(x, torch.Tensor) and x.requires_grad), None)
    if torch.is_grad_enabled() and wants_grad is not None:
        warnings.warn(f"opfuse backend: {wants_grad} requires grad and grad mode is on, but the compiled graph "
                      "computes without autograd: its outputs carry no autograd graph (call the model under "
                      "torch.no_grad() or torch.inference_mode())", stacklevel=2)
        compiled._warned_no_autograd = True     # said here, once: not again at the first call
    stamps = {i: _stamp(example_inputs[i]) for i, (kind, _) in enumerate(bound.slots) if kind == "weight"}
    scalars = {i: ref[0] for i, (kind, ref) in enumerate(bound.slots) if kind == "scalar"}

    def run(*args: Any) -> Any:
        changed = next((i for i, stamp in stamps.items() if _stamp(args[i]) != stamp), None)
        if changed is None:      # a lifted float attribute is not guarded by dynamo: its value is compared
            changed = next((i for i, value in scalars.items() if args[i].item() != value), None)
        if changed is not None:   # the kernels hold the old values: running them would be silently wrong
            reason = (f"weight {placeholders[changed]} changed since compiling; call torch._dynamo.reset() to "
                      "compile again")
            if reason not in last_fallback_reasons:
                last_fallback_reasons.append(reason)
                warnings.warn(f"opfuse backend: running this graph unfused through PyTorch: {reason}", stacklevel=2)
            return gm(*args)
        out = compiled(*[args[i] for i in bound.runtime_positions])
        return out if isinstance(out, (tuple, list)) else (out,)

    return run


def _compile_bound(bound: _BoundWeights, examples: Sequence[Any], config: FusionConfig) -> torch.nn.Module:
    """`opfuse.compile` of the bound graph, refused (GraphError) where the graph writes into a runtime input in
    place (torch.compile promises eager's semantics, and the compiled graph would leave the input as it was), and
    where the compile fell back to running the graph eagerly on a private copy (`fallback="eager"`), whose buffers are
    not the model's. The compile's other warnings reach the caller as they were, but the one about the wrapper's
    training flag (the graph holds the model's mode)."""
    from opfuse.module import EagerFallback, TrainingModeWarning
    from opfuse.compiler import compile as opfuse_compile
    from opfuse.frontend.torch_translate import InputWrittenWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = opfuse_compile(bound, examples, config, dynamic_shapes=bound.dims or None)
        except Exception as error:      # raised once the warnings are out
            compiled = error
    written = [w for w in caught if issubclass(w.category, InputWrittenWarning)]
    for warning in caught:      # not the wrapper's training flag: the graph holds the model's mode
        if warning not in written and not issubclass(warning.category, TrainingModeWarning):
            warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
    if isinstance(compiled, Exception):
        raise compiled
    if isinstance(compiled, EagerFallback):
        raise GraphError(f"the compile failed, and its eager fallback would run a private copy of the graph: "
                         f"{compiled.reason}")
    if written:
        index = written[0].message.index
        raise GraphError(f"the graph writes into its input {index} ({bound.input_names[index]}) in place, which the "
                         "compiled graph would leave as it was: torch.compile keeps eager's semantics")
    return compiled


def register() -> None:
    """Make backend="opfuse" known to torch.compile (also done through the package's entry point)."""
    from torch._dynamo import list_backends, register_backend

    if "opfuse" not in list_backends(exclude_tags=()):
        register_backend(name="opfuse")(opfuse_backend)
