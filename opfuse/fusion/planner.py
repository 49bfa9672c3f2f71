"""Fusion planner: decides which nodes share a kernel (`plan_fusion(graph, config, hw) -> FusionPlan`).

Inductor-style greedy fusion, with Hidet's anchor vocabulary and XLA's resource check:

1. every kernel-launching node starts as its own group; every view (reshape, permute, ...) is a VIEW group
   that launches nothing; graph inputs and constants belong to no group.
2. vertical rounds (`config.vertical`): the candidates are producer -> consumer pairs of groups that share a
   buffer (seen through views), sorted by the bytes the fusion would save. Views between two groups without an
   anchor join the consumer as coordinate maps (`legality`); after the rounds, a view PyTorch would copy joins
   the elementwise group it is a view of, which then writes it directly. Each is merged when it is legal
   (`legality.can_fuse`), fits the hardware (`resources.estimate_resources`; otherwise OVER_BUDGET and the
   pair is "split back", i.e. stays two kernels) and pays (the cost model predicts the fused kernel faster
   than the two apart; skipped when `config.use_cost_model` is False). Rounds repeat until nothing changes.
   Conv-conv fusion (`config.conv_conv`) is one more vertical pair: a depthwise conv group feeding a 1x1 conv
   group becomes one CONV_CONV group; the block's 1x1 expansion conv may then join it (the whole inverted
   residual) when the cost model, which counts the halo recompute, says it pays. Either way it is a decision.
   Squeeze-and-excitation (`config.squeeze`): after the rounds, a global average pool alone, the GEMM group
   reading its result and the GEMM group reading that one's (pool -> 1x1 conv + activation -> 1x1 conv + sigmoid)
   become one SQUEEZE group when `opfuse.fusion.squeeze` recognises the chain, it fits and it pays.
3. horizontal (`config.horizontal`): sibling anchors reading the same input, with compatible shapes and
   identical epilogues, become one HORIZONTAL group (weights concatenated at codegen time); then small
   independent elementwise groups, each dominated by its launch overhead, share one launch.
4. the groups are listed in topological order, each with its kind, anchor, traffic, predicted time, resources
   and the reason it is what it is; every candidate considered is a FusionDecision, taken or refused, with its
   reason in words and as a stable code (`opfuse.fusion.reasons`).
"""

from __future__ import annotations

import heapq
from typing import Mapping, Sequence
from dataclasses import dataclass

from opfuse.config import FusionConfig, for_graph
from opfuse.fusion.cost import GroupTraffic, KernelEstimate, estimate_kernel, group_traffic
from opfuse.fusion.legality import (EPILOGUE_VIEWS, MAPPED_COPIES, REPEATING_VIEWS, anchor_prologue, can_fuse,
                                    in_order, is_view,
                                    joins_as_map, node_index, operand_chain, path_outside, row_norm_epilogue,
                                    row_norm_prologue, skip_operands)
from opfuse.fusion.plan import FusionDecision, FusionGroup, FusionPlan, GroupKind, Verdict
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import anchor_of, conv_chain, conv_conv_key, conv_conv_slice_table, gemm_view
from opfuse.fusion.squeeze import global_average, squeeze_chain
from opfuse.fusion.tiles import (MIN_SPLIT_STEPS, anchor_grid, anchor_loop, anchor_tiles, row_tiles, row_view,
                                 split_k_slices, split_k_table, tile_key)
from opfuse.hardware import HardwareProfile, get_hardware
from opfuse.ir.graph import DTYPE_BYTES, WIDE_INTEGERS, Graph, Node
from opfuse.ir.ops import FusionKind, kind_of, view_copies
from opfuse.ir.verify import verify


def plan_fusion(graph: Graph, config: FusionConfig | None = None, hw: HardwareProfile | None = None,
                measured_over_budget: Mapping[frozenset[str], str] | None = None,
                measured_slower: Mapping[frozenset[str], str] | None = None) -> FusionPlan:
    """Group the graph's nodes into kernels and record every fusion decision.

    What the GPU measured of an earlier build, each a map of node sets to why: no merge may bring such a set
    together again, so those groups are split back. `measured_over_budget`: the nodes of a group whose compiled
    kernel failed the resource check (every config spilled). `measured_slower`: nodes of a group whose kernel
    measured slower than its ops run one by one through PyTorch (`compiler.kept_apart`: two of its anchors, or
    its one anchor and another of its nodes).
    """
    config = for_graph(config, graph)
    hw = hw or get_hardware(config.hardware)
    verify(graph, check_types=False)   # unknown ops and dangling inputs fail here, naming the node
    planner = _Planner(graph, config, hw, measured_over_budget or {}, measured_slower or {})
    if config.vertical:
        planner.vertical()
        planner.squeeze()
        planner.absorb_copying_views()
        planner.store_slices()
    if config.horizontal:
        planner.horizontal_anchors()
        planner.horizontal_pointwise()
    return planner.finish()


@dataclass(frozen=True)
class _Candidate:
    """A producer -> consumer pair of groups; `views` lie between them when the buffer passes through views."""

    producer: int
    consumer: int
    views: tuple[str, ...]


def disjoint_equal_slices(slices: Sequence[Node]) -> bool:
    """Slices of one value along one dim, all of one size, no two overlapping."""
    if not slices or len({(s.inputs[0], s.attrs["dim"]) for s in slices}) != 1:
        return False
    spans = sorted((s.attrs["start"], s.type.shape[s.attrs["dim"]]) for s in slices)
    return len({size for _, size in spans}) == 1 and all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))


