"""Padding a sequence at its end: whether a model traced at S positions along one dim gives, at its first s positions,
what the model gives at s, when its inputs are padded from s to S at the end of that dim and its outputs cut back.

Entry point: `end_padding(graph, reference, input_dims, zero_filled) -> EndPadding | RowDependence`. `graph` is the
model at S positions, `reference` the same model traced at another size s' (its nodes named and wired alike: any
other graph is refused). Where the sequence lives in every value is read off the two: the dims whose size is S in
one and s' in the other; a dim that changes with the size in any other way (merged with another dim, S - 1) is
refused. The walk then checks, node by node, that every value's entries at real positions (below s along each of
its sequence dims) are the model's at s:

- an op that keeps positions apart keeps them (`opfuse.ir.rows.dim_maps` says where each dim goes: elementwise ops,
  reductions and products over other dims); a reshape that keeps the sequence a dim of its own, in its place among
  the other digits of the flat index, too;
- a value computed from constants alone (position ids and embeddings, causal triangles, T5's relative-position
  bias) must equal the reference's on its first s' positions along its sequence dims, and all of it where it has
  none: a constant that depends on the size otherwise is refused;
- attention over the sequence as its keys only where padded keys are masked: the mask's padded entries are False,
  or an additive bias of at most `MASKED` (-10000: transformers' dtype minimum, -1e9 and -inf all are) or -inf,
  assuming the scores it is added to lie within 4900 of each other (exp then underflows to 0 in float32); or the
  attention is causal with its queries the same sequence. A softmax over the sequence
  likewise (its padded outputs are then exactly 0), and a product contracting the sequence only where one operand's
  padded entries are exactly 0 (those probabilities);
- a scan along the sequence (cumsum, cumprod) reads only the positions before each: kept;
- a slice along the sequence that keeps positions [start, end) at both sizes reads the first `end` positions
  (`EndPadding.least`: the smallest call padding may serve);
- an attr other than a size (`SIZE_ATTRS`) that differs between the two traces (a roll by the length) is refused;
- anything else along the sequence (an opaque op, a reduction, a slice from the end) is refused, naming the node.

Whether padded entries are finite is followed too (`taints`): a masked softmax gives its padded keys probability 0,
and a product their values times 0, only where the scores and values there are finite. Padded copies of real
positions compute finite values as the real ones do; values computed from an input padded with zeros may not be
(a division by the mask), and where the walk loses track of them through an op that can make an infinity, they
may not be read by attention, a masked product or a saturated bias.

What padded entries hold is followed as far as a mask needs (`Fill`): an input is padded with copies of its last
position (unknown, None) or, where `zero_filled` names it, with zeros (an attention mask: 0 masks a key); an
elementwise op whose operands' padded entries are known computes its own (a mask cast to bool, combined with a
constant triangle by where, made an additive bias); a bias of at most `SATURATED` stays one whatever finite value
is added to it.

Limits: a query whose every real key is masked (an all-zero attention-mask row) reads padded keys too; its output is
meaningless either way (PyTorch averages the masked keys or gives NaN). The reference trace compares constants at
two sizes, not at every size: a constant that depends on the size in a way both sizes agree on is not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

import torch

from opfuse.ir.graph import Graph, Node, torch_dtype
from opfuse.ir.ops import SCAN_OPS, get_op
from opfuse.ir.rows import CONTRACTS, KEYS, SCANS, UNREADABLE, Mixes, RowDependence, dim_maps

Fill = "bool | int | float | None"      # the value of a value's padded entries along one of its sequence dims
MASKED = -1e4           # an additive bias at most this gives a key probability 0 (exp underflows in float32)
SATURATED = -2e4        # a bias at most this stays at most MASKED whatever score (under 1e4) is added to it


# elementwise ops that make no infinity of finite operands: a known padded value they lose track of stays finite
FINITE_OPS = frozenset({"add", "sub", "mul", "neg", "abs", "where", "cast", "identity", "relu", "relu6", "gelu",
                        "silu", "sigmoid", "tanh", "hardswish", "hardsigmoid", "leaky_relu", "maximum", "minimum",
                        "clamp", "lt", "le", "gt", "ge", "eq", "ne", "logical_not", "erf", "sin", "cos"})

# attrs that may differ between the two traces: sizes, whose effect shows in the shapes the walk reads (a reshape's
# target, a whole slice's end); an opaque call's function, a closure of each trace, never compares equal: a graph
# with an opaque call does not pad (what the call bakes in of the size is unknown)
SIZE_ATTRS = frozenset({"shape", "size", "end"})


def _same(a: object, b: object) -> bool:
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
                bool(torch.equal(a.cpu(), b.cpu()))
        return bool(a == b)
    except Exception:       # values that cannot be compared are taken to differ
        return False


@dataclass(frozen=True)
class EndPadding:
    """How a padded call is cut back: each output's sequence dims; and the smallest call size padding serves."""

    cuts: dict[str, tuple[int, ...]]
    least: int = 1


