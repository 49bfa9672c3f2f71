"""Fusion legality: may a producer group and a consumer group become one kernel? (`can_fuse` -> None | Reason).

The rules are written over fusion kinds (`opfuse.ir.ops.FusionKind`), TVM style, never over op names. A legal
group has at most one *hub*: an anchor (conv, gemm, attention) or a reduction.

- anchor + epilogue: the anchor followed by elementwise ops of its output's size. An epilogue may read other
  full-size activations from outside (the skip of a residual add: kind RESIDUAL, switch `config.residual`).
  A GEMM-shaped anchor (a linear, a 1x1 conv) takes a prologue of elementwise ops on its input that read nothing
  else of full size (`anchor_prologue`: squeeze-and-excitation's channel scale before the project conv): they run
  on each operand tile as it is loaded. A linear's prologue may open with a layer norm over the last dim whose
  input comes from outside the group (pre-LN transformers' ln -> qkv / fc1, ConvNeXt's LN -> pwconv1): the kernel
  computes the row statistics in a first pass over K, then normalizes each A tile before its dot. Other anchors
  load their operand tiles as they are (through views, below).
- a depthwise conv's row norm (switch `config.norm_epilogue`): the layer norm or RMS norm over the channels that
  follows a depthwise conv through its epilogue (ConvNeXt's 7x7 conv -> permute -> LayerNorm) joins the conv's
  epilogue (`row_norm_epilogue`): a depthwise tile reduces nothing across channels, so a tile spanning every channel
  of its pixels holds whole rows and normalizes them in registers. Elementwise ops may follow the norm.
- reduction + prologue/epilogue: elementwise ops of the reduction's input size before it (the residual add
  before a layer norm, the scale before a softmax; a prologue value read outside too is stored by the kernel),
  elementwise ops of its output size after it.
- elementwise chain: elementwise ops that all have the same number of elements (no broadcast growth, so the
  kernel iterates over one index space and recomputes nothing).

- conv-conv chain (`two_anchor_rule`, switch `config.conv_conv`): a depthwise conv (groups == Cin == Cout) with
  its elementwise epilogue feeding a 1x1 conv (stride 1, no padding, groups 1) with its epilogue (bias, residual
  add, activation): kind CONV_CONV, one kernel in which the depthwise result never reaches memory. The 1x1
  expansion conv before the depthwise may join too (the whole inverted-residual block), but only together with
  the pointwise conv; whether its halo recompute pays is the cost model's business. Each stage but the last is
  read only by the next conv and takes only constant operands (it is computed on the fly, per tile).

An anchor no template tiles is a library call alone (`library_anchor_rule`: an sdpa of head dims over the attention
template's runs torch's attention) and takes no epilogue.

Everything else is refused with a reason: any other pair of anchors, an anchor and any other reduction, two
reductions, opaque ops, a value the consumer reads that someone outside the pair reads too (several users), and a
merge that would put a group outside the pair both after and before the fused kernel (a cycle). Each reason is an
`opfuse.fusion.reasons.Reason`: a stable code (listed there) and the words. Choices made here, and why:

- injective ops that copy stay single kernels (a gather), but a roll (an index map: Swin's shifted windows), a
  concatenation, a constant pad, an embedding (a row index loaded, then the row) and an upsample (nearest: one
  source index per output element; linear: its 2^dims neighbours weighted) join an elementwise chain without a hub:
  the elementwise template loads each of a cat's inputs under the mask of its slice (DenseNet's cat -> batch norm
  -> relu, ShuffleNet's cat -> channel shuffle), a pad's input under the mask of its extent, an embedding's table at
  the row it loads, an upsample's input at its source indices. Each element is still computed once: inside the
  group a node has as many elements as each value it reads, a cat's inputs being its slices and a pad's input its
  inner part (so an upsample reads its input from outside the group: HRNet's upsample -> residual add -> ReLU), and
  what the group writes has the size of its largest value.
- an expand (a repeat: expand, then a merge PyTorch copies) joins the kernel that reads it, loading its input (a
  node recomputed per repeat would be broadcast growth, refused below): repeat, tile and repeat_interleave are index
  maps of their reader's load.
- views that keep every element (reshape, permute, identity) join elementwise kernels and a reduction's prologue,
  whose templates evaluate values at coordinates and map them through views (a reshape of a permuted tensor is
  then no copy but an index map on a load). They follow a reduction in its kernel too: its epilogue is computed at
  the reduction's own coordinates, and after such views at the ones they map to (group norm's reshape back to [N,
  C, H, W], then its affine and the model's activation; a copy the reduction writes directly, MobileViT's patches
  folded back after a layer norm), no node reading its values through two views. An anchor's kernel indexes its output tile as it is, but its
  epilogue may permute (EPILOGUE_VIEWS: ConvNeXt's linear back to NCHW for the layer scale and residual), and a
  linear reads its input through views (`operand_views`: the head merge after attention, Swin's window partition)
  when they make a strided index map of its operand load (`opfuse.ir.strided`). Slices and expands stay outside (they
  would drop or repeat elements). The passes remove no-op views before planning.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import MAX_HEAD_DIM, MAX_ROW_CHANNELS, tiles_attention
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, along_channels, get_op, kind_of, view_copies
from opfuse.ir.strided import MAPPED_VIEWS, contiguous_strides, operand_groups, through_views

Users = Mapping[str, Sequence[Node]]
ELEMENT_KEEPING_VIEWS = frozenset({"reshape", "permute", "identity"})
REPEATING_VIEWS = frozenset({"expand"})     # views a kernel without an anchor maps on a load of their input (a repeat)
WINDOW_POOLS = frozenset({"max_pool2d", "avg_pool2d", "max_pool3d", "avg_pool3d"})
EPILOGUE_VIEWS = frozenset({"permute"})      # views an anchor's epilogue maps: values stay at the tile's coordinates
MAPPED_COPIES = frozenset({"cat", "roll", "embedding", "pad", "upsample"})   # copying ops an elementwise kernel
                                                                             # computes as index maps


def can_fuse(graph: Graph, producer_nodes: Iterable[str], consumer_nodes: Iterable[str], users: Users,
             config: FusionConfig | None = None, index: Mapping[str, int] | None = None) -> Reason | None:
    """None when the consumer group may join the producer group in one kernel, else the reason (code and words).

    `users` is `graph.users()`; `index` (node name -> position in the graph) makes the cycle check cheaper.
    """
    config = config or FusionConfig()
    index = index if index is not None else node_index(graph)
    producer, consumer = set(producer_nodes), set(consumer_nodes)
    merged = producer | consumer
    for rule in (opaque_rule, injective_rule, library_anchor_rule):
        reason = rule(graph, merged)
        if reason:
            return reason
    reason = view_rule(graph, merged, users)
    if reason:
        return reason
    return (several_users_rule(graph, producer, consumer, users, index)
            or copied_operand_rule(graph, merged)
            or structure_rule(graph, merged, users, config, index)
            or residual_rule(graph, merged, users, config, index)
            or cycle_rule(graph, producer, consumer, users, index))


def node_index(graph: Graph) -> dict[str, int]:
    """Position of each node in the graph's topological order."""
    return {name: i for i, name in enumerate(graph.nodes)}


