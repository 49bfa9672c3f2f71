"""Prologues of GEMM kernels: elementwise ops applied to the A tile as it is loaded, before the dot.

Entry point: `Prologue(graph, nodes, source, layout, k, device)` for the chain `nodes` between A's source value and
the anchor (`opfuse.fusion.legality_anchors.anchor_prologue`: squeeze-and-excitation's channel scale before the
project conv, a scale before a linear). It gives the GEMM template its extra parameters (`params`), the Triton lines
that turn the loaded tile `a` into the prologue's result (`code`, run on every K block), and the launch arguments
(`launch_args`).

Contract with the template: at the prologue point `a` [BLOCK_M, BLOCK_K] is the loaded A tile, `k_at` [BLOCK_K]
the global reduction index of its columns, `a_g0 .. a_g3` [BLOCK_M] its row index in A's four row groups, and
`mask_m`, K the row mask and the reduction length. An operand of a prologue node is a scalar constant (a literal)
or a tensor broadcast to A's shape (a (N, C, 1, 1) scale costs nothing along the pixels; a batch norm's [C]
parameters lie along dim 1), read through its strides at the tile's coordinates. Each node's result is rounded to its dtype, as eager rounds the value it would write, and
the tile's elements past M or K are zero again after the prologue (x / s at a masked zero would be NaN, and NaN
times B's masked zero is still NaN).

A linear's chain may open with a layer norm or an RMS norm over the last dim
(`opfuse.fusion.legality_anchors.row_norm_prologue`; the sibling linears of a horizontal group share it): then
`stats_code` gives lines the template runs before its K loop (a pass over K reading the tile's rows as the K loop
does, through `a_rows`, `offs_k` and A's reduction strides: the A operand is the norm's input, read through the row
views between the norm and the linear as the linear would read its output), and the code normalizes
each tile with the rows' mean and rstd and the norm's weight and bias (`pn0_ptr`, `pn1_ptr`: [K] vectors), rounded
to the norm's dtype as its stored output would be. The library form computes the norm through PyTorch first
(the kernel's `operand_nodes`: F.layer_norm, one more launch, which its `launches` counts).

An RMS norm that only row views follow to the linear is deferred instead (`deferred`): x * rstd * w @ B is
rstd * (x * w @ B) for each row, so the K loop that loads the rows anyway sums their squares, the tiles go to the dot
as x * w / max|w| (rounded once, as the norm's output is; never larger than x, so never past float16's range), and
`scale_code` multiplies the accumulator by rstd * max|w| after the loop: no pass of its own before it. Where the
kernel folds w into its weight instead (`fold_weight`: B's row k times w[k], `row_scale`; the gated pair's kernel,
whose weight no other form shares), the A tiles go to the dot as loaded and the loop only sums their squares,
elementwise ([BLOCK_M, BLOCK_K]) and across the tile once after it: no change of the tile's layout and no reduction
across threads in the loop.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.epilogue import TileLayout
from opfuse.codegen.expr import Unsupported, emit, literal, triton_dtype
from opfuse.fusion.legality_anchors import ROW_NORMS
from opfuse.ir.graph import Graph
from opfuse.ir.ops import along_channels, get_op


class Prologue:
    """The elementwise ops between a GEMM's A source and its anchor, as kernel parameters, code and arguments."""

    def __init__(self, graph: Graph, nodes: Sequence[str], source: str, layout: TileLayout, k: int,
                 device: torch.device, fold_weight: bool = False):
        self.graph, self.nodes, self.source, self.layout, self.k = graph, list(nodes), source, layout, k
        self.device = device
        self.operands: list[str | torch.Tensor] = []     # runtime value names, or constants held on the device
        self.constants: dict[str, torch.Tensor] = {}     # the constants the nodes read (the library forms run
                                                         # the nodes through PyTorch too)
        self.lines: list[str] = ["p = a.to(tl.float32)"]
        self.norm: str | None = None                     # the layer norm or RMS norm opening the chain, if any
        self.norm_vectors: list[torch.Tensor] = []       # its weight and bias, [K] on the device
        opening = graph[self.nodes[0]] if self.nodes else None
        self.deferred = (opening is not None and opening.op == "rms_norm"   # the module docstring's deferred norm
                         and all(get_op(graph[name].op).alias for name in self.nodes[1:]))
        self.norm_scale = 1.0                            # a deferred norm's max |weight|
        self.folded = self.deferred and fold_weight      # the module docstring's fold_weight
        self.row_scale: torch.Tensor | None = None       # then the norm's weight [K], for B's rows
        chain = {source}
        for name in self.nodes:
            node = graph[name]
            if get_op(node.op).alias:    # a row view between a layer norm and its linear: the same tile
                chain.add(name)
                continue
            if node.op in ROW_NORMS and self.deferred:
                self.lines += self._deferred_lines(node)
                chain.add(name)
                continue
            if node.op in ROW_NORMS:
                self.lines.append(f"p = ({self._normalized(node)}).to({triton_dtype(node.type.dtype)}).to(tl.float32)")
                chain.add(name)
                continue
            args = ["p" if value in chain else self._operand(value, node, position)
                    for position, value in enumerate(node.inputs)]
            self.lines.append(f"p = ({emit(node.op, node.attrs, args)}).to({triton_dtype(node.type.dtype)})"
                              ".to(tl.float32)")
            chain.add(name)
        if not self.folded:     # (folded, the tile goes to the dot as loaded)
            self.lines.append("a = tl.where(mask_m[:, None] & (k_at < K)[None, :], p, 0.0).to(a.dtype)")
        self.output = self.nodes[-1]

    def _normalized(self, node) -> str:
        """(p - mean) * rstd [* weight] [+ bias] (a layer norm) or p * rstd [* weight] (an RMS norm) on the tile,
        the statistics from `stats_code`'s pass."""
        if node is not self.graph[self.nodes[0]]:
            raise Unsupported(f"{node.describe()}: a norm prologue must read the kernel's A operand")
        self.norm = node.name
        expression = "(p - ln_mean[:, None]) * ln_rstd[:, None]" if node.op == "layer_norm" else "p * ln_rstd[:, None]"
        for value, op in zip(node.inputs[1:], ("*", "+")):
            constant = self.constants.setdefault(value, self.graph.constants[value].to(self.device))
            self.norm_vectors.append(constant.reshape(-1))
            j = len(self.norm_vectors) - 1
            expression = (f"({expression}) {op} tl.load(pn{j}_ptr + k_at, mask=k_at < K, other=0.0)"
                          ".to(tl.float32)[None, :]")
        return expression

    def _deferred_lines(self, node) -> list[str]:
        """A deferred RMS norm's lines on the tile (module docstring): the squares summed; folded, its weight left to
        B's rows (`row_scale`), else the tile times its weight over the largest of its magnitudes."""
        self.norm = node.name
        if self.folded:
            squares = ["ln_squares += p * p"]
        else:
            squares = ["ln_squares += tl.sum(p * p, axis=1)"]
        if len(node.inputs) < 2:
            return squares
        constant = self.graph.constants[node.inputs[1]]
        self.constants.setdefault(node.inputs[1], constant.to(self.device))   # (for the forms that run it in PyTorch)
        weight = constant.reshape(-1).float()
        if self.folded:
            self.row_scale = weight
            return squares
        self.norm_scale = float(weight.abs().max()) or 1.0
        self.norm_vectors.append((weight / self.norm_scale).to(self.device))
        return squares + ["p = p * tl.load(pn0_ptr + k_at, mask=k_at < K, other=0.0)[None, :]"]

    def scale_code(self, indent: str = "    ") -> str:
        """Lines run after the K loop: a deferred norm's rstd * max|weight| on each row of the accumulator."""
        if not self.deferred:
            return ""
        eps = repr(float(self.graph[self.norm].attrs["eps"]))
        squares = "tl.sum(ln_squares, axis=1)" if self.folded else "ln_squares"
        return f"{indent}acc = acc * (tl.rsqrt({squares} / K + {eps}) * {self.norm_scale!r})[:, None]"

    def stats_code(self, indent: str = "    ") -> str:
        """Lines run before the K loop when the chain opens with a layer norm: the mean and rstd of each of the
        tile's rows in a pass over K of their own. Each K block's mean and sum of squared deviations are merged
        into the running ones (Chan et al.), as the layer norm's own kernel does (`opfuse.codegen.reduction`): the
        textbook E[x^2] - mean^2 loses the variance to cancellation where a row's mean is large against its spread
        (transformer residual streams), the merge does not, at one more subtraction per element."""
        if self.norm is None:
            return ""
        if self.deferred:     # the squares are summed in the K loop (folded: elementwise, across the tile after)
            shape = "[BLOCK_M, BLOCK_K]" if self.folded else "[BLOCK_M]"
            return indent + f"ln_squares = tl.zeros({shape}, dtype=tl.float32)"
        eps = repr(float(self.graph[self.norm].attrs["eps"]))
        if self.graph[self.norm].op == "rms_norm":     # the rows' mean square: no cancellation to guard against
            lines = ["ln_squares = tl.zeros([BLOCK_M], dtype=tl.float32)",
                     "for ks in range(0, K, BLOCK_K):",
                     "    ln_k = ks + offs_k",
                     "    if A_SPLIT_K:",
                     "        ln_ptrs = a_rows[:, None] + ((ln_k // AK) * s_ako + (ln_k % AK) * s_ak)[None, :]",
                     "    else:",
                     "        ln_ptrs = a_rows[:, None] + ln_k[None, :] * s_ak",
                     "    ln_x = tl.load(ln_ptrs, mask=mask_m[:, None] & (ln_k < K)[None, :], other=0.0).to(tl.float32)",
                     "    ln_squares += tl.sum(ln_x * ln_x, axis=1)",
                     f"ln_rstd = tl.rsqrt(ln_squares / K + {eps})"]
            return "\n".join(indent + line for line in lines)
        lines = ["ln_mean = tl.zeros([BLOCK_M], dtype=tl.float32)",
                 "ln_m2 = tl.zeros([BLOCK_M], dtype=tl.float32)",
                 "ln_seen = tl.zeros([BLOCK_M], dtype=tl.float32)",
                 "for ks in range(0, K, BLOCK_K):",
                 "    ln_k = ks + offs_k",
                 "    ln_ok = ln_k < K",
                 "    if A_SPLIT_K:",
                 "        ln_ptrs = a_rows[:, None] + ((ln_k // AK) * s_ako + (ln_k % AK) * s_ak)[None, :]",
                 "    else:",
                 "        ln_ptrs = a_rows[:, None] + ln_k[None, :] * s_ak",
                 "    ln_x = tl.load(ln_ptrs, mask=mask_m[:, None] & ln_ok[None, :], other=0.0).to(tl.float32)",
                 "    ln_count = tl.sum(tl.where(ln_ok, 1.0, 0.0), axis=0)",
                 "    ln_block_mean = tl.sum(ln_x, axis=1) / ln_count",
                 "    ln_d = tl.where(ln_ok[None, :], ln_x - ln_block_mean[:, None], 0.0)",
                 "    ln_total = ln_seen + ln_count",
                 "    ln_delta = ln_block_mean - ln_mean",
                 "    ln_mean = ln_mean + ln_delta * (ln_count / ln_total)",
                 "    ln_m2 = (ln_m2 + tl.sum(ln_d * ln_d, axis=1)",
                 "             + ln_delta * ln_delta * (ln_seen * ln_count / ln_total))",
                 "    ln_seen = ln_total",
                 f"ln_rstd = 1.0 / tl.sqrt(tl.maximum(ln_m2 / K, 0.0) + {eps})"]
        return "\n".join(indent + line for line in lines)

    def _operand(self, value: str, reader, position: int) -> str:
        """Input `position` of node `reader`, loaded at the tile's coordinates; one that lies along the channels
        (`along_channels`: a batch norm's [C] parameters) is laid along dim 1 first."""
        source = self.graph[value]
        per_channel = along_channels(reader, position)
        if source.op == "constant":
            if self.graph.constants[value].numel() == 1:
                return literal(self.graph.constants[value].reshape(()).item())
            constant = self.constants.setdefault(value, self.graph.constants[value].to(self.device))
            if per_channel:
                constant = constant.reshape([-1 if d == 1 else 1 for d in range(len(reader.type.shape))])
            self.operands.append(constant)
        elif per_channel:
            raise Unsupported(f"{reader.describe()}: batch-norm parameter {value} is not a constant")
        else:
            self.operands.append(value)
        j = len(self.operands) - 1
        offsets = (f"(a_g0 * po{j}_s0 + a_g1 * po{j}_s1 + a_g2 * po{j}_s2 + a_g3 * po{j}_s3)[:, None] "
                   f"+ k_at[None, :] * po{j}_sk")
        return (f"tl.load(po{j}_ptr + {offsets}, mask=mask_m[:, None] & (k_at < K)[None, :], other=0.0)"
                ".to(tl.float32)")

    @property
    def params(self) -> str:
        """Kernel parameters for the template signature (each followed by a comma)."""
        return "".join(f"po{j}_ptr, po{j}_s0, po{j}_s1, po{j}_s2, po{j}_s3, po{j}_sk, "
                       for j in range(len(self.operands))) + "".join(f"pn{j}_ptr, "
                                                                      for j in range(len(self.norm_vectors)))

    @property
    def row_stride_names(self) -> list[str]:
        """The operands' strides along A's row groups (`opfuse.codegen.base.row_unit_of`)."""
        return [f"po{j}_s{i}" for j in range(len(self.operands)) for i in range(4)]

    def code(self, indent: str = "        ") -> str:
        return "\n".join(indent + line for line in self.lines)

    def launch_args(self, values: dict[str, torch.Tensor]) -> list:
        """Each operand broadcast to A's shape, and its strides in A's row groups (the layout's three, then an
        empty fourth) and along the reduction."""
        args: list = []
        for operand in self.operands:
            tensor = values[operand] if isinstance(operand, str) else operand
            tensor, strides = self.layout.strides(tensor, channels=self.k)
            r0, r1, r2, channel = strides[-4:]
            args += [tensor, r0, r1, r2, 0, channel]
        return args + list(self.norm_vectors)