class _Planner:
    """The mutable state of one planning run: groups, decisions, cached estimates."""

    def __init__(self, graph: Graph, config: FusionConfig, hw: HardwareProfile,
                 measured_over_budget: Mapping[frozenset[str], str], measured_slower: Mapping[frozenset[str], str]):
        self.graph, self.config, self.hw = graph, config, hw
        self.measured_over_budget, self.measured_slower = measured_over_budget, measured_slower
        self.users = graph.users()
        self.index = node_index(graph)
        self.groups: dict[int, list[str]] = {}        # group id -> node names in topological order
        self.group_of: dict[str, int] = {}
        self.kinds: dict[int, GroupKind] = {}         # kinds fixed by horizontal merges
        self.notes: dict[int, list[str]] = {}         # what each merge into the group was
        self.decisions: list[FusionDecision] = []
        self.seen: set[tuple[frozenset[str], frozenset[str]]] = set()
        self._estimates: dict[frozenset[str], KernelEstimate] = {}
        self._traffic: dict[frozenset[str], GroupTraffic] = {}
        for node in graph:
            if kind_of(node) is not FusionKind.SOURCE:
                self.groups[len(self.groups)] = [node.name]
                self.group_of[node.name] = len(self.groups) - 1

    # ---- estimates (cached: candidate pairs are re-examined every round) ------------------------------
    def estimate(self, nodes: list[str]) -> KernelEstimate:
        key = frozenset(nodes)
        if key not in self._estimates:
            self._estimates[key] = estimate_kernel(self.graph, in_order(nodes, self.index), self.users,
                                                   self.hw, self.config.dtype)
        return self._estimates[key]

    def traffic(self, nodes: list[str]) -> GroupTraffic:
        key = frozenset(nodes)
        if key in self._estimates:
            return self._estimates[key].traffic
        if key not in self._traffic:
            self._traffic[key] = group_traffic(self.graph, in_order(nodes, self.index), self.users)
        return self._traffic[key]

    def bytes_saved(self, first: list[str], second: list[str]) -> int:
        """Traffic the two groups move apart minus what they move as one kernel."""
        return (self.traffic(first).bytes_moved + self.traffic(second).bytes_moved
                - self.traffic(first + second).bytes_moved)

    # ---- vertical fusion ----------------------------------------------------------------------------
    def vertical(self) -> None:
        """Greedy rounds over producer -> consumer pairs, largest saving first, until nothing merges."""
        while True:
            candidates = self.vertical_candidates()
            candidates.sort(key=lambda c: (-self._candidate_saving(c), self.index[self.groups[c.producer][0]],
                                           self.index[self.groups[c.consumer][0]]))
            touched: set[int] = set()
            for candidate in candidates:
                if candidate.producer in touched or candidate.consumer in touched:
                    continue   # one of them grew this round; the pair is re-formed next round
                if self.try_vertical(candidate):
                    touched |= {candidate.producer, candidate.consumer}
            if not touched:
                return

    def vertical_candidates(self) -> list[_Candidate]:
        """Every pair where a consumer group reads a producer group's value, directly or through views."""
        found: dict[_Candidate, None] = {}
        for consumer, nodes in self.groups.items():
            if self.is_view_group(consumer):
                continue
            for name in nodes:
                for value in self.graph[name].inputs:
                    for producer, views in self.producers_of(value, consumer, ()):
                        found[_Candidate(producer, consumer, views)] = None
        return list(found)

    def producers_of(self, value: str, consumer: int, views: tuple[str, ...]) -> list[tuple[int, tuple[str, ...]]]:
        """Kernel groups whose buffer `value` is, or is a view of (with the views passed on the way)."""
        group = self.group_of.get(value)
        if group is None or group == consumer:
            return []   # a graph input or constant, or a value inside the consumer
        if not self.is_view_group(group):
            return [(group, views)]
        found = []
        for base in self.graph[value].inputs:
            found += self.producers_of(base, consumer, views + (value,))
        return found

    def _candidate_saving(self, candidate: _Candidate) -> int:
        if candidate.views and self.views_blocked(candidate):
            return 0   # blocked: saves nothing
        return self.bytes_saved(self.groups[candidate.producer],
                                list(candidate.views) + self.groups[candidate.consumer])

    def views_blocked(self, candidate: _Candidate, with_producer: bool = True) -> Reason | None:
        """Why the views between the pair cannot join the consumer as coordinate maps, or None when they can:
        neither side (the consumer alone, without `with_producer`) has an anchor, or the producer's anchor may
        take them into its epilogue (EPILOGUE_VIEWS, before an elementwise consumer or the row norm a depthwise conv
        computes, `row_norm_epilogue`); each view keeps every element (or, without `with_producer`, repeats it: an
        expand, whose input the consumer then loads, never recomputes), and the consumer (or a view on the way) is
        all that reads it."""
        producer, consumer = self.groups[candidate.producer], self.groups[candidate.consumer]
        sides = producer + consumer if with_producer else consumer
        anchor = next((n for n in sides if kind_of(self.graph[n]) is FusionKind.ANCHOR), None)
        hubs = (FusionKind.ANCHOR, FusionKind.REDUCTION)
        within = set(consumer) | set(candidate.views)
        epilogue = anchor in producer and (not any(kind_of(self.graph[n]) in hubs for n in consumer)
                                           or row_norm_epilogue(self.graph, anchor, within | set(producer)) is not None)
        # the row views between a layer norm and the linear that takes it as its prologue
        rows = {n for n in anchor_prologue(self.graph, anchor, set(sides) | within, self.users)
                if is_view(self.graph[n])} if anchor is not None and with_producer else set()
        for name in reversed(candidate.views):     # from the producer's side
            view = self.graph[name]
            blocks = f"view {name} ({view.op}) between them blocks fusion"
            if anchor is not None and name not in rows and not (epilogue and view.op in EPILOGUE_VIEWS):
                return Reason(Code.VIEW_IN_ANCHOR, f"{blocks}: an anchor's kernel maps no views")
            if not (joins_as_map(view) or (not with_producer and view.op in REPEATING_VIEWS)):
                return Reason(Code.VIEW_DROPS_ELEMENTS, f"{blocks}: it does not keep every element")
            readers = [u.name for u in self.users[name] if u.name not in within]
            if readers or name in self.graph.outputs:
                return Reason(Code.VIEW_SHARED, f"{blocks}: {', '.join(readers) or 'the graph outputs'} read it too")
        if any(kind_of(self.graph[n]) is FusionKind.OPAQUE for n in consumer):
            return Reason(Code.OPAQUE, f"views between them block fusion: {consumer[0]} runs through PyTorch")
        return None

    def absorb_copying_views(self) -> None:
        """A view PyTorch would copy (a reshape of a permuted tensor: ShuffleNet's channel shuffle), reached
        from an elementwise group (no anchor) through views only that group's value passes, joins that group with
        the views on the way: its kernel writes the copy's value directly, one launch and one round trip fewer. A
        group with a reduction (MobileViT's layer norm before its patches fold back) does where the views may
        follow its reduction (`can_fuse`: they map its coordinates forward, each element once)."""
        for group in list(self.groups):
            if group not in self.groups or not self.is_view_group(group) or not self.copies(self.groups[group]):
                continue
            chain, value = [], self.groups[group][0]
            while self.group_of.get(value) is not None and self.is_view_group(self.group_of[value]):
                node = self.graph[value]
                if not joins_as_map(node) or (chain and [u.name for u in self.users[value]] != [chain[-1]]):
                    break
                chain.append(value)
                value = node.inputs[0]
            else:
                producer = self.group_of.get(value)
                nodes = self.groups.get(producer, []) if producer is not None else []
                if (nodes and chain and [u.name for u in self.users[value]] == [chain[-1]]
                        and value not in self.graph.outputs
                        and (all(kind_of(self.graph[n]).elementwise or joins_as_map(self.graph[n]) for n in nodes)
                             or self.reduction_writes(nodes, chain))):
                    for name in chain:
                        self.merge(producer, self.group_of[name], f"view {name} ({self.graph[name].op}) written "
                                   "directly: no copy kernel")

    def reduction_writes(self, nodes: list[str], views: list[str]) -> bool:
        """Whether reduction group `nodes` (no anchor) may take `views` of its value into its kernel."""
        kinds = [kind_of(self.graph[n]) for n in nodes]
        return (FusionKind.REDUCTION in kinds and FusionKind.ANCHOR not in kinds
                and can_fuse(self.graph, nodes, views, self.users, self.config, self.index) is None)

    def store_slices(self) -> None:
        """An elementwise group whose one output (no graph output) is read only through slices along one dim, each
        a view group of its own, of equal size and disjoint (ShuffleNet's chunk of its shuffled concat), stores the
        slices instead: each a dense tensor of its own, which its readers read dense (a conv through cuDNN would
        copy a strided slice first). The slices are disjoint, so no more bytes are written."""
        for group in list(self.groups):
            nodes = self.groups.get(group)
            if (not nodes or self.is_view_group(group)    # views alone: PyTorch's, a copy or none
                    or not all(kind_of(self.graph[n]).elementwise or joins_as_map(self.graph[n]) for n in nodes)):
                continue
            outputs = [n for n in nodes if n in self.graph.outputs or any(u.name not in nodes for u in self.users[n])]
            if len(outputs) != 1 or outputs[0] in self.graph.outputs:
                continue
            slices = list({u.name: u for u in self.users[outputs[0]]}.values())
            if all(self.is_lone_slice(s) for s in slices) and disjoint_equal_slices(slices):
                for s in slices:
                    self.merge(group, self.group_of[s.name], f"slice {s.name} stored as a tensor of its own")

    def is_lone_slice(self, node: Node) -> bool:
        """A step-1 slice that is a view group by itself."""
        group = self.group_of.get(node.name)
        return (node.op == "slice" and node.attrs.get("step", 1) == 1 and group is not None
                and self.groups[group] == [node.name])

    def copy_reads_through(self, candidate: _Candidate) -> bool:
        """Whether views between a pair that cannot fuse (an anchor's output, say) may join the consumer alone, its
        kernel then reading the producer's output through them: views a linear's operand load maps (the head merge
        after attention, read by the output projection: read through the strides the producer's output comes with,
        whatever its layout), or views of which one PyTorch would copy, an elementwise or reduction kernel maps
        (Swin's window reverse after its projection, read by the roll and residual add; a repeat, expand and merge,
        read by an add: `legality.REPEATING_VIEWS`)."""
        views, consumer = list(candidate.views), self.groups[candidate.consumer]
        anchor = anchor_of(self.graph, consumer)
        if anchor is not None:
            within = set(views) | set(consumer)
            if not set(views) <= set(operand_chain(self.graph, anchor, within, self.users)):
                return False
        elif (not any(view_copies(self.graph, self.graph[v]) for v in views)
              or self.views_blocked(candidate, with_producer=False) is not None):
            return False
        return can_fuse(self.graph, views, consumer, self.users, self.config, self.index) is None

    def absorb_views(self, candidate: _Candidate) -> None:
        """Fold the candidate's view groups into its consumer group: the consumer's kernel maps them."""
        for name in candidate.views:
            self.merge(candidate.consumer, self.group_of[name], f"view {name} ({self.graph[name].op}) read through "
                       "as a coordinate map")

    def try_vertical(self, candidate: _Candidate) -> bool:
        """Decide one pair: record the decision, merge when legal, within budget and profitable."""
        producer, consumer = self.groups[candidate.producer], self.groups[candidate.consumer]
        key = (frozenset(producer), frozenset(consumer))
        if key in self.seen:
            return False   # same node sets, same answer: legality, budget and cost depend on nothing else
        self.seen.add(key)
        fusion = self.fusion_label(producer, consumer)
        if candidate.views:
            blocked = self.views_blocked(candidate) or can_fuse(
                self.graph, producer, list(candidate.views) + consumer, self.users, self.config, self.index)
            if blocked:
                if self.copy_reads_through(candidate):
                    self.absorb_views(candidate)   # no fusion, but no copy kernel: the consumer maps the views
                self.record(producer, consumer, fusion, Verdict.ILLEGAL, blocked)
                return False
            self.absorb_views(candidate)     # the consumer reads through them whether or not the pair merges
            consumer = self.groups[candidate.consumer]
        return self.decide(candidate.producer, candidate.consumer, fusion,
                           can_fuse(self.graph, producer, consumer, self.users, self.config, self.index))

    def fusion_label(self, producer: list[str], consumer: list[str]) -> str:
        """'vertical', 'residual', 'prologue' or 'conv-conv': what kind of fusion the pair would be."""
        merged = producer + consumer
        anchors = [n for n in merged if kind_of(self.graph[n]) is FusionKind.ANCHOR]
        if len(anchors) > 1:
            return "conv-conv" if all(self.graph[a].op == "conv2d" for a in anchors) else "vertical"
        if any(kind_of(self.graph[n]) is FusionKind.REDUCTION for n in consumer) and \
                all(kind_of(self.graph[n]).elementwise for n in producer):
            return "prologue"
        if anchors and skip_operands(self.graph, merged, anchors[0], self.users, self.index):
            return "residual"
        return "vertical"

    # ---- taking or refusing one fusion --------------------------------------------------------------
    def measured_against(self, merged: Sequence[str]) -> tuple[Verdict, Reason] | None:
        """The verdict and reason of a merge that would bring together again a node set an earlier build measured
        (`plan_fusion`'s `measured_over_budget`, `measured_slower`), or None."""
        for nodes, why in self.measured_over_budget.items():
            if nodes <= set(merged):
                return Verdict.OVER_BUDGET, Reason(Code.SPLIT_BACK, f"split back: the compiled kernel of "
                                                   f"{', '.join(sorted(nodes))} was {why}")
        for nodes, why in self.measured_slower.items():
            if nodes <= set(merged):
                return Verdict.UNPROFITABLE, Reason(Code.SPLIT_BACK, f"split back: the kernel fusing "
                                                    f"{', '.join(sorted(nodes))} measured {why}")
        return None

    def decide(self, first: int, second: int, fusion: str, illegal: Reason | None,
               kind: GroupKind | None = None) -> bool:
        """Check budget and profit of merging groups `first` and `second`; merge and record."""
        a, b = self.groups[first], self.groups[second]
        if illegal:
            self.record(a, b, fusion, Verdict.ILLEGAL, illegal)
            return False
        apart = self.estimate(a).time + self.estimate(b).time
        fused = self.estimate(a + b)
        measured = self.measured_against(a + b)
        if measured:
            self.record(a, b, fusion, *measured, fused.time)
            return False
        resources = fused.resources
        if resources is not None and not resources.fits:
            over = f"fused kernel over budget, kept apart: {resources.reason}"
            self.record(a, b, fusion, Verdict.OVER_BUDGET, Reason(Code.OVER_BUDGET, over), fused.time)
            return False
        instead = self.norm_joins_linear_instead(a, b) if fusion == "prologue" and self.config.use_cost_model else None
        if instead is not None:
            self.record(a, b, fusion, Verdict.UNPROFITABLE, instead, fused.time)
            return False
        note = f" ({fused.note})" if fused.note else ""   # the recompute a conv-conv kernel pays
        step = self.whole_block_pays(a, b) if fusion == "conv-conv" else None
        if self.config.use_cost_model and fused.time >= apart and step is None:
            tile = f" ({resources.reason})" if resources is not None and resources.reason else ""
            slower = f"predicted {fused.time * 1e6:.2f} us fused >= {apart * 1e6:.2f} us apart{tile}{note}"
            self.record(a, b, fusion, Verdict.UNPROFITABLE, Reason(Code.UNPROFITABLE, slower), fused.time)
            return False
        saved = self.bytes_saved(a, b)
        reason = Reason(Code.FUSED,
                        f"saves {saved:,} B and 1 launch: {apart * 1e6:.2f} -> {fused.time * 1e6:.2f} us{note}")
        if self.config.use_cost_model and fused.time >= apart:
            reason = Reason(Code.WHOLE_BLOCK, f"saves {saved:,} B and 1 launch, a step to the whole block ({step}); "
                            f"alone {apart * 1e6:.2f} -> {fused.time * 1e6:.2f} us{note}")
        self.record(a, b, fusion, Verdict.FUSED, reason, fused.time)
        self.merge(first, second, f"{fusion}: {', '.join(b)} into {', '.join(a)} ({reason.text})", kind)
        return True

    def norm_joins_linear_instead(self, producer: list[str], consumer: list[str]) -> Reason | None:
        """Why elementwise ops should not join a lone layer norm as its prologue: the norm may instead be the prologue
        of the linear that alone reads it (`legality.row_norm_prologue`, through row views), which its input must
        then come from outside of; the reason when the cost model predicts that split faster, else None. The
        planner merges pairs greedily, so it compares the two plans of these three groups here."""
        if len(consumer) != 1 or self.graph[consumer[0]].op != "layer_norm":
            return None
        norm, reader = consumer[0], consumer[0]
        views: list[str] = []
        while len(self.users[reader]) == 1 and is_view(self.users[reader][0]):
            reader = self.users[reader][0].name
            views.append(reader)
        readers = self.users[reader]
        if len(readers) != 1 or readers[0].op != "linear" or reader in self.graph.outputs:
            return None
        linear = self.groups[self.group_of[readers[0].name]]
        between = [v for v in views if v not in linear]
        if can_fuse(self.graph, [norm], between + linear, self.users, self.config, self.index) is not None:
            return None
        absorbed = self.estimate([norm] + between + linear)
        if absorbed.resources is not None and not absorbed.resources.fits:
            return None
        stored = self.estimate(producer + consumer).time + self.estimate(linear).time
        split = self.estimate(producer).time + absorbed.time
        if split >= stored:
            return None
        return Reason(Code.UNPROFITABLE, f"{norm} joins {readers[0].name} as its prologue instead: predicted "
                      f"{split * 1e6:.2f} us against {stored * 1e6:.2f} us with {', '.join(producer)} in its kernel")

    def whole_block_pays(self, depthwise: list[str], pointwise: list[str]) -> str | None:
        """Why a depthwise + pointwise pair that does not pay alone is still worth fusing: with the block's 1x1
        expansion conv it makes one kernel predicted faster than the three apart (the expansion then joins in a
        later round, on its own merits), or None. The planner merges pairs, so it looks this one step ahead."""
        if not (self.config.conv_conv and self.config.conv_conv_expand):
            return None
        anchor = next((n for n in depthwise if kind_of(self.graph[n]) is FusionKind.ANCHOR), None)
        expansion = self.group_of.get(self.graph[anchor].inputs[0]) if anchor is not None else None
        if expansion is None or self.is_view_group(expansion):
            return None
        first = self.groups[expansion]
        if can_fuse(self.graph, first, depthwise + pointwise, self.users, self.config, self.index) is not None:
            return None
        whole = self.estimate(first + depthwise + pointwise)
        if whole.resources is not None and not whole.resources.fits:
            return None
        apart = self.estimate(first).time + self.estimate(depthwise).time + self.estimate(pointwise).time
        if whole.time >= apart:
            return None
        return f"predicted {apart * 1e6:.2f} -> {whole.time * 1e6:.2f} us with {', '.join(first)}"

    def record(self, first: list[str], second: list[str], fusion: str, verdict: Verdict, reason: Reason,
               time_fused: float = 0.0) -> None:
        """Append a decision; `time_fused` stays 0 when no fused kernel was estimated (illegal pairs)."""
        self.decisions.append(FusionDecision(
            producer=in_order(first, self.index), consumer=in_order(second, self.index), fusion=fusion,
            verdict=verdict, reason=reason.text, code=reason.code, bytes_saved=self.bytes_saved(first, second),
            time_unfused=self.estimate(first).time + self.estimate(second).time, time_fused=time_fused))

    def merge(self, keep: int, gone: int, note: str, kind: GroupKind | None = None) -> None:
        """Fold group `gone` into group `keep`."""
        self.groups[keep] = in_order(self.groups[keep] + self.groups.pop(gone), self.index)
        for name in self.groups[keep]:
            self.group_of[name] = keep
        self.notes[keep] = self.notes.get(keep, []) + self.notes.pop(gone, []) + [note]
        self.kinds.pop(gone, None)
        if kind is not None:
            self.kinds[keep] = kind

    # ---- squeeze-and-excitation ---------------------------------------------------------------------
    def squeeze(self) -> None:
        """A global average pool alone, the anchor group reading its result and the anchor group reading that
        one's become one SQUEEZE kernel (`opfuse.fusion.squeeze`) where legal, within budget and profitable."""
        for pool in list(self.groups):
            nodes = self.groups.get(pool, [])
            if len(nodes) != 1 or not global_average(self.graph, self.graph[nodes[0]]):
                continue
            first = self.reader_group(pool)
            if first is None or anchor_of(self.graph, self.groups[first]) is None:
                continue
            second = self.reader_group(first)
            if second is None or anchor_of(self.graph, self.groups[second]) is None:
                continue
            self.try_squeeze(pool, first, second)

    def reader_group(self, group: int) -> int | None:
        """The one group that reads the values of `group`, or None when no group or several do."""
        nodes = self.groups[group]
        readers = {self.group_of[u.name] for n in nodes for u in self.users[n] if u.name not in nodes}
        return readers.pop() if len(readers) == 1 else None

    def try_squeeze(self, pool: int, first: int, second: int) -> bool:
        """Decide one pool -> GEMM -> GEMM chain: record the decision, merge the three groups when it is a squeeze
        chain (`squeeze_chain`), fits and pays (the cost model's one kernel against its three apart)."""
        parts = [self.groups[g] for g in (pool, first, second)]
        producer, consumer = parts[0], in_order(parts[1] + parts[2], self.index)
        key = (frozenset(producer), frozenset(consumer))
        if key in self.seen:
            return False
        self.seen.add(key)
        merged = in_order(producer + consumer, self.index)
        apart = sum(self.estimate(p).time for p in parts)
        saved = sum(self.traffic(p).bytes_moved for p in parts) - self.traffic(merged).bytes_moved

        def record(verdict: Verdict, reason: Reason, time_fused: float = 0.0) -> None:
            self.decisions.append(FusionDecision(producer=list(producer), consumer=consumer, fusion="squeeze",
                                                 verdict=verdict, reason=reason.text, code=reason.code,
                                                 bytes_saved=saved, time_unfused=apart, time_fused=time_fused))

        chain = squeeze_chain(self.graph, merged, self.users)
        if not self.config.squeeze:
            chain = Reason(Code.DISABLED, "squeeze fusion disabled (config.squeeze)")
        elif chain is None:
            chain = Reason(Code.NOT_SQUEEZE, f"{', '.join(merged)} hold more than a global average and two GEMMs "
                           "with elementwise epilogues")
        if isinstance(chain, Reason):
            record(Verdict.ILLEGAL, chain)
            return False
        fused = self.estimate(merged)
        measured = self.measured_against(merged)
        if measured:
            record(*measured, fused.time)
            return False
        if fused.resources is not None and not fused.resources.fits:
            record(Verdict.OVER_BUDGET, Reason(Code.OVER_BUDGET, f"squeeze kernel over budget, kept apart: "
                                               f"{fused.resources.reason}"), fused.time)
            return False
        if self.config.use_cost_model and fused.time >= apart:
            record(Verdict.UNPROFITABLE, Reason(Code.UNPROFITABLE, f"predicted {fused.time * 1e6:.2f} us fused >= "
                                                f"{apart * 1e6:.2f} us apart ({fused.note})"), fused.time)
            return False
        reason = Reason(Code.FUSED, f"saves {saved:,} B and 2 launches: {apart * 1e6:.2f} -> {fused.time * 1e6:.2f} "
                        f"us ({fused.note})")
        record(Verdict.FUSED, reason, fused.time)
        notes = [n for g in (pool, first, second) for n in self.notes.get(g, [])]
        self.merge(pool, first, "")
        self.merge(pool, second, "", GroupKind.SQUEEZE)
        self.notes[pool] = notes + [f"squeeze: {', '.join(merged)} in one kernel ({reason.text})"]
        return True

    # ---- horizontal fusion --------------------------------------------------------------------------
    def horizontal_anchors(self) -> None:
        """Sibling anchors on one input with identical epilogues become one HORIZONTAL group."""
        families: dict[tuple, list[int]] = {}
        for group in self.ordered_ids():
            key = self.sibling_key(group)
            if key is not None:
                families.setdefault(key, []).append(group)
        for members in families.values():
            if len(members) > 1:
                self.merge_siblings(members)

    def sibling_key(self, group: int) -> tuple | None:
        """What siblings must share: op, input value and shape-compatibility attributes; None if not a sibling."""
        nodes = self.groups[group]
        anchor = anchor_of(self.graph, nodes)
        if anchor is None or group in self.kinds or conv_chain(self.graph, nodes):
            return None   # no anchor, already horizontal, or a conv-conv chain (its first conv is no sibling)
        node = self.graph[anchor]
        if nodes[0] != anchor or any(is_view(self.graph[n]) for n in nodes):
            return None   # one kernel over concatenated siblings reads their input and writes their tiles as they are
        if not all(self.graph.is_constant(w) for w in node.inputs[1:]):
            return None   # weights are concatenated at codegen time: they must be known
        if node.op == "linear":
            return ("linear", node.inputs[0], self.graph[node.inputs[1]].type.shape[1])
        if node.op == "conv2d" and node.attrs["groups"] == 1:
            kernel = self.graph[node.inputs[1]].type.shape[2:]
            return ("conv2d", node.inputs[0], kernel, tuple(node.attrs["stride"]), tuple(node.attrs["padding"]),
                    tuple(node.attrs["dilation"]))
        return None

    def merge_siblings(self, members: list[int]) -> None:
        """Merge siblings with the most common epilogue; refuse the others with the difference."""
        signatures = {group: self.epilogue_signature(group) for group in members}
        classes: dict[tuple, list[int]] = {}
        for group in members:
            signature, problem = signatures[group]
            if problem:
                other = next(m for m in members if m != group)
                self.record(self.groups[other], self.groups[group], "horizontal", Verdict.ILLEGAL, problem)
            else:
                classes.setdefault(signature, []).append(group)
        ranked = sorted(classes.values(), key=len, reverse=True)
        for other in ranked[1:]:   # one refusal per differing epilogue, against the largest class
            self.record(self.groups[ranked[0][0]], self.groups[other[0]], "horizontal", Verdict.ILLEGAL,
                        Reason(Code.DIFFERENT_EPILOGUES, f"different epilogues: {self.describe_epilogue(ranked[0][0])} "
                               f"vs {self.describe_epilogue(other[0])}"))
        for siblings in ranked:
            base = siblings[0]
            for group in siblings[1:]:
                dependency = self.dependency(base, group)
                illegal = Reason(Code.DEPENDENT, f"siblings are not independent: {dependency}") if dependency else None
                self.decide(base, group, "horizontal", illegal, GroupKind.HORIZONTAL)

    def epilogue_signature(self, group: int) -> tuple[tuple, Reason | None]:
        """The epilogue's ops, attributes and operand pattern; a problem when it reads a non-constant."""
        nodes = self.groups[group]
        position = {name: i for i, name in enumerate(nodes)}
        signature = []
        for name in nodes[1:]:   # nodes[0] is the anchor (`sibling_key`): the epilogue is all downstream of it
            node = self.graph[name]
            operands = []
            for value in node.inputs:
                if value in position:
                    operands.append(position[value])
                elif self.graph.is_constant(value):
                    operands.append("scalar" if self.graph[value].type.numel == 1 else "constant")
                else:
                    return (), Reason(Code.SIBLING_OPERAND, f"epilogue of {nodes[0]} reads {value}, not a constant: "
                                      "concatenated siblings take constant per-channel operands only")
            attrs = tuple(sorted((k, repr(v)) for k, v in node.attrs.items() if not callable(v)))
            signature.append((node.op, attrs, node.type.dtype, tuple(operands)))
        return tuple(signature), None

    def describe_epilogue(self, group: int) -> str:
        """'relu', 'batch_norm, relu' or 'no epilogue' (no brackets: reports render rich markup)."""
        return ", ".join(self.graph[n].op for n in self.groups[group][1:]) or "no epilogue"

    def horizontal_pointwise(self) -> None:
        """Small independent elementwise groups, each mostly launch overhead, share one launch."""
        cluster: int | None = None
        for group in self.ordered_ids():
            if not self.is_small_pointwise(group):
                continue
            if cluster is None:
                cluster = group
                continue
            dependency = self.dependency(cluster, group)
            if dependency:
                self.record(self.groups[cluster], self.groups[group], "horizontal", Verdict.ILLEGAL,
                            Reason(Code.DEPENDENT, f"not independent: {dependency}"))
                cluster = group
                continue
            if not self.decide(cluster, group, "horizontal", None, GroupKind.HORIZONTAL_POINTWISE):
                cluster = group
            elif not self.is_small_pointwise(cluster):
                cluster = None   # the shared launch is no longer launch-bound: start a new one

    def dependency(self, first: int, second: int) -> str | None:
        """How one group depends on the other (a direct read or a path through other nodes), or None."""
        a, b = set(self.groups[first]), set(self.groups[second])
        for reader, written in ((b, a), (a, b)):
            for name in in_order(reader, self.index):
                read = next((v for v in self.graph[name].inputs if v in written), None)
                if read is not None:
                    return f"{name} reads {read}"
        via = path_outside(self.graph, a, b, a | b, self.users, self.index) or \
            path_outside(self.graph, b, a, a | b, self.users, self.index)
        return f"a path runs through {via}" if via else None

    def is_small_pointwise(self, group: int) -> bool:
        """All elementwise (or slices it stores: `store_slices`), and its kernel body takes less time than its
        launch."""
        nodes = self.groups[group]
        if group in self.kinds and self.kinds[group] is not GroupKind.HORIZONTAL_POINTWISE:
            return False
        if not all(kind_of(self.graph[n]).elementwise or self.graph[n].op == "slice" for n in nodes):
            return False
        return self.estimate(nodes).time - self.hw.launch_time < self.hw.launch_time

    # ---- the result ---------------------------------------------------------------------------------
    def copies(self, nodes: list[str]) -> bool:
        """A view group PyTorch must run as a copy (a reshape of a permuted tensor)."""
        return any(view_copies(self.graph, self.graph[n]) for n in nodes)

    def is_view_group(self, group: int) -> bool:
        return all(is_view(self.graph[n]) for n in self.groups[group])

    def ordered_ids(self) -> list[int]:
        """Group ids in a topological order of the group graph (ties: the earliest node first)."""
        needs: dict[int, set[int]] = {g: set() for g in self.groups}
        feeds: dict[int, set[int]] = {g: set() for g in self.groups}
        for group, nodes in self.groups.items():
            for name in nodes:
                for value in self.graph[name].inputs:
                    other = self.group_of.get(value)
                    if other is not None and other != group:
                        needs[group].add(other)
                        feeds[other].add(group)
        ready = [(self.index[nodes[0]], g) for g, nodes in self.groups.items() if not needs[g]]
        heapq.heapify(ready)
        order = []
        while ready:
            _, group = heapq.heappop(ready)
            order.append(group)
            for user in feeds[group]:
                needs[user].discard(group)
                if not needs[user]:
                    heapq.heappush(ready, (self.index[self.groups[user][0]], user))
        if len(order) != len(self.groups):
            raise AssertionError("fusion planner made a cycle between groups")   # can_fuse must prevent this
        return order

    def classify(self, group: int) -> GroupKind:
        """The group's kind, read off its nodes' fusion kinds."""
        if group in self.kinds:
            return self.kinds[group]
        nodes = self.groups[group]
        kinds = [kind_of(self.graph[n]) for n in nodes]
        if self.is_view_group(group):
            return GroupKind.VIEW
        if FusionKind.OPAQUE in kinds:
            return GroupKind.OPAQUE
        copies = [n for n in nodes if kind_of(self.graph[n]) is FusionKind.INJECTIVE and not is_view(self.graph[n])]
        if any(self.graph[n].op not in MAPPED_COPIES for n in copies) or \
                (len(nodes) == 1 and copies and self.graph[nodes[0]].type.dtype in WIDE_INTEGERS):
            return GroupKind.INJECTIVE      # a gather, pad or other copy runs through PyTorch, and a lone copy of
                                            # wide integers too; a cat or roll, even alone, is an index map of the
                                            # elementwise template
        computing = [n for n in nodes if not is_view(self.graph[n])]
        stored = [n for n in nodes if n in self.graph.outputs or any(u.name not in nodes for u in self.users[n])]
        if len(nodes) == 1 or (len(computing) == 1 and stored == computing):
            return GroupKind.SINGLE         # one op, alone or reading through views (a linear after a flatten)
        if conv_chain(self.graph, nodes):
            return GroupKind.CONV_CONV
        anchor = anchor_of(self.graph, nodes)
        if anchor is not None:
            residual = skip_operands(self.graph, nodes, anchor, self.users, self.index)
            return GroupKind.RESIDUAL if residual else GroupKind.ANCHOR_EPILOGUE
        if FusionKind.REDUCTION in kinds:
            return GroupKind.REDUCTION
        return GroupKind.POINTWISE

    def explain(self, group: int, kind: GroupKind, refusals: dict[str, Reason]) -> Reason:
        """Why the group is what it is: a merged group's code is fused, a lone node's the first refusal it met."""
        nodes = self.groups[group]
        first = self.graph[nodes[0]]
        if kind is GroupKind.VIEW and self.copies(nodes):
            return Reason(Code.VIEW_COPY, f"{first.op} of a permuted tensor is no view: PyTorch copies it (one kernel)")
        if kind is GroupKind.VIEW:
            return Reason(Code.VIEW, f"view ({first.op}): no kernel, no traffic")
        if kind is GroupKind.OPAQUE:
            return Reason(Code.OPAQUE, f"opaque op {first.name} runs through PyTorch")
        if kind is GroupKind.INJECTIVE:
            return Reason(Code.COPYING_OP,
                          f"{first.name} ({first.op}) stays its own kernel: copying injective ops take no fusion here")
        if group in self.notes:
            return Reason(Code.FUSED, "; ".join(self.notes[group]))
        if nodes[0] in refusals:
            return Reason(refusals[nodes[0]].code, f"alone: {refusals[nodes[0]].text}")
        return Reason(Code.NO_CANDIDATE, "alone: no fusion candidate")

    def finish(self) -> FusionPlan:
        """The plan: groups in topological order with their numbers, and every decision."""
        refusals: dict[str, Reason] = {}   # why a lone node stayed alone: what stopped its output first
        refused = [d for d in self.decisions if d.verdict is not Verdict.FUSED]
        for side in ("producer", "consumer"):
            for decision in refused:
                nodes = getattr(decision, side)
                if len(nodes) == 1:
                    refusals.setdefault(nodes[0], Reason(decision.code, decision.reason))
        groups = []
        for new_id, group in enumerate(self.ordered_ids()):
            nodes = self.groups[group]
            kind = self.classify(group)
            estimate = self.estimate(nodes)
            traffic = estimate.traffic
            why = self.explain(group, kind, refusals)
            reason = why.text
            table, default_slices, time, unsplit = self.split_k(nodes, kind, estimate)
            row_slices, time = self.row_slices(nodes, kind, estimate.anchor, time)
            if row_slices > 1:
                reason += (f"; its rows split into {row_slices} slices, summed with the epilogue by a second "
                           "kernel (fewer row blocks than the GPU has SMs)")
            if default_slices > 1:
                reason += (f"; split-K: {default_slices} slices of the reduction, summed with the epilogue by a "
                           "second kernel (the tile grid alone would leave most SMs idle)")
            elif table and kind is not GroupKind.CONV_CONV:
                reason += (f"; split-K offered (the resource model's tile would leave most SMs idle), but the "
                           f"kernel's default tile runs unsplit ({unsplit}): one kernel unless the autotuner "
                           "measures a split faster")
            groups.append(FusionGroup(
                id=new_id, kind=kind, nodes=list(nodes), anchor=estimate.anchor, inputs=list(traffic.inputs),
                outputs=list(traffic.outputs), flops=traffic.flops, bytes_read=traffic.bytes_read,
                bytes_written=traffic.bytes_written, predicted_time=time,
                launches=(0 if kind is GroupKind.VIEW and not self.copies(nodes)
                          else 1 + (default_slices > 1) + (row_slices > 1)),
                split_k=table, resources=estimate.resources, reason=reason, code=why.code))
        return FusionPlan(self.graph, groups, self.decisions, self.hw.name, self.config, self.hw)

    def row_slices(self, nodes: list[str], kind: GroupKind, anchor: str | None, time: float) -> tuple[int, float]:
        """(the row slices of the default tile of the group's row reduction, `time` with the second launch and
        the float32 partial sums priced where it splits); 1 where it does not, or the group is no row reduction
        (`opfuse.fusion.tiles.row_tiles`, the kernel's own rule): a squeeze-and-excitation group's pool or an
        anchor's group runs a template of its own."""
        if kind is GroupKind.SQUEEZE or anchor is not None:
            return 1, time
        reductions = [self.graph[n] for n in nodes if kind_of(self.graph[n]) is FusionKind.REDUCTION]
        view = row_view(self.graph, reductions[0]) if len(reductions) == 1 else None
        if view is None:
            return 1, time
        slices = row_tiles(view, self.hw.sm_count)[0][2]
        if slices == 1:
            return 1, time
        partials = 2 * slices * view.rows * 4
        return slices, time + (self.hw.launch_overhead + partials / self.hw.memory_bandwidth) * self.hw.time_factor

    def split_k(self, nodes: list[str], kind: GroupKind, estimate: KernelEstimate
                ) -> tuple[dict[str, int], int, float, str]:
        """(the K slices of each tile of the group's kernel, the K slices of its default tile, predicted seconds,
        why that tile runs unsplit where it does); no slices ({}) where the planner does not split. A conv-conv
        kernel gets the mid-channel slices of each of its tiles (`conv_conv_slice_table`), summed inside the kernel.

        The decision, made here once: an anchor whose tiles (the resource model's) fill under a quarter of the SMs
        splits a long reduction (`split_k_slices`). Its kernel then gets a split form, and each config runs the
        slices the plan gives its tile (`split_k_table`: every tile's own grid and K blocks), which the autotuner
        measures. Untuned, the kernel runs its default tile (`opfuse.fusion.tiles`), which may need no slices: the
        plan counts the second launch, and prices it (a launch and the fp32 partial tiles written and read once),
        only where that tile splits."""
        tile = estimate.resources.tile if estimate.resources is not None else {}
        if kind is GroupKind.CONV_CONV:   # mid-channel slices, summed by the tile's last program: one launch
            chain = conv_chain(self.graph, nodes)
            table = conv_conv_slice_table(self.graph, chain, self.hw.sm_count)
            if {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"} <= tile.keys():   # the planned tile, whatever it is
                table[conv_conv_key(tile)] = tile.get("SPLIT_K", 1)
            return table, 1, estimate.time, ""
        if (not self.config.split_k or estimate.anchor is None or kind is GroupKind.SQUEEZE
                or not {"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= tile.keys()):
            return {}, 1, estimate.time, ""
        if row_norm_prologue(self.graph, estimate.anchor, nodes, self.users):
            return {}, 1, estimate.time, ""   # a slice sees part of K, and the layer norm's statistics need all of it
        view = gemm_view(self.graph, estimate.anchor)
        if view is None:
            return {}, 1, estimate.time, ""
        rows, columns, reduction, batch = view
        if kind is GroupKind.HORIZONTAL:   # sibling anchors (ungrouped) run as one GEMM over their columns together
            columns = sum(self.graph[n].type.shape[-1 if self.graph[n].op == "linear" else 1]
                          for n in nodes if kind_of(self.graph[n]) is FusionKind.ANCHOR)
        if split_k_slices(*anchor_grid(tile, rows, columns, reduction, batch), self.hw.sm_count) == 1:
            return {}, 1, estimate.time, ""
        taps, gather = anchor_loop(self.graph, estimate.anchor)
        table = split_k_table(rows, columns, reduction, batch, taps, self.hw.sm_count)
        default = anchor_tiles(rows, columns, reduction, batch, DTYPE_BYTES[self.config.dtype], gather,
                               hw=self.hw)[0]
        default_slices = table[tile_key(default)]
        if default_slices == 1:
            programs, steps = anchor_grid(default, rows, columns, reduction, batch, taps)
            if 4 * programs > self.hw.sm_count:
                unsplit = f"its {programs} tiles keep over a quarter of the SMs busy"
            elif steps < MIN_SPLIT_STEPS:
                unsplit = f"its reduction is {steps} K blocks, under the {MIN_SPLIT_STEPS} a split needs"
            else:
                unsplit = "too few slices would fit to pay for a second kernel"
            return table, 1, estimate.time, unsplit
        partials = 2 * default_slices * rows * columns * batch * 4
        return (table, default_slices,
                estimate.time + (self.hw.launch_overhead + partials / self.hw.memory_bandwidth) * self.hw.time_factor,
                "")

