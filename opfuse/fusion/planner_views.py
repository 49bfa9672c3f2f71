"""Vertical fusion through views: which views between two groups block their fusion, views that join a
consumer as index maps of its loads, copies PyTorch would make written by their producer's kernel, and values read
only through slices stored as the slices. Methods of `opfuse.fusion.planner._Planner` (`ViewFusion`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from opfuse.fusion.legality import can_fuse
from opfuse.fusion.legality_anchors import anchor_prologue, row_norm_epilogue
from opfuse.fusion.legality_views import EPILOGUE_VIEWS, REPEATING_VIEWS, is_view, joins_as_map, operand_chain
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import anchor_of
from opfuse.ir.graph import Node
from opfuse.ir.ops import FusionKind, kind_of, view_copies

if TYPE_CHECKING:
    from opfuse.fusion.planner import _Candidate


def disjoint_equal_slices(slices: Sequence[Node]) -> bool:
    """Slices of one value along one dim, all of one size, no two overlapping."""
    if not slices or len({(s.inputs[0], s.attrs["dim"]) for s in slices}) != 1:
        return False
    spans = sorted((s.attrs["start"], s.type.shape[s.attrs["dim"]]) for s in slices)
    return len({size for _, size in spans}) == 1 and all(a + size <= b for (a, size), (b, _) in zip(spans, spans[1:]))


class ViewFusion:
    """The planner's view and slice handling (its groups, graph and users are the planner's)."""

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
        read by an add: `legality_views.REPEATING_VIEWS`)."""
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

    def copies(self, nodes: list[str]) -> bool:
        """A view group PyTorch must run as a copy (a reshape of a permuted tensor)."""
        return any(view_copies(self.graph, self.graph[n]) for n in nodes)

    def is_view_group(self, group: int) -> bool:
        return all(is_view(self.graph[n]) for n in self.groups[group])
