"""Split-K forms of the anchor kernels: K cut into slices that each store an fp32 partial tile; the last slice of a
tile to finish sums them in slice order and runs the group's epilogue, in the same launch (`SplitK`, `last_slice`).

`sliced_template` derives a template's slice form by line edits that must each apply once; `with_slices` gives each
config the slices the planner decided for its tile (`FusionGroup.split_k`, `opfuse.fusion.tiles.split_k_table`),
`slices_of` reads them back.
The reduce kernel (`REDUCE_TEMPLATE`) serves the library form (`SplitK.reduce_only`): the library's result is one
slice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

import torch
import triton

from opfuse.codegen.base import KernelConfig, rows_jit
from opfuse.codegen.epilogue import TILE_INDEX, generate_kernel
from opfuse.fusion.tiles import tile_key
from opfuse.ir.graph import GraphError

if TYPE_CHECKING:
    from opfuse.codegen.epilogue import Epilogue, TileLayout
    from opfuse.fusion.plan import FusionGroup

# split-K's second kernel: the K slices' fp32 partial tiles ws[slice, batch, row, column] summed in slice order
# (the same order every run), then the group's epilogue, under the same contract as the anchor templates; its row
# count M is rebound as a multiple of ROW_UNIT (`opfuse.codegen.base.row_unit_of`: ws's rows are N apart)
REDUCE_TEMPLATE = '''
import triton
import triton.language as tl


''' + rows_jit(["M"]) + '''
def KERNEL_NAME(
    ws_ptr, M, N, SLICES, R1, R2, B1,
    {params}
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UNIT: tl.constexpr, ROW_UNIT: tl.constexpr,
):
{units}
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_b = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
''' + TILE_INDEX + '''\
    ws = ws_ptr + pid_b * M * N + offs_m[:, None] * N + offs_n[None, :]
    slice_size = tl.num_programs(2) * M * N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SLICES):
        acc += tl.load(ws + s * slice_size, mask=mask_m[:, None] & mask_n[None, :], other=0.0)

{epilogue}
'''
REDUCE_BLOCK_M, REDUCE_BLOCK_N = 32, 64


# The last slice of a tile to arrive goes on, the others return (the split kernels' tails: `last_slice`, the attention
# template's key slices): a CTA barrier orders all the program's stores before its count goes up, an acquire-release
# atomic on the tile's count in cnt_ptr (one a program of the grid's first two axes; its slices on axis 2) tells the
# last, which resets the count for the next launch. Whatever it then reads of the other slices' stores it reads
# through L2 (.cg: they are not in its L1).
LAST_ARRIVAL = """\
    tl.debug_barrier()
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    if tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel") != tl.num_programs(2) - 1:
        return
    tl.store(cnt_ptr + tile, 0)
"""


class ArrivalCounts:
    """The arrival counts of a split kernel's tiles (`LAST_ARRIVAL`): zeros between launches, each tile's last slice
    resetting its own. Made when the kernel is built, for the most tiles any of its configs launches, so none is ever
    made inside a CUDA graph capture (its zeros would be written only at replay) and every captured graph keeps this
    one buffer."""

    def __init__(self, tiles: Iterable[int], device: torch.device | str):
        self.tensor = torch.zeros(max(tiles, default=1), dtype=torch.int32, device=device)

    def of(self, tiles: int, device: torch.device, kernel: str) -> torch.Tensor:
        """The counts for a launch of `tiles` tiles on `device`; an error where they were made for fewer or
        another device."""
        if tiles > self.tensor.numel() or self.tensor.device != device:
            raise ValueError(f"kernel {kernel}: {tiles} tiles on {device}, counts made for "
                             f"{self.tensor.numel()} on {self.tensor.device}")
        return self.tensor


def last_slice(tile_at: str) -> str:
    """The sliced kernel's tail in place of its epilogue: slice pid_k stores its fp32 partial tile (`tile_at`: the
    offset in ws of slice {s}'s tile); the last to arrive (`LAST_ARRIVAL`) sums every slice's tile in slice order
    (the same order every run, whichever slice is last) into acc for the epilogue that follows."""
    return f"""\
    tl.store(ws_ptr + {tile_at.format(s="pid_k")}, acc, mask=mask_m[:, None] & mask_n[None, :])
{LAST_ARRIVAL}\
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(tl.num_programs(2)):
        acc += tl.load(ws_ptr + {tile_at.format(s="s")}, mask=mask_m[:, None] & mask_n[None, :], other=0.0,
                       cache_modifier=".cg")
