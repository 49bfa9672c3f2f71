"""`torch.compile(model, backend="opfuse")`: the dynamo backend.

Dynamo hands over an FX GraphModule whose parameters and buffers arrive as extra inputs. For inference they are
constants: they are bound into a small wrapper module (so torch.export lifts them as constants and BN folding
and weight packing apply), and the opfuse-compiled wrapper is called with the user's inputs only. A graph opfuse
cannot compile runs as dynamo gave it (the reason is kept in `last_fallback_reasons`), never wrongly.

Dynamo does not recompile when a weight's values change (`load_state_dict`, an in-place update, `.data = ...`),
and the compiled kernels hold the weights they were built with: each call compares the weights dynamo passes with
the bound ones (storage and version counter, no data read) and runs a graph whose weights changed as dynamo gave it.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch

from opfuse.config import FusionConfig

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

    def forward(self, *inputs: Any) -> Any:
        args = [getattr(self, ref) if kind == "weight" else inputs[ref] for kind, ref in self.slots]
        return self.gm(*args)


def opfuse_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Callable[..., Any]:
    """Compile one dynamo graph with opfuse; options may carry `config=FusionConfig(...)`."""
    from opfuse.compiler import compile as opfuse_compile

    config = options.get("config") or options.get("options", {}).get("config") or FusionConfig()
    bound = _BoundWeights(gm, example_inputs)
    runtime_examples = [example_inputs[i] for i in bound.runtime_positions]
    try:
        compiled = opfuse_compile(bound, runtime_examples, config)
    except Exception as error:   # graph breaks give odd graphs: run them as dynamo made them, and say so
        reason = f"{type(error).__name__}: {error}"
        last_fallback_reasons.append(reason)
        warnings.warn(f"opfuse backend: running this graph unfused through PyTorch: {reason}", stacklevel=2)
        return gm.forward

    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
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


def register() -> None:
    """Make backend="opfuse" known to torch.compile (also done through the package's entry point)."""
    from torch._dynamo import list_backends, register_backend

    if "opfuse" not in list_backends(exclude_tags=()):
        register_backend(name="opfuse")(opfuse_backend)