def masks(fill: Fill) -> bool:
    """Whether padded entries of this value make their keys' probabilities exactly 0."""
    return fill is False or (type(fill) is float and fill <= MASKED)


def is_zero(fill: Fill) -> bool:
    return fill is not None and type(fill) is not bool and fill == 0


class _Walk:
    def __init__(self, graph: Graph, reference: Graph, input_dims: Mapping[str, int], zero_filled: Collection[str]):
        from opfuse.passes.simplify_attention_masks import CompileTimeValues

        self.graph, self.reference = graph, reference
        self.input_dims, self.zero_filled = input_dims, set(zero_filled)
        self.values, self.reference_values = CompileTimeValues(graph), CompileTimeValues(reference)
        self.seq: dict[str, tuple[int, ...]] = {}          # value -> its sequence dims
        self.fills: dict[str, dict[int, Fill]] = {}        # value computed from the inputs -> padded entries' fills
        self.checked: dict[str, Fill] = {}                 # static value checked -> its value where all one, else None
        self.static_fills: dict[str, dict[int, Fill]] = {}  # static value checked -> its padded entries' fills
        self.tainted: set[str] = set()      # values whose padded entries may not be finite (module docstring)
        self.zero_derived: set[str] = set()  # values computed from an input padded with zeros (`derives_from_zeros`)
        self.approximate: set[str] = set()   # values whose fill is a saturated bias plus unknown finite values
        self.least = 1
        name = next(iter(input_dims))
        self.size = graph[name].type.shape[input_dims[name]]
        self.reference_size = reference[name].type.shape[input_dims[name]]

    def run(self) -> EndPadding | RowDependence:
        if list(self.graph.outputs) != list(self.reference.outputs):
            return RowDependence(self.graph[self.graph.outputs[0]], f"is not an output of the model traced at "
                                 f"{self.reference_size} positions as at {self.size}")
        for node in self.graph:
            try:
                self.seq[node.name] = self.sequence_dims(node)
                if node.op == "input":
                    self.input(node)
                elif node.name not in self.values.cone:
                    self.fills[node.name] = self.node(node)
                    if self.taints(node):
                        self.tainted.add(node.name)
                    if self.derives_from_zeros(node):
                        self.zero_derived.add(node.name)
            except Mixes as why:
                return RowDependence(node, str(why))
            except UNREADABLE as error:
                return RowDependence(node, f"cannot be analysed ({type(error).__name__}: {error})")
        cuts = {}
        for name in self.graph.outputs:
            node = self.graph[name]
            if name not in self.fills and node.op != "input":
                return RowDependence(node, "is an output computed from constants alone: it may have been made for "
                                     f"{self.size} positions")
            cuts[name] = self.seq[name]
        return EndPadding(cuts, self.least)

    # ---- where the sequence lives --------------------------------------------------------------------------------

    def sequence_dims(self, node: Node) -> tuple[int, ...]:
        other = self.reference.nodes.get(node.name)
        if other is None or other.op != node.op or other.inputs != node.inputs:
            raise Mixes(f"is not the same node in the model traced at {self.reference_size} positions: the graph "
                        "changes with the size")
        for key in node.attrs.keys() | other.attrs.keys():
            mine, theirs = node.attrs.get(key), other.attrs.get(key)
            if key not in SIZE_ATTRS and not _same(mine, theirs):
                raise Mixes(f"has {key} {mine!r} at {self.size} positions and {theirs!r} at {self.reference_size}: "
                            "it computes otherwise at another size")
        shape, other_shape = node.type.shape, other.type.shape
        if len(shape) != len(other_shape):
            raise Mixes(f"has rank {len(shape)} at {self.size} positions and {len(other_shape)} at "
                        f"{self.reference_size}")
        dims = []
        for dim, (a, b) in enumerate(zip(shape, other_shape)):
            if a == b:
                continue
            if (a, b) != (self.size, self.reference_size):
                raise Mixes(f"has {a} along dim {dim} at {self.size} positions and {b} at {self.reference_size}: it "
                            "holds the sequence other than as a dim of its own")
            dims.append(dim)
        return tuple(dims)

    def input(self, node: Node) -> None:
        dim = self.input_dims.get(node.name)
        want = () if dim is None else (dim % len(node.type.shape),)
        if self.seq[node.name] != want:
            raise Mixes(f"holds the sequence in dims {list(self.seq[node.name])}, declared {list(want)}")
        self.fills[node.name] = {d: (0 if node.name in self.zero_filled else None) for d in want}
        if node.name in self.zero_filled:
            self.zero_derived.add(node.name)

    def static(self, name: str) -> Fill:
        """Check a value computed from constants alone against the reference (module docstring); its value where it
        is one value throughout, else None."""
        if name in self.checked:
            return self.checked[name]
        value, other = self.values.value(name), self.reference_values.value(name)
        if value is None or other is None:
            raise Mixes(f"reads {name}, a value computed from constants that is too large to compare at two sizes")
        prefix = value
        for dim in self.seq[name]:
            prefix = prefix.narrow(dim, 0, self.reference_size)
        same = prefix.shape == other.shape and (prefix is other or torch.equal(prefix, other))
        if not same:
            where = f"on its first {self.reference_size} positions" if self.seq[name] else "at both sizes"
            raise Mixes(f"reads {name}, a constant that differs {where}: it is made for {self.size} positions")
        flat = value.reshape(-1)
        uniform = flat.numel() > 0 and bool((flat == flat[0]).all())
        self.checked[name] = flat[0].item() if uniform else None
        self.static_fills[name] = {dim: padded_value(value, self.seq[name], dim) for dim in self.seq[name]}
        return self.checked[name]

    # ---- nodes -----------------------------------------------------------------------------------------------

    def node(self, node: Node) -> dict[int, Fill]:
        for name in node.inputs:
            if name in self.values.cone:
                self.static(name)
        if not any(self.seq[i] for i in node.inputs):
            if self.seq[node.name] and node.op != "expand" and not get_op(node.op).kind.elementwise:
                raise Mixes(f"makes dims {list(self.seq[node.name])} that change with the size from values that do "
                            "not hold the sequence")
            return {dim: None for dim in self.seq[node.name]}    # a value the same at every position, broadcast
        if node.op == "reshape":
            return self.reshape(node)
        if node.op == "sdpa":
            return self.attention(node)
        if node.op == "slice":
            return self.slice(node)
        maps = dim_maps(self.graph, node)
        out_dims = set(self.seq[node.name])
        for position, name in enumerate(node.inputs):
            for dim in self.seq[name]:
                target = maps[position][dim]
                where = f"the sequence (dim {dim} of {name})"
                if isinstance(target, str):
                    self.along_sequence(node, position, dim, target, where)
                elif target not in out_dims:
                    raise Mixes(f"moves {where} to dim {target}, which does not change with the size")
        if get_op(node.op).kind.elementwise:
            return {dim: self.elementwise_fill(node, maps, dim) for dim in out_dims}
        if len(node.inputs) == 1 and (get_op(node.op).alias or node.op == "expand"):   # a view moves its entries
            moved = {target: self.fills[node.inputs[0]].get(dim) for dim, target in enumerate(maps[0])
                     if isinstance(target, int) and dim in self.seq[node.inputs[0]]}
            return {dim: moved.get(dim) for dim in out_dims}
        if node.op == "softmax" and node.attrs["dim"] % len(node.type.shape) in out_dims:
            return {dim: (0.0 if dim == node.attrs["dim"] % len(node.type.shape) else None) for dim in out_dims}
        return {dim: None for dim in out_dims}

    def taints(self, node: Node) -> bool:
        """Whether `node`'s padded entries may hold +inf or NaN: an operand's may; or the value it computes for them
        is one; or it turns a known padded value into unknown ones where that value is infinite (a -inf mask
        anywhere but in a selection, a sum with scores, a softmax or attention's mask); or an op that can make an
        infinity of finite values (a division, a log: not in `FINITE_OPS`) reads a value computed from an input
        padded with zeros (`zero_derived`: 0 / 0); or a softmax or attention masks whole padded rows (-inf
        everywhere: NaN)."""
        if any(i in self.tainted for i in node.inputs):
            return True
        computed = self.fills[node.name]
        if any(isinstance(f, float) and (math.isnan(f) or f == math.inf) for f in computed.values()):
            return True
        elementwise = get_op(node.op).kind.elementwise
        if elementwise and node.op not in FINITE_OPS and not self.finite_divisor(node) and \
                None in computed.values() and any(i in self.zero_derived for i in node.inputs):
            return True
        if node.op in ("softmax", "sdpa"):
            scores = node.inputs[0] if node.op == "softmax" else (node.inputs[3] if len(node.inputs) > 3 else None)
            reduced = node.attrs["dim"] % len(node.type.shape) if node.op == "softmax" else \
                len(self.graph[scores].type.shape) - 1 if scores else None
            rows = {d: f for d, f in self.fills.get(scores, {}).items() if d != reduced}
            if any(masks(f) or (type(f) is float and f == -math.inf) for f in rows.values()):
                return True     # padded rows masked throughout
        for position, name in enumerate(node.inputs):
            known = [f for f in self.fills.get(name, {}).values() if f is not None]
            if not known or node.op in ("where", "softmax") or (node.op == "sdpa" and position == 3):
                continue        # a selection, or a mask's -inf where it masks
            infinite = any(isinstance(f, float) and not math.isfinite(f) for f in known)
            if infinite and (node.op == "add" or (node.op == "sub" and position == 0)):
                continue        # -inf plus finite scores: still -inf, a mask
            if (infinite or (elementwise and node.op not in FINITE_OPS)) and None in computed.values():
                return True
        return False

    def finite_divisor(self, node: Node) -> bool:
        """A division by a constant that is nowhere 0 (a scale): as finite as a product."""
        if node.op != "div" or node.inputs[1] not in self.values.cone:
            return False
        value = self.values.value(node.inputs[1])
        return value is not None and bool((value != 0).all()) and bool(torch.isfinite(value).all())

    def derives_from_zeros(self, node: Node) -> bool:
        """Whether a value computed from an input padded with zeros flows into `node`'s padded entries: through any
        operand but a selection's condition or attention's mask (which pick, not flow), and a softmax (probabilities
        are finite)."""
        if node.op == "softmax":
            return False
        flowing = node.inputs[1:] if node.op == "where" else node.inputs[:3] if node.op == "sdpa" else node.inputs
        return any(i in self.zero_derived for i in flowing)

    def along_sequence(self, node: Node, position: int, dim: int, why: str, where: str) -> None:
        """An op reading the sequence dim `dim` of operand `position` other than position by position: fine only
        as the module docstring lists."""
        name = node.inputs[position]
        fill = self.fills.get(name, {}).get(dim)
        if node.op == "softmax" and masks(fill):
            return
        if node.op in SCAN_OPS and why == SCANS:
            return
        if why == CONTRACTS and node.op == "matmul":
            other = node.inputs[1 - position]
            other_dim = len(self.graph[other].type.shape) - (2 if position == 0 else 1)
            zero_here, zero_there = is_zero(fill), is_zero(self.fills.get(other, {}).get(other_dim))
            if other_dim in self.seq[other] and ((zero_here and other not in self.tainted) or
                                                 (zero_there and name not in self.tainted)):
                return
            raise Mixes(f"contracts {where} with neither operand's padded entries known to be 0")
        if node.op == "softmax":
            raise Mixes(f"takes a softmax over {where}, whose padded entries are not masked")
        raise Mixes(why.format(where=where))

    def reshape(self, node: Node) -> dict[int, Fill]:
        source, target = self.graph[node.inputs[0]].type.shape, node.type.shape
        before, after = self.seq[node.inputs[0]], self.seq[node.name]
        if len(before) != 1 or len(after) != 1 or math.prod(source[:before[0]]) != math.prod(target[:after[0]]):
            raise Mixes(f"reshapes {list(source)} to {list(target)}, moving the sequence among other digits")
        return {after[0]: self.fills[node.inputs[0]].get(before[0])}

    def attention(self, node: Node) -> dict[int, Fill]:
        q, k, v = node.inputs[:3]
        rank = {name: len(self.graph[name].type.shape) for name in node.inputs}
        if any(d != rank[q] - 2 for d in self.seq[q]):
            raise Mixes(f"holds the sequence in {q} other than in its query rows")
        keys = [d for name in (k, v) for d in self.seq[name]]
        if any(d != rank[name] - 2 for name in (k, v) for d in self.seq[name]) or \
                bool(self.seq[k]) != bool(self.seq[v]):
            raise Mixes(f"holds the sequence in {k} or {v} other than in their key rows")
        if len(node.inputs) > 3:
            mask = node.inputs[3]
            if any(d < rank[mask] - 2 for d in self.seq[mask]):
                raise Mixes(f"holds the sequence in its mask {mask} other than along queries or keys")
        if keys:
            if {k, v} & self.tainted:
                raise Mixes(f"reads padded keys or values ({k}, {v}) that may not be finite")
            causal = node.attrs.get("is_causal") and self.seq[q]
            masked = len(node.inputs) > 3 and (rank[mask] - 1) in self.seq[mask] and \
                masks(self.fills.get(mask, {}).get(rank[mask] - 1))
            if not (causal or masked):
                raise Mixes(KEYS.format(where=f"the sequence (dim {self.seq[k][0]} of {k})") +
                            " and no mask masks them")
        return {dim: None for dim in self.seq[node.name]}

    def slice(self, node: Node) -> dict[int, Fill]:
        source = node.inputs[0]
        dim = node.attrs["dim"] % len(node.type.shape)
        other = self.reference[node.name].attrs
        if dim not in self.seq[source] or dim in self.seq[node.name]:
            if dim in self.seq[source] and (node.attrs.get("start") or 0) == 0 and (node.attrs.get("step") or 1) == 1:
                return dict(self.fills[source])         # the whole sequence: a no-op
            if dim in self.seq[source]:
                raise Mixes(f"slices the sequence (dim {dim} of {source}) from a position that moves with the size")
            return dict(self.fills[source])
        start, end, step = (node.attrs.get(k) for k in ("start", "end", "step"))
        if (start, end, step) != tuple(other.get(k) for k in ("start", "end", "step")) or (step or 1) != 1 or \
                start is None or end is None or not 0 <= start < end:
            raise Mixes(f"slices the sequence (dim {dim} of {source}) at positions that change with the size")
        self.least = max(self.least, end)
        return {d: f for d, f in self.fills[source].items() if d != dim}

    def elementwise_fill(self, node: Node, maps: list, dim: int) -> Fill:
        """The padded entries along output dim `dim` of an elementwise op: known where its operands' are."""
        known = []
        for position, name in enumerate(node.inputs):
            held = [d for d, target in enumerate(maps[position]) if target == dim]
            if name in self.values.cone:
                fills = self.static_fills.get(name, {})
                known.append(fills.get(held[0]) if held and held[0] in fills else self.checked.get(name))
            elif held and held[0] in self.seq[name]:
                exact = name not in self.approximate or node.op in ("add", "sub")   # a bias plus scores: a mask only
                known.append(self.fills[name].get(held[0]) if exact else None)
            else:
                known.append(None)          # real values, broadcast along the padded positions
        if node.op == "where" and known[0] is not None:
            return known[1] if known[0] else known[2]
        if node.op == "where" and node.inputs[0] == node.inputs[2] and known[1] is False:
            return False                    # a and b (the capture's where(a, b, a)) with b False
        if node.op == "where" and node.inputs[0] == node.inputs[1] and known[2] is True:
            return True                     # a or b, where(a, a, b), with b True
        if node.op in ("add", "sub") and known.count(None) == 1 and node.inputs[known.index(None)] not in self.tainted:
            bias = known[1 - known.index(None)]
            if type(bias) is float and bias <= SATURATED and (node.op == "add" or known[0] is not None):
                self.approximate.add(node.name)
                return bias                 # a saturated bias plus or minus a finite value: still a mask
        if any(k is None for k in known):
            return None
        try:
            args = [torch.tensor(k, dtype=torch_dtype(self.graph[n].type.dtype)) for k, n in zip(known, node.inputs)]
            result = get_op(node.op).run(args, node.attrs)
        except Exception:       # an op that cannot run on scalars: its fill is unknown
            return None
        return result.item() if result.numel() == 1 else None


