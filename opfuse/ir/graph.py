"""The one graph IR every frontend produces and every later stage reads.

A `Graph` is an ordered list of `Node`s kept in topological order. Every value is a node: graph inputs are
nodes with op ``input``, weights and other tensors known at compile time are nodes with op ``constant`` whose
tensor lives in ``graph.constants``. A model's state (a KV cache) is a node with op ``state``, its initial tensor in
``graph.constants`` too, and ``graph.state`` maps it to the node whose value it holds after a call: the compiled
model writes that into the state's tensor, which keeps it for the next call (an ``index_copy`` writes it in place).
Each node has exactly one output, described by its `TensorType`
(logical PyTorch shape, NCHW for images; the memory layout is the code generator's business).
Multi-output source ops (split) are lowered by the frontends to several single-output nodes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import torch

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}
FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")
WIDE_INTEGERS = ("int64", "int32")     # round past 2^24 in a generated kernel's float32 arithmetic
SHORT_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp64": "float64"}


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical dtype name ('float16', ...) of a torch dtype or a name such as 'fp16'."""
    if isinstance(dtype, str):
        name = SHORT_DTYPE_NAMES.get(dtype, dtype)
    else:
        name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unsupported dtype {dtype!r}; known: {', '.join(DTYPE_BYTES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a canonical dtype name."""
    return getattr(torch, dtype_name(name))


@dataclass(frozen=True)
class TensorType:
    """Shape and dtype of one value."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "TensorType":
        return cls(tuple(tensor.shape), dtype_name(tensor.dtype))

    def with_dtype(self, dtype: str) -> "TensorType":
        return TensorType(self.shape, dtype)

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass
class Node:
    """One operation. `inputs` name the nodes whose outputs it reads, in the op's argument order."""

    name: str
    op: str
    inputs: list[str]
    attrs: dict[str, Any]
    type: TensorType
    source: str = ""  # where the node came from (fx node name, ONNX node name): used in error messages

    def describe(self) -> str:
        where = f" (from {self.source})" if self.source and self.source != self.name else ""
        return f"{self.name} [{self.op}]{where}"


class GraphError(ValueError):
    """A malformed graph or model; the message names the offending node."""


@dataclass
class Graph:
    """Nodes in topological order, the names of the output nodes, the constant tensors, and the state updates."""

    name: str = "graph"
    nodes: dict[str, Node] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=list)
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    state: dict[str, str] = field(default_factory=dict)     # state node -> the node it holds after a call

    # ---- building -------------------------------------------------------------------------------
    def unique_name(self, base: str) -> str:
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "v"
        if base not in self.nodes:
            return base
        i = 1
        while f"{base}_{i}" in self.nodes:
            i += 1
        return f"{base}_{i}"

    def add_node(self, op: str, inputs: Iterable[str], type: TensorType, attrs: dict[str, Any] | None = None,
                 name: str | None = None, source: str = "") -> Node:
        """Append a node (its inputs must already exist) and return it."""
        inputs = list(inputs)
        name = self.unique_name(name or op)
        for i in inputs:
            if i not in self.nodes:
                raise GraphError(f"node {name} [{op}] reads {i!r}, which is not defined before it")
        node = Node(name, op, inputs, dict(attrs or {}), type, source or name)
        self.nodes[name] = node
        return node

    def add_input(self, name: str, type: TensorType) -> Node:
        return self.add_node("input", [], type, name=name)

    def add_constant(self, name: str, tensor: torch.Tensor, source: str = "") -> Node:
        node = self.add_node("constant", [], TensorType.of(tensor), name=name, source=source)
        self.constants[node.name] = tensor
        return node

    def add_state(self, name: str, tensor: torch.Tensor, source: str = "") -> Node:
        """A state node holding `tensor` before the first call (its updates: `graph.state`)."""
        node = self.add_node("state", [], TensorType.of(tensor), name=name, source=source)
        self.constants[node.name] = tensor
        return node

    # ---- queries ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Node]:
        return iter(list(self.nodes.values()))

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, name: str) -> Node:
        try:
            return self.nodes[name]
        except KeyError:
            raise GraphError(f"no node named {name!r} in graph {self.name}") from None

    @property
    def input_nodes(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.op == "input"]

    def users(self) -> dict[str, list[Node]]:
        """Map from each node name to the nodes that read it (a node reading a value twice is listed twice)."""
        users: dict[str, list[Node]] = {name: [] for name in self.nodes}
        for node in self.nodes.values():
            for i in node.inputs:
                users[i].append(node)
        return users

    def writes_state_in_place(self, name: str, users: dict[str, list[Node]] | None = None) -> bool:
        """Whether node `name` updates the model's state in place: an index_copy of the state node it updates
        (`graph.state`), which nothing else reads. Its rows are written into the state's own tensor (by PyTorch's
        index_copy_, or by a kernel's store at the index's positions), never a copy of the whole state."""
        node = self.nodes[name]
        if node.op != "index_copy" or self.state.get(node.inputs[0]) != name:
            return False
        users = self.users() if users is None else users
        return [u.name for u in users[node.inputs[0]]] == [name]

    def stored_shape(self, name: str) -> tuple[int, ...]:
        """The elements a kernel computing node `name` stores: its shape, or, for an index_copy, its source's (the
        rows it writes into the state's tensor at the index's positions: `writes_state_in_place`)."""
        node = self.nodes[name]
        return self.nodes[node.inputs[2]].type.shape if node.op == "index_copy" else node.type.shape

    def input_types(self, node: Node) -> list[TensorType]:
        return [self.nodes[i].type for i in node.inputs]

    def is_constant(self, name: str) -> bool:
        return self.nodes[name].op == "constant"

    @property
    def observed(self) -> list[str]:
        """The values a call makes visible: the outputs, and the values the state holds after it."""
        return list(self.outputs) + [update for update in self.state.values() if update not in self.outputs]

    def scalar_value(self, name: str) -> float | None:
        """The value of `name` when it is a one-element constant, else None."""
        if not self.is_constant(name) or self.nodes[name].type.numel != 1:
            return None
        return float(self.constants[name].reshape(()).item())

    def only_reader(self, name: str, users: dict[str, list[Node]]) -> Node | None:
        """The one node that reads `name` (`users` is `users()`), or None: several readers, none, or a graph
        output."""
        readers = users[name]
        if len(readers) != 1 or name in self.outputs:
            return None
        return readers[0]

    # ---- editing --------------------------------------------------------------------------------
    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of `old` (and the graph outputs) read `new` instead."""
        for node in self.nodes.values():
            node.inputs = [new if i == old else i for i in node.inputs]
        self.outputs = [new if o == old else o for o in self.outputs]
        self.state = {holder: new if value == old else value for holder, value in self.state.items()}

    def remove(self, name: str) -> None:
        self.nodes.pop(name)
        self.constants.pop(name, None)

    def sort(self) -> None:
        """Re-establish topological order (stable: keeps the existing order where it is already valid)."""
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str) -> None:
            stack = [(name, iter(self.nodes[name].inputs))]
            state[name] = 1
            while stack:
                current, pending = stack[-1]
                for dep in pending:
                    if dep not in self.nodes:
                        raise GraphError(f"node {current} reads undefined value {dep!r}")
                    if state.get(dep) == 1:
                        raise GraphError(f"cycle through node {dep}")
                    if dep not in state:
                        state[dep] = 1
                        stack.append((dep, iter(self.nodes[dep].inputs)))
                        break
                else:
                    stack.pop()
                    state[current] = 2
                    order.append(current)

        for name in list(self.nodes):
            if name not in state:
                visit(name)
        self.nodes = {name: self.nodes[name] for name in order}

    def copy(self) -> "Graph":
        """A structural copy; constant tensors are shared, so passes must build new tensors, never edit them."""
        nodes = {name: Node(n.name, n.op, list(n.inputs), dict(n.attrs), n.type, n.source)
                 for name, n in self.nodes.items()}
        return Graph(self.name, nodes, list(self.outputs), dict(self.constants), dict(self.state))

    # ---- display --------------------------------------------------------------------------------
    def format(self) -> str:
        lines = [f"graph {self.name}:"]
        for n in self.nodes.values():
            attrs = {k: v for k, v in n.attrs.items() if not callable(v)}
            lines.append(f"  %{n.name}: {n.type} = {n.op}({', '.join('%' + i for i in n.inputs)})"
                         + (f" {attrs}" if attrs else ""))
        lines.append(f"  return {', '.join('%' + o for o in self.outputs)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()