def in_order(names: Iterable[str], index: Mapping[str, int]) -> list[str]:
    return sorted(names, key=index.__getitem__)


# ---- rules on single nodes -----------------------------------------------------------------------------

def opaque_rule(graph: Graph, nodes: Iterable[str]) -> Reason | None:
    """Opaque ops run through PyTorch and never share a kernel."""
    for name in sorted(nodes):
        node = graph[name]
        if kind_of(node) is FusionKind.OPAQUE:
            target = node.attrs.get("target")
            return Reason(Code.OPAQUE, f"opaque op {name}{f' ({target})' if target else ''} runs through PyTorch")
    return None


def injective_rule(graph: Graph, nodes: Iterable[str]) -> Reason | None:
    """Copying injective ops stay single kernels, but a cat in a chain without a hub (see the module docstring)."""
    nodes = sorted(nodes)
    hub = next((n for n in nodes if kind_of(graph[n]) in (FusionKind.ANCHOR, FusionKind.REDUCTION)), None)
    for name in nodes:
        node = graph[name]
        if kind_of(node) is FusionKind.INJECTIVE and not get_op(node.op).alias:
            if node.op not in MAPPED_COPIES:
                return Reason(Code.COPYING_OP, f"injective op {name} ({node.op}) stays its own kernel")
            if hub is not None:
                return Reason(Code.CAT_WITH_HUB, f"{name} ({node.op}) joins elementwise chains only, not the kernel "
                              f"of {hub} ({graph[hub].op})")
    return None


