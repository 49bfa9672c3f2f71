"""Squeeze-and-excitation: a global average pool and the two GEMM groups after it as one SQUEEZE group
(`opfuse.fusion.squeeze`). Methods of `opfuse.fusion.planner._Planner` (`SqueezeFusion`)."""

from __future__ import annotations

from opfuse.fusion.legality_common import in_order
from opfuse.fusion.plan import Fusion, FusionDecision, GroupKind, Verdict
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.resources import anchor_of
from opfuse.fusion.squeeze import global_average, squeeze_chain


class SqueezeFusion:
    """The planner's squeeze-and-excitation fusion (its groups, graph and users are the planner's)."""

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
            self.decisions.append(FusionDecision(producer=list(producer), consumer=consumer, fusion=Fusion.SQUEEZE,
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
