"""What the convolution kernels share (`opfuse.codegen.conv` and the kernels beside it: `conv_implicit_gemm`,
`conv_depthwise`, `conv_conv`): a conv2d node's geometry as the kernels take it (`ConvGeometry`), the input strides
their templates address output rows with, and the anchors' weights copied to the device.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.expr import Unsupported, int_pair
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import Graph, Node

# the input's strides along the output rows' pixels, which set ROW_UNIT with the epilogue's
# (`opfuse.codegen.base.row_unit_of`)
X_ROW_STRIDES = ("s_xn", "s_xh", "s_xw")
# the conv templates' geometry parameters (`ConvGeometry.constexprs` gives their values), in their signatures
GEOMETRY_PARAMS = """\
    KH: tl.constexpr, KW: tl.constexpr, STRIDE_H: tl.constexpr, STRIDE_W: tl.constexpr,
    PAD_H: tl.constexpr, PAD_W: tl.constexpr, DIL_H: tl.constexpr, DIL_W: tl.constexpr,
"""


class ConvGeometry:
    """Stride, padding, dilation, groups and kernel size of a conv2d node, as the kernels take them."""

    def __init__(self, graph: Graph, node: Node):
        x_type, w_type = graph[node.inputs[0]].type, graph[node.inputs[1]].type
        if len(x_type.shape) != 4:
            raise Unsupported(f"{node.describe()}: input {x_type} is not [N, C, H, W]", Code.OPERAND_SHAPE)
        self.stride = int_pair(node.attrs.get("stride", 1), node, "stride")
        self.padding = int_pair(node.attrs.get("padding", 0), node, "padding")
        self.dilation = int_pair(node.attrs.get("dilation", 1), node, "dilation")
        self.groups = int(node.attrs.get("groups", 1))
        self.batch, self.cin, self.height, self.width = x_type.shape
        self.cin_per_group, self.kh, self.kw = w_type.shape[1:]

    def key(self) -> tuple:
        return self.stride, self.padding, self.dilation, self.groups, self.cin_per_group, self.kh, self.kw

    def is_depthwise(self, cout: int) -> bool:
        """Whether the conv, with `cout` output channels, runs as `DepthwiseConvKernel`: one input channel a group
        (groups == Cin > 1) and Cout a multiple of Cin."""
        return self.groups > 1 and self.groups == self.cin and cout % self.cin == 0

    def constexprs(self) -> dict[str, int]:
        return dict(KH=self.kh, KW=self.kw, STRIDE_H=self.stride[0], STRIDE_W=self.stride[1],
                    PAD_H=self.padding[0], PAD_W=self.padding[1], DIL_H=self.dilation[0], DIL_W=self.dilation[1])


def weights_on_device(weights: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The anchors' weights [Cout, Cin/g, Kh, Kw] (the graph's, on the host) as one tensor, concatenated along Cout,
    on `device` in `dtype`: one copy to the device each call, so a kernel calls it once for each device copy it
    holds."""
    return torch.cat(list(weights), 0).to(device=device, dtype=dtype)
