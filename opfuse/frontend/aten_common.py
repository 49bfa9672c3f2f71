"""What the ATen op handlers share (`opfuse.frontend.aten_ops`): the handler contract, its registration, and the
argument helpers more than one family of handlers uses.

A handler gets the translator (`opfuse.frontend.torch_translate.Translator`) and the call's arguments by schema
name, emits IR nodes through `Translator.emit` and returns the name of the node holding the result, or a
`MultiOutput` for tuple-valued calls. It raises `Unmapped` when the call has no IR equivalent (or none with these
arguments): the translator then keeps the call as an opaque node. Each family module keeps its handlers in a table
of its own (`registrar`); `opfuse.frontend.aten_ops.HANDLERS` joins them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.fx as fx

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator


class Unmapped(Exception):
    """This call has no IR mapping (or none with these arguments); it becomes an opaque node."""


@dataclass
class MultiOutput:
    """A tuple-valued call; `item(i)` emits the IR for output i when a getitem reads it."""

    node: fx.Node
    item: Callable[[int], str]


def tensor_value(node: fx.Node) -> torch.Tensor | None:
    """The (fake) tensor torch recorded as `node`'s result; None for tuples and non-tensor results."""
    val = node.meta.get("val")
    return val if isinstance(val, torch.Tensor) else None


def op_name(target: Any) -> str:
    """'conv2d' for aten.conv2d.default, 'transformers.grouped_mm_fallback' for another library's op: handlers are
    keyed by the op, overloads told apart by their args."""
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
        return name if target.namespace == "aten" else f"{target.namespace}.{name}"
    return ""


Handler = Callable[["Translator", dict[str, Any]], "str | MultiOutput"]


def registrar(table: dict[str, Handler]) -> Callable[..., Callable[[Handler], Handler]]:
    """`maps(*names)`: a decorator that enters its handler in `table` under each of the ATen op names."""
    def maps(*names: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            for name in names:
                table[name] = handler
            return handler
        return register
    return maps


def pair(value: Any) -> tuple[int, int]:
    """A 2-D argument (kernel size, stride, padding) as two ints."""
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return int(values[0]), int(values[-1])  # a single value stands for both


def single(value: Any) -> int:
    """A 1-D argument (kernel size, stride, padding) as one int."""
    return int(list(value)[0]) if isinstance(value, (list, tuple)) else int(value)


def triple(value: Any) -> list[int]:
    """A 3-D argument (stride, padding, dilation) as three ints: a single value stands for all three."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]
    return values * 3 if len(values) == 1 else values


def wrap_dim(dim: int, rank: int) -> int:
    """`dim` of a tensor of `rank` dims, made non-negative (-1 is the last)."""
    return dim + rank if dim < 0 else dim


def first_output(t: Translator, name: str) -> MultiOutput:
    """A tuple-valued call whose output 0 is `name`; the others (statistics, indices, masks) stay opaque."""
    def item(index: int) -> str:
        if index != 0:
            raise Unmapped(f"output {index} has no IR mapping")
        return name
    name = t.take_name(name)
    return MultiOutput(t.node, item)


def permuted(t: Translator, value: str, order: list[int]) -> str:
    """`value` permuted to `order`; no node where the order is the identity."""
    return value if order == list(range(len(order))) else t.emit("permute", [value], {"dims": order})


def reshaped(t: Translator, value: str, shape: list[int]) -> str:
    """`value` reshaped to `shape`; no node where it has that shape already."""
    return value if list(t.type_of(value).shape) == shape else t.emit("reshape", [value], {"shape": shape})