def copied_operand_rule(graph: Graph, nodes: set[str]) -> Reason | None:
    """An anchor's kernel loads what its epilogue and prologue read from outside through strides, which a view
    PyTorch would copy (a reshape of a permuted tensor), or a view of one, has none of: such a reader stays out of
    the anchor's kernel, in one that maps the views on its load (MobileViTv2's residual add of the unfolded patches,
    MobileViT's layer norm of them before a linear), instead of a copy through PyTorch before it."""
    if not any(kind_of(graph[n]) is FusionKind.ANCHOR for n in nodes):
        return None
    for name in sorted(nodes):
        if kind_of(graph[name]) is FusionKind.ANCHOR:
            continue
        for value in graph[name].inputs:
            copy = next((v for v in view_chain(graph, value) if view_copies(graph, graph[v])), None) \
                if value not in nodes else None
            if copy is not None:
                return Reason(Code.VIEW_IN_ANCHOR, f"{name} reads {value}, a view of {copy}, which PyTorch would "
                              "copy: an anchor's kernel loads what it reads through strides, so the views are mapped "
                              "on a load of its reader's own kernel instead")
    return None


def view_chain(graph: Graph, name: str) -> list[str]:
    """`name` and the views it is a view of, back to the first value that is none."""
    chain = []
    while is_view(graph[name]) and graph[name].inputs:
        chain.append(name)
        name = graph[name].inputs[0]
    return chain


def library_anchor_rule(graph: Graph, nodes: Iterable[str]) -> Reason | None:
    """An anchor no template tiles runs as a library call, alone: an sdpa of head dims over the attention
    template's (`tiles_attention`) is torch's attention, which takes no epilogue."""
    nodes = sorted(nodes)
    for name in nodes:
        if graph[name].op == "sdpa" and not tiles_attention(graph, name) \
                and any(not is_view(graph[n]) for n in nodes if n != name):
            dims = sorted({graph[v].type.shape[-1] for v in graph[name].inputs[:3]})
            return Reason(Code.LIBRARY_ANCHOR, f"{name} (sdpa, head dims {dims}) runs as torch's attention, a "
                          f"library call: the attention template tiles head dims up to {MAX_HEAD_DIM}")
    return None


def view_rule(graph: Graph, nodes: Iterable[str], users: Users) -> Reason | None:
    """Views that keep every element join kernels without an anchor, and a linear's operand views join its kernel
    (see the module docstring)."""
    nodes = sorted(nodes)
    anchor = next((n for n in nodes if kind_of(graph[n]) is FusionKind.ANCHOR), None)
    mapped = operand_views(graph, nodes, users) if anchor is not None else set()
    if anchor is not None:     # and the row views between a layer norm prologue and its linear
        mapped |= {n for n in anchor_prologue(graph, anchor, nodes, users) if is_view(graph[n])}
        mapped |= {n for n in reachable(graph, anchor, set(nodes), users) if graph[n].op in EPILOGUE_VIEWS}
    for name in nodes:
        node = graph[name]
        if not is_view(node) or name in mapped:
            continue
        if anchor is not None:
            return Reason(Code.VIEW_IN_ANCHOR, f"view {name} ({node.op}) cannot join anchor {anchor}'s kernel")
        if node.op not in ELEMENT_KEEPING_VIEWS | REPEATING_VIEWS:
            return Reason(Code.VIEW_DROPS_ELEMENTS,
                          f"view {name} ({node.op}) cannot join a kernel: it does not keep every element")
    return None


def operand_chain(graph: Graph, anchor: str, within: Iterable[str], users: Users) -> list[str]:
    """The views of `within` through which linear `anchor` reads its input, source side first: a chain of
    MAPPED_VIEWS, each read by the next alone (the last by the anchor alone), that replayed on the contiguous
    source is a strided map of the operand load (`opfuse.ir.strided.operand_groups`); empty when there is none."""
    node = graph[anchor]
    within = set(within)
    if node.op != "linear":
        return []
    chain: list[str] = []
    value, reader = node.inputs[0], anchor
    while value in within and graph[value].op in MAPPED_VIEWS and [u.name for u in users[value]] == [reader] \
            and value not in graph.outputs:
        chain.append(value)
        value, reader = graph[value].inputs[0], value
    chain.reverse()
    if not chain:
        return []
    source = graph[value].type.shape
    dims = through_views(source, contiguous_strides(source), [graph[v] for v in chain])
    if dims is None or operand_groups(dims, len(node.type.shape) - 1) is None:
        return []
    return chain


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


