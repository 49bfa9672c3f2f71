"""What an anchor takes besides its elementwise epilogue (the rules in `opfuse.fusion.legality`'s docstring): the
prologue a linear or a 1x1 conv applies to its operand tiles as it loads them (`anchor_prologue`), which a linear's
may open with a row norm (`row_norm_prologue`, through row views), and the row norm a depthwise conv computes in its
epilogue (`row_norm_epilogue`); and the gated pair of sibling linears one kernel computes together
(`gated_pair`: act(x W_gate^T) * (x W_up^T), a SwiGLU or GeGLU MLP's first half).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from opfuse.fusion.legality_common import Users
from opfuse.fusion.legality_conv import is_depthwise_conv, is_pointwise_conv
from opfuse.fusion.legality_views import EPILOGUE_VIEWS, epilogue_spaces
from opfuse.fusion.reasons import Reason
from opfuse.fusion.tiles import MAX_ROW_CHANNELS
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import kind_of
from opfuse.ir.strided import contiguous_strides, operand_groups, through_views

ROW_NORMS = frozenset({"layer_norm", "rms_norm"})   # reductions over the last dim that keep every element


def anchor_prologue(graph: Graph, anchor: str, within: Iterable[str], users: Users) -> list[str]:
    """The elementwise nodes of `within` that a linear or a 1x1 conv (stride 1, no padding, one group) applies to
    its input tile as it loads it, source side first: a chain ending at the anchor's input, each node read by the
    next alone (the last by the anchor alone), in the input's dtype, reading one full-size value (the previous
    node, or the source) and otherwise only constants and smaller broadcasts; a linear's chain may open with a
    layer norm over the last dim (`is_row_norm_prologue`: the kernel computes its row statistics first); empty when
    there is none."""
    node = graph[anchor]
    within = set(within)
    if not (node.op == "linear" or is_pointwise_conv(graph, anchor)):
        return []
    dtype = graph[node.inputs[0]].type.dtype
    chain: list[str] = []
    value, reader = node.inputs[0], anchor
    while (value in within and kind_of(graph[value]).elementwise and graph[value].type.dtype == dtype
           and [u.name for u in users[value]] == [reader] and value not in graph.outputs):
        step = graph[value]
        full = [v for v in step.inputs if not graph.is_constant(v) and graph[v].type.numel >= step.type.numel]
        if len(full) != 1 or graph[full[0]].type.numel != step.type.numel or graph[full[0]].type.dtype != dtype:
            break       # (a cast from another dtype stays out: the tile is loaded in the anchor's dtype)
        chain.append(value)
        value, reader = full[0], value
    if node.op == "linear":     # the layer norm the linear normalizes its tiles with, maybe through row views
        # (only as the whole chain: the views map A's rows, which the other ops' operands are not read through)
        views, norm, norm_reader = [], value, reader
        while not chain and norm in within and keeps_rows(graph, graph[norm]) and [u.name for u in users[norm]] == [norm_reader] \
                and norm not in graph.outputs:
            views.append(norm)
            norm, norm_reader = graph[norm].inputs[0], norm
        if norm in within and is_row_norm_prologue(graph, norm, norm_reader, within, users) \
                and (not views or maps_rows(graph, norm, views[::-1], len(node.type.shape) - 1)):
            chain += views + [norm]
    chain.reverse()
    return chain


def keeps_rows(graph: Graph, node: Node) -> bool:
    """A view that regroups or reorders the leading dims and keeps the last one last (GPT-2's [1, T, C] -> [T, C]
    before its addmm, ViT's [N, T, C] -> [T, N, C] before the attention's in_proj): a layer norm over the last dim
    commutes with it, so the linear may normalize its rows read through it."""
    source = graph[node.inputs[0]].type.shape
    if node.op == "reshape":
        return bool(node.type.shape) and bool(source) and node.type.shape[-1] == source[-1]
    if node.op == "permute":
        dims = list(node.attrs["dims"])
        return bool(dims) and dims[-1] % len(dims) == len(dims) - 1
    return False


def maps_rows(graph: Graph, source: str, views: Sequence[str], row_dims: int) -> bool:
    """Whether `views` (source side first) replayed on the contiguous `source` are a strided map of a GEMM operand
    load (`opfuse.ir.strided.operand_groups`): the kernel reads through them, no copy."""
    shape = graph[source].type.shape
    dims = through_views(shape, contiguous_strides(shape), [graph[v] for v in views])
    return dims is not None and operand_groups(dims, row_dims) is not None


def norm_prologue_on(config, op: str) -> bool:
    """Whether FusionConfig `config` lets a norm of `op` open a linear's prologue: norm_prologue any row norm,
    rms_norm_prologue an RMS norm (deferred after the K loop, `opfuse.codegen.prologue`)."""
    return config.norm_prologue or (op == "rms_norm" and config.rms_norm_prologue)


def row_norm_prologue(graph: Graph, anchor: str, within: Iterable[str], users: Users) -> str | None:
    """The layer norm or RMS norm opening `anchor`'s prologue (`anchor_prologue`), or None."""
    chain = anchor_prologue(graph, anchor, within, users)
    return chain[0] if chain and graph[chain[0]].op in ROW_NORMS else None


