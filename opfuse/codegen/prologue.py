"""Prologues of GEMM kernels: elementwise ops applied to the A tile as it is loaded, before the dot.

Entry point: `Prologue(graph, nodes, source, layout, k, device)` for the chain `nodes` between A's source value and
the anchor (`opfuse.fusion.legality.anchor_prologue`: squeeze-and-excitation's channel scale before the project
conv, a scale before a linear). It gives the GEMM template its extra parameters (`params`), the Triton lines that
turn the loaded tile `a` into the prologue's result (`code`, run on every K block), and the launch arguments
(`launch_args`).

Contract with the template: at the prologue point `a` [BLOCK_M, BLOCK_K] is the loaded A tile, `k_at` [BLOCK_K]
the global reduction index of its columns, `a_g0 .. a_g3` [BLOCK_M] its row index in A's four row groups, and
`mask_m`, K the row mask and the reduction length. An operand of a prologue node is a scalar constant (a literal)
or a tensor broadcast to A's shape (a (N, C, 1, 1) scale costs nothing along the pixels), read through its strides
at the tile's coordinates. Each node's result is rounded to its dtype, as eager rounds the value it would write, and
the tile's elements past M or K are zero again after the prologue (x / s at a masked zero would be NaN, and NaN
times B's masked zero is still NaN).
"""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.epilogue import TileLayout
from opfuse.codegen.expr import emit, literal, triton_dtype
from opfuse.ir.graph import Graph


class Prologue:
    """The elementwise ops between a GEMM's A source and its anchor, as kernel parameters, code and arguments."""

    def __init__(self, graph: Graph, nodes: Sequence[str], source: str, layout: TileLayout, k: int,
                 device: torch.device):
        self.graph, self.nodes, self.source, self.layout, self.k = graph, list(nodes), source, layout, k
        self.device = device
        self.operands: list[str | torch.Tensor] = []     # runtime value names, or constants held on the device
        self.constants: dict[str, torch.Tensor] = {}     # the constants the nodes read (the library forms run
                                                         # the nodes through PyTorch too)
        self.lines: list[str] = ["p = a.to(tl.float32)"]
        chain = {source}
        for name in self.nodes:
            node = graph[name]
            args = ["p" if value in chain else self._operand(value) for value in node.inputs]
            self.lines.append(f"p = ({emit(node.op, node.attrs, args)}).to({triton_dtype(node.type.dtype)})"
                              ".to(tl.float32)")
            chain.add(name)
        self.lines.append("a = tl.where(mask_m[:, None] & (k_at < K)[None, :], p, 0.0).to(a.dtype)")
        self.output = self.nodes[-1]

    def _operand(self, value: str) -> str:
        node = self.graph[value]
        if node.op == "constant":
            constant = self.constants.setdefault(value, self.graph.constants[value].to(self.device))
            if constant.numel() == 1:
                return literal(constant.reshape(()).item())
            self.operands.append(constant)
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
                       for j in range(len(self.operands)))

    def code(self, indent: str = "        ") -> str:
        return "\n".join(indent + line for line in self.lines)

    @property
    def runtime_values(self) -> list[str]:
        return [v for v in self.operands if isinstance(v, str)]

    def launch_args(self, values: dict[str, torch.Tensor]) -> list:
        """Each operand broadcast to A's shape, and its strides in A's row groups (the layout's three, then an
        empty fourth) and along the reduction."""
        args: list = []
        for operand in self.operands:
            tensor = values[operand] if isinstance(operand, str) else operand
            tensor, strides = self.layout.strides(tensor, channels=self.k)
            r0, r1, r2, channel = strides[-4:]
            args += [tensor, r0, r1, r2, 0, channel]
        return args
