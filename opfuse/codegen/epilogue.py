"""Epilogues of the anchor kernels (conv, GEMM): the group's elementwise tail, generated onto a 2-D output tile.

Entry point: `Epilogue(graph, group, anchors, layout, device)`. It analyses the group once at build time and
gives the kernel template three things: the extra kernel parameters (`params`), the Triton lines that turn the
float32 accumulator tile into every stored value (`code`), and at run time the launch arguments for those
parameters together with the freshly allocated outputs (`launch_args`).

Contract with the templates. At the epilogue point a template has defined:
  acc [BLOCK_M, BLOCK_N] float32   the anchor's result, bias not added yet
  offs_n, mask_n [BLOCK_N]         global output channel of each column (concatenated channels in horizontal
                                   groups) and whether it exists
  mask_m [BLOCK_M]                 whether each row exists
  r0, r1, r2 [BLOCK_M]             the row index split over the layout's 3 row dims (see `TileLayout`)
  b0, b1 (scalars)                 the batch index split over the 2 batch dims (batched layouts only)

A flat epilogue (`Epilogue(..., flat=True)`, `Epilogue.flat_form()`) is the same code over a 1-D block of the
output's elements in memory order: there `acc`, `offs_n` (each element's channel), `r0, r1, r2` and `mask` are
[BLOCK] vectors, and `offs_dense` is each element's offset in a dense [batch, rows, channels] tensor. Every tensor
it reads or writes gets a constexpr flag (`<prefix>_DENSE`, set at launch from its strides): a dense one is
addressed by `offs_dense`, which Triton vectorises, any other through its strides. This is how a pointwise kernel
over a library call's result streams it at full width whatever the channel count (58 channels leave no row of a
2-D tile aligned).

Every extra operand of an epilogue node is one of: a scalar constant (a literal in the source), a constant that
varies along the channel dim only (a float32 vector the kernel loads with `offs_n`), or anything else (a runtime
tensor such as a residual, or a constant of another broadcast pattern), read through its strides after
broadcasting it to the output shape (`expand`, so broadcast dims cost nothing).

A permute in the epilogue (ConvNeXt's linear, then back to NCHW for its layer scale and residual) moves nothing:
every value stays at the tile's coordinates, and a node after the permute sees its operands and its output through
the inverse permutation (`spaces`: per chain position, the anchor dims its dims are). An output after a permute is
the permuted view of a buffer laid out as the anchor's output.

A row norm (layer norm or RMS norm over the channels) is the one reduction an epilogue computes, and only on a tile
of whole rows (`Epilogue(..., whole_rows=True)`: a depthwise conv's tiles spanning every channel, for
`opfuse.fusion.legality_anchors.row_norm_epilogue`): each row's statistics come from the tile itself, the lanes past the
channels masked out of them.

Horizontal groups (sibling anchors on one input) run one kernel over the concatenated output channels: the
siblings' epilogues must be structurally identical; their constant operands are concatenated along the channels,
and each sibling's outputs are views (narrow on the channel dim) of one buffer per stored value; or, where an
output is read by a cat alone (a part its kernel may store in place: `opfuse.fusion.concat_in_place`), each output
is a tensor of its own (`separate`), stored under the mask of its sibling's channels (the tile form only).

The kernels' other forms live beside it: split-K (`opfuse.codegen.split_k`), the library and unfused forms and
their base class `EpilogueKernel` (`opfuse.codegen.forms`), the GEMM prologue (`opfuse.codegen.prologue`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Sequence

import torch

from opfuse.codegen.base import load_kernel, unit_code
from opfuse.codegen.expr import Unsupported, emit, literal, triton_dtype
from opfuse.fusion.legality_anchors import ROW_NORMS, anchor_prologue, normalizes_last_dim
from opfuse.fusion.legality_common import Users
from opfuse.fusion.legality_views import EPILOGUE_VIEWS, epilogue_spaces, operand_views
from opfuse.fusion.plan import FusionGroup
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import Graph, Node, torch_dtype
from opfuse.ir.ops import FusionKind, along_channels, kind_of

ROW_GROUPS = 3      # row dims a kernel decomposes its row index into (N, H, W for images)
BATCH_GROUPS = 2    # batch dims a batched kernel decomposes its batch grid index into (batch, heads)


def _split(dims: tuple[int, ...], groups: int) -> list[tuple[int, ...]]:
    """`dims` as exactly `groups` groups: padded with empty groups in front, or with the leading dims merged."""
    if len(dims) <= groups:
        return [()] * (groups - len(dims)) + [(d,) for d in dims]
    merged = len(dims) - groups + 1
    return [dims[:merged]] + [(d,) for d in dims[merged:]]


def _group_stride(tensor: torch.Tensor, dims: tuple[int, ...]) -> int | None:
    """The stride of a linear index over `dims` of `tensor`, or None if those dims do not merge into one."""
    live = [d for d in dims if tensor.shape[d] != 1]
    if not live:
        return 0
    for outer, inner in zip(live, live[1:]):
        if tensor.stride(outer) != tensor.stride(inner) * tensor.shape[inner]:
            return None
    return tensor.stride(live[-1])


@dataclass(frozen=True)
class TileLayout:
    """How the dims of a logical shape map onto an anchor kernel's index space.

    One dim is the channel dim (the tile's N axis: output channels or features), `batch_dims` run along a grid
    axis (batched matmul), every other dim is a row dim (the tile's M axis: pixels or tokens). Kernels see
    ROW_GROUPS row dims and BATCH_GROUPS batch dims; fewer are padded with size-1 dims, more are merged.
    """

    shape: tuple[int, ...]
    channel_dim: int
    batch_dims: tuple[int, ...] = ()
    channels_last: bool = False          # allocate outputs NHWC (4-D conv outputs)
    # allocate outputs with their dims in this order in memory, outermost first (None: as `shape`, or NHWC with
    # `channels_last`): attention's [B, H, S, D] output is laid out [B, S, H, D], so the head merge is a view
    dim_order: tuple[int, ...] | None = None
    # (shape, strides, channels) of tensors seen -> their kernel strides: runs are launched many times with
    # the same layouts, and recomputing this was most of a launch's Python time
    _stride_cache: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def row_dims(self) -> tuple[int, ...]:
        return tuple(d for d in range(len(self.shape)) if d != self.channel_dim and d not in self.batch_dims)

    @property
    def channels(self) -> int:
        return self.shape[self.channel_dim]

    @property
    def rows(self) -> int:
        return math.prod(self.shape[d] for d in self.row_dims)

    @property
    def batch(self) -> int:
        return math.prod(self.shape[d] for d in self.batch_dims)

    def row_sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in g) for g in _split(self.row_dims, ROW_GROUPS))

    def batch_sizes(self) -> tuple[int, ...]:
        return tuple(math.prod(self.shape[d] for d in g) for g in _split(self.batch_dims, BATCH_GROUPS))

    def strides(self, tensor: torch.Tensor, channels: int | None = None) -> tuple[torch.Tensor, list[int]]:
        """`tensor` broadcast to this shape (with `channels` channels if given) and its kernel strides.

        The strides are [batch 0, batch 1] (batched layouts only) + [row 0, row 1, row 2] + [channel]. Dims that
        must merge but do not (rare: more than 3 row dims of a non-contiguous tensor) are made contiguous.
        """
        key = (tuple(tensor.shape), tensor.stride(), channels)
        cached = self._stride_cache.get(key)
        if cached is not None:   # a view with those strides needs no copy; its data pointer is the tensor's
            return tensor, cached
        target = list(self.shape)
        if channels is not None:
            target[self.channel_dim] = channels
        if tensor.dim() < len(target):  # broadcasting aligns on the right
            tensor = tensor.reshape((1,) * (len(target) - tensor.dim()) + tuple(tensor.shape))
        tensor = tensor.expand(target)
        groups = (_split(self.batch_dims, BATCH_GROUPS) if self.batch_dims else []) \
            + _split(self.row_dims, ROW_GROUPS)
        strides = [_group_stride(tensor, g) for g in groups]
        if None not in strides:
            strides.append(tensor.stride(self.channel_dim))
            self._stride_cache[key] = strides
            return tensor, strides
        tensor = tensor.contiguous()
        return tensor, [_group_stride(tensor, g) for g in groups] + [tensor.stride(self.channel_dim)]

    def empty(self, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """A new output of this layout's shape in its memory layout (`dim_order`, `channels_last`)."""
        if self.dim_order is not None:
            physical = torch.empty([self.shape[d] for d in self.dim_order], dtype=dtype, device=device)
            return physical.permute([self.dim_order.index(d) for d in range(len(self.shape))])
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        return torch.empty(self.shape, dtype=dtype, device=device, memory_format=memory_format)

    def stride_names(self, prefix: str) -> list[str]:
        batch = [f"{prefix}_sb0", f"{prefix}_sb1"] if self.batch_dims else []
        return batch + [f"{prefix}_sr0", f"{prefix}_sr1", f"{prefix}_sr2", f"{prefix}_sc"]

    def offset_expr(self, prefix: str, flat: bool = False, first_channel: int = 0) -> str:
        """Triton expression of the element offsets of a tensor read through `prefix` strides: of the
        [BLOCK_M, BLOCK_N] tile, or with `flat` of the [BLOCK] elements (`offs_dense` where the tensor is dense);
        `first_channel`: the tile's channel that is the tensor's first (a sibling's own output)."""
        rows = f"r0 * {prefix}_sr0 + r1 * {prefix}_sr1 + r2 * {prefix}_sr2"
        batch = f"b0 * {prefix}_sb0 + b1 * {prefix}_sb1 + " if self.batch_dims else ""
        if flat:
            return f"(offs_dense if {prefix}_DENSE else {batch}{rows} + offs_n * {prefix}_sc)"
        channels = f"(offs_n - {first_channel})" if first_channel else "offs_n"
        return f"{batch}({rows})[:, None] + {channels}[None, :] * {prefix}_sc"

    def dense(self, strides: Sequence[int]) -> bool:
        """Whether kernel `strides` (as `strides` gives them) address a dense [batch, rows, channels] tensor: each
        dim's stride the product of the sizes inside it, on every dim longer than 1."""
        return all(stride == step for stride, step in zip(strides, self._dense_strides) if step is not None)

    @cached_property
    def _dense_strides(self) -> list[int | None]:
        """The kernel strides of a dense tensor, None on dims of size 1 (any stride does there)."""
        sizes = list(self.batch_sizes() if self.batch_dims else ()) + list(self.row_sizes()) + [self.channels]
        steps = [math.prod(sizes[i + 1:]) for i in range(len(sizes))]
        return [step if size > 1 else None for size, step in zip(sizes, steps)]


def siblings_and_chains(graph: Graph, group: FusionGroup, anchor_ops: tuple[str, ...], users: Users | None = None
                        ) -> tuple[list[str], list[list[str]]]:
    """The group's anchors (several only in horizontal groups) and, per anchor, the chain anchor + its epilogue.

    Every non-anchor node must depend on exactly one anchor; a node before the anchor (but the views a linear
    reads its input through, `operand_views`, and a GEMM's prologue, `anchor_prologue`, which the templates take
    apart) or joining two siblings is refused. `users`: `graph.users()`, where the lowering has it already.
    """
    users = graph.users() if users is None else users
    anchors = [n for n in group.nodes if kind_of(graph[n]) is FusionKind.ANCHOR]
    mapped = operand_views(graph, group.nodes, users)
    for anchor in anchors:
        mapped |= set(anchor_prologue(graph, anchor, group.nodes, users))
    computed = [n for n in group.nodes if graph[n].op not in ("input", "constant") and n not in mapped]
    if not anchors:
        raise Unsupported(f"group {group.name} has no anchor", Code.EPILOGUE_FORM)
    for a in anchors:
        if graph[a].op not in anchor_ops:
            raise Unsupported(f"anchor {graph[a].describe()} is not one of {', '.join(anchor_ops)}",
                              Code.SEVERAL_ANCHORS)
    owner: dict[str, int] = {a: i for i, a in enumerate(anchors)}
    chains = [[a] for a in anchors]
    for name in computed:
        if name in anchors:
            continue
        node = graph[name]
        sources = {owner[i] for i in node.inputs if i in owner}
        if not sources:
            raise Unsupported(f"{node.describe()} does not depend on the anchor (prologues are not fused into "
                              "anchor kernels)", Code.EPILOGUE_FORM)
        if len(sources) > 1:
            raise Unsupported(f"{node.describe()} reads several sibling anchors' results", Code.EPILOGUE_FORM)
        owner[name] = sources.pop()
        chains[owner[name]].append(name)
    if len(anchors) > 1 and len({len(c) for c in chains}) != 1:
        raise Unsupported(f"horizontal group {group.name}: sibling epilogues differ in length", Code.EPILOGUE_FORM)
    return anchors, chains


class Epilogue:
    """The elementwise tail of an anchor group, as kernel parameters, Triton lines and launch arguments."""

    def __init__(self, graph: Graph, group: FusionGroup, chains: list[list[str]], layout: TileLayout,
                 device: torch.device, bias: list[torch.Tensor | None] | None = None, flat: bool = False,
                 whole_rows: bool = False):
        """`chains`: per sibling anchor, its name then its epilogue nodes; `bias`: per sibling, the anchor's
        bias (a [channels] constant) or None; `layout`: the output's layout with all siblings' channels; `flat`:
        code for a 1-D block of elements instead of a 2-D tile (module docstring); `whole_rows`: the template's
        tile spans every channel (BLOCK_N >= channels, one program along them), so that a row norm over the
        channels (`opfuse.fusion.legality_anchors.row_norm_epilogue`) is computed in the tile (`_row_norm`)."""
        self.graph, self.group, self.layout, self.device = graph, group, layout, device
        self.flat, self.whole_rows = flat, whole_rows
        self._arguments = (graph, group, chains, layout, device, bias)
        self._flat_form: Epilogue | None = None
        self.chains = chains
        widths = [graph[c[0]].type.shape[layout.channel_dim] for c in chains]
        if sum(widths) != layout.channels:
            raise AssertionError("layout channels must be the siblings' channels summed")
        self.spans = [(sum(widths[:i]), w) for i, w in enumerate(widths)]
        self.ops = [graph[n].op for n in chains[0]]
        spaces = epilogue_spaces(graph, chains[0][0], chains[0][1:])
        if isinstance(spaces, Reason):
            raise Unsupported(spaces.text, Code.EPILOGUE_FORM)
        self.spaces = [spaces[n] for n in chains[0]]      # per chain position: its dims as the anchor's dims
        self.full_spaces: list[tuple[int, ...]] = []    # per full operand: the space it is read in
        self.output_fill: float | None = None     # tests poison outputs (NaN) to catch unwritten elements
        self.channel_vectors: list[torch.Tensor] = []
        self.full_operands: list[str | torch.Tensor] = []   # runtime value names or kernel-held constants
        self.lines: list[str] = [] if flat else ["mask = mask_m[:, None] & mask_n[None, :]"]

        if bias is not None and any(b is not None for b in bias):
            vector = self.channel_vector([b if b is not None else 0.0 for b in bias])
            self.lines.append(f"x0 = acc + {vector}")
        else:
            self.lines.append("x0 = acc")
        position = {name: p for chain in chains for p, name in enumerate(chain)}
        for p in range(1, len(chains[0])):
            nodes = [graph[chain[p]] for chain in chains]
            if nodes[0].op in EPILOGUE_VIEWS:
                self.lines.append(f"x{p} = x{self._permute(nodes, position)}")
                continue
            if nodes[0].op in ROW_NORMS:
                self.lines += self._row_norm(nodes, position)
                continue
            self._check_node(nodes, position)
            args = [self._operand(nodes, i, position) for i in range(len(nodes[0].inputs))]
            self.lines.append(f"x{p} = {emit(nodes[0].op, nodes[0].attrs, args)}")

        self.stored: list[int] = []                # chain positions written to memory
        self.outputs: list[tuple[int, int]] = []   # per group output: (sibling, index into self.stored)
        for name in group.outputs:
            if name not in position:
                raise Unsupported(f"group output {name!r} is not computed by the group", Code.EPILOGUE_FORM)
            sibling = next(i for i, c in enumerate(chains) if name in c)
            p = position[name]
            if p not in self.stored:
                self.stored.append(p)
            self.outputs.append((sibling, self.stored.index(p)))
        self.dtypes = [torch_dtype(graph[chains[0][p]].type.dtype) for p in self.stored]
        self.stored_spaces = [self.spaces[p] for p in self.stored]
        identity = self.spaces[0]
        self.separate = (len(chains) > 1 and not flat and all(space == identity for space in self.stored_spaces)
                         and _a_cat_reads_alone(graph, group.outputs))
        if self.separate:       # one store per output, under the mask of its sibling's channels
            for i, (s, j) in enumerate(self.outputs):
                p, (start, width) = self.stored[j], self.spans[s]
                within = f"mask & ((offs_n >= {start}) & (offs_n < {start + width}))[None, :]"
                self.lines.append(f"tl.store(out{i}_ptr + {layout.offset_expr(f'out{i}', first_channel=start)}, "
                                  f"x{p}.to({triton_dtype(graph[chains[0][p]].type.dtype)}), mask={within})")
            return
        for j, p in enumerate(self.stored):
            self.lines.append(f"tl.store(out{j}_ptr + {layout.offset_expr(f'out{j}', flat)}, "
                              f"x{p}.to({triton_dtype(graph[chains[0][p]].type.dtype)}), mask=mask)")

    def flat_form(self) -> "Epilogue":
        """This epilogue as flat code (module docstring), built on first use."""
        if self.flat:
            return self
        if self._flat_form is None:
            self._flat_form = Epilogue(*self._arguments, flat=True, whole_rows=self.whole_rows)
        self._flat_form.output_fill = self.output_fill
        return self._flat_form

    def drop_flat_form(self) -> None:
        """Free the flat form (its device copies of the constants) where it will not run."""
        self._flat_form = None

    # ---- analysis -----------------------------------------------------------------------------------
    def _permute(self, nodes: list[Node], position: dict[str, int]) -> int:
        """The chain position a permute reads (it needs no code: values stay where they are)."""
        node = nodes[0]
        if len(nodes) > 1:
            raise Unsupported(f"horizontal group: {node.describe()} permutes a sibling's epilogue", Code.EPILOGUE_FORM)
        return position[node.inputs[0]]

    def _row_norm(self, nodes: list[Node], position: dict[str, int]) -> list[str]:
        """The lines of a layer norm or RMS norm over the channels at its chain position: each row's statistics
        from the tile (which must span every channel: `whole_rows`), its elements past the channels masked out."""
        node = nodes[0]
        p, source = position[node.name], f"x{position[node.inputs[0]]}"
        if self.flat or not self.whole_rows or len(nodes) > 1:
            raise Unsupported(f"{node.describe()}: a norm over the channels needs a tile of whole rows (a depthwise "
                              "conv's, one anchor)", Code.EPILOGUE_FORM)
        if not normalizes_last_dim(self.graph, node) or self.spaces[p][-1] != self.layout.channel_dim:
            raise Unsupported(f"{node.describe()} does not normalize the anchor's channels alone", Code.EPILOGUE_FORM)
        n, eps = self.layout.channels, repr(float(node.attrs["eps"]))
        lines = [f"t{p} = tl.where(mask, {source}, 0.0).to(tl.float32)"]    # (a cast before it: stats in float32)
        if node.op == "layer_norm":
            lines += [f"t{p} = tl.where(mask, t{p} - tl.sum(t{p}, axis=1)[:, None] / {n}, 0.0)"]
        lines.append(f"x{p} = t{p} * tl.rsqrt(tl.sum(t{p} * t{p}, axis=1)[:, None] / {n} + {eps})")
        for value, op in zip(node.inputs[1:], ("*", "+")):     # weight, bias: [channels] constants
            lines.append(f"x{p} = x{p} {op} {self.channel_vector([self.graph.constants[value]])}")
        return lines

    def _shape_in(self, space: tuple[int, ...], chain: Sequence[str] | None = None) -> tuple[int, ...]:
        """The shape of a value in `space`, of `chain`'s anchor (default: the first)."""
        anchor_shape = self.graph[(chain or self.chains[0])[0]].type.shape
        return tuple(anchor_shape[d] for d in space)

    def _check_node(self, nodes: list[Node], position: dict[str, int]) -> None:
        """Refuse a non-elementwise node, a shape change, and siblings whose nodes at one position differ."""
        first = nodes[0]
        if not kind_of(first).elementwise:
            raise Unsupported(f"{first.describe()} is not elementwise; anchor epilogues take elementwise ops only",
                              Code.EPILOGUE_FORM)
        space = self.spaces[position[first.name]]
        for node, chain in zip(nodes, self.chains):
            if node.op != first.op or node.attrs != first.attrs or node.type.dtype != first.type.dtype:
                raise Unsupported(f"horizontal group: {node.describe()} differs from {first.describe()}",
                                  Code.EPILOGUE_FORM)
            if node.type.shape != self._shape_in(space, chain):
                raise Unsupported(f"{node.describe()} changes the anchor's output shape "
                                  f"{self._shape_in(space, chain)} to {node.type.shape}", Code.EPILOGUE_FORM)
            for i, value in enumerate(node.inputs):
                if (value in position) != (first.inputs[i] in position) or \
                        (value in position and position[value] != position[first.inputs[i]]):
                    raise Unsupported(f"horizontal group: {node.describe()} reads other values than "
                                      f"{first.describe()}", Code.EPILOGUE_FORM)

    def channel_vector(self, parts: list[torch.Tensor | float]) -> str:
        """Load expression of a per-channel constant made of one part (tensor or scalar) per sibling, at the tile's
        output columns (`offs_n`, `mask_n`): a kernel parameter of its own."""
        pieces = [torch.full((w,), float(part)) if not isinstance(part, torch.Tensor)
                  else part.reshape(w).float().cpu() for part, (_, w) in zip(parts, self.spans)]
        j = len(self.channel_vectors)
        self.channel_vectors.append(torch.cat(pieces).to(self.device).contiguous())
        if self.flat:
            return f"tl.load(cv{j}_ptr + offs_n, mask=mask, other=0.0)"
        return f"tl.load(cv{j}_ptr + offs_n, mask=mask_n, other=0.0)[None, :]"

    def _classify(self, node: Node, index: int, space: tuple[int, ...]) -> tuple[str, object]:
        """("scalar", float) | ("channel", [C] tensor) | ("full", value name or constant tensor), for an input of
        a node whose dims are the anchor dims `space`."""
        value = node.inputs[index]
        source = self.graph[value]
        out_shape = node.type.shape
        channel = self.layout.channel_dim
        constant = self.graph.constants[value] if source.op == "constant" else None
        inverse = [space.index(d) for d in range(len(space))]
        if along_channels(node, index):
            if constant is None or tuple(constant.shape) != (out_shape[1],):
                raise Unsupported(f"{node.describe()}: batch-norm parameter {value} is not a constant "
                                  f"[{out_shape[1]}] vector", Code.NOT_CONSTANT)
            if space[1] == channel:
                return "channel", constant
            along = [out_shape[1] if d == 1 else 1 for d in range(len(out_shape))]    # [C] on dim 1, as a tensor
            return "full", constant.reshape(along).permute(inverse).to(self.device)
        shape = tuple(source.type.shape)
        if len(shape) > len(out_shape):
            raise Unsupported(f"{node.describe()}: operand {value} has more dims than the output", Code.OPERAND_SHAPE)
        aligned = (1,) * (len(out_shape) - len(shape)) + shape
        if any(s not in (1, o) for s, o in zip(aligned, out_shape)):
            raise Unsupported(f"{node.describe()}: operand {value} {shape} does not broadcast to {out_shape}",
                              Code.OPERAND_SHAPE)
        anchor_aligned = [aligned[j] for j in inverse]       # the operand's shape seen from the anchor's dims
        if constant is not None:
            if constant.numel() == 1:
                return "scalar", float(constant.reshape(()).item())
            if all(s == 1 for d, s in enumerate(anchor_aligned) if d != channel):
                return "channel", constant.reshape(-1)
            return "full", constant.reshape(aligned).permute(inverse).to(self.device)
        return "full", value

    def _operand(self, nodes: list[Node], index: int, position: dict[str, int]) -> str:
        """Triton expression of input `index` of the nodes at one chain position (one node per sibling)."""
        value = nodes[0].inputs[index]
        if value in position:
            return f"x{position[value]}"
        space = self.spaces[position[next(v for v in nodes[0].inputs if v in position)]]
        kinds = [self._classify(node, index, space) for node in nodes]
        if all(k == "scalar" for k, _ in kinds) and len({v for _, v in kinds}) == 1:
            return literal(kinds[0][1])
        if all(k in ("scalar", "channel") for k, _ in kinds):
            return self.channel_vector([v for _, v in kinds])
        if len(nodes) > 1:
            raise Unsupported(f"horizontal group: {nodes[0].describe()} reads a full tensor {value}; only "
                              "constants shared along the channels can be concatenated", Code.EPILOGUE_FORM)
        j = len(self.full_operands)
        self.full_operands.append(kinds[0][1])
        self.full_spaces.append(space if isinstance(kinds[0][1], str) else self.spaces[0])   # constants: moved
        return (f"tl.load(fo{j}_ptr + {self.layout.offset_expr(f'fo{j}', self.flat)}, mask=mask, "
                "other=0.0).to(tl.float32)")

    # ---- what the template and the launcher use -----------------------------------------------------
    @property
    def params(self) -> str:
        """Kernel parameters for the template signature (each followed by a comma)."""
        names = [f"cv{j}_ptr" for j in range(len(self.channel_vectors))]
        for prefix in self._tensor_prefixes:
            names += [f"{prefix}_ptr"] + self.layout.stride_names(prefix)
            if self.flat:
                names.append(f"{prefix}_DENSE: tl.constexpr")
        return "".join(f"{n}, " for n in names)

    def code(self, indent: str = "    ") -> str:
        return "\n".join(indent + line for line in self.lines)

    @property
    def unit_names(self) -> list[str]:
        """The batch and row strides of every tensor the tile epilogue reads or writes (`params`): what a template
        with a UNIT rebinds as multiples of it, with its own parameters (`generate_kernel`). A flat epilogue has
        none (its dense tensors are addressed by `offs_dense`)."""
        if self.flat:
            return []
        return [name for prefix in self._tensor_prefixes for name in self.layout.stride_names(prefix)[:-1]]

    @property
    def row_stride_names(self) -> list[str]:
        """The row strides of every tensor the epilogue reads or writes (`params`): where one is 1, that tensor
        is contiguous along the tile's rows (`opfuse.codegen.base.row_unit_of`)."""
        return [name for prefix in self._tensor_prefixes
                for name in self.layout.stride_names(prefix)[-1 - ROW_GROUPS:-1]]

    @property
    def _tensor_prefixes(self) -> list[str]:
        """The parameter prefixes of the tensors it reads (full operands) and writes, in `params` order."""
        stores = len(self.outputs) if self.separate else len(self.stored)
        return [f"fo{j}" for j in range(len(self.full_operands))] + [f"out{j}" for j in range(stores)]

    def launch_args(self, values: dict[str, torch.Tensor], outputs: Sequence[torch.Tensor | None] | None = None
                    ) -> tuple[list, list[torch.Tensor]]:
        """(arguments for `params`, the group's outputs) for one run; `values` holds the runtime inputs. `outputs`:
        per group output, a tensor to store it into (any strides) or None; one sibling's output of a horizontal
        group is a part of the siblings' one buffer, and an output stored permuted has its own: those are new."""
        args: list = list(self.channel_vectors)
        identity = self.spaces[0]
        for operand, space in zip(self.full_operands, self.full_spaces):
            tensor = values[operand] if isinstance(operand, str) else operand
            if space != identity:     # broadcast in the node's dims, then seen from the anchor's
                tensor = tensor.reshape((1,) * (len(space) - tensor.dim()) + tuple(tensor.shape))
                tensor = tensor.expand(self._shape_in(space)).permute([space.index(d) for d in range(len(space))])
            tensor, strides = self.layout.strides(tensor)
            args += [tensor, *strides] + ([self.layout.dense(strides)] if self.flat else [])
        if self.separate:
            return self._separate_outputs(args, outputs)
        given = self._given(outputs)
        buffers = []
        for j, (dtype, space) in enumerate(zip(self.dtypes, self.stored_spaces)):
            buffer, strides = self._stored_in(given.get(j) if space == identity else None, dtype)
            args += [buffer, *strides] + ([self.layout.dense(strides)] if self.flat else [])
            buffers.append(buffer if space == identity else buffer.permute(space))
        if len(self.chains) == 1:
            return args, [buffers[b] for _, b in self.outputs]
        channel = self.layout.channel_dim
        return args, [buffers[b].narrow(channel, *self.spans[s]) for s, b in self.outputs]

    def _separate_outputs(self, args: list, outputs: Sequence[torch.Tensor | None] | None
                          ) -> tuple[list, list[torch.Tensor]]:
        """`launch_args` of a `separate` epilogue: each output in the tensor given for it, or a new one."""
        results = []
        for i, (s, j) in enumerate(self.outputs):
            shape = list(self.layout.shape)
            shape[self.layout.channel_dim] = self.spans[s][1]
            given = outputs[i] if outputs is not None else None
            if given is not None and list(given.shape) != shape:
                given = None
            buffer, strides = self._stored_in(given, self.dtypes[j], replace(self.layout, shape=tuple(shape)))
            args += [buffer, *strides]
            results.append(buffer)
        return args, results

    def _stored_in(self, given: torch.Tensor | None, dtype: torch.dtype, layout: TileLayout | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """(the tensor an output is stored in, its kernel strides): `given` where its strides group as the kernel
        addresses them (`TileLayout.strides` would otherwise address a contiguous copy of it), else a new one."""
        layout = layout or self.layout
        if given is not None:
            seen, strides = self.layout.strides(given, channels=layout.channels)
            if seen.data_ptr() == given.data_ptr():
                return given, strides
        buffer = layout.empty(dtype, self.device)
        if self.output_fill is not None:
            buffer.fill_(self.output_fill)
        return buffer, self.layout.strides(buffer, channels=layout.channels)[1]

    def _given(self, outputs: Sequence[torch.Tensor | None] | None) -> dict[int, torch.Tensor]:
        """{stored buffer: the tensor given to store it into} (`launch_args`)."""
        if outputs is None or len(self.chains) != 1:
            return {}
        return {b: out for (_, b), out in zip(self.outputs, outputs)
                if out is not None and tuple(out.shape) == self.layout.shape}


def generate_kernel(template: str, epilogue: Epilogue, prefix: str = "fused", units: Sequence[str] | None = None,
                    rows: Sequence[str] = (), row_strides: Sequence[str] = ()) -> tuple[str, str, object]:
    """(name, source, jitted function) of `template` with the epilogue inserted, named `prefix`_<ops>_<hash>.

    The template has `{params}` and `{epilogue}` slots and calls its function KERNEL_NAME (see `load_kernel`).
    `units`: the template's own integer parameters that address the tile's channel dim, for a template with a
    `UNIT: tl.constexpr` parameter and a `{units}` slot where the kernel rebinds them and the epilogue's row
    strides as multiples of UNIT (`opfuse.codegen.base.unit_code`); None for a template without.
    `rows`: its row counts, for a template declared with `rows_jit(rows)` and a `ROW_UNIT: tl.constexpr`
    parameter, and `row_strides` its own tensors' strides along the rows (the epilogue's are added).
    """
    names = () if units is None else (*units, *epilogue.unit_names)
    source = template.format(params=epilogue.params, epilogue=epilogue.code(), units=unit_code(names, rows))
    strides = (*row_strides, *epilogue.row_stride_names) if rows else ()
    return load_kernel(prefix, epilogue.ops, source, names, rows, strides, epilogue.layout.rows)


# The row and batch indices of the contract (module docstring), for templates whose tile covers rows offs_m of M and
# columns offs_n of N in batch pid_b (GEMM and the split-K reduce); they paste it in after defining those.
TILE_INDEX = '''\
    mask_m = offs_m < M
    mask_n = offs_n < N
    b0 = pid_b // B1
    b1 = pid_b % B1
    r2 = offs_m % R2
    r1 = (offs_m // R2) % R1
    r0 = offs_m // (R2 * R1)
'''

def compute_dtype(graph: Graph, value: str, node: Node) -> str:
    """The dtype the anchor's tensor-core inputs use: its activation's, if it is one the kernels take."""
    dtype = graph[value].type.dtype
    if dtype not in ("float16", "bfloat16", "float32"):
        raise Unsupported(f"{node.describe()} computes in {dtype}; anchor kernels take float16/bfloat16/float32",
                          Code.OPERAND_DTYPE)
    return dtype


def _a_cat_reads_alone(graph: Graph, names: Sequence[str]) -> bool:
    """Whether one of values `names` is read by one cat and nothing else (no graph output)."""
    users = graph.users()
    readers = (graph.only_reader(name, users) for name in names)
    return any(reader is not None and reader.op == "cat" for reader in readers)