ROW_NORMS = frozenset({"layer_norm", "rms_norm"})   # reductions over the last dim that keep every element


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


def operand_views(graph: Graph, nodes: Iterable[str], users: Users) -> set[str]:
    """The views of `nodes` that are operand maps of a linear anchor among them (`operand_chain`)."""
    nodes = list(nodes)
    return {view for name in nodes if kind_of(graph[name]) is FusionKind.ANCHOR
            for view in operand_chain(graph, name, nodes, users)}


def epilogue_spaces(graph: Graph, anchor: str, epilogue: Sequence[str]) -> dict[str, tuple[int, ...]] | Reason:
    """Per value of the anchor's epilogue (`epilogue` in topological order), the anchor dims its dims are: an
    EPILOGUE_VIEWS permute reorders them, any other node has its inputs'. A Reason names a node that reads the
    anchor's values in two orders (its template would need two coordinates per element)."""
    spaces = {anchor: tuple(range(len(graph[anchor].type.shape)))}
    for name in epilogue:
        node = graph[name]
        seen = {spaces[v] for v in node.inputs if v in spaces}
        if len(seen) != 1:
            return Reason(Code.VIEW_IN_ANCHOR,
                          f"{name} ({node.op}) reads {anchor}'s values in two orders of their dims")
        space = seen.pop()
        spaces[name] = tuple(space[d] for d in node.attrs["dims"]) if node.op in EPILOGUE_VIEWS else space
    return spaces


def mixed_orders(graph: Graph, hub: str, epilogue: Sequence[str]) -> Reason | None:
    """Why a reduction's epilogue (`epilogue` in topological order) cannot be computed once per element at mapped
    coordinates, or None: a node reads the hub's values through two different views (two coordinates each)."""
    orders: dict[str, object] = {hub: hub}
    for name in epilogue:
        node = graph[name]
        seen = {orders[v] for v in node.inputs if v in orders}
        if len(seen) != 1:
            return Reason(Code.VIEW_AFTER_REDUCTION, f"{name} ({node.op}) reads {hub}'s values through two views")
        order = seen.pop()
        orders[name] = name if node.op in ("reshape", "permute") else order
    return None


def joins_as_map(node: Node) -> bool:
    """A node an elementwise or reduction kernel evaluates through coordinates: a view keeping every element, a
    cat or a roll."""
    return node.op in ELEMENT_KEEPING_VIEWS or node.op in MAPPED_COPIES


def loaded_view(graph: Graph, name: str, within: set[str]) -> bool:
    """Whether `name` is a view of `within` reached through views of `within` alone from a value outside it: no
    element of it is computed in the kernel, only loaded (the views before a repeat's expand, however small)."""
    while name in within and is_view(graph[name]) and graph[name].inputs:
        name = graph[name].inputs[0]
    return name not in within


def maps_on_load(node: Node) -> bool:
    """A node an elementwise or reduction kernel evaluates through coordinates (`joins_as_map`), or an expand of a
    value it loads (REPEATING_VIEWS: what reads a repeat)."""
    return joins_as_map(node) or node.op in REPEATING_VIEWS


def is_view(node: Node) -> bool:
    return get_op(node.op).alias


# ---- rules on the pair ---------------------------------------------------------------------------------

def several_users_rule(graph: Graph, producer: set[str], consumer: set[str], users: Users,
                       index: Mapping[str, int]) -> Reason | None:
    """Each value passed from producer to consumer must be read by the consumer group only, but for a row
    reduction reading an elementwise chain's value: its kernel stores the value as it reads it, each element once
    (the residual sum that a layer norm normalizes and the next residual add reads again; pooling windows overlap
    or skip elements, so a pool does not)."""
    merged = producer | consumer
    hubs = (FusionKind.ANCHOR, FusionKind.REDUCTION)
    reductions = [graph[n] for n in consumer if kind_of(graph[n]) is FusionKind.REDUCTION]
    stores = (bool(reductions) and not any(windowed(r) for r in reductions)
              and not any(kind_of(graph[n]) in hubs for n in producer))
    shares = False
    for name in in_order(producer, index):
        readers = [u.name for u in users[name]]
        if not any(r in consumer for r in readers):
            continue
        shares = True
        if any(r not in merged for r in readers) and not (stores and kind_of(graph[name]).elementwise):
            return Reason(Code.SEVERAL_USERS, f"{name} has several users: {', '.join(dict.fromkeys(readers))}")
    if not shares:
        return Reason(Code.NO_SHARED_VALUE, "the consumer reads no value of the producer")
    return None


