"""Which rows of a graph are independent: whether padding its inputs along one dim (the batch) with extra rows, and
cutting its outputs back, can change the rows kept.

Entry points: `row_dependence(graph, input_dims=None, output_dims=None) -> RowDependence | None`, and `value_rows`
(where the batch lives in every value). None means every output row is computed from the same row of the inputs
alone, so a package may run a batch of 3 on its batch-4 model padded with a row of its own choosing; otherwise the first node that mixes rows (or that the analysis cannot
follow) and why, in words. It errs on the side of refusing: a wrong "independent" is a silent wrong answer, a wrong
"dependent" only costs running the exact batch sizes.

The walk goes through the graph in order and keeps, for each value, where the batch lives in it (`Rows`): the dim
that carries it, and the fixed-size dims merged into that dim around it, as [B, S, H] -> [B*S, H] merges S in
(a row's index along that dim is then `index // S`). A value that does not depend on the inputs (weights) has no
batch. Each op says, through `dim_maps`, to which output dim every dim of every operand goes, or why that operand
dim cannot carry the batch (a softmax over it, the K of a product, a key sequence): pointwise and broadcast ops by
their kind, reductions by the dims they reduce (`REDUCED_DIMS`), anchors and layout ops each by what it does.
Reshapes are followed digit by digit (`reshape_rows`). Opaque ops are refused: what they do to rows is unknown.

Limits: the graph was traced at one batch size and every other number in it reads as fixed. A dim equal to the
batch only by coincidence, or a scalar made from the batch size (``x / x.shape[0]``), cannot be told from the
batch; for that reason a constant along the batch dim is refused unless it is the same for every row. Ask on a graph
traced at a batch of 2 or more: at batch 1 every size-1 dim looks like the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, NamedTuple, Sequence

import torch

from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import SCAN_OPS, FusionKind, along_channels, get_op, kv_heads_shared


@dataclass(frozen=True)
class Rows:
    """Where the batch lives in one value: dim `dim`, whose index reads as the digits (*outer, batch, *inner), so
    an element's row is `(index // prod(inner)) % batch`. `outer` and `inner` are fixed sizes (never 1) merged into
    that dim by reshapes."""

    dim: int
    outer: tuple[int, ...] = ()
    inner: tuple[int, ...] = ()

    def moved(self, dim: int) -> "Rows":
        return Rows(dim, self.outer, self.inner)


class RowDependence(NamedTuple):
    """The node whose output rows may read other rows, and why."""

    node: Node
    why: str

    def __str__(self) -> str:
        return f"{self.node.describe()} {self.why}"


class Mixes(Exception):
    """Raised by a rule: this node may mix rows (the message says why)."""


# A dim map per operand: for each of its dims, the output dim it becomes, or why it cannot carry the batch (a str
# with a {where} to fill in: "reduces over {where}").
DimMap = list["int | str"]


# ---- the walk ----------------------------------------------------------------------------------------------

def row_dependence(graph: Graph, input_dims: Mapping[str, int | None] | None = None,
                   output_dims: Mapping[str, int] | None = None) -> RowDependence | None:
    """None when every output's rows along its dim in `output_dims` (default: dim 0 of every output) are each
    computed from the same row of the inputs along their dim in `input_dims` (default: dim 0 of every input; None:
    an input without the batch), and from nothing else that depends on the batch; else the first node that may
    mix rows and why."""
    rows = value_rows(graph, input_dims)
    if isinstance(rows, RowDependence):
        return rows
    for name in graph.outputs:
        want = 0 if output_dims is None else output_dims[name]
        try:
            check_output(graph, graph[name], rows[name], want)
        except Mixes as why:
            return RowDependence(graph[name], str(why))
    return None


def value_rows(graph: Graph, input_dims: Mapping[str, int | None] | None = None
               ) -> dict[str, Rows | None] | RowDependence:
    """Where the batch lives in every value (`Rows`, None for a value without it), the inputs holding it along
    their dim in `input_dims` (as `row_dependence` takes them); or the first node that may mix rows and why."""
    input_dims = {n.name: 0 for n in graph.input_nodes} if input_dims is None else dict(input_dims)
    rows: dict[str, Rows | None] = {}
    batch = None
    for node in graph:
        try:
            if node.op == "input":
                rows[node.name], batch = input_rows(node, input_dims.get(node.name), batch)
            else:
                rows[node.name] = node_rows(graph, node, [rows[i] for i in node.inputs])
        except Mixes as why:
            return RowDependence(node, str(why))
        except UNREADABLE as error:     # attrs or shapes unlike its op's: refuse rather than guess
            return RowDependence(node, f"cannot be analysed ({type(error).__name__}: {error})")
    return rows


UNREADABLE = (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError, ZeroDivisionError)


def input_rows(node: Node, dim: int | None, batch: int | None) -> tuple[Rows | None, int | None]:
    """An input's rows, and the batch size (which every input with a batch must share)."""
    if dim is None:
        return None, batch
    shape = node.type.shape
    if not -len(shape) <= dim < len(shape):
        raise Mixes(f"has no dim {dim} to hold the batch (its shape is {list(shape)})")
    dim %= len(shape)
    if batch is not None and shape[dim] != batch:
        raise Mixes(f"has {shape[dim]} rows along dim {dim}, the inputs before it {batch}")
    return Rows(dim), shape[dim]


