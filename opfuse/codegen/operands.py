"""Operand loading and storing shared by the elementwise and reduction kernels (pointwise.py, reduction.py).

A generated kernel evaluates group values at *coordinates*: one Triton expression per logical dimension of the
value (None where the coordinate is always 0, e.g. a size-1 dimension). `Region.value(name, coords)` emits the
lines computing a value there, in float32; `Region.integer` one of a wide integer dtype (int32, int64), exactly, in
int64 (a float op reads it converted, as eager's type promotion does): a group input is loaded through its runtime
strides, an elementwise node goes through `expr.emit` with its operands' coordinates broadcast (numpy rules), a view node (reshape, permute,
expand, slice, identity) and a roll only map coordinates, a cat picks the input whose slice holds the coordinate
(each input evaluated under its slice's mask), a pad loads its input under the mask of the input's extent (the pad
value elsewhere), an embedding, a take or a gather computes its index (exactly, as an integer) and then loads the
source there, and the sliding windows (unfold, im2col, col2im: `opfuse.codegen.windows`) map coordinates, masked
where they pad. Broadcast constants, channels-last activations and channel-slice views therefore need no special
case, and no view is ever copied. `build_kernel` wraps the lines into the kernel's source.

The coordinate helpers are in `opfuse.codegen.coordinates`; the runtime half both kernel kinds share
(`TemplateKernel`) and the kernel's tensor parameters (`KernelArgs`) in `opfuse.codegen.template_kernel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from opfuse.codegen.base import load_kernel
from opfuse.codegen.coordinates import Coords, broadcast_coords, cubic_taps, unravel_expressions, upsample_source
from opfuse.codegen.expr import (DISCRETE_OPS, INTEGER_OPS, SUPPORTED_OPS, Unsupported, emit, emit_integer, literal,
                                 triton_dtype)
from opfuse.codegen.template_kernel import KernelArgs, TensorParam
from opfuse.codegen.windows import col2im_value, im2col_value, unfold_coords
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.tiles import next_power_of_2  # noqa: F401  (pointwise, reduction import it here)
from opfuse.ir.graph import WIDE_INTEGERS, Graph, Node
from opfuse.ir.ops import along_channels

VIEW_OPS = frozenset({"reshape", "identity", "permute", "expand", "slice"})
GATHERS = frozenset({"take", "gather"})     # index maps whose index is a value the kernel computes


# ---- code emission ----------------------------------------------------------------------------------

def exact(node: Node) -> None:
    """Refuse a value the float32 arithmetic of a generated kernel would not hold exactly where it is loaded as a
    float: float64 values (a float64 model's, which its float32 arithmetic would round, copies and index maps too),
    and 32- and 64-bit integers (token ids, positions) outside `Region.integer`, which round past 2^24. Such a group
    runs through PyTorch instead, and says why."""
    if node.type.dtype in WIDE_INTEGERS or node.type.dtype == "float64":
        raise Unsupported(f"{node.describe()} holds {node.type.dtype} values, which a kernel's float32 arithmetic "
                          "rounds")


class Emitter:
    """Shared state of one kernel's code generation: the group, its parameters and fresh variable names."""

    def __init__(self, graph: Graph, group: FusionGroup, scalars: dict[str, str]):
        self.graph = graph
        self.group = group
        self.members = set(group.nodes)
        self.args = KernelArgs(graph)
        self.scalars = scalars                  # constants of one element, inlined as literals
        self.flags: dict[str, tuple[str, int]] = {}   # constexpr flag -> (value, region key): see Region.flat
        self._counter = 0

    def fresh(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}{self._counter}"

    def region(self, tile: str, mask: str, flat: "FlatIndex | None" = None) -> "Region":
        return Region(self, tile, mask, flat)


@dataclass
class FlatIndex:
    """A pointwise region's flat index: tensors dense in the iteration order are addressed by it directly.

    Whether a tensor is dense in that order is only known at run time, so each gets a constexpr flag and both
    addressings are generated; the dense one skips the div/mod of the coordinates and loads vectors.
    """

    offsets: str                # the Triton variable holding the flat index
    coords: Coords              # the iteration coordinates derived from it
    shape: tuple[int, ...]      # the iteration shape
    key: int                    # which iteration space (component) the flags belong to


class Region:
    """One straight-line block of generated code (a loop body, a branch) with its own cache of computed values."""

    def __init__(self, emitter: Emitter, tile: str, mask: str, flat: FlatIndex | None = None):
        self.emitter = emitter
        self.graph = emitter.graph
        self.tile = tile            # Triton shape of the block, e.g. "[BLOCK]" or "[BLOCK_M, BLOCK_L]"
        self.mask = mask
        self.flat = flat
        self.lines: list[str] = []
        self.cache: dict[tuple[str, Coords, str], str] = {}    # (value, coordinates, mask) -> its variable
        self.zero = emitter.fresh("zero")
        # full-tile zero offsets: every pointer block gets the tile's shape even when an operand is broadcast
        self.lines.append(f"{self.zero} = tl.zeros({tile}, dtype=tl.int32)")

    def assign(self, expression: str, prefix: str = "v") -> str:
        name = self.emitter.fresh(prefix)
        self.lines.append(f"{name} = {expression}")
        return name

    def bind(self, name: str, coords: Coords, variable: str) -> None:
        """Declare that `variable` holds value `name` at `coords` (a reduction result, say; an int64 one where
        `name` is a wide integer, as `integer` gives)."""
        exact = ("int",) if self.graph[name].type.dtype in WIDE_INTEGERS else ()
        self.cache[(name, tuple(coords), self.mask) + exact] = variable

    # ---- values -----------------------------------------------------------------------------------
    def value(self, name: str, coords: Coords) -> str:
        """A float32 Triton expression for value `name` at `coords`, emitting the lines it needs."""
        coords = tuple(coords)
        key = (name, coords, self.mask)     # a value loaded under a cat branch's narrower mask is another value
        if key in self.cache:
            return self.cache[key]
        if name in self.emitter.scalars:
            return self.emitter.scalars[name]
        node = self.graph[name]
        if node.type.dtype in WIDE_INTEGERS:        # computed exactly; a float op reads it converted
            result = self.assign(f"{self.integer(name, coords)}.to(tl.float32)")
        elif name not in self.emitter.members:
            result = self._load(name, coords)
        elif node.op in VIEW_OPS:
            result = self.value(node.inputs[0], self.view_coords(node, coords))
        elif node.op == "cat":
            result = self._cat(node, coords)
        elif node.op == "roll":
            result = self.value(node.inputs[0], self._roll_coords(node, coords))
        elif node.op == "embedding":
            result = self._embedding(node, coords)
        elif node.op in GATHERS:
            result = self._gather(node, coords)
        elif node.op == "pad":
            result = self._pad(node, coords)
        elif node.op == "upsample":
            result = self._upsample(node, coords)
        elif node.op == "unfold":
            result = self.value(node.inputs[0], unfold_coords(node, self.graph[node.inputs[0]].type.shape, coords))
        elif node.op == "im2col":
            result = im2col_value(self, node, coords)
        elif node.op == "col2im":
            result = col2im_value(self, node, coords)
        elif node.op in SUPPORTED_OPS:
            args = [self._operand(node, position, i, coords) for position, i in enumerate(node.inputs)]
            result = self.assign(emit(node.op, node.attrs, args))
        else:
            raise Unsupported(f"node {node.describe()} cannot be computed elementwise inside this kernel")
        self.cache[key] = result
        return result

    def _operand(self, node: Node, position: int, name: str, coords: Coords) -> str:
        """Input `position` (value `name`) of elementwise `node` at the coordinates of its output's `coords`. A
        discrete op (a comparison) decides on the value eager would hold: a wide integer exactly, a float rounded
        to its dtype."""
        coords = self.operand_coords(node, position, coords)
        if node.op not in DISCRETE_OPS:
            return self.value(name, coords)
        if self.graph[name].type.dtype in WIDE_INTEGERS:
            return self.integer(name, coords)
        return self._rounded(self.value(name, coords), name)

    def integer(self, name: str, coords: Coords) -> str:
        """An int64 Triton expression for value `name`, of a wide integer dtype (int32, int64: token ids,
        positions, counts), at `coords`, computed exactly: loaded as the integer it is, mapped through views and
        index maps, computed by `INTEGER_OPS` in int64 (each result wrapped to its dtype, as torch's int32
        arithmetic wraps) or cast (a float truncated toward zero, as torch casts). Any other op has no exact form
        here and is refused (`Unsupported`): the group runs through PyTorch."""
        coords = tuple(coords)
        key = (name, coords, self.mask, "int")
        if key in self.cache:
            return self.cache[key]
        node = self.graph[name]
        if name in self.emitter.scalars:        # (a float one truncated, as torch casts it)
            return str(int(self.graph.constants[name].reshape(-1)[0]))
        if name not in self.emitter.members:
            result = self.assign(f"{self.load_exact(name, coords)}.to(tl.int64)")
        elif node.op in VIEW_OPS:
            result = self.integer(node.inputs[0], self.view_coords(node, coords))
        elif node.op == "roll":
            result = self.integer(node.inputs[0], self._roll_coords(node, coords))
        elif node.op == "cat":
            result = self._cat(node, coords, exact=True)
        elif node.op == "pad":
            result = self._pad(node, coords, exact=True)
        elif node.op in GATHERS:
            result = self._gather(node, coords, exact=True)
        elif node.op == "cast":
            result = self.assign(self._wrapped(self.as_integer(node.inputs[0], coords), node))
        elif node.op in INTEGER_OPS:
            args = [self.value(i, self.operand_coords(node, 0, coords)) if node.op == "where" and position == 0
                    else self.as_integer(i, self.operand_coords(node, position, coords))
                    for position, i in enumerate(node.inputs)]
            result = self.assign(self._wrapped(emit_integer(node.op, args), node))
        else:
            raise Unsupported(f"{node.describe()} holds {node.type.dtype} values, which a kernel computes exactly "
                              f"only through integer arithmetic, and {node.op} has no integer form here")
        self.cache[key] = result
        return result

    def as_integer(self, name: str, coords: Coords) -> str:
        """Value `name` at `coords` as an int64 expression: a wide integer or a one-element constant exactly, a bool
        or narrow integer from its float32 value (exact), a float rounded to its dtype, then truncated toward zero
        (torch's cast of the value eager holds)."""
        if self.graph[name].type.dtype in WIDE_INTEGERS or name in self.emitter.scalars:
            return self.integer(name, coords)
        return f"({self._rounded(self.value(name, coords), name)}).to(tl.int64)"

    def _wrapped(self, expression: str, node: Node) -> str:
        """An int64 `expression` wrapped to `node`'s dtype where that is int32, as torch's arithmetic wraps."""
        return f"({expression}).to(tl.int32).to(tl.int64)" if node.type.dtype == "int32" else expression

    def _gather(self, node: Node, coords: Coords, exact: bool = False) -> str:
        """A take (numpy.take along `axis`: the indices' dims replace it) or a gather (torch.gather: the index has
        the output's shape and replaces the coordinate along `dim`) at `coords`: the index computed exactly, a
        negative one counting from the end, then the source there. An index outside the source (eager raises)
        reads nothing and gives NaN, or 0 for an integer source."""
        source, indices = node.inputs[:2]
        shape = self.graph[source].type.shape
        if node.op == "take":
            axis, rank = node.attrs["axis"] % len(shape), len(self.graph[indices].type.shape)
            at, before, after = coords[axis:axis + rank], coords[:axis], coords[axis + rank:]
        else:
            axis = node.attrs["dim"] % len(shape)
            at, before, after = coords, coords[:axis], coords[axis + 1:]
        index = self.integer(indices, at)
        position = self.assign(f"tl.where({index} < 0, {index} + {shape[axis]}, {index})", "i")
        return self.masked(source, before + (position,) + after, f"({position} >= 0) & ({position} < {shape[axis]})",
                           "0" if exact else "float('nan')", exact)

    def _roll_coords(self, node: Node, coords: Coords) -> Coords:
        """Coordinates in the input of a roll: out[i] = in[(i - shift) mod n] along each rolled dim; shifts along
        one dim named twice (or as d and d - rank) add up, as torch.roll applies them one after the other."""
        result = list(coords)
        rank = len(node.type.shape)
        offsets: dict[int, int] = {}
        for shift, dim in zip(node.attrs["shifts"], node.attrs["dims"]):
            dim %= rank
            offsets[dim] = (offsets.get(dim, 0) - shift) % node.type.shape[dim]
        for dim, offset in offsets.items():
            if coords[dim] is not None and offset:
                result[dim] = f"(({coords[dim]} + {offset}) % {node.type.shape[dim]})"
        return tuple(result)

    def _pad(self, node: Node, coords: Coords, exact: bool = False) -> str:
        """A constant pad at `coords`: its input at `coords` less the padding before, loaded under the mask of the
        input's extent, the pad value outside it. F.pad's pads name the last dim's (before, after) first; a
        negative pad crops."""
        pads, shape = node.attrs["pads"], self.graph[node.inputs[0]].type.shape
        rank = len(shape)
        inner, inside = list(coords), []
        for i in range(len(pads) // 2):
            dim, before = rank - 1 - i, int(pads[2 * i])
            if before == 0 and int(pads[2 * i + 1]) == 0:
                continue
            position = coords[dim] or "0"
            inner[dim] = position if before == 0 else f"({position} - {before})"
            inside.append(self.assign(f"({inner[dim]} >= 0) & ({inner[dim]} < {shape[dim]})", "inside"))
        if not inside:
            return (self.integer if exact else self.value)(node.inputs[0], coords)
        fill = str(int(node.attrs["value"])) if exact else literal(node.attrs["value"])
        return self.masked(node.inputs[0], tuple(inner), " & ".join(f"({c})" for c in inside), fill, exact)

    def masked(self, name: str, coords: Coords, inside: str, other: str, exact: bool = False) -> str:
        """Value `name` at `coords` (`integer`'s where `exact`) computed under the kernel's mask narrowed by the
        Triton condition `inside` (where it is false nothing is loaded, so an address outside a tensor is never
        read), `other` there."""
        within = self.assign(inside, "inside")
        outer = self.mask
        self.mask = f"{outer} & {within}"
        try:
            value = (self.integer if exact else self.value)(name, coords)
        finally:
            self.mask = outer
        return self.assign(f"tl.where({within}, {value}, {other})")

    def _upsample(self, node: Node, coords: Coords) -> str:
        """An upsample at `coords`: its input at the source coordinates of each spatial dim (`upsample_source`), one
        load for nearest modes, the 2^dims neighbours weighted for linear; cubic's 4 taps a dim (`cubic_taps`: 16
        loads in 2-D) weighted and summed in tap order (x0 * w0 + x1 * w1 + x2 * w2 + x3 * w3, PyTorch's
        cubic_interp1d). The outer dims' weights are applied last, as PyTorch nests them."""
        in_shape = self.graph[node.inputs[0]].type.shape
        spatial = range(2, len(in_shape))
        if node.attrs["mode"] == "cubic":
            taps = {d: cubic_taps(node, d - 2, in_shape[d], coords[d], self.assign) for d in spatial}

            def convolve(taken: tuple, dims: list[int]) -> str:
                if not dims:
                    return self.value(node.inputs[0], coords[:2] + taken)
                return self.assign(" + ".join(f"{convolve(taken + (index,), dims[1:])} * {weight}"
                                              for index, weight in taps[dims[0]]))
            return convolve((), list(spatial))
        sources = {d: upsample_source(node, d - 2, in_shape[d], coords[d], self.assign) for d in spatial}
        if node.attrs["mode"] != "linear":
            return self.value(node.inputs[0], coords[:2] + tuple(sources[d][0] for d in spatial))

        def blend(taken: tuple, dims: list[int]) -> str:
            if not dims:
                return self.value(node.inputs[0], coords[:2] + taken)
            low, high, weight = sources[dims[0]]
            if high == low:         # a size-1 input dim: one neighbour
                return blend(taken + (low,), dims[1:])
            near, far = blend(taken + (low,), dims[1:]), blend(taken + (high,), dims[1:])
            return self.assign(f"(1.0 - {weight}) * {near} + {weight} * {far}")
        return blend((), list(spatial))

    def _embedding(self, node: Node, coords: Coords) -> str:
        """The table row the index at `coords` names; an index outside the table (eager raises) reads nothing and
        gives NaN, never another row's values or memory past the table."""
        row = self.integer(node.inputs[1], coords[:-1])
        rows = self.graph[node.inputs[0]].type.shape[0]
        return self.masked(node.inputs[0], (row, coords[-1]), f"({row} >= 0) & ({row} < {rows})", "float('nan')")

    def _rounded(self, value: str, name: str) -> str:
        """`value` (float32) rounded to the dtype of node `name` where that is narrower and the kernel computed it
        (a float16 sum past 65504 is inf in eager, finite in float32)."""
        dtype = self.graph[name].type.dtype
        if name not in self.emitter.members or dtype not in ("float16", "bfloat16"):
            return value
        return f"({value}).to({triton_dtype(dtype)}).to(tl.float32)"

    def _cat(self, node: Node, coords: Coords, exact: bool = False) -> str:
        """A cat at `coords`: each input computed (loaded) at its own coordinates under the mask of its slice of
        the cat dim, the one whose slice holds the coordinate picked."""
        dim = node.attrs["dim"] % len(node.type.shape)
        position = coords[dim]
        if position is None:
            raise Unsupported(f"cat {node.describe()} along a dimension of size 1")
        branches: list[tuple[int, str]] = []
        start, outer = 0, self.mask
        for name in node.inputs:
            size = self.graph[name].type.shape[dim]
            end = start + size
            if size == 0:
                continue
            local = None if size == 1 else (position if start == 0 else f"({position} - {start})")
            inside = self.assign(f"({position} >= {start}) & ({position} < {end})", "inside")
            self.mask = f"{outer} & {inside}"
            try:
                branches.append((end, (self.integer if exact else self.value)(
                    name, coords[:dim] + (local,) + coords[dim + 1:])))
            finally:
                self.mask = outer
            start = end
        result = branches[-1][1]
        for end, value in reversed(branches[:-1]):
            result = f"tl.where({position} < {end}, {value}, {result})"
        return self.assign(result)

    def operand_coords(self, node: Node, position: int, coords: Coords) -> Coords:
        """Coordinates of input `position` of elementwise `node` for its output element at `coords`."""
        if along_channels(node, position):
            return (coords[1],)
        return broadcast_coords(coords, node.type.shape, self.graph[node.inputs[position]].type.shape)

    def _load(self, name: str, coords: Coords) -> str:
        exact(self.graph[name])
        target = self.emitter.fresh("x")
        self._addressed(self.emitter.args.input(name), coords,
                        lambda pointer: f"{target} = tl.load({pointer}, mask={self.mask}, other=0.0).to(tl.float32)")
        return target

    def load_exact(self, name: str, coords: Coords) -> str:
        """Group input `name` at `coords` in its own dtype, with no float32 round trip: a wide integer a scan
        carries exactly (`opfuse.codegen.reduction`'s cumsum), which `value` refuses (`exact`)."""
        key = (name, tuple(coords), self.mask, "exact")
        if key not in self.cache:
            target = self.emitter.fresh("x")
            self._addressed(self.emitter.args.input(name), tuple(coords),
                            lambda pointer: f"{target} = tl.load({pointer}, mask={self.mask}, other=0)")
            self.cache[key] = target
        return self.cache[key]

    def store_exact(self, name: str, coords: Coords, value: str) -> None:
        """Write the Triton expression `value`, as it is (an int64 scan, say), to output `name` at `coords`."""
        self._addressed(self.emitter.args.output(name), tuple(coords),
                        lambda pointer: f"tl.store({pointer}, {value}, mask={self.mask})")

    def held(self, name: str, coords: Coords) -> str:
        """Value `name` at `coords` as a kernel holds it: a wide integer as `integer` computes it, else `value`."""
        wide = self.graph[name].type.dtype in WIDE_INTEGERS
        return self.integer(name, coords) if wide else self.value(name, coords)

    def store(self, name: str, coords: Coords) -> None:
        """Write value `name` at `coords` to its output tensor as the kernel holds it (`held`; tl.store casts to the
        output dtype)."""
        value = self.held(name, coords)
        self._addressed(self.emitter.args.output(name), tuple(coords),
                        lambda pointer: f"tl.store({pointer}, {value}, mask={self.mask})")

    def store_at_index(self, name: str, coords: Coords) -> None:
        """Store index_copy `name`'s source at `coords` (the source's) into its state's tensor (the output's), the
        coordinate along its dim replaced by the index's value there (`Graph.stored_shape`), computed exactly."""
        node = self.graph[name]
        dim, index = node.attrs["dim"], node.inputs[1]
        value = self.value(node.inputs[2], coords)
        position = self.integer(index, (coords[dim],))
        self.store_exact(name, tuple(position if d == dim else c for d, c in enumerate(coords)), value)

    def _addressed(self, param: TensorParam, coords: Coords, line: Callable[[str], str]) -> None:
        """Emit `line(pointer)` with strided addressing; for a possibly dense tensor also with the flat index."""
        strided = f"{param.prefix}_ptr + {self.offset(param, coords)}"
        flat = self.flat
        if flat is not None and coords == flat.coords and param.type.shape == flat.shape:
            flag = f"DENSE{flat.key}_{param.prefix}"
            self.emitter.flags[flag] = (param.value, flat.key)
            self.lines += [f"if {flag}:", "    " + line(f"{param.prefix}_ptr + {flat.offsets}"),
                           "else:", "    " + line(strided)]
        else:
            self.lines.append(line(strided))

    def offset(self, param: TensorParam, coords: Coords) -> str:
        terms = [f"{c} * {param.stride(d)}" for d, c in enumerate(coords) if c is not None]
        return " + ".join([self.zero] + terms)

    # ---- coordinate mappings ----------------------------------------------------------------------------
    def view_coords(self, node: Node, coords: Coords) -> Coords:
        """Coordinates in the input of view `node` of the element at `coords` of its output."""
        in_shape = self.graph[node.inputs[0]].type.shape
        out_shape = node.type.shape
        if node.op == "identity":
            return coords
        if node.op == "expand":
            return broadcast_coords(coords, out_shape, in_shape)
        if node.op == "permute":
            result: list = [None] * len(in_shape)
            for d, source in enumerate(node.attrs["dims"]):
                result[source % len(in_shape)] = coords[d]
            return tuple(result)
        if node.op == "slice":
            dim = node.attrs["dim"] % len(in_shape)
            start, _, step = slice(node.attrs.get("start"), node.attrs.get("end"),
                                   node.attrs.get("step", 1)).indices(in_shape[dim])
            c = coords[dim]
            if c is None:
                mapped = str(start) if start else None
            else:
                mapped = c if (start, step) == (0, 1) else f"({c} * {step} + {start})"
            return coords[:dim] + (mapped,) + coords[dim + 1:]
        return self.reshape_coords(coords, out_shape, in_shape)

    def reshape_coords(self, coords: Coords, out_shape: Sequence[int], in_shape: Sequence[int]) -> Coords:
        """Coordinates in `in_shape` of the element at `coords` of `out_shape` (same row-major element order).

        Dimensions are matched in runs of equal size products, so a reshape that only adds, drops, splits or
        merges dimensions maps most coordinates one to one.
        """
        out_dims = [d for d, s in enumerate(out_shape) if s > 1]
        in_dims = [d for d, s in enumerate(in_shape) if s > 1]
        result: list = [None] * len(in_shape)
        i = j = 0
        while i < len(out_dims):
            group_out, group_in = [out_dims[i]], [in_dims[j]]
            size_out, size_in = out_shape[out_dims[i]], in_shape[in_dims[j]]
            i, j = i + 1, j + 1
            while size_out != size_in:
                if size_out < size_in:
                    group_out.append(out_dims[i])
                    size_out *= out_shape[out_dims[i]]
                    i += 1
                else:
                    group_in.append(in_dims[j])
                    size_in *= in_shape[in_dims[j]]
                    j += 1
            if len(group_out) == 1 and len(group_in) == 1:
                result[group_in[0]] = coords[group_out[0]]
                continue
            terms, inner = [], 1
            for d in reversed(group_out):
                c = coords[d] or "0"
                terms.append(c if inner == 1 else f"{c} * {inner}")
                inner *= out_shape[d]
            flat = self.assign(" + ".join(reversed(terms)), "f")
            for d, c in zip(group_in, unravel_expressions(flat, [in_shape[d] for d in group_in])):
                result[d] = self.assign(c, "i")
        return tuple(result)

    def unravel(self, flat: str, shape: Sequence[int], order: Sequence[int] | None = None) -> Coords:
        """Coordinates of flat index `flat` enumerating `shape` with dimensions in `order` (outermost first)."""
        order = list(range(len(shape))) if order is None else list(order)
        kept = [d for d in order if shape[d] > 1]
        result: list = [None] * len(shape)
        for d, expression in zip(kept, unravel_expressions(flat, [shape[d] for d in kept])):
            result[d] = self.assign(expression, "i")
        return tuple(result)

    def unravel_choice(self, flat: str, shape: Sequence[int], orders: Sequence[Sequence[int]], selector: str
                       ) -> Coords:
        """`unravel` in the order `orders[selector]`, the constexpr `selector` choosing among them when the kernel
        compiles (each order one branch; the coordinates are the same variables in every branch)."""
        if len(orders) == 1:
            return self.unravel(flat, shape, orders[0])
        result: list = [self.emitter.fresh("i") if size > 1 else None for size in shape]
        for k, order in enumerate(orders):
            kept = [d for d in order if shape[d] > 1]
            self.lines.append("else:" if k == len(orders) - 1 else f"{'if' if k == 0 else 'elif'} {selector} == {k}:")
            self.lines += [f"    {result[d]} = {e}"
                           for d, e in zip(kept, unravel_expressions(flat, [shape[d] for d in kept]))]
        return tuple(result)


def build_kernel(graph: Graph, group: FusionGroup, emitter: Emitter, body: list[str], constexprs: list[str],
                 params: Sequence[str] = ()):
    """Wrap the kernel body's lines into source, name it and load it: (name, source, triton function); `params`
    are parameters of the template's own (a workspace pointer) between the tensors' and the constexprs.

    The source names no group or value, only ops and types: groups that compute the same (GPT-2's 25 layer norms)
    get one source, so one module, one Triton compile and one tuning (the cache key is the source)."""
    signature = (emitter.args.signature() + "".join(f", {p}" for p in params)
                 + "".join(f", {c}: tl.constexpr" for c in constexprs))
    ops = [graph[n].op for n in group.nodes if graph[n].op not in VIEW_OPS] or ["copy"]
    header = (f'"""Generated by opfuse: {", ".join(graph[n].op for n in group.nodes)}."""\n'
              "import triton\nimport triton.language as tl\n\n" + emitter.args.describe() + "\n")
    template = (f"{header}\n@triton.jit\ndef KERNEL_NAME({signature}):\n"
                + "\n".join("    " + line for line in body) + "\n")
    return load_kernel("fused", ops, template)
