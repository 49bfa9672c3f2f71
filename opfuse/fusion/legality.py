"""Fusion legality: may a producer group and a consumer group become one kernel? (`can_fuse` -> None | Reason).

The rules are written over fusion kinds (`opfuse.ir.ops.FusionKind`), TVM style, never over op names. A legal
group has at most one *hub*: an anchor (conv, gemm, attention) or a reduction. This module holds `can_fuse` and
the rules it chains; beside it, `legality_anchors` (an anchor's prologue and row norms), `legality_views` (views
and copies mapped on loads), `legality_conv` (conv-conv chains) and `legality_common` (graph walks they share).

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
  A scan (cumsum, a reduction that keeps every element) takes both the same way (an integer one carries its sum in
  int64, and wide integers before and after it are computed exactly: `opfuse.codegen.operands.Region.integer`).
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
  concatenation, a constant pad, an embedding (a row index loaded, then the row), an upsample (nearest: one
  source index per output element; linear: its 2^dims neighbours weighted) and sliding windows (unfold, im2col,
  col2im: `opfuse.codegen.windows`) join an elementwise chain without a hub: the elementwise template loads each of
  a cat's inputs under the mask of its slice (DenseNet's cat -> batch norm -> relu, ShuffleNet's cat -> channel
  shuffle), a pad's input under the mask of its extent, an embedding's table at the row it loads, an upsample's
  input at its source indices, a window's element at its position in the input (col2im: the sum of the column
  entries landing there). Each element is still computed once (`element_flow_rule`): inside the group a node has as
  many elements as each value it reads, but where it reads each input element at most once (a cat's inputs are its
  slices, a pad's input its inner part, col2im's columns, windows that do not overlap) or reads a value that is only
  loaded through index maps (halonet's pad read by two unfolds of overlapping windows); so an upsample or
  overlapping windows read a computed input from outside the group (HRNet's upsample -> residual add -> ReLU), and
  what the group writes has one size.
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

import math
from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.legality_anchors import anchor_prologue, norm_prologue_on, row_norm_epilogue
from opfuse.fusion.legality_common import (Users, in_order, node_index, path_outside, reachable, reachable_backwards,
                                           same_size_rule)
from opfuse.fusion.legality_conv import two_anchor_rule
from opfuse.fusion.legality_views import (ELEMENT_KEEPING_VIEWS, EPILOGUE_VIEWS, MAPPED_COPIES, REPEATING_VIEWS,
                                          epilogue_spaces, is_view, loaded_view, maps_on_load, mixed_orders,
                                          operand_chain, operand_views, reads_each_once)
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import MAX_HEAD_DIM, tiles_attention
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, get_op, kind_of, view_chain, view_copies

WINDOW_POOLS = frozenset({"max_pool2d", "avg_pool2d", "max_pool3d", "avg_pool3d"})


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


# ---- rules on single nodes -----------------------------------------------------------------------------

def opaque_rule(graph: Graph, nodes: Iterable[str]) -> Reason | None:
    """Opaque ops run through PyTorch and never share a kernel (but a state written in place, which an elementwise
    chain's kernel stores: `Graph.writes_state_in_place`)."""
    for name in sorted(nodes):
        node = graph[name]
        if kind_of(node) is FusionKind.OPAQUE and not graph.writes_state_in_place(name):
            if get_op(node.op).kernel is not None:
                return alone(node)
            target = node.attrs.get("target")
            return Reason(Code.OPAQUE, f"opaque op {name}{f' ({target})' if target else ''} runs through PyTorch")
    return None


def alone(node: Node) -> Reason:
    """Why an op that runs alone in a kernel of its own (`OpDef.kernel`) takes no fusion."""
    return Reason(Code.ALONE, f"{node.name} ({node.op}) runs alone, in a kernel of its own ({get_op(node.op).kernel})")


def injective_rule(graph: Graph, nodes: Iterable[str]) -> Reason | None:
    """Copying injective ops stay single kernels, but the index maps of MAPPED_COPIES (a cat, a pad, sliding
    windows, ...) in a chain without a hub (see the module docstring)."""
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
    if anchors and reductions and norm is None and not norm_prologue_on(config, graph[reductions[0]].op):
        return Reason(Code.DISABLED, f"{graph[reductions[0]].op} {reductions[0]} as {anchors[0]}'s prologue: off "
                      "(FusionConfig.norm_prologue)")
    if len(reductions) > 1:
        return Reason(Code.TWO_REDUCTIONS, f"two reductions ({reductions[0]}, {reductions[1]}) in one kernel")
    writes = [n for n in order if graph.writes_state_in_place(n, users)]
    if writes and (anchors or reductions):
        hub = (anchors + reductions)[0]
        return Reason(Code.NOT_ELEMENTWISE, f"{writes[0]} ({graph[writes[0]].op}) writes the model's state, which only "
                      f"an elementwise chain's kernel stores, not {hub}'s")
    for name in order:
        if not kind_of(graph[name]).elementwise and name not in anchors + reductions + writes \
                and not maps_on_load(graph[name]):
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
    """A chain computes each element once: a node has as many elements as each value it reads inside the group,
    but a copying map that reads each input element at most once (`reads_each_once`: a cat's inputs are its slices,
    a pad's input its inner part, a col2im's columns land on one position each), a value only loaded through index
    maps (`loaded_view`: a pad read by the unfolds of overlapping windows costs loads, not arithmetic), and a
    one-element value (recomputed for every element it meets, it costs no more than loading it: T5's -bound of its
    overflow clamp); and every value the group writes has one size, the kernel's iteration space (a value before a
    crop or a col2im may be larger: the elements no output reads are never computed). A state written in place
    counts the elements it stores (`Graph.stored_shape`: its source's)."""
    def numel(name: str) -> int:
        return math.prod(graph.stored_shape(name))

    for name in order:
        node = graph[name]
        if reads_each_once(node):       # (a roll keeps its element count)
            continue
        for value in node.inputs:
            if value in merged and numel(value) not in (numel(name), 1) and not loaded_view(graph, value, merged):
                return Reason(Code.BROADCAST_GROWTH, f"broadcast growth: {name} has {numel(name)} elements, "
                              f"{value} {numel(value)} ({graph[value].type})")
    written = [n for n in order if n in graph.outputs or any(u.name not in merged for u in users[n])]
    largest = max((numel(n) for n in written), default=0)
    for name in written:
        if numel(name) != largest:
            return Reason(Code.OUTPUT_SIZE, f"{name} is written with {numel(name)} elements, the kernel "
                          f"iterates over {largest}")
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
