"""Convolution anchor kernels with fused epilogues: implicit GEMM, 1x1 as GEMM, and depthwise direct convolution.

Entry point: `lower_conv_group(graph, group, device)` for groups anchored on conv2d (or horizontal groups of
sibling conv2ds on one input). Which kernel a conv gets:
  depthwise (groups == Cin > 1, Cout a multiple of Cin)  -> `opfuse.codegen.conv_depthwise.DepthwiseConvKernel`:
      direct convolution, one multiply-add per tap;
  1x1, no padding, groups == 1                            -> `opfuse.codegen.gemm.GemmKernel` over pixels (a
      strided 1x1 conv is a GEMM over the strided view x[:, :, ::s, ::s]);
  anything else                                          -> `opfuse.codegen.conv_implicit_gemm.ConvKernel`:
      implicit GEMM (a grouped conv's configs may block its conv groups).
All kernels read the activation through its 4 strides (channels-last in practice; a channel-slice view works),
load zeros for padding taps, and store channels-last outputs through the shared epilogue; what they share is in
`opfuse.codegen.conv_common`. The conv through PyTorch (`ConvLibraryAnchor`) is a kernel's library form.

Traffic: the input is read once per output-channel tile (Kh·Kw times through L2/shared memory), the packed
weight once per pixel tile, the output written once; FLOPs as `opfuse.ir.op_costs.conv2d_flops`.
"""

from __future__ import annotations

import torch

from opfuse.codegen.base import GroupKernel
from opfuse.codegen.conv_common import ConvGeometry, weights_on_device
from opfuse.codegen.conv_depthwise import DepthwiseConvKernel
from opfuse.codegen.conv_implicit_gemm import ConvKernel
from opfuse.codegen.epilogue import Epilogue, TileLayout, compute_dtype, siblings_and_chains
from opfuse.codegen.expr import Unsupported, refusal
from opfuse.codegen.gemm import GemmKernel, prologue_source, anchor_biases
from opfuse.codegen.library_fused import FusedConvLibrary, fused_chain
from opfuse.codegen.prologue import Prologue
from opfuse.fusion.legality_anchors import anchor_prologue, row_norm_epilogue
from opfuse.fusion.legality_common import Users
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.tiles import conv_as_gemm
from opfuse.hardware import HardwareProfile
from opfuse.ir.graph import Graph, torch_dtype


def lower_conv_group(graph: Graph, group: FusionGroup, device: torch.device | str,
                     hw: HardwareProfile | None = None) -> GroupKernel:
    """The kernel of a group anchored on conv2d (horizontal: sibling convs of one geometry on one input), with
    tiles for GPU `hw` (default: the default profile)."""
    device = torch.device(device)
    users = graph.users()      # once for the whole lowering: each step below reads it
    anchors, chains, geometry, norm, ops = _taken(graph, group, users)
    first = graph[anchors[0]]
    x = first.inputs[0]
    dtype = torch_dtype(compute_dtype(graph, x, first))
    # the graph's weights: each kernel below copies them to the device once (`weights_on_device`), ConvKernel as
    # the packing of its default config
    weights = [graph.constants[graph[a].inputs[1]] for a in anchors]
    n, _, h_out, w_out = first.type.shape
    layout = TileLayout((n, sum(w.shape[0] for w in weights), h_out, w_out), channel_dim=1, channels_last=True)
    biases = anchor_biases(graph, anchors)
    epilogue = Epilogue(graph, group, chains, layout, device, biases, whole_rows=norm is not None)

    g = geometry
    library = ConvLibraryAnchor(x, weights, dtype, device, geometry)
    if ops:     # a 1x1 conv computes them on its input tiles (the planner takes them for no other conv)
        weight = weights_on_device(weights, device, dtype)
        source = prologue_source(graph, ops)
        input_layout = TileLayout(graph[x].type.shape, channel_dim=1, channels_last=True)
        kernel = GemmKernel(graph, group, device, epilogue, a=source, k=g.cin,
                            b_packed=weight[:, :, 0, 0].t().contiguous(), conv=True,
                            prologue=Prologue(graph, ops, source, input_layout, g.cin, device), hw=hw)
    elif g.is_depthwise(layout.channels):
        kernel = DepthwiseConvKernel(graph, group, device, epilogue, x, geometry,
                                     weights_on_device(weights, device, dtype), hw)
    elif conv_as_gemm((g.kh, g.kw), g.padding, g.groups):
        weight = weights_on_device(weights, device, dtype)
        stride_h, stride_w = g.stride
        a_view = None if g.stride == (1, 1) else (lambda t: t[:, :, ::stride_h, ::stride_w])
        kernel = GemmKernel(graph, group, device, epilogue, a=x, k=g.cin,
                            b_packed=weight[:, :, 0, 0].t().contiguous(), a_view=a_view, hw=hw,
                            conv=True)
    else:
        kernel = ConvKernel(graph, group, device, epilogue, x, geometry, weights, dtype, hw)
    if norm is not None:    # no library form: its epilogue kernel's tiles would have to span the channels too
        return kernel
    kernel.library_anchor = library
    chain = fused_chain(graph, group, anchors, chains, device)
    if chain is not None:
        kernel.library_fused = FusedConvLibrary(chain, library.device_weight, x, biases[0], layout.channels, geometry)
    return kernel


