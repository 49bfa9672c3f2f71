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
   become one SQUEEZE group when `opfuse.fusion.squeeze` recognises the chain, it fits and it pays. A grouped
   GEMM whose two column halves make act(gate) * up (a mixture of experts' SwiGLU) takes that product.
3. horizontal (`config.horizontal`): sibling anchors reading the same input, with compatible shapes and
   identical epilogues, become one HORIZONTAL group (weights concatenated at codegen time); the outputs read of
   one library call of several (topk's values and indices) one group, called once; then small
   independent elementwise groups, each dominated by its launch overhead, share one launch.
4. the groups are listed in topological order, each with its kind, anchor, traffic, predicted time, resources
   and the reason it is what it is; every candidate considered is a FusionDecision, taken or refused, with its
   reason in words and as a stable code (`opfuse.fusion.reasons`).

This module holds the greedy vertical rounds and the one decision sequence every merge goes through (`decide`);
the planner's other parts are methods of the same planner in modules of their own: `planner_views` (views between
groups, copies written by their producer, stored slices), `planner_squeeze`, `planner_horizontal` and
`planner_groups` (the plan's listing: kinds, reasons, row slices, split-K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from opfuse.config import FusionConfig, for_graph
from opfuse.fusion.cost import GroupTraffic, KernelEstimate, estimate_kernel, group_traffic
from opfuse.fusion.legality import can_fuse, skip_operands
from opfuse.fusion.legality_anchors import ROW_NORMS
from opfuse.fusion.legality_common import in_order, node_index
from opfuse.fusion.legality_views import is_view
from opfuse.fusion.plan import Fusion, FusionDecision, FusionPlan, GroupKind, Verdict
from opfuse.fusion.planner_groups import GroupListing
from opfuse.fusion.planner_horizontal import HorizontalFusion
from opfuse.fusion.planner_squeeze import SqueezeFusion
from opfuse.fusion.planner_views import ViewFusion
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile, get_hardware
from opfuse.ir.graph import Graph
from opfuse.ir.ops import FusionKind, kind_of
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
        planner.gated_experts()
        planner.absorb_copying_views()
        planner.store_slices()
    if config.horizontal:
        planner.horizontal_anchors()
        planner.call_outputs()
        planner.gated_siblings()
        planner.shared_norm_prologues()
        planner.horizontal_pointwise()
    return planner.finish()


@dataclass(frozen=True)
class _Candidate:
    """A producer -> consumer pair of groups; `views` lie between them when the buffer passes through views."""

    producer: int
    consumer: int
    views: tuple[str, ...]


class _Planner(ViewFusion, SqueezeFusion, HorizontalFusion, GroupListing):
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

    def fusion_label(self, producer: list[str], consumer: list[str]) -> Fusion:
        """What kind of fusion the pair would be: vertical, residual, prologue or conv-conv."""
        merged = producer + consumer
        anchors = [n for n in merged if kind_of(self.graph[n]) is FusionKind.ANCHOR]
        if len(anchors) > 1:
            return Fusion.CONV_CONV if all(self.graph[a].op == "conv2d" for a in anchors) else Fusion.VERTICAL
        if any(kind_of(self.graph[n]) is FusionKind.REDUCTION for n in consumer) and \
                all(kind_of(self.graph[n]).elementwise for n in producer):
            return Fusion.PROLOGUE
        if anchors and skip_operands(self.graph, merged, anchors[0], self.users, self.index):
            return Fusion.RESIDUAL
        return Fusion.VERTICAL

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

    def decide(self, first: int, second: int, fusion: Fusion, illegal: Reason | None,
               kind: GroupKind | None = None) -> bool:
        """Check budget and profit of merging groups `first` and `second`; merge and record."""
        a, b = self.groups[first], self.groups[second]
        illegal = illegal or self.template_refuses(a + b, kind)
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
        instead = (self.norm_joins_linear_instead(a, b) if fusion is Fusion.PROLOGUE and self.config.use_cost_model
                   else None)
        if instead is not None:
            self.record(a, b, fusion, Verdict.UNPROFITABLE, instead, fused.time)
            return False
        note = f" ({fused.note})" if fused.note else ""   # the recompute a conv-conv kernel pays
        step = self.whole_block_pays(a, b) if fusion is Fusion.CONV_CONV else None
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
        self.merge(first, second, f"{fusion.value}: {', '.join(b)} into {', '.join(a)} ({reason.text})", kind)
        return True

    def norm_joins_linear_instead(self, producer: list[str], consumer: list[str]) -> Reason | None:
        """Why elementwise ops should not join a lone layer norm as its prologue: the norm may instead be the prologue
        of the linear that alone reads it (`legality_anchors.row_norm_prologue`, through row views), which its input
        must then come from outside of; the reason when the cost model predicts that split faster, else None. The
        planner merges pairs greedily, so it compares the two plans of these three groups here."""
        if len(consumer) != 1 or self.graph[consumer[0]].op not in ROW_NORMS:
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

    def record(self, first: list[str], second: list[str], fusion: Fusion, verdict: Verdict, reason: Reason,
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