def is_row_norm_prologue(graph: Graph, name: str, reader: str, within: Iterable[str], users: Users) -> bool:
    """Whether layer norm or RMS norm `name` may open a linear's prologue (pre-LN transformers' ln_1 -> qkv,
    ConvNeXt's LN -> pwconv1, Llama's input norm -> its q, k and v projections): it normalizes the last dim only, its
    weight and bias are constants (or absent), `reader` alone reads it or every reader is a sibling linear of
    `within` reading it directly (a horizontal group: one GEMM over their columns normalizes its shared A), and its
    input comes from outside `within` (the kernel computes the row statistics from that input in a pass over K of
    its own; a residual sum others read is stored by the group that computes it)."""
    node = graph[name]
    readers = [u.name for u in users[name]]
    if node.op not in ROW_NORMS or name in graph.outputs:
        return False
    if readers != [reader] and not siblings_read(graph, name, readers, within):
        return False
    source = node.inputs[0]
    if source in set(within) or graph.is_constant(source) or graph[source].type.dtype != node.type.dtype:
        return False
    return normalizes_last_dim(graph, node)


def siblings_read(graph: Graph, name: str, readers: Sequence[str], within: Iterable[str]) -> bool:
    """Whether `readers` of `name` are two or more linears of `within`, each reading `name` as its input."""
    within = set(within)
    return len(readers) > 1 and all(r in within and graph[r].op == "linear" and graph[r].inputs[0] == name
                                    for r in readers)


def normalizes_last_dim(graph: Graph, node: Node) -> bool:
    """A layer norm or RMS norm over the last dim alone, its weight and bias constants of that size (or absent)."""
    shape = node.type.shape
    if node.op not in ROW_NORMS or not shape:
        return False
    if node.op == "layer_norm":
        normalized = node.attrs["normalized_shape"]
        normalized = [normalized] if isinstance(normalized, int) else list(normalized)
        if len(normalized) != 1 or normalized[0] != shape[-1]:
            return False
    return all(graph.is_constant(v) and graph[v].type.numel == shape[-1] for v in node.inputs[1:])


def row_norm_epilogue(graph: Graph, anchor: str, within: Iterable[str]) -> str | None:
    """The row norm of `within` that depthwise conv `anchor` computes in its epilogue (`config.norm_epilogue`), or
    None: the one layer norm or RMS norm of `within`, over its last dim alone (`normalizes_last_dim`), whose input
    the anchor's epilogue computes (elementwise ops and EPILOGUE_VIEWS permutes of `within`) with the anchor's
    channel dim last, and the anchor has 2 to MAX_ROW_CHANNELS channels. Its kernel's tile then spans every
    channel of its pixels (`opfuse.fusion.tiles.whole_row_tile`), which a depthwise conv can afford: it reduces
    nothing across channels, so its registers hold only its outputs."""
    if not is_depthwise_conv(graph, anchor) or not 1 < graph[anchor].type.shape[1] <= MAX_ROW_CHANNELS:
        return None     # (one channel is a plain conv to the kernels: `ConvGeometry.is_depthwise`)
    within = set(within)
    norms = [n for n in within if graph[n].op in ROW_NORMS]
    if len(norms) != 1 or not normalizes_last_dim(graph, graph[norms[0]]):
        return None
    norm = graph[norms[0]]
    path, value = [], norm.inputs[0]        # the epilogue from the anchor to the norm, each node one full input
    while value != anchor:
        if value not in within:
            return None
        node = graph[value]
        full = [v for v in node.inputs if v in within or v == anchor]
        if not (kind_of(node).elementwise or node.op in EPILOGUE_VIEWS) or len(full) != 1:
            return None
        path.append(value)
        value = full[0]
    spaces = epilogue_spaces(graph, anchor, path[::-1] + [norm.name])
    if isinstance(spaces, Reason) or spaces[norm.name][-1] != 1:   # NCHW: the conv's channels are dim 1
        return None
    return norm.name