def windowed(node: Node) -> bool:
    """A pool whose windows may overlap or skip input elements (an adaptive pool to 1 x 1 reduces whole rows)."""
    if node.op == "adaptive_avg_pool2d":
        return tuple(node.type.shape[-2:]) != (1, 1)
    return node.op in WINDOW_POOLS


def two_anchor_rule(graph: Graph, merged: set[str], anchors: Sequence[str], users: Users, config: FusionConfig,
                    index: Mapping[str, int]) -> Reason | None:
    """Several anchors in one kernel: only a conv-conv chain ([expand 1x1 ->] depthwise -> 1x1) is legal."""
    names = ", ".join(anchors)
    prefix = f"two anchors ({names})" if len(anchors) == 2 else f"{len(anchors)} anchors ({names})"
    if not config.conv_conv:
        return Reason(Code.DISABLED, f"{prefix}: conv-conv fusion disabled (config.conv_conv)")
    if len(anchors) > 2 and not config.conv_conv_expand:
        return Reason(Code.DISABLED, f"{prefix}: fusing the expansion conv too is disabled (config.conv_conv_expand)")
    problem = conv_chain_problem(graph, merged, list(anchors), users)
    return Reason(problem.code, f"{prefix}: {problem.text}") if problem else None


def conv_chain_problem(graph: Graph, merged: set[str], anchors: list[str], users: Users) -> Reason | None:
    """Why `anchors` (in order) with the rest of `merged` are no conv-conv kernel, or None when they are one."""
    for name in anchors:
        if graph[name].op != "conv2d":
            return Reason(Code.TWO_ANCHORS,
                          f"{name} ({graph[name].op}) is no convolution: only convolutions chain in one kernel")
    if len(anchors) > 3:
        return Reason(Code.TWO_ANCHORS, "at most three convolutions (expand, depthwise, pointwise) chain in one kernel")
    stages = conv_stages(graph, merged, anchors)
    owner = {name: i for i, stage in enumerate(stages) for name in stage}
    for i, (earlier, later) in enumerate(zip(anchors, anchors[1:])):
        if owner.get(graph[later].inputs[0]) != i:
            return Reason(Code.TWO_ANCHORS, f"{earlier} does not feed {later}: convolutions share a kernel only as "
                          "a chain, each reading the previous one's result (depthwise into 1x1)")
    if len(anchors) == 2 and is_pointwise_conv(graph, anchors[0]) and is_depthwise_conv(graph, anchors[1]):
        return Reason(Code.EXPAND_ALONE, f"the 1x1 conv {anchors[0]} joins the depthwise conv {anchors[1]} only "
                      f"together with {anchors[1]}'s pointwise conv (the whole inverted-residual block)")
    *expand, depthwise, pointwise = anchors
    if not is_depthwise_conv(graph, depthwise):
        return Reason(Code.CONV_SHAPE, f"{depthwise} is not a depthwise conv (groups == in == out channels): "
                      "conv-conv fusion takes a depthwise conv feeding a 1x1 conv")
    for name in expand + [pointwise]:
        if not is_pointwise_conv(graph, name):
            return Reason(Code.CONV_SHAPE, f"{name} is not a 1x1 conv (stride 1, no padding, groups 1)")
    for name in anchors:
        for value in graph[name].inputs[1:]:
            if not graph.is_constant(value):
                return Reason(Code.INNER_OPERAND, f"{name} reads {value} as weight or bias, not a constant")
    for name in sorted(merged - set(owner)):
        return Reason(Code.ANCHOR_PROLOGUE, f"{name} would be a prologue of {anchors[0]}: anchors take epilogues only")
    for i, stage in enumerate(stages):
        anchor = stage[0]
        for name in stage[1:]:
            if not kind_of(graph[name]).elementwise:
                return Reason(Code.NOT_ELEMENTWISE, f"{name} ({graph[name].op}) is not elementwise")
            for value in graph[name].inputs:
                if owner.get(value, i) < i:
                    return Reason(Code.INNER_READ, f"{name} reads {value} from the chain of {stages[owner[value]][0]}, "
                                  "which is never written")
        problem = same_size_rule(graph, stage[1:], graph[anchor].type.numel, f"{anchor}'s output")
        if problem:
            return problem
        if i == len(stages) - 1:
            break
        following = stages[i + 1][0]
        handed = graph[following].inputs[0]
        for name in stage:
            readers = [u.name for u in users[name] if u.name not in stage and not
                       (name == handed and u.name == following)]
            if readers or name in graph.outputs:
                who = ", ".join(dict.fromkeys(readers)) or "the graph's outputs"
                return Reason(Code.INNER_READ, f"{name} is read by {who}: the {graph[anchor].op} result of {anchor} "
                              "stays in registers in a conv-conv kernel")
        problem = constant_operands_only(graph, stage, owner)
        if problem:
            return problem
    return None


