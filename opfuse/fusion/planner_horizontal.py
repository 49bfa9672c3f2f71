"""Horizontal fusion: sibling anchors reading one input with identical epilogues become one group (with the row
norm they all read as its prologue), the gate and up halves of a gated MLP one GEMM (two sibling linears, or a
mixture of experts' grouped GEMM and its product), the outputs read of one library call one call, and small
independent elementwise groups share one launch. Methods of `opfuse.fusion.planner._Planner` (`HorizontalFusion`)."""

from __future__ import annotations

from opfuse.fusion.legality_anchors import (ROW_NORMS, gated_experts, gated_pair, is_row_norm_prologue,
                                            norm_prologue_on)
from opfuse.fusion.legality_common import in_order, path_outside
from opfuse.fusion.legality_views import is_view, maps_on_load
from opfuse.fusion.plan import Fusion, GroupKind, Verdict
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import anchor_of, conv_chain
from opfuse.ir.ops import FusionKind, get_op, kind_of
from opfuse.ir.ops_alone import call_of


class HorizontalFusion:
    """The planner's horizontal fusion (its groups, graph and users are the planner's)."""

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

    def call_outputs(self) -> None:
        """The outputs read of one library call of several (`opfuse.ir.ops_alone`: topk's values and indices, one
        op each) become one group, which calls it once."""
        calls: dict[tuple, list[int]] = {}
        for group in self.ordered_ids():
            nodes = self.groups[group]
            node = self.graph[nodes[0]]
            if len(nodes) == 1 and "output" in node.attrs and get_op(node.op).kernel == "library":
                calls.setdefault(call_of(node), []).append(group)
        for members in calls.values():
            for other in members[1:]:
                self.merge(members[0], other, "outputs of one call: one call computes them")

    def gated_siblings(self) -> None:
        """Two sibling linears whose results one multiplies by the other's activation (a SwiGLU or GeGLU MLP's
        gate and up projections, each with its own epilogue, so no HORIZONTAL family) become one HORIZONTAL group
        when the pair is a `legality_anchors.gated_pair`: one GEMM computes act(gate) * up, one launch fewer, and
        neither the activation nor the up projection is written."""
        for group in self.ordered_ids():
            if group not in self.groups or group in self.kinds:
                continue
            nodes = self.groups[group]
            product = next((n for n in nodes if self.graph[n].op == "mul"), None)
            if product is None:
                continue
            others = {self.group_of[v] for v in self.graph[product].inputs if v in self.group_of} - {group}
            if len(others) != 1:
                continue
            other = others.pop()
            if other in self.kinds or gated_pair(self.graph, self.groups[other] + nodes, self.users) is None:
                continue
            self.decide(other, group, Fusion.GATED, None, GroupKind.HORIZONTAL)

    def gated_experts(self) -> None:
        """A grouped GEMM alone and the groups of nothing but the act(gate) * up its two column halves make (a
        mixture of experts' SwiGLU, `legality_anchors.gated_experts`: the slices, the activation, the product)
        become one group: one grouped GEMM computes the product, neither half is written."""
        for group in self.ordered_ids():
            if group not in self.groups or [self.graph[n].op for n in self.groups[group]] != ["grouped_mm"]:
                continue
            gated = gated_experts(self.graph, self.groups[group][0], self.users)
            if gated is None:
                continue
            members = sorted({self.group_of[n] for n in gated.nodes} - {group},
                             key=lambda g: self.index[self.groups[g][0]])
            if any(m in self.kinds or not set(self.groups[m]) <= gated.nodes for m in members):
                continue
            for other in members[1:]:
                self.merge(members[0], other, "the gated product of a grouped GEMM's halves")
            self.decide(group, members[0], Fusion.GATED, None, GroupKind.OPAQUE)

    def shared_norm_prologues(self) -> None:
        """A layer norm or RMS norm that only sibling linears of one HORIZONTAL group read, alone in its group,
        becomes that group's prologue (`legality_anchors.is_row_norm_prologue`): the GEMM over their columns
        normalizes its shared A as it loads it (Llama's input norm and its q, k, v projections), as one linear's
        kernel does."""
        for group in self.ordered_ids():
            if group not in self.groups or self.kinds.get(group) is not GroupKind.HORIZONTAL:
                continue
            nodes = self.groups[group]
            anchors = [n for n in nodes if kind_of(self.graph[n]) is FusionKind.ANCHOR]
            norm = self.graph[anchors[0]].inputs[0]
            if self.graph[norm].op not in ROW_NORMS or self.groups.get(self.group_of.get(norm)) != [norm] \
                    or not norm_prologue_on(self.config, self.graph[norm].op):
                continue
            if not is_row_norm_prologue(self.graph, norm, anchors[0], nodes + [norm], self.users):
                continue
            self.decide(self.group_of[norm], group, Fusion.PROLOGUE, None, GroupKind.HORIZONTAL)

    def merge_siblings(self, members: list[int]) -> None:
        """Merge siblings with the most common epilogue; refuse the others with the difference."""
        signatures = {group: self.epilogue_signature(group) for group in members}
        classes: dict[tuple, list[int]] = {}
        for group in members:
            signature, problem = signatures[group]
            if problem:
                other = next(m for m in members if m != group)
                if gated_pair(self.graph, self.groups[other] + self.groups[group], self.users) is None:
                    self.record(self.groups[other], self.groups[group], Fusion.HORIZONTAL, Verdict.ILLEGAL, problem)
                # (else `gated_siblings` merges the two, and says so)
            else:
                classes.setdefault(signature, []).append(group)
        ranked = sorted(classes.values(), key=len, reverse=True)
        for other in ranked[1:]:   # one refusal per differing epilogue, against the largest class
            self.record(self.groups[ranked[0][0]], self.groups[other[0]], Fusion.HORIZONTAL, Verdict.ILLEGAL,
                        Reason(Code.DIFFERENT_EPILOGUES, f"different epilogues: {self.describe_epilogue(ranked[0][0])} "
                               f"vs {self.describe_epilogue(other[0])}"))
        for siblings in ranked:
            base = siblings[0]
            for group in siblings[1:]:
                dependency = self.dependency(base, group)
                illegal = Reason(Code.DEPENDENT, f"siblings are not independent: {dependency}") if dependency else None
                self.decide(base, group, Fusion.HORIZONTAL, illegal, GroupKind.HORIZONTAL)

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
                self.record(self.groups[cluster], self.groups[group], Fusion.HORIZONTAL, Verdict.ILLEGAL,
                            Reason(Code.DEPENDENT, f"not independent: {dependency}"))
                cluster = group
                continue
            if not self.decide(cluster, group, Fusion.HORIZONTAL, None, GroupKind.HORIZONTAL_POINTWISE):
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
        """All elementwise (or slices it stores: `store_slices`, or ops its kernel evaluates through coordinates:
        `legality.maps_on_load`, a rotary embedding's cat, or a KV cache's update written in place:
        `Graph.writes_state_in_place`), and its kernel body takes less time than its launch."""
        nodes = self.groups[group]
        if group in self.kinds and self.kinds[group] is not GroupKind.HORIZONTAL_POINTWISE:
            return False
        if not all(kind_of(self.graph[n]).elementwise or self.graph[n].op == "slice" or maps_on_load(self.graph[n])
                   or self.graph.writes_state_in_place(n, self.users) for n in nodes) \
                or all(is_view(self.graph[n]) for n in nodes):
            return False      # (views alone launch nothing)
        return self.estimate(nodes).time - self.hw.launch_time < self.hw.launch_time
