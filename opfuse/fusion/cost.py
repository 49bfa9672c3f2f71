"""Cost model: bytes, FLOPs and predicted time of a kernel (`group_traffic`, `predict_time`, `estimate_kernel`).

The seed's rules, written down once:

- a kernel takes max(FLOPs / (peak * efficiency), bytes / (bandwidth * memory efficiency)) plus one launch
  (roofline): tensor-core peak for groups built around a conv/gemm/attention anchor, CUDA-core peak otherwise;
- an op whose density (FLOPs per byte moved) is under `config.density_threshold` (10) is a fusion candidate.

Traffic: a group reads each value from outside it once and writes each value that is read outside it or is a
graph output; views inside it are free. A group of one node moves exactly what the op registry says
(`opfuse.ir.ops.node_bytes` / `node_flops`, the one source of truth for per-op formulas).

One refinement, so that the seed's warning ("fuse too much and registers or shared memory overflow, and the
kernel gets slower") shows up in the predictions: when the resource model has to shrink an anchor's tile to
fit a fused epilogue, the tensor-core rate drops with the tile's operand reuse (see `tile_efficiency`).
All hardware numbers come from `opfuse.hardware.HardwareProfile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

from opfuse.config import FusionConfig
from opfuse.fusion.plan import ResourceEstimate
from opfuse.fusion.resources import ATTENTION_TILES, GEMM_TILES, anchor_of, estimate_resources
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, Node
from opfuse.ir.ops import FusionKind, get_op, kind_of, launches_kernel, node_bytes, node_flops

Users = Mapping[str, Sequence[Node]]


@dataclass(frozen=True)
class GroupTraffic:
    """FLOPs and bytes of one kernel, and the values it reads and writes."""

    flops: int
    bytes_read: int
    bytes_written: int
    inputs: tuple[str, ...]      # values read from outside, in first-use order
    outputs: tuple[str, ...]     # values written (read outside, or graph outputs)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def density(self) -> float:
        return self.flops / self.bytes_moved if self.bytes_moved else 0.0


@dataclass(frozen=True)
class KernelEstimate:
    """What the cost and resource models say about one group: traffic, tile and predicted seconds."""

    traffic: GroupTraffic
    resources: ResourceEstimate | None   # None for views and opaque ops (no kernel of ours)
    time: float
    anchor: str | None


def predict_time(flops: float, bytes_moved: float, hw: HardwareProfile, dtype: str, matrix: bool,
                 tile_efficiency: float = 1.0) -> float:
    """Roofline seconds of one kernel plus its launch; `matrix` selects the tensor-core peak."""
    if matrix:
        flop_rate = hw.matrix_peak(dtype) * hw.matrix_efficiency * tile_efficiency
    else:
        flop_rate = hw.vector_flops * hw.vector_efficiency
    byte_rate = hw.memory_bandwidth * hw.memory_efficiency
    return max(flops / flop_rate, bytes_moved / byte_rate) + hw.launch_overhead


def group_traffic(graph: Graph, nodes: Iterable[str], users: Users) -> GroupTraffic:
    """FLOPs and bytes of the kernel running `nodes` (external values read once, views free)."""
    nodes = list(nodes)
    if len(nodes) == 1:   # one node alone: exactly the registry's numbers
        node = graph[nodes[0]]
        read, written = node_bytes(graph, node)
        outputs = (node.name,) if written else ()
        return GroupTraffic(node_flops(graph, node), read, written, tuple(dict.fromkeys(node.inputs)), outputs)
    node_set = set(nodes)
    graph_outputs = set(graph.outputs)
    inputs: dict[str, None] = {}
    outputs: list[str] = []
    flops = 0
    for name in nodes:
        node = graph[name]
        flops += node_flops(graph, node)
        for value in node.inputs:
            if value not in node_set:
                inputs[value] = None
        if name in graph_outputs or any(u.name not in node_set for u in users[name]):
            outputs.append(name)
    if all(get_op(graph[n].op).alias for n in nodes):   # views only: no kernel, no traffic
        return GroupTraffic(0, 0, 0, tuple(inputs), tuple(outputs))
    read = sum(graph[v].type.nbytes for v in inputs)
    written = sum(graph[v].type.nbytes for v in outputs)
    return GroupTraffic(flops, read, written, tuple(inputs), tuple(outputs))


def tile_efficiency(resources: ResourceEstimate | None) -> float:
    """Tensor-core rate of a tile relative to the default tile: operand reuse BM*BN/(BM+BN), at most 1.

    A BM x BN tile loads (BM + BN) * BK operand elements per 2 * BM * BN * BK FLOPs, so a smaller tile feeds
    the tensor cores from memory proportionally more often; `matrix_efficiency` is calibrated on the default.
    """
    if resources is None or "BLOCK_M" not in resources.tile or "BLOCK_N" not in resources.tile:
        return 1.0
    default = ATTENTION_TILES[0] if "HEAD_DIM" in resources.tile else GEMM_TILES[0]

    def reuse(tile: Mapping[str, int]) -> float:
        return tile["BLOCK_M"] * tile["BLOCK_N"] / (tile["BLOCK_M"] + tile["BLOCK_N"])

    return min(1.0, reuse(resources.tile) / reuse(default))


def estimate_kernel(graph: Graph, nodes: Sequence[str], users: Users, hw: HardwareProfile,
                    dtype: str) -> KernelEstimate:
    """Traffic, resources and predicted time of the kernel that runs `nodes` (in topological order)."""
    traffic = group_traffic(graph, nodes, users)
    kernels = [n for n in nodes if launches_kernel(graph, graph[n])]
    if not kernels:
        return KernelEstimate(traffic, None, 0.0, None)
    anchor = anchor_of(graph, kernels)
    resources = None
    if not any(kind_of(graph[n]) is FusionKind.OPAQUE for n in kernels):
        resources = estimate_resources(graph, kernels, anchor, hw, dtype)
    time = predict_time(traffic.flops, traffic.bytes_moved, hw, dtype, matrix=anchor is not None,
                        tile_efficiency=tile_efficiency(resources))
    return KernelEstimate(traffic, resources, time, anchor)


def op_density(graph: Graph, node: Node) -> float:
    """FLOPs per byte the op moves when it runs alone (0 for views and sources)."""
    read, written = node_bytes(graph, node)
    return node_flops(graph, node) / (read + written) if read + written else 0.0


def is_fusion_candidate(graph: Graph, node: Node, config: FusionConfig) -> bool:
    """The seed's rule: a kernel-launching op under the density threshold is worth fusing."""
    return get_op(node.op).launches_kernel and op_density(graph, node) < config.density_threshold