def constant_operands_only(graph: Graph, stage: Sequence[str], owner: Mapping[str, int]) -> Reason | None:
    """An inner stage is recomputed per tile from constants: scalars and per-channel vectors only."""
    for name in stage[1:]:
        node = graph[name]
        for position, value in enumerate(node.inputs):
            if value in owner:
                continue
            if not graph.is_constant(value):
                return Reason(Code.INNER_OPERAND, f"{name} reads activation {value}: an inner conv's epilogue takes "
                              "constant operands only (bias, scale, clamp bounds)")
            shape = graph[value].type.shape
            aligned = (1,) * (len(node.type.shape) - len(shape)) + tuple(shape)   # broadcasting aligns right
            per_channel = all(size == 1 for dim, size in enumerate(aligned) if dim != 1)
            if not (per_channel or along_channels(node, position)):
                return Reason(Code.INNER_OPERAND, f"{name} reads constant {value} {graph[value].type}, which varies "
                              "along more than the channels")
    return None


def conv_stages(graph: Graph, nodes: Iterable[str], anchors: Sequence[str]) -> list[list[str]]:
    """Per anchor of a conv chain, the anchor and its epilogue (the nodes of `nodes` it reaches before the next
    anchor), in topological order; nodes reached from no anchor are left out."""
    within = set(nodes)
    order = {name: i for i, name in enumerate(graph.nodes)}
    owner: dict[str, int] = {}
    for name in sorted(within, key=order.__getitem__):
        if name in anchors:
            owner[name] = anchors.index(name)
            continue
        sources = [owner[v] for v in graph[name].inputs if v in owner]
        if sources:
            owner[name] = max(sources)
    return [[n for n in sorted(owner, key=order.__getitem__) if owner[n] == i] for i in range(len(anchors))]


def conv_pairs(node: Node, attr: str, default: int) -> tuple[int, int]:
    value = node.attrs.get(attr, default)
    return (value, value) if isinstance(value, int) else tuple(value)


def is_depthwise_conv(graph: Graph, name: str) -> bool:
    """A conv2d with one filter per channel: groups == input channels == output channels."""
    node = graph[name]
    if node.op != "conv2d" or len(node.type.shape) != 4:
        return False
    channels = graph[node.inputs[0]].type.shape[1]
    return node.attrs.get("groups", 1) == channels == node.type.shape[1]


def is_pointwise_conv(graph: Graph, name: str) -> bool:
    """A 1x1 conv2d with stride 1, no padding and one group: a GEMM over pixels."""
    node = graph[name]
    if node.op != "conv2d" or len(node.type.shape) != 4:
        return False
    return (tuple(graph[node.inputs[1]].type.shape[2:]) == (1, 1) and node.attrs.get("groups", 1) == 1
            and conv_pairs(node, "stride", 1) == (1, 1) and conv_pairs(node, "padding", 0) == (0, 0))


