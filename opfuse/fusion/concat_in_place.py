"""A concatenation its producers write in place: `write_concats_in_place`, `writes_in_place`, `planned_slots`.

A cat that a convolution or a linear reads joins no kernel (`cat-with-hub`): it runs as a copy kernel of its own,
which reads every part once and writes it again (Inception's and GoogLeNet's blocks, a feature pyramid's merge).
Where a part's producer is a kernel that stores through run-time strides (an anchor's epilogue, the elementwise,
reduction and pooling templates: a group of WRITER_KINDS), that kernel stores the part straight into its slice of the
cat's buffer (`slots`), and the cat moves none of its bytes. Where every part is such a value (none read by another
node too, a graph output, input or constant, a view, or made by a kernel of another kind: a conv-conv or attention
kernel), the cat's group becomes GroupKind.IN_PLACE, which gets no kernel: the runtime allocates the buffer before
the first part is stored (`opfuse.runtime.compiled`). A cat with any other part keeps its copy kernel: one launch
for every part, where copying that part in would be a launch of its own. A kernel that cannot store into its slice
after all (a library form with no epilogue kernel, a group the templates refused) has its output copied there, which
the launch count of a captured graph shows.
"""

from __future__ import annotations

from typing import Sequence

from opfuse.codegen.template_kernel import INT32_LIMIT
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.fusion.reasons import Code
from opfuse.fusion.legality_common import Users
from opfuse.ir.graph import Graph

# the group kinds whose kernels store each output through strides the runtime may choose (horizontal siblings whose
# output a cat reads store apart: `opfuse.codegen.epilogue.Epilogue.separate`; a conv-conv, squeeze or attention
# kernel allocates its own)
WRITER_KINDS = frozenset({GroupKind.SINGLE, GroupKind.ANCHOR_EPILOGUE, GroupKind.RESIDUAL, GroupKind.HORIZONTAL,
                          GroupKind.POINTWISE, GroupKind.HORIZONTAL_POINTWISE, GroupKind.REDUCTION})


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


def writes_in_place(graph: Graph, groups: Sequence[FusionGroup], cat: str, users: Users) -> bool:
    """Whether every part of cat node `cat` is a value its producer's kernel may store into its slice (module
    docstring), and the cat's elements within int32 offsets: an anchor's kernel addresses its output with int32
    offsets (`opfuse.codegen.lower`), which through a slice reach as far as the cat's whole buffer."""
    if graph[cat].type.numel > INT32_LIMIT:
        return False
    producer = {output: group for group in groups for output in group.outputs}
    for part in graph[cat].inputs:
        group = producer.get(part)
        if (group is None or group.kind not in WRITER_KINDS or graph.only_reader(part, users) is not graph[cat]
                or graph[part].op in ("input", "constant", "state")
                or (group.anchor is not None and graph[group.anchor].op == "sdpa")):
            return False
    return True


def write_concats_in_place(graph: Graph, groups: list[FusionGroup], users: Users, config: FusionConfig) -> None:
    """Turn each cat group whose parts their kernels may all store in place into an IN_PLACE group (module
    docstring): no launch, no traffic of its own."""
    if not config.concat_in_place:
        return
    for group in groups:
        if is_candidate(graph, group) and writes_in_place(graph, groups, group.nodes[0], users):
            group.kind, group.code = GroupKind.IN_PLACE, Code.IN_PLACE
            group.bytes_read = group.bytes_written = group.launches = 0
            group.predicted_time, group.resources = 0.0, None
            group.reason = (f"cat {group.nodes[0]} written in place, no copy kernel: its parts' kernels store "
                            f"{', '.join(graph[group.nodes[0]].inputs)} into their slices")


def planned_slots(plan: FusionPlan) -> dict[str, tuple[str, int, int, int]]:
    """{part of a cat the plan writes in place: (the cat, dim, start, length of the slice its kernel stores it in)}."""
    return {part: (group.nodes[0], *where) for group in plan.groups if group.kind is GroupKind.IN_PLACE
            for part, where in slots(plan.graph, group.nodes[0]).items()}