def supports(graph: Graph, group: FusionGroup, users: Users | None = None) -> Reason | None:
    """None where the conv template takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("conv", lambda: _taken(graph, group, graph.users() if users is None else users))


def _taken(graph: Graph, group: FusionGroup, users: Users
           ) -> tuple[list[str], list[list[str]], ConvGeometry, str | None, list[str]]:
    """The group as the template takes it: its convolutions (several: horizontal siblings of one geometry on one
    input), their epilogue chains, the geometry, the row norm in the epilogue and the prologue ops (a 1x1 conv's);
    `Unsupported` (its code says which kind) where the template cannot."""
    anchors, chains = siblings_and_chains(graph, group, ("conv2d",), users)
    if len(anchors) > 1 and group.kind is not GroupKind.HORIZONTAL:
        raise Unsupported(f"group {group.name} ({group.kind.value}) holds several convolutions: {', '.join(anchors)}",
                          Code.SEVERAL_ANCHORS)
    first = graph[anchors[0]]
    geometry = ConvGeometry(graph, first)
    for name in anchors:
        node = graph[name]
        if node.inputs[0] != first.inputs[0] or ConvGeometry(graph, node).key() != geometry.key():
            raise Unsupported(f"horizontal group {group.name}: {node.describe()} differs from {first.describe()} in "
                              "input or geometry", Code.SEVERAL_ANCHORS)
        if not graph.is_constant(node.inputs[1]):
            raise Unsupported(f"{node.describe()}: the weight is not a constant", Code.NOT_CONSTANT)
    if len(anchors) > 1 and geometry.groups != 1:
        raise Unsupported(f"horizontal group {group.name}: grouped convolutions are not concatenated",
                          Code.SEVERAL_ANCHORS)
    compute_dtype(graph, first.inputs[0], first)
    anchor_biases(graph, anchors)
    channels = sum(graph[a].type.shape[1] for a in anchors)
    norm = row_norm_epilogue(graph, anchors[0], group.nodes)
    if norm is not None and (len(anchors) > 1 or not geometry.is_depthwise(channels)):
        raise Unsupported(f"group {group.name}: norm {norm} in the epilogue of {first.describe()}", Code.EPILOGUE_FORM)
    ops = anchor_prologue(graph, anchors[0], group.nodes, users)
    g = geometry
    if ops and (len(anchors) > 1 or not (conv_as_gemm((g.kh, g.kw), g.padding, g.groups) and g.stride == (1, 1))):
        raise Unsupported(f"group {group.name}: a prologue ({', '.join(ops)}) before {first.describe()}",
                          Code.EPILOGUE_FORM)
    return anchors, chains, geometry, norm, ops


class ConvLibraryAnchor:
    """The convolution through PyTorch (cuDNN), as [1, pixels, channels]: its channels-last output, flattened.

    Its weight in PyTorch's layout, channels-last as the input is (whatever layout the frontend gave the constant:
    ONNX initializers come contiguous), goes to the device on first use and `release` drops it, so a conv kernel
    holds one device copy of its weight (the packed one) unless the autotuner keeps its library form."""

    def __init__(self, x: str, weights: list[torch.Tensor], dtype: torch.dtype, device: torch.device,
                 geometry: ConvGeometry):
        self.x, self.weights, self.dtype, self.device, self.geometry = x, weights, dtype, device, geometry
        self.weight: torch.Tensor | None = None

    def device_weight(self) -> torch.Tensor:
        """The weight on the device, made on first use (the fused library form reads this same copy)."""
        if self.weight is None:   # channels-last like the input: cuDNN would transpose a mismatched one per call
            weight = weights_on_device(self.weights, self.device, self.dtype)
            self.weight = weight.contiguous(memory_format=torch.channels_last)
        return self.weight

    def __call__(self, values: dict[str, torch.Tensor]) -> torch.Tensor:
        g = self.geometry
        y = torch.nn.functional.conv2d(values[self.x], self.device_weight(), None, g.stride, g.padding, g.dilation,
                                       g.groups)
        y = y.contiguous(memory_format=torch.channels_last)
        return y.permute(0, 2, 3, 1).reshape(1, -1, y.shape[1])

    def release(self) -> None:
        self.weight = None