"""


class SplitK:
    """The split-K form of an anchor kernel: `template` with each K slice storing its partial tile and the last to
    finish summing them and running the epilogue (`last_slice` of `tile_at`, the template's offset of slice {s}'s
    tile in its workspace), and the reduce kernel the library form runs its result through. Built only for groups
    the planner split (`FusionGroup.split_k`)."""

    def __init__(self, template: str | None, tile_at: str, epilogue: "Epilogue", units: Sequence[str] = (),
                 rows: Sequence[str] = (), row_strides: Sequence[str] = ()):
        """`units`: the template's unit parameters (`opfuse.codegen.base.unit_code`); `rows` its row counts and
        `row_strides` the row strides of what the sliced kernel reads and stores (`opfuse.codegen.base.row_unit_of`;
        the epilogue's are added)."""
        self.source, self.counts = "", None
        if template is not None:
            sliced = template.replace("{params}", "ws_ptr, cnt_ptr, {params}", 1).replace(
                "{epilogue}", last_slice(tile_at).replace("{", "{{").replace("}", "}}") + "{epilogue}", 1)
            self.name, self.source, self.partial = generate_kernel(sliced, epilogue, "splitk", units, rows,
                                                                   row_strides)
        self.reduce_name, self.reduce_source, self.reduce = generate_kernel(REDUCE_TEMPLATE, epilogue, units=("N",),
                                                                            rows=("M",), row_strides=("N",))

    def count_tiles(self, tiles: Iterable[int], device: torch.device | str) -> None:
        """Make the arrival counts (`ArrivalCounts`) for configs launching `tiles` tiles (programs of the grid's
        first two axes) each: once the kernel's configs are known."""
        self.counts = ArrivalCounts(tiles, device)

    @property
    def sources(self) -> str:
        """The sliced kernel's source and the reduce kernel's: what the anchor kernel's `source` adds of them."""
        return self.source + "\n\n" + self.reduce_source

    @classmethod
    def reduce_only(cls, epilogue: "Epilogue") -> "SplitK":
        """Just the reduce kernel: what the library form runs over the library's result (one slice)."""
        return cls(None, "", epilogue)

    def run_reduce(self, workspace: torch.Tensor, layout: "TileLayout", args: list, block_m: int = REDUCE_BLOCK_M,
                   block_n: int = REDUCE_BLOCK_N, num_warps: int = 4) -> None:
        """Sum the slices of `workspace` [slices, batch, rows, columns] into the epilogue's outputs (`args`)."""
        slices, batch, rows, columns = workspace.shape
        _, r1, r2 = layout.row_sizes()
        b1 = layout.batch_sizes()[1] if layout.batch_dims else 1
        grid = (triton.cdiv(rows, block_m), triton.cdiv(columns, block_n), batch)
        self.reduce[grid](workspace, rows, columns, slices, r1, r2, b1, *args,
                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def sliced_template(template: str, edits: Sequence[tuple[str, str]]) -> str:
    """`template` edited into its split-K form: each (old, new) line edit must apply exactly once, so a change to
    the template that breaks the derivation fails at import, not on a GPU."""
    for old, new in edits:
        if template.count(old) != 1:
            raise AssertionError(f"split-K template edit: {old.strip()!r} occurs {template.count(old)} times")
        template = template.replace(old, new)
    return template


def with_slices(configs: Sequence[KernelConfig], group: "FusionGroup") -> list[KernelConfig]:
    """`configs` each with the SPLIT_K the plan decided for its tile (`group.split_k`, by `tile_key`; 1: that
    config runs as one kernel). Codegen derives no slice count of its own: a tile the plan has no count for is a
    plan made for other tiles, an error."""
    split = []
    for config in configs:
        params = dict(config.params) | {"SPLIT_K": planned_slices(group, tile_key(config), "K slices")}
        split.append(KernelConfig.of(config.num_warps, config.num_stages, **params))
    return list(dict.fromkeys(split))


def planned_slices(group: "FusionGroup", key: str, what: str) -> int:
    """The slices the plan decided for the tile named `key` (`group.split_k`: K slices, or a conv-conv kernel's
    mid-channel slices); a tile the plan has none for is an error naming `what` and the tiles it has."""
    if key not in group.split_k:
        raise GraphError(f"group {group.name}: the plan decides no {what} for tile {key} "
                         f"(it has {', '.join(group.split_k) or 'none'})")
    return group.split_k[key]


def unsplit(config: KernelConfig) -> KernelConfig:
    """`config` run as one kernel (SPLIT_K 1): the unsplit form a split kernel offers the autotuner."""
    return KernelConfig.of(config.num_warps, config.num_stages, **(dict(config.params) | {"SPLIT_K": 1}))


def slices_of(config: KernelConfig) -> int:
    return dict(config.params).get("SPLIT_K", 1)