def node_rows(graph: Graph, node: Node, ins: list[Rows | None]) -> Rows | None:
    """The rows of `node`'s output; Mixes if they may read other rows. A node reading no batch has none."""
    if all(r is None for r in ins):
        return None
    if node.op == "reshape":
        return reshape_rows(graph, node, ins[0])
    return place(graph, node, ins, dim_maps(graph, node))


def place(graph: Graph, node: Node, ins: list[Rows | None], maps: list[DimMap]) -> Rows:
    """The output rows the operands' rows go to through `maps`: every operand with a batch must put it in the
    same output dim, merged the same way, and no operand without one may vary along that dim."""
    out_shape = node.type.shape
    placed, first = None, None
    for position, (name, r) in enumerate(zip(node.inputs, ins)):
        if r is None:
            continue
        where = f"the batch (dim {r.dim} of {name})"
        target = maps[position][r.dim]
        if isinstance(target, str):
            raise Mixes(target.format(where=where))
        if graph[name].type.shape[r.dim] != out_shape[target]:
            raise Mixes(f"broadcasts {where} to {out_shape[target]} rows")
        if placed is not None and r.moved(target) != placed:
            raise Mixes(f"reads the batch in two places: {where} and {first}")
        placed, first = r.moved(target), where
    for position, (name, r) in enumerate(zip(node.inputs, ins)):
        if r is None:
            for dim, target in enumerate(maps[position]):
                if target == placed.dim:
                    check_batch_free(graph, name, dim, placed)
    return placed


def check_batch_free(graph: Graph, name: str, dim: int, rows: Rows) -> None:
    """An operand without the batch, along the output dim that holds it (`rows`): fine where it is the same for
    every row (size 1, or a constant equal across the batch's digit, as Swin's window masks tiled over the batch);
    otherwise it may have been made for this batch size."""
    size = graph[name].type.shape[dim]
    if size != 1 and not same_for_every_row(graph, name, dim, rows):
        raise Mixes(f"reads {name}, which does not depend on the inputs yet varies along its dim {dim} ({size} "
                    f"rows), where the output holds the batch (dim {rows.dim}): it may have been made for this "
                    "batch size")


