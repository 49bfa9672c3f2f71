"""The finished plan: groups in topological order, each with its kind, the reason it is what it is, its row
slices and split-K. Methods of `opfuse.fusion.planner._Planner` (`GroupListing`)."""

from __future__ import annotations

import heapq
import math

from opfuse.fusion.concat_in_place import write_concats_in_place
from opfuse.fusion.cost import KernelEstimate
from opfuse.fusion.legality import alone, skip_operands
from opfuse.fusion.legality_common import in_order
from opfuse.fusion.legality_anchors import gated_pair, row_norm_prologue
from opfuse.fusion.legality_views import MAPPED_COPIES, is_view
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind, Verdict
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import anchor_of, anchor_problem, conv_chain, conv_conv_key, conv_conv_slice_table
from opfuse.fusion.tiles import (MIN_SPLIT_STEPS, anchor_grid, anchor_loop, anchor_tiles, attention_key,
                                 key_split_table, row_tiles, row_view, slice_statistics, split_k_table, tile_key,
                                 tiles_attention)
from opfuse.ir.graph import DTYPE_BYTES
from opfuse.ir.ops import FusionKind, get_op, kind_of


class GroupListing:
    """The planner's listing of its groups as a FusionPlan."""

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
        """The group's kind: fixed by a horizontal or squeeze merge, else read off its nodes (`kind_of_nodes`)."""
        return self.kinds[group] if group in self.kinds else self.kind_of_nodes(self.groups[group])

    def kind_of_nodes(self, nodes: list[str]) -> GroupKind:
        """The kind of a group of `nodes` (in order), read off their fusion kinds."""
        kinds = [kind_of(self.graph[n]) for n in nodes]
        if all(is_view(self.graph[n]) for n in nodes):   # views: none, or opfuse's copy where PyTorch copies
            return GroupKind.POINTWISE if self.copies(nodes) else GroupKind.VIEW
        if any(k is FusionKind.OPAQUE and not self.graph.writes_state_in_place(n, self.users)
               for n, k in zip(nodes, kinds)):
            return GroupKind.OPAQUE     # (a state written in place is stored by the elementwise template)
        copies = [n for n in nodes if kind_of(self.graph[n]) is FusionKind.INJECTIVE and not is_view(self.graph[n])]
        if any(self.graph[n].op not in MAPPED_COPIES for n in copies):
            return GroupKind.INJECTIVE      # a copy no kernel maps runs through PyTorch; a cat, pad or gather, even
                                            # alone, is an index map of the elementwise template
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

    def template_refuses(self, nodes: list[str], kind: GroupKind | None = None) -> Reason | None:
        """Why the template of a group of `nodes` (of `kind`, else as `kind_of_nodes` reads it) would refuse it
        (`opfuse.codegen.lower.template_refusal`: its `supports`, nothing generated), or None."""
        from opfuse.codegen.lower import template_refusal     # (codegen builds on the plan's types)

        ordered = in_order(nodes, self.index)
        estimate, traffic = self.estimate(ordered), self.traffic(ordered)
        group = FusionGroup(-1, kind or self.kind_of_nodes(ordered), ordered, anchor=estimate.anchor,
                            inputs=list(traffic.inputs), outputs=list(traffic.outputs))
        return template_refusal(self.graph, group, self.users)

    def explain(self, group: int, kind: GroupKind, refusals: dict[str, Reason]) -> Reason:
        """Why the group is what it is: a merged group's code is fused, a lone node's the first refusal it met."""
        nodes = self.groups[group]
        first = self.graph[nodes[0]]
        if self.is_view_group(group) and self.copies(nodes):
            return Reason(Code.VIEW_COPY, f"{first.op} of a permuted tensor is no view and nothing reads it through "
                          "its index map: one copy kernel does (as PyTorch would)")
        if kind is GroupKind.VIEW:
            return Reason(Code.VIEW, f"view ({first.op}): no kernel, no traffic")
        if kind is GroupKind.OPAQUE and group not in self.notes:
            if get_op(first.op).kernel is not None:
                return alone(first)
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
                reason += (f"; its rows split into {row_slices} slices, merged with the epilogue by a second "
                           "kernel (fewer row blocks than the GPU has SMs)")
            attention = estimate.anchor is not None and self.graph[estimate.anchor].op == "sdpa"
            if default_slices > 1 and attention:
                reason += (f"; its keys split into {default_slices} slices, combined with the epilogue by each "
                           "tile's last slice (flash-decoding: the query tiles alone would leave most SMs idle)")
            elif default_slices > 1:
                reason += (f"; split-K: {default_slices} slices of the reduction, summed with the epilogue by each "
                           "tile's last slice (the tile grid alone would leave most SMs idle)")
            elif table and attention:
                reason += ("; its keys split into slices offered (the query tiles would leave most SMs idle), but "
                           f"{unsplit}: one kernel unless the autotuner measures a split faster")
            elif table and kind is not GroupKind.CONV_CONV:
                reason += (f"; split-K offered (a tile the autotuner may run would leave most SMs idle), but the "
                           f"kernel's default tile runs unsplit ({unsplit}): one kernel unless the autotuner "
                           "measures a split faster")
            groups.append(FusionGroup(
                id=new_id, kind=kind, nodes=list(nodes), anchor=estimate.anchor, inputs=list(traffic.inputs),
                outputs=list(traffic.outputs), flops=traffic.flops, bytes_read=traffic.bytes_read,
                bytes_written=traffic.bytes_written, predicted_time=time,
                launches=(0 if kind is GroupKind.VIEW else 1 + (row_slices > 1)),
                split_k=table, resources=estimate.resources, reason=reason, code=why.code))
        write_concats_in_place(self.graph, groups, self.users, self.config)
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
        partials = 2 * slice_statistics(view.mode) * slices * view.rows * 4
        return slices, self.with_partials(time, partials, launch=True)

    def split_k(self, nodes: list[str], kind: GroupKind, estimate: KernelEstimate
                ) -> tuple[dict[str, int], int, float, str]:
        """(the K slices of each tile of the group's kernel, the K slices of its default tile, predicted seconds,
        why that tile runs unsplit where it does); no slices ({}) where the planner does not split. A conv-conv
        kernel gets the mid-channel slices of each of its tiles (`conv_conv_slice_table`), summed inside the kernel.

        The decision, made here once: an anchor one of whose tiles (`anchor_tiles`, those the autotuner may run)
        fills under a quarter of the SMs splits a long reduction (`split_k_slices`). Its kernel then gets a split
        form, and each config runs the slices the plan gives its tile (`split_k_table`: every tile's own grid and K blocks), which the autotuner
        measures. Untuned, the kernel runs its default tile (`opfuse.fusion.tiles`), which may need no slices: the
        plan prices the fp32 partial tiles (written and read once) only where that tile splits; each tile's last
        slice sums them and runs the epilogue, in the same launch (`opfuse.codegen.split_k.last_slice`)."""
        tile = estimate.resources.tile if estimate.resources is not None else {}
        if kind is GroupKind.CONV_CONV:   # mid-channel slices, summed by the tile's last program: one launch
            chain = conv_chain(self.graph, nodes)
            table = conv_conv_slice_table(self.graph, chain, self.hw.sm_count)
            if {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps"} <= tile.keys():   # the planned tile, whatever it is
                table[conv_conv_key(tile)] = tile.get("SPLIT_K", 1)
            return table, 1, estimate.time, ""
        if self.config.split_k and estimate.anchor is not None and self.graph[estimate.anchor].op == "sdpa":
            return self.key_splits(nodes, estimate)
        if (not self.config.split_k or estimate.anchor is None or kind is GroupKind.SQUEEZE
                or not {"BLOCK_M", "BLOCK_N", "BLOCK_K"} <= tile.keys()):
            return {}, 1, estimate.time, ""
        if row_norm_prologue(self.graph, estimate.anchor, nodes, self.users):
            return {}, 1, estimate.time, ""   # a slice sees part of K, and the layer norm's statistics need all of it
        if gated_pair(self.graph, nodes, self.users) is not None:
            return {}, 1, estimate.time, ""   # the gating needs the whole sum of each tile
        problem = anchor_problem(self.graph, nodes, estimate.anchor)
        if problem is None:
            return {}, 1, estimate.time, ""
        rows, columns, reduction, batch = problem
        taps, gather = anchor_loop(self.graph, estimate.anchor)
        table = split_k_table(rows, columns, reduction, batch, taps, self.hw.sm_count)
        candidates = anchor_tiles(rows, columns, reduction, batch, DTYPE_BYTES[self.config.dtype], gather,
                                  hw=self.hw)
        if all(table[tile_key(t)] == 1 for t in candidates):
            return {}, 1, estimate.time, ""
        default = candidates[0]
        default_slices = table[tile_key(default)]
        if default_slices == 1:
            programs, steps = anchor_grid(default, rows, columns, reduction, batch, taps)
            if 4 * programs > self.hw.sm_count:
                unsplit = f"its {programs} tiles keep over a quarter of the SMs busy"
            elif steps < MIN_SPLIT_STEPS:
                unsplit = f"its reduction is {steps} K blocks, under the {MIN_SPLIT_STEPS} a split needs"
            else:
                unsplit = "too few slices would fit to pay for their partial tiles"
            return table, 1, estimate.time, unsplit
        partials = 2 * default_slices * rows * columns * batch * 4
        return table, default_slices, self.with_partials(estimate.time, partials), ""

    def key_splits(self, nodes: list[str], estimate: KernelEstimate) -> tuple[dict[str, int], int, float, str]:
        """`split_k` of an sdpa group: the key slices of each attention tile (`key_split_table`: where the query
        tiles leave most SMs idle over two key blocks or more, decoding over a cache), of its default tile, the
        predicted seconds with the float32 partial rows where that tile splits, and why it
        runs unsplit where it does. A bare sdpa runs torch's attention untuned (`opfuse.codegen.attention`), which the
        autotuner measures against the split kernel."""
        node = self.graph[estimate.anchor]
        q, k = (self.graph[i].type.shape for i in node.inputs[:2])
        tile = estimate.resources.tile if estimate.resources is not None else {}
        if len(q) < 3 or not tiles_attention(self.graph, node.name) or "BLOCK_N" not in tile:
            return {}, 1, estimate.time, ""
        heads = math.prod(node.type.shape[:-2])
        table = key_split_table(q[-2], k[-2], heads, self.hw.sm_count)
        if all(slices == 1 for slices in table.values()):
            return {}, 1, estimate.time, ""
        if [n for n in nodes if self.graph[n].op not in ("input", "constant")] == [node.name]:
            return table, 1, estimate.time, "a bare attention runs torch's attention untuned"
        slices = table[attention_key(tile)]
        if slices == 1:
            return table, 1, estimate.time, f"its default tile {attention_key(tile)} runs unsplit"
        partials = 2 * slices * heads * q[-2] * (node.type.shape[-1] + 2) * 4
        return table, slices, self.with_partials(estimate.time, partials), ""

    def with_partials(self, time: float, partial_bytes: int, launch: bool = False) -> float:
        """`time` with a split's float32 partials written once and read once (`partial_bytes`, both ways) priced,
        and with `launch` the second kernel that merges them (row slices: `opfuse.codegen.reduction`)."""
        extra = partial_bytes / self.hw.memory_bandwidth + (self.hw.launch_overhead if launch else 0.0)
        return time + extra * self.hw.time_factor