def padded_value(value: torch.Tensor, dims: tuple[int, ...], dim: int) -> Fill:
    """The one value a constant holds at every entry that may be padded along `dim` while real along its other
    sequence dims `dims`, for any call size: the entries whose index along `dim` exceeds their index along each
    other one (a causal triangle is False there), or, with no other, every entry past the first; None where they
    differ."""
    shape = value.shape
    positions = [torch.arange(shape[d], device=value.device).reshape([-1 if e == d else 1 for e in range(len(shape))])
                 for d in dims]
    along = positions[dims.index(dim)]
    others = [p for d, p in zip(dims, positions) if d != dim]
    padded = along > (torch.stack(torch.broadcast_tensors(*others)).amax(0) if others else 0)
    picked = value[padded.expand(shape)] if others or along.numel() > 1 else value.new_empty(0)
    if picked.numel() == 0 or not bool((picked == picked.reshape(-1)[0]).all()):
        return None
    return picked.reshape(-1)[0].item()


def end_padding(graph: Graph, reference: Graph, input_dims: Mapping[str, int],
                zero_filled: Collection[str] = ()) -> EndPadding | RowDependence:
    """Whether padding the inputs named in `input_dims` at the end of their dim there (with zeros for those in
    `zero_filled`, else copies of their last position) and cutting the outputs back gives the model's results at the
    smaller size (module docstring): how to cut, or the first node that may read a padded position and why."""
    return _Walk(graph, reference, input_dims, zero_filled).run()


def end_padding_with_zeros(graph: Graph, reference: Graph, uses: Sequence[tuple[int, int]], rows: str
                           ) -> tuple[EndPadding, tuple[int, ...]] | str:
    """`end_padding` of the inputs at `uses` ((input index, dim) pairs) for the first choice of them padded with
    zeros that pads, fewest first: (how it pads, those inputs' indices); else why not, after `rows` (why the rows
    analysis refused) the first refusal."""
    import itertools

    names = [node.name for node in graph.input_nodes]
    input_dims = {names[index]: axis for index, axis in uses}
    users = [index for index, _ in uses]
    why = rows
    for count in range(len(users) + 1):
        for zeros in itertools.combinations(users, count):
            found = end_padding(graph, reference, input_dims, [names[i] for i in zeros])
            if isinstance(found, EndPadding):
                return found, zeros
            why = f"{rows}; nor may its end be padded: {found}" if why is rows else why
    return why