def same_for_every_row(graph: Graph, name: str, dim: int, rows: Rows) -> bool:
    """Whether the value `name` (no batch in it) is the same for every row along `dim`, which holds the batch as
    `rows` say: a constant equal across the batch's digit of that dim, an expand of size 1 along it, an embedding
    of ids that are, or an elementwise op of operands that are."""
    node = graph[name]
    if node.op == "constant":
        tensor = graph.constants[name]
        outer, inner = math.prod(rows.outer), math.prod(rows.inner)
        digits = tensor.unflatten(dim, (outer, tensor.shape[dim] // (outer * inner), inner))
        return bool(torch.equal(digits, digits.narrow(dim + 1, 0, 1).expand_as(digits)))
    if node.op == "expand":
        source = graph[node.inputs[0]].type.shape
        inner = dim - (len(node.type.shape) - len(source))
        return inner < 0 or source[inner] == 1 or same_for_every_row(graph, node.inputs[0], inner, rows)
    if node.op == "embedding" and dim < len(graph[node.inputs[1]].type.shape):   # rows of the table its ids pick
        return same_for_every_row(graph, node.inputs[1], dim, rows)
    if get_op(node.op).kind.elementwise and node.op != "batch_norm":
        # computed from constants too large to fold (BERT's token-type embedding at batch 32 x 512): the same for
        # every row where each operand is, broadcast from the right
        for name in node.inputs:
            shape = graph[name].type.shape
            inner = dim - (len(node.type.shape) - len(shape))
            if inner >= 0 and shape[inner] != 1 and not same_for_every_row(graph, name, inner, rows):
                return False
        return True
    return False


def check_output(graph: Graph, node: Node, rows: Rows | None, dim: int) -> None:
    """An output is cut back along `dim`: the batch must be there alone, or the output the same for every row."""
    if rows is None:
        if node.type.shape and node.type.shape[dim] != 1 and not same_for_every_row(graph, node.name, dim, Rows(dim)):
            raise Mixes(f"is an output that does not depend on the inputs yet varies along dim {dim}, where it is "
                        "cut back: it may have been made for this batch size")
        return
    if rows.dim != dim:
        raise Mixes(f"is an output with the batch in dim {rows.dim}, not dim {dim} where it is cut back")
    if rows.outer or rows.inner:
        raise Mixes(f"is an output whose dim {dim} holds the batch merged with dims of sizes "
                    f"{list(rows.outer + rows.inner)}, so cutting it back would not cut whole rows")


# ---- reshapes: the batch is one digit of the flat index ----------------------------------------------------------

def reshape_rows(graph: Graph, node: Node, rows: Rows) -> Rows:
    """A reshape keeps the flat order, in which the batch is one digit between the fixed digits before it and
    after it. It lands in the output dim whose dims before it regroup whole digits before the batch and whose dims
    after it regroup whole digits after it; any other split would tie a row's layout to the batch size."""
    source, target = graph[node.inputs[0]].type.shape, node.type.shape
    before = [d for d in (*source[:rows.dim], *rows.outer) if d != 1]
    after = [d for d in (*rows.inner, *source[rows.dim + 1:]) if d != 1]
    prefixes = {math.prod(before[:i]): tuple(before[i:]) for i in range(len(before) + 1)}
    suffixes = {math.prod(after[j:]): tuple(after[:j]) for j in range(len(after) + 1)}
    fits = [Rows(e, prefixes[math.prod(target[:e])], suffixes[math.prod(target[e + 1:])])
            for e in range(len(target))
            if math.prod(target[:e]) in prefixes and math.prod(target[e + 1:]) in suffixes]
    where = f"the batch (dim {rows.dim} of {node.inputs[0]}, {list(source)})"
    if not fits:
        raise Mixes(f"reshapes to {list(target)}, splitting {where} or merging it with dims it is not next to")
    if len(fits) > 1:
        raise Mixes(f"reshapes to {list(target)}, where {where} could be in dims {[f.dim for f in fits]}")
    return fits[0]


# ---- what each op does to its operands' dims -------------------------------------------------------------------

Shapes = list[tuple[int, ...]]
Rule = Callable[[Node, Shapes], list[DimMap]]


def dim_maps(graph: Graph, node: Node) -> list[DimMap]:
    """For each operand of `node`, where each of its dims goes in the output (see `DimMap`): elementwise ops by
    their kind, reductions by `REDUCED_DIMS`, the rest by `RULES`; anything else is refused."""
    kind = get_op(node.op).kind
    shapes = [graph[i].type.shape for i in node.inputs]
    if kind.elementwise:
        return [elementwise_map(node, position, len(shape)) for position, shape in enumerate(shapes)]
    if kind is FusionKind.REDUCTION and node.op in REDUCED_DIMS:
        return reduction_maps(node, shapes)
    rule = RULES.get(node.op)
    if rule is None:
        target = node.attrs.get("target")
        raise Mixes(f"is a {kind.value} op" + (f" ({target})" if target else "")
                    + " whose effect on rows the analysis does not know")
    return rule(node, shapes)


def elementwise_map(node: Node, position: int, rank: int) -> DimMap:
    """Operands broadcast from the right, except a batch norm's [C] vectors, which lie along dim 1."""
    if along_channels(node, position):
        return [1]
    out_rank = len(node.type.shape)
    return list(range(out_rank - rank, out_rank))


def _dims(value: int | Sequence[int] | None, rank: int) -> set[int]:
    """Dims named by an attribute (an int or a list; None or empty: all of them), made non-negative."""
    if value is None or (not isinstance(value, int) and len(value) == 0):
        return set(range(rank))
    return {d % rank for d in ([value] if isinstance(value, int) else value)}


def _last(count: int) -> Callable[[Node, int], tuple[set[int], bool]]:
    return lambda node, rank: (set(range(rank - count, rank)), True)


def _reduce_attrs(node: Node, rank: int) -> tuple[set[int], bool]:
    return _dims(node.attrs.get("dims"), rank), bool(node.attrs.get("keepdim", False))


# For each reduction op: (the dims of its first operand it reduces, whether it keeps them); its other operands (a
# norm's weight and bias) lie along the reduced dims.
REDUCED_DIMS: dict[str, Callable[[Node, int], tuple[set[int], bool]]] = {
    "softmax": lambda node, rank: (_dims(node.attrs["dim"], rank), True),
    "layer_norm": lambda node, rank: _last(len(node.attrs["normalized_shape"]))(node, rank),
    "rms_norm": _last(1),
    **{name: lambda node, rank: (_dims(node.attrs["dim"], rank), True) for name in SCAN_OPS},
    **{name: _reduce_attrs for name in ("mean", "sum", "prod", "amax", "amin", "any")},
    **{name: _last(2) for name in ("max_pool2d", "avg_pool2d", "adaptive_avg_pool2d")},
    **{name: _last(3) for name in ("max_pool3d", "avg_pool3d")},
}

REDUCES = "reduces over {where}: each row's result reads every other row"
SCANS = "scans along {where}: each row's result reads every row before it"
WEIGHT = "reads {where} in a weight operand, which every row reads"


def weights(shapes: Shapes) -> list[DimMap]:
    """Operands every output element may read (a weight, a bias): none of their dims can hold the batch."""
    return [[WEIGHT] * len(shape) for shape in shapes]


def reduction_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    rank = len(shapes[0])
    reduced, keepdim = REDUCED_DIMS[node.op](node, rank)
    kept = iter(range(len(node.type.shape)))
    why = SCANS if node.op in SCAN_OPS else REDUCES
    first: DimMap = [why if d in reduced else (d if keepdim else next(kept)) for d in range(rank)]
    return [first] + weights(shapes[1:])


def per_sample_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """Convolutions and channel norms: each index of dim 0 (the sample) alone; every other dim is mixed. An input
    of the weight's rank is batched; one dim fewer is a single unbatched sample, whose dim 0 is its channels."""
    rank = len(shapes[0])
    if len(shapes) > 1 and rank != len(shapes[1]):
        unbatched = "mixes {where}: the input is one unbatched sample, its dim 0 the channels"
        return [[unbatched] * rank] + weights(shapes[1:])
    return [[0] + ["mixes {where}: it convolves or normalises over that dim"] * (rank - 1)] + weights(shapes[1:])


def deformable_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """A deformable convolution: its image, offsets and mask by sample, as a convolution's input (each sample's
    pixels read at offsets known at run time); its weight and bias weights."""
    sampled = per_sample_maps(node, shapes[:1])[0]
    by_sample = [[0] + ["samples {where} at offsets known at run time"] * (len(shape) - 1) for shape in shapes]
    maps = [sampled, *weights(shapes[1:2]), by_sample[2]]
    if node.attrs["has_bias"]:
        maps += weights(shapes[3:4])
    return maps + by_sample[len(maps):]


CONTRACTS = "contracts {where} as the K of its product: each output reads every row"


def linear_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """x[..., K] @ w[N, K]ᵀ: the rows of x are any dims but the last."""
    return [list(range(len(shapes[0]) - 1)) + [CONTRACTS]] + weights(shapes[1:])


def matmul_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """torch.matmul: [..., M, K] @ [..., K, N], leading dims broadcast; a 1-D first operand is one row [K], a 1-D
    second one column [K], and the output lacks that dim. The batch may be in a leading dim, in M or in N."""
    ra, rb = len(shapes[0]), len(shapes[1])
    out_rank = len(node.type.shape)
    lead = out_rank - (ra >= 2) - (rb >= 2)
    a: DimMap = [CONTRACTS] if ra == 1 else \
        [d + lead - (ra - 2) for d in range(ra - 2)] + [lead, CONTRACTS]
    b: DimMap = [CONTRACTS] if rb == 1 else \
        [d + lead - (rb - 2) for d in range(rb - 2)] + [CONTRACTS, out_rank - 1]
    return [a, b]


KEYS = "attends over {where} as its key/value sequence: padding adds keys that every query reads"
SHARED_HEADS = "holds {where} in key/value heads that several query heads share (grouped-query attention)"


def sdpa_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """q[..., Sq, D], k[..., Sk, D], v[..., Sk, Dv], mask?[..., Sq, Sk]: the batch may be in the leading dims or in
    the query rows, never in the keys (each query's softmax runs over all of them) or the features."""
    out_rank = len(node.type.shape)

    def leading(rank: int) -> list[int]:
        return [d + out_rank - rank for d in range(rank - 2)]

    queries: int | str = out_rank - 2
    if node.attrs.get("is_causal"):
        queries = "holds {where} in its query rows while causal: a query's mask depends on its position"
    q, k, v = (len(shape) for shape in shapes[:3])
    maps = [leading(q) + [queries, CONTRACTS],
            leading(k) + [KEYS, CONTRACTS],
            leading(v) + [KEYS, "holds {where} in its value features, which the analysis does not follow"]]
    for position in (1, 2):     # key/value heads several query heads share: head h reads h // (Hq / Hkv)
        if kv_heads_shared(shapes[0], shapes[position]) > 1:
            maps[position][-3] = SHARED_HEADS
    if len(shapes) > 3:
        mask = len(shapes[3])
        maps.append((leading(mask) + [queries, KEYS])[-mask:] if mask else [])
    return maps


def identity_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    return [list(range(len(shape))) for shape in shapes]


def permute_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    rank = len(shapes[0])
    order = [d % rank for d in node.attrs["dims"]]
    return [[order.index(d) for d in range(rank)]]


def expand_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    out_rank = len(node.type.shape)
    return [list(range(out_rank - len(shapes[0]), out_rank))]


def except_dims(moved: Callable[[Node, Shapes], set[int]], why: str) -> Rule:
    """A rule for ops that keep every operand's dims in place except `moved(node, shapes)`, which cannot hold the
    batch for `why`."""
    def maps(node: Node, shapes: Shapes) -> list[DimMap]:
        dims = moved(node, shapes)
        return [[why if d in dims else d for d in range(len(shape))] for shape in shapes]
    return maps


def every_dim(node: Node, shapes: Shapes) -> set[int]:
    """Every dim of every operand: an op whose output rows read all of its inputs' (`except_dims`)."""
    return set(range(max(len(shape) for shape in shapes)))


def sliced_dims(node: Node, shapes: Shapes) -> set[int]:
    """The slice's dim, unless the slice keeps all of it in order (a no-op)."""
    dim = node.attrs["dim"] % len(shapes[0])
    start, step = node.attrs.get("start") or 0, node.attrs.get("step") or 1
    whole = step == 1 and start in (0, -shapes[0][dim]) and node.type.shape[dim] == shapes[0][dim]
    return set() if whole else {dim}


def padded_dims(node: Node, shapes: Shapes) -> set[int]:
    """F.pad's pads name the last dim's (begin, end) first."""
    pads, rank = node.attrs["pads"], len(shapes[0])
    return {rank - 1 - i for i in range(len(pads) // 2) if pads[2 * i] or pads[2 * i + 1]}


def image_window_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """im2col and col2im: each image of a batch alone (dim 0); its channels and positions are rearranged into
    (out of) columns of sliding windows. One dim fewer is one unbatched image, whose dim 0 is not a batch."""
    rank, batched = len(shapes[0]), len(shapes[0]) == (4 if node.op == "im2col" else 3)
    why = "rearranges {where} into sliding windows of an image" if node.op == "im2col" else \
        "sums {where} back from sliding windows of an image"
    return [([0] if batched else [why]) + [why] * (rank - 1)]


def take_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """numpy.take(x, indices, axis): x's axis is replaced by the indices' dims."""
    rank, index_rank = len(shapes[0]), len(shapes[1])
    axis = node.attrs["axis"] % rank
    x: DimMap = [d if d < axis else "gathers along {where}: the indices pick rows" if d == axis
                 else d + index_rank - 1 for d in range(rank)]
    return [x, [axis + d for d in range(index_rank)]]


def gather_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """torch.gather(x, dim, index): the output has the index's dims; x's `dim` is picked by the index's values."""
    rank = len(shapes[0])
    axis = node.attrs["dim"] % rank
    x: DimMap = [d if d != axis else "gathers along {where}: the indices pick rows" for d in range(rank)]
    return [x, list(range(len(shapes[1])))]


def embedding_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """weight[V, D] gathered by indices[...]: the output is the indices' dims, then D."""
    return weights(shapes[:1]) + [list(range(len(shapes[1])))]


# The ops neither elementwise nor a reduction of `REDUCED_DIMS` whose rows the analysis follows (opaque ops, the
# generic "opaque" above all, are refused unless listed: what they do is unknown).
def state_write_maps(node: Node, shapes: Shapes) -> list[DimMap]:
    """A write into the model's state (`index_copy` of a KV cache) outlives the call: padded rows would stay in it
    for the next call to read, so no operand dim can hold the batch."""
    why = "writes the model's state, which outlives the call, from {where}"
    return [[why] * len(shape) for shape in shapes]


RULES: dict[str, Rule] = {
    "index_copy": state_write_maps,
    "conv2d": per_sample_maps,
    "conv_transpose": per_sample_maps,
    "local_response_norm": per_sample_maps,
    "linear": linear_maps,
    "matmul": matmul_maps,
    "sdpa": sdpa_maps,
    "identity": identity_maps,
    "permute": permute_maps,
    "expand": expand_maps,
    "take": take_maps,
    "gather": gather_maps,
    "embedding": embedding_maps,
    "slice": except_dims(sliced_dims, "slices {where}: which rows it keeps depends on their positions"),
    "cat": except_dims(lambda node, shapes: {node.attrs["dim"] % len(shapes[0])},
                       "concatenates along {where}: rows of one operand land among another's"),
    "roll": except_dims(lambda node, shapes: _dims(node.attrs.get("dims"), len(shapes[0])),
                        "rolls {where}: rows move to other rows"),
    "pad": except_dims(padded_dims, "pads {where}: rows are added by position"),
    "upsample": except_dims(lambda node, shapes: set(range(2, len(shapes[0]))),
                            "resamples {where}: rows are read by their positions"),
    "unfold": except_dims(lambda node, shapes: {node.attrs["dim"] % len(shapes[0])},
                          "slides windows along {where}: a window reads several rows"),
    "im2col": image_window_maps,
    "col2im": image_window_maps,
    # the ops that run alone (`opfuse.ir.ops_alone`): topk and sort move values along their dim; a histogram, a
    # mixture of experts' grouped GEMM (rows grouped by offsets counted at run time) and an LSTM (a recurrence
    # along its sequence, its state shared by the batch's rows at no fixed position) hold no dim apart
    "topk": except_dims(lambda node, shapes: {node.attrs["dim"]}, "ranks values along {where}"),
    "sort": except_dims(lambda node, shapes: {node.attrs["dim"]}, "sorts values along {where}"),
    "histc": except_dims(lambda node, shapes: set(range(len(shapes[0]))), "counts every element of {where}"),
    "grouped_mm": except_dims(lambda node, shapes: set(range(len(shapes[0]))),
                              "groups rows by offsets counted at run time ({where})"),
    "lstm": except_dims(every_dim, "runs a recurrence over {where}"),
    # a scatter writes along its dim at indices known at run time, and an index smaller than the data along
    # another dim leaves the rest of that dim as it was; grid sampling keeps only the batch (each image is read at
    # positions its grid holds)
    "scatter": except_dims(lambda node, shapes: {node.attrs["dim"] % len(shapes[0])} | {
        d for d, (n, i) in enumerate(zip(shapes[0], shapes[1])) if n != i}, "scatters along {where}"),
    # a determinant reads its whole matrix; a bit cast keeps every element where it is
    "det": except_dims(lambda node, shapes: {len(shapes[0]) - 2, len(shapes[0]) - 1},
                       "takes a determinant of the matrices over {where}"),
    "bitcast": except_dims(lambda node, shapes: set(), "{where}"),
    # RoI align reads each region of the image its batch index names
    "roi_align": except_dims(every_dim, "reads the regions of the image its rois name ({where})"),
    "deform_conv2d": deformable_maps,
    "max_pool2d_indices": except_dims(lambda node, shapes: {len(shapes[0]) - 2, len(shapes[0]) - 1},
                                      "pools windows of {where}"),
    "grid_sample": except_dims(lambda node, shapes: set(range(1, max(len(shape) for shape in shapes))),
                               "samples at positions its grid holds ({where})"),
}