@dataclass(frozen=True)
class GatedPair:
    """Two sibling linears and how their results combine (`gated_pair`)."""

    gate: str                  # the linear whose result is activated
    activation: tuple[str, ...]    # the single-input elementwise ops on it, in order (SiLU, GELU; may be none)
    up: str                    # the linear whose result multiplies it
    product: str               # the mul of the two


def gated_pair(graph: Graph, nodes: Iterable[str], users: Users) -> GatedPair | None:
    """The gated pair `nodes` are, or None: two linears on one input with constant weights (and biases, if any)
    and as many output features, one followed by a chain of single-input elementwise ops, the two results
    multiplied, and nothing but the product (and what the group computes from it) read outside them. One GEMM over
    the two weights' columns interleaved then computes act(gate + gate bias) * (up + up bias) in its tile
    (`opfuse.codegen.gemm`): the activation and the other linear's result are never written."""
    nodes = set(nodes)
    linears = [n for n in nodes if graph[n].op == "linear"]
    if len(linears) != 2:
        return None
    first, second = (graph[n] for n in linears)
    if first.inputs[0] != second.inputs[0] \
            or not all(graph.is_constant(name) for n in (first, second) for name in n.inputs[1:]) \
            or first.type.shape != second.type.shape:
        return None
    for gate, up in ((first, second), (second, first)):
        product = gated_product(graph, gate, up, users, nodes)
        if product is not None:
            return GatedPair(gate.name, product[0], up.name, product[1])
    return None


def gated_product(graph: Graph, gate: Node, up: Node, users: Users, within: set[str] | None = None
                  ) -> tuple[tuple[str, ...], str] | None:
    """(the chain of single-input elementwise ops from `gate`, the mul of its end and `up`), or None: each value
    read once (by the next, and within `within` where given), neither an output, `up` read by the mul alone, and
    every value of the chain of gate's shape. What a gated GEMM computes in its tile (`gated_pair`,
    `gated_experts`)."""
    chain, value = [], gate.name
    while True:
        readers = users[value]
        if len(readers) != 1 or value in graph.outputs or within is not None and readers[0].name not in within:
            return None
        reader = readers[0]
        if reader.op == "mul" and sorted(reader.inputs) == sorted([value, up.name]) \
                and [u.name for u in users[up.name]] == [reader.name] and up.name not in graph.outputs \
                and reader.type.shape == gate.type.shape:
            return tuple(chain), reader.name
        if not kind_of(reader).elementwise or len(reader.inputs) != 1 or reader.type.shape != gate.type.shape:
            return None
        chain.append(reader.name)
        value = reader.name


@dataclass(frozen=True)
class GatedExperts:
    """A grouped GEMM whose output's two column halves combine as act(gate) * up (`gated_experts`)."""

    experts: str               # the grouped_mm
    gate: str                  # the slice of its first half of columns
    activation: tuple[str, ...]    # the single-input elementwise ops on it, in order
    up: str                    # the slice of its second half
    product: str               # the mul of the two

    @property
    def nodes(self) -> set[str]:
        return {self.experts, self.gate, *self.activation, self.up, self.product}


def gated_experts(graph: Graph, name: str, users: Users) -> GatedExperts | None:
    """The gated experts grouped_mm `name` starts, or None: its weight a constant, its result read only by two
    slices, its first and its second half of columns, the first through a chain of single-input elementwise ops,
    the two multiplied, and nothing but the product read outside them (a mixture of experts' SwiGLU: transformers'
    gate_up_proj). One grouped GEMM over the halves' columns interleaved computes act(gate) * up in its tile
    (`opfuse.codegen.grouped_gemm`), as a gated pair of linears does."""
    experts = graph[name]
    if experts.op != "grouped_mm" or not graph.is_constant(experts.inputs[1]) or name in graph.outputs:
        return None
    columns = experts.type.shape[1]
    half = columns // 2
    slices = {r.attrs["start"]: r for r in users[name]
              if r.op == "slice" and r.attrs["dim"] == 1 and r.attrs.get("step", 1) == 1}
    if columns % 2 or len(users[name]) != 2 or sorted(slices) != [0, half] or slices[0].attrs["end"] != half \
            or slices[half].attrs["end"] < columns:
        return None
    gate, up = slices[0], slices[half]
    product = gated_product(graph, gate, up, users)
    return None if product is None else GatedExperts(name, gate.name, product[0], up.name, product[1])