def structure_rule(graph: Graph, merged: set[str], users: Users, config: FusionConfig,
                   index: Mapping[str, int]) -> Reason | None:
    """The merged group must be one hub with elementwise prologue/epilogue, or an elementwise chain."""
    order = in_order(merged, index)
    anchors = [n for n in order if kind_of(graph[n]) is FusionKind.ANCHOR]
    reductions = [n for n in order if kind_of(graph[n]) is FusionKind.REDUCTION]
    if len(anchors) > 1:
        return two_anchor_rule(graph, merged, anchors, users, config, index)
    norm = row_norm_epilogue(graph, anchors[0], merged) if anchors and len(reductions) == 1 else None
    if norm is not None and not config.norm_epilogue:
        return Reason(Code.DISABLED, f"{graph[norm].op} {norm} in {anchors[0]}'s epilogue: off "
                      "(FusionConfig.norm_epilogue)")
    if anchors and reductions and norm is None \
            and not set(reductions) <= set(anchor_prologue(graph, anchors[0], merged, users)):
        return Reason(Code.ANCHOR_AND_REDUCTION, f"reduction {reductions[0]} and anchor {anchors[0]} in one kernel: "
                      "anchors take elementwise epilogues only (but a depthwise conv the norm over its channels, and "
                      "a linear the layer norm or RMS norm of an input from outside as its prologue)")
    if anchors and reductions and norm is None and not config.norm_prologue:
        return Reason(Code.DISABLED, f"{graph[reductions[0]].op} {reductions[0]} as {anchors[0]}'s prologue: off "
                      "(FusionConfig.norm_prologue)")
    if len(reductions) > 1:
        return Reason(Code.TWO_REDUCTIONS, f"two reductions ({reductions[0]}, {reductions[1]}) in one kernel")
    for name in order:
        if not kind_of(graph[name]).elementwise and name not in anchors + reductions and not maps_on_load(graph[name]):
            return Reason(Code.NOT_ELEMENTWISE, f"{name} ({graph[name].op}) is not elementwise")
    if not anchors and not reductions:
        return element_flow_rule(graph, order, merged, users)
    hub = (anchors + reductions)[0]
    after = reachable(graph, hub, merged, users) - {hub}
    before = reachable_backwards(graph, hub, merged) - {hub}
    # the views a linear reads its input through are part of its operand load, and what it computes on the tiles
    # it loads is a prologue it may take
    operand = set(operand_chain(graph, hub, merged, users)) | set(anchor_prologue(graph, hub, merged, users)) \
        if anchors else set()
    epilogue = [n for n in order if n in after]
    prologue = [n for n in order if n in before and n not in operand]
    for name in order:
        if name == hub or name in after or name in before:
            continue
        return Reason(Code.SIDE_BRANCH,
                      f"{name} reaches {hub}'s epilogue from a side branch (neither before nor after {hub})")
    if prologue and anchors:
        return Reason(Code.ANCHOR_PROLOGUE,
                      f"{prologue[0]} would be a prologue of anchor {hub}: only a linear or a 1x1 conv takes one, "
                      "of elementwise ops reading nothing else of full size")
    if anchors and any(graph[n].op in EPILOGUE_VIEWS for n in epilogue):
        spaces = epilogue_spaces(graph, hub, epilogue)
        if isinstance(spaces, Reason):
            return spaces
    after_norm = reachable(graph, norm, merged, users) if norm is not None else set()
    # a reduction's epilogue is computed at its own coordinates, and after a view that keeps every element at the
    # ones they map to (the reduction template's `store_epilogue`: group norm's reshape back to [N, C, H, W], a
    # copy a layer norm writes directly), one mapping per element
    view = next((n for n in epilogue if is_view(graph[n]) and (norm is None or n in after_norm)
                 and (anchors or graph[n].op not in ELEMENT_KEEPING_VIEWS)), None)
    if view is not None and reductions:
        return Reason(Code.VIEW_AFTER_REDUCTION, f"view {view} ({graph[view].op}) after reduction {hub}: its "
                      "epilogue is computed at the reduction's own coordinates, or a reshape or permute of them")
    if reductions and not anchors:
        mixed = mixed_orders(graph, hub, epilogue)
        if mixed is not None:
            return mixed
    hub_input = graph[graph[hub].inputs[0]].type.numel
    computed = [n for n in prologue if not loaded_view(graph, n, merged)]     # (a repeat's views load its input)
    return (same_size_rule(graph, epilogue, graph[hub].type.numel, f"{hub}'s output")
            or same_size_rule(graph, computed, hub_input, f"{hub}'s input"))


def element_flow_rule(graph: Graph, order: Sequence[str], merged: set[str], users: Users) -> Reason | None:
    """A chain computes each element once: a node has as many elements as each value it reads inside the group
    (a cat's inputs are its slices; a one-element value, recomputed for every element it meets, costs no more than
    loading it: T5's -bound of its overflow clamp), and every value the group writes has the size of its largest."""
    for name in order:
        node = graph[name]
        if node.op in ("cat", "pad"):      # each input element read once (a roll keeps its element count)
            continue
        for value in node.inputs:
            if value in merged and graph[value].type.numel not in (node.type.numel, 1) \
                    and not loaded_view(graph, value, merged):
                return Reason(Code.BROADCAST_GROWTH, f"broadcast growth: {name} has {node.type.numel} elements, "
                              f"{value} {graph[value].type.numel} ({graph[value].type})")
    largest = max(graph[n].type.numel for n in order)
    for name in order:
        written = name in graph.outputs or any(u.name not in merged for u in users[name])
        if written and graph[name].type.numel != largest:
            return Reason(Code.OUTPUT_SIZE, f"{name} is written with {graph[name].type.numel} elements, the kernel "
                          f"iterates over {largest}")
    return None


