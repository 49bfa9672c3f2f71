"""The fusion plan's data: groups (one kernel each), every fusion decision taken or refused, and resources.

Everything the planner decides is recorded here as data, so the CLI tables, the JSON output and the HTML
report render the same facts. `FusionPlan` is produced by `opfuse.fusion.planner.plan_fusion`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from opfuse.fusion.reasons import Code
from opfuse.ir.graph import Graph


def plain(value: Any) -> Any:
    """A dataclass's asdict() made JSON: enums as their values, tuples as lists."""
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


class Verdict(str, Enum):
    FUSED = "fused"
    ILLEGAL = "illegal"                 # several users, shape mismatch, cycle, opaque op, kind rule
    UNPROFITABLE = "unprofitable"       # the cost model predicts no gain
    OVER_BUDGET = "over budget"         # the fused kernel would exceed registers or shared memory


class Fusion(str, Enum):
    """What a candidate fusion would make of its two sides."""
    VERTICAL = "vertical"                   # the consumer's ops into the producer's kernel (an epilogue)
    RESIDUAL = "residual"                   # an anchor with the add of a skip connection in its epilogue
    PROLOGUE = "prologue"                   # elementwise ops into the reduction or GEMM that reads them
    HORIZONTAL = "horizontal"               # siblings reading one input, in one launch
    GATED = "gated"                         # act(x W_gate) * (x W_up) as one GEMM: two sibling linears, or a
                                            # grouped GEMM's two column halves (a mixture of experts)
    CONV_CONV = "conv-conv"                 # a depthwise conv and the conv it feeds, in one kernel
    SQUEEZE = "squeeze"                     # squeeze-excitation's pool, GEMMs and scale, in one kernel


class GroupKind(str, Enum):
    ANCHOR_EPILOGUE = "anchor+epilogue"     # conv/gemm/attention with bias, activation, cast after it
    RESIDUAL = "residual"                   # anchor + add(skip) (+ activation): cross-layer fusion
    HORIZONTAL = "horizontal"               # sibling anchors on one input, concatenated weights
    HORIZONTAL_POINTWISE = "horizontal pointwise"   # independent small elementwise ops in one launch
    CONV_CONV = "conv-conv"                 # depthwise + pointwise convolution
    SQUEEZE = "squeeze"                     # global average pool -> small GEMM -> small GEMM (SE's squeeze)
    POINTWISE = "pointwise"                 # elementwise chain
    REDUCTION = "reduction"                 # softmax / layer norm / mean / pooling with prologue/epilogue
    INJECTIVE = "injective"                 # concat, gather, copies
    VIEW = "view"                           # metadata only: reshape, permute, slice; no kernel
    IN_PLACE = "in place"                   # a cat its parts' producers store into: no kernel (`concat_in_place`)
    OPAQUE = "opaque"                       # runs through PyTorch
    SINGLE = "single"                       # one op alone (nothing worth fusing with it)


@dataclass
class ResourceEstimate:
    """What the group's kernel needs for one tile, and whether that fits the hardware profile."""

    tile: dict[str, int]                    # BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, ...
    registers_per_thread: int
    shared_memory_bytes: int
    fits: bool
    reason: str = ""                        # why it does not fit, in words
    rate_tile: dict[str, int] | None = None  # the tile whose tensor-core rate prices the kernel (None: `tile`):
                                            # an anchor's best-reusing tile that fits, clipped to its problem
                                            # (`opfuse.fusion.resources.rate_tile`), the autotuner's likely choice


class Moves:
    """What a kernel of `flops`, `bytes_read` and `bytes_written` moves: its bytes, and its compute density (FLOPs
    per byte moved: under the config's threshold, a fusion candidate). A base of the records that have the three."""

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def density(self) -> float:
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


@dataclass
class FusionGroup(Moves):
    """One kernel of the fused model (or none, for views)."""

    id: int
    kind: GroupKind
    nodes: list[str]                        # in topological order
    anchor: str | None = None               # the conv/gemm/attention node, if any
    inputs: list[str] = field(default_factory=list)     # values read from outside the group
    outputs: list[str] = field(default_factory=list)    # values written (used outside, or graph outputs)
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    predicted_time: float = 0.0             # seconds, cost model
    launches: int = 1                       # 0 for views; 2 where the kernel's default tile splits K (its K
                                            # slices, then their sum)
    split_k: dict[str, int] = field(default_factory=dict)   # the planner's split-K decision for an anchor kernel:
                                            # K slices per tile (`opfuse.fusion.tiles.split_k_table`, by tile_key),
                                            # which its configs run; empty: no split form. A conv-conv kernel: its
                                            # mid-channel slices per tile (`resources.conv_conv_slice_table`); an
                                            # attention kernel: its key slices (`tiles.key_split_table`)
    resources: ResourceEstimate | None = None
    reason: str = ""                        # why the group is what it is
    code: Code = Code.NO_CANDIDATE          # the same as a stable code: fused for a merged group, the first refusal
                                            # a lone node met, view, view-copy, opaque or copying-op

    @property
    def name(self) -> str:
        return f"g{self.id}"


@dataclass
class FusionDecision:
    """One candidate fusion, taken or refused, and why: in words (`reason`) and as a stable code (`code`, one of
    `opfuse.fusion.reasons.Code`, whose module lists what each means)."""

    producer: list[str]                     # node names of the producing side
    consumer: list[str]                     # node names of the consuming side
    fusion: Fusion
    verdict: Verdict
    reason: str
    code: Code
    bytes_saved: int = 0                    # traffic the fusion removes (if taken)
    time_unfused: float = 0.0               # predicted seconds of the two parts
    time_fused: float = 0.0                 # predicted seconds of the fused kernel

    def __post_init__(self) -> None:
        self.fusion = Fusion(self.fusion)   # its value given ("vertical"): the member, or a ValueError


@dataclass
class FusionPlan:
    graph: Graph                            # the graph the groups refer to (after passes)
    groups: list[FusionGroup]               # in an order that respects dependencies
    decisions: list[FusionDecision]
    hardware: str                           # the profile's name
    config: Any = None                      # the FusionConfig used
    profile: Any = None                     # the HardwareProfile planned for (its kernels' tiles follow it too)

    def group_of(self, node_name: str) -> FusionGroup:
        for group in self.groups:
            if node_name in group.nodes:
                return group
        raise KeyError(node_name)

    @property
    def kernel_launches(self) -> int:
        return sum(g.launches for g in self.groups)

    @property
    def refused(self) -> list[FusionDecision]:
        return [d for d in self.decisions if d.verdict is not Verdict.FUSED]

    def to_dict(self) -> dict[str, Any]:
        return {
            "hardware": self.hardware,
            "kernel_launches": self.kernel_launches,
            "groups": [plain(asdict(g)) | {"name": g.name, "density": g.density} for g in self.groups],
            "decisions": [plain(asdict(d)) for d in self.decisions],
        }
