"""A concatenation its producers write in place: `write_concats_in_place(plan parts)`, `slots`, `written_parts`.

A cat that a convolution or a linear reads joins no kernel (`cat-with-hub`): it runs as a copy kernel of its own,
which reads every part once and writes it again (Inception's and GoogLeNet's blocks, a feature pyramid's merge).
Where a part's producer is a kernel that stores through run-time strides (an anchor's epilogue, the elementwise,
reduction and pooling templates: a group of WRITER_KINDS), that kernel stores the part straight into its slice of the
cat's buffer (`slots`), and the cat moves none of its bytes. The other parts (read by another node too, a graph
output, input or constant, a view, or made by a group of another kind: a horizontal group's siblings share one
buffer) are copied into their slices, one copy each. The cat is written in place where those copies are predicted
faster than its copy kernel (`opfuse.fusion.cost.predict_time`): its group becomes GroupKind.IN_PLACE, which gets no
kernel; the runtime allocates the buffer before the first part is stored and runs the copies at the cat's place
(`opfuse.runtime.compiled`). A kernel that cannot store into the slice after all (a library form with no epilogue
kernel, a group the templates refused) has its output copied there, which the launch count of a captured graph shows.
"""

from __future__ import annotations

from typing import Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.cost import predict_time
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.fusion.reasons import Code
from opfuse.hardware import HardwareProfile
from opfuse.fusion.legality_common import Users
from opfuse.ir.graph import Graph

# the group kinds whose kernels store each output through strides the runtime may choose (horizontal siblings share
# one buffer, and a conv-conv, squeeze or attention kernel allocates its own)
WRITER_KINDS = frozenset({GroupKind.SINGLE, GroupKind.ANCHOR_EPILOGUE, GroupKind.RESIDUAL, GroupKind.POINTWISE,
                          GroupKind.HORIZONTAL_POINTWISE, GroupKind.REDUCTION})


def slots(graph: Graph, cat: str) -> dict[str, tuple[int, int, int]]:
    """Each part of cat node `cat` (distinct parts: `is_candidate`): (dim, start, length) of its slice."""
    node = graph[cat]
    dim = node.attrs["dim"] % len(node.type.shape)
    start, result = 0, {}
    for part in node.inputs:
        length = graph[part].type.shape[dim]
        result[part] = (dim, start, length)
        start += length
    return result


def is_candidate(graph: Graph, group: FusionGroup) -> bool:
    """A group that is one cat of distinct parts (a part twice would need two slices)."""
    if len(group.nodes) != 1 or graph[group.nodes[0]].op != "cat":
        return False
    parts = graph[group.nodes[0]].inputs
    return len(set(parts)) == len(parts)


def written_parts(graph: Graph, groups: Sequence[FusionGroup], cat: str, users: Users) -> list[str]:
    """The parts of cat node `cat` whose producers store them in place (module docstring); the rest are copied."""
    producer = {output: group for group in groups for output in group.outputs}
    written = []
    for part in graph[cat].inputs:
        group = producer.get(part)
        if (group is not None and group.kind in WRITER_KINDS and part not in graph.outputs
                and [u.name for u in users[part]] == [cat] and graph[part].op not in ("input", "constant", "state")
                and not (group.anchor is not None and graph[group.anchor].op == "sdpa")):
            written.append(part)
    return written


def write_concats_in_place(graph: Graph, groups: list[FusionGroup], users: Users, hw: HardwareProfile,
                           config: FusionConfig) -> None:
    """Turn each cat group that pays into an IN_PLACE group (module docstring), its traffic and time those of the
    copies of the parts not written in place."""
    if not config.concat_in_place:
        return
    for group in groups:
        if not is_candidate(graph, group):
            continue
        cat = group.nodes[0]
        written = written_parts(graph, groups, cat, users)
        if not written:
            continue
        copied = [part for part in graph[cat].inputs if part not in written]
        sizes = [graph[part].type.nbytes for part in copied]
        time = sum(predict_time(0, 2 * size, hw, config.dtype, matrix=False) for size in sizes)
        if time >= group.predicted_time:
            continue
        group.kind, group.code = GroupKind.IN_PLACE, Code.IN_PLACE
        group.bytes_read = group.bytes_written = sum(sizes)
        group.launches, group.predicted_time, group.resources = len(copied), time, None
        group.reason = (f"cat {cat} written in place, no copy kernel: its producers' kernels store "
                        f"{', '.join(written)} into their slices"
                        + (f"; {', '.join(copied)} copied into {'its slice' if len(copied) == 1 else 'theirs'} "
                           "through PyTorch" if copied else ""))


def planned_slots(plan: FusionPlan, users: Users
                  ) -> tuple[dict[str, tuple[str, int, int, int]], dict[str, list[tuple[str, tuple[int, int, int]]]]]:
    """Of the plan's cats written in place: ({part its producer stores in place: (cat, dim, start, length)},
    {cat: [(part copied in at the cat's step, (dim, start, length))]})."""
    stored: dict[str, tuple[str, int, int, int]] = {}
    copied: dict[str, list[tuple[str, tuple[int, int, int]]]] = {}
    for group in plan.groups:
        if group.kind is not GroupKind.IN_PLACE:
            continue
        cat = group.nodes[0]
        written = set(written_parts(plan.graph, plan.groups, cat, users))
        copied[cat] = []
        for part, where in slots(plan.graph, cat).items():
            if part in written:
                stored[part] = (cat, *where)
            else:
                copied[cat].append((part, where))
    return stored, copied
