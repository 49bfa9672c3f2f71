"""`torch.compile(model, backend="opfuse")`: the dynamo backend.

Dynamo hands over an FX GraphModule whose parameters and buffers arrive as extra inputs. For inference they are
constants: they are bound into a small wrapper module (so torch.export lifts them as constants and BN folding
and weight packing apply), and the opfuse-compiled wrapper is called with the user's inputs only. A graph opfuse
cannot compile runs as dynamo gave it (the reason is kept in `last_fallback_reasons`), never wrongly.

Dynamo does not recompile when a weight's values change (`load_state_dict`, an in-place update, `.data = ...`),
and the compiled kernels hold the weights they were built with: each call compares the weights dynamo passes with
the bound ones (storage and version counter, no data read) and runs a graph whose weights changed as dynamo gave it.

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
    """Parameters and buffers dynamo lifted into inputs (named L_self_..._parameters_/_buffers_ by dynamo)."""
    name = str(placeholder.target)
    return isinstance(value, torch.nn.Parameter) or "_parameters_" in name or "_buffers_" in name


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
        self.slots: list[tuple[str, int | str]] = []
        runtime = 0
        for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
            if _is_weight(node, value):     # named as dynamo names it, so that a refusal names it so too
                name = str(node.target) if str(node.target).isidentifier() else f"w{index}"
                self.register_buffer(name, value.detach().clone())
                self.slots.append(("weight", name))
            else:
                self.slots.append(("input", runtime))
                runtime += 1
        self.runtime_positions = [i for i, (kind, _) in enumerate(self.slots) if kind == "input"]
        self.input_names = [str(placeholders[i].target) for i in self.runtime_positions]    # as dynamo names them

    def forward(self, *inputs: Any) -> Any:
        args = [getattr(self, ref) if kind == "weight" else inputs[ref] for kind, ref in self.slots]
        return self.gm(*args)


def opfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """Compile one dynamo graph with opfuse; options may carry `config=FusionConfig(...)`."""
    config = options.get("config") or options.get("options", {}).get("config") or FusionConfig()
    bound = _BoundWeights(gm, example_inputs)
    runtime_examples = [example_inputs[i] for i in bound.runtime_positions]
    try:
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

    def run(*args: Any) -> Any:
        changed = next((i for i, stamp in stamps.items() if _stamp(args[i]) != stamp), None)
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
    from opfuse.compiler import EagerFallback, TrainingModeWarning
    from opfuse.compiler import compile as opfuse_compile
    from opfuse.frontend.torch_export import InputWrittenWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            compiled = opfuse_compile(bound, examples, config)
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