def same_size_rule(graph: Graph, names: Sequence[str], numel: int, what: str) -> Reason | None:
    """Every node has `numel` elements: no broadcast growth inside a kernel."""
    for name in names:
        if graph[name].type.numel != numel:
            return Reason(Code.BROADCAST_GROWTH, f"broadcast growth: {name} has {graph[name].type.numel} elements, "
                          f"{what} {numel} ({graph[name].type})")
    return None


def skip_operands(graph: Graph, nodes: Iterable[str], anchor: str, users: Users,
                  index: Mapping[str, int]) -> list[str]:
    """Full-size activations from outside that the anchor's epilogue reads (the skip of a residual add)."""
    node_set = set(nodes)
    size = graph[anchor].type.numel
    skips: list[str] = []
    for name in in_order(reachable(graph, anchor, node_set, users) - {anchor}, index):
        for value in graph[name].inputs:
            if (value not in node_set and value not in skips and not graph.is_constant(value)
                    and graph[value].type.numel == size):
                skips.append(value)
    return skips


def residual_rule(graph: Graph, merged: set[str], users: Users, config: FusionConfig,
                  index: Mapping[str, int]) -> Reason | None:
    """An epilogue that reads a skip activation is a residual fusion: allowed only with config.residual."""
    if config.residual:
        return None
    for name in in_order(merged, index):
        if kind_of(graph[name]) is FusionKind.ANCHOR:
            skips = skip_operands(graph, merged, name, users, index)
            if skips:
                return Reason(Code.DISABLED, f"residual fusion disabled (epilogue of {name} reads {skips[0]})")
    return None


def cycle_rule(graph: Graph, producer: set[str], consumer: set[str], users: Users,
               index: Mapping[str, int]) -> Reason | None:
    """Merging must not put a node outside the pair both after and before the fused kernel."""
    merged = producer | consumer
    via = path_outside(graph, producer, consumer, merged, users, index) or \
        path_outside(graph, consumer, producer, merged, users, index)
    if via:
        return Reason(Code.CYCLE, f"cycle through {via}: it reads one side of the pair and feeds the other")
    return None


# ---- graph walks ---------------------------------------------------------------------------------------

def reachable(graph: Graph, start: str, within: set[str], users: Users) -> set[str]:
    """Nodes of `within` reachable from `start` along edges inside `within` (start included)."""
    seen, stack = {start}, [start]
    while stack:
        for user in users[stack.pop()]:
            if user.name in within and user.name not in seen:
                seen.add(user.name)
                stack.append(user.name)
    return seen


def reachable_backwards(graph: Graph, start: str, within: set[str]) -> set[str]:
    """Nodes of `within` that reach `start` along edges inside `within` (start included)."""
    seen, stack = {start}, [start]
    while stack:
        for value in graph[stack.pop()].inputs:
            if value in within and value not in seen:
                seen.add(value)
                stack.append(value)
    return seen


def path_outside(graph: Graph, sources: set[str], targets: set[str], exclude: set[str], users: Users,
                 index: Mapping[str, int]) -> str | None:
    """The first node outside `exclude` on a path from `sources` to `targets`, or None when there is none.

    Only nodes placed before the last target can lie on such a path (the graph is in topological order),
    which keeps the walk short: usually it ends at once.
    """
    if not targets:
        return None
    last = max(index[t] for t in targets)
    origin: dict[str, str] = {}
    stack: list[str] = []
    for name in sources:
        for user in users[name]:
            if user.name not in exclude and user.name not in origin and index[user.name] < last:
                origin[user.name] = user.name
                stack.append(user.name)
    while stack:
        name = stack.pop()
        for user in users[name]:
            if user.name in targets:
                return origin[name]
            if user.name not in exclude and user.name not in origin and index[user.name] < last:
                origin[user.name] = origin[name]
                stack.append(user.name)
    return None
