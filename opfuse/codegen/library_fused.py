"""The fused library form of an anchor kernel: the whole group as one library call that runs the epilogue itself.

cuDNN fuses a convolution with its bias, a residual add and ReLU (`torch.cudnn_convolution_relu`,
`torch.cudnn_convolution_add_relu`); cuBLASLt fuses a GEMM with its bias and ReLU or tanh-GELU
(`torch._addmm_activation`). Where a group's epilogue is exactly one of these chains and the group stores only its
last value, its kernel offers `LIBRARY_FUSED` beside its other forms (`EpilogueKernel.library_fused`): one launch
where the library form makes two (the library's kernel, then the generated epilogue kernel) and no round trip of
the anchor's result through memory. The autotuner measures it like every other form and keeps it only where it is
faster. The chains (`fused_chain`):

    conv2d -> relu             conv2d -> add(residual) -> relu       cuDNN: CUDA devices only
    linear -> relu             linear -> gelu(approximate='tanh')    cuBLASLt; on other devices ATen's addmm
                                                                     and ReLU (its CPU GELU is erf's: no GELU)

A library that cannot run a chain for some shape (no cuDNN engine for it, say) raises; the form then reports
`LibraryUnavailable` and the autotuner leaves it out, as it leaves out a Triton config that is out of resources.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from opfuse.fusion.plan import FusionGroup
from opfuse.ir.graph import Graph

if TYPE_CHECKING:
    from opfuse.codegen.conv_common import ConvGeometry

# the activations each anchor's library call fuses, on CUDA devices and elsewhere
ACTIVATIONS = {("conv2d", True): ("relu",), ("linear", True): ("relu", "gelu_tanh"), ("linear", False): ("relu",)}


class LibraryUnavailable(RuntimeError):
    """The library refused the fused call (no engine for this shape or layout): the form is not a candidate."""


@dataclass(frozen=True)
class FusedChain:
    """A group's epilogue as the library can run it: the activation ('relu' or 'gelu_tanh') and the residual
    tensor added before it (conv2d only), or None."""

    activation: str
    residual: str | None = None


def _activation(graph: Graph, name: str) -> str | None:
    node = graph[name]
    if node.op == "relu":
        return "relu"
    if node.op == "gelu" and node.attrs.get("approximate", "none") == "tanh":
        return "gelu_tanh"
    return None


def fused_chain(graph: Graph, group: FusionGroup, anchors: Sequence[str], chains: Sequence[Sequence[str]],
                device: torch.device) -> FusedChain | None:
    """The chain of a group of one conv2d or linear anchor that the library fuses on `device` (see the module
    docstring), or None: the group's only output is the chain's last node, which is the activation; a residual is
    a full-shape runtime tensor of the anchor's dtype added with no scaling."""
    if len(anchors) != 1 or len(chains) != 1:
        return None
    chain, anchor = list(chains[0]), graph[anchors[0]]
    if list(group.outputs) != chain[-1:] or len(chain) not in (2, 3):
        return None
    activation = _activation(graph, chain[-1])
    if activation not in ACTIVATIONS.get((anchor.op, torch.device(device).type == "cuda"), ()):
        return None
    residual = None
    if len(chain) == 3:
        add = graph[chain[1]]
        others = [i for i in add.inputs if i != anchor.name]
        if anchor.op != "conv2d" or add.op != "add" or len(add.inputs) != 2 or len(others) != 1 \
                or add.attrs.get("alpha", 1) != 1:
            return None
        residual = others[0]
        if graph.is_constant(residual) or graph[residual].type != anchor.type:
            return None
    for previous, name in zip(chain, chain[1:]):
        if previous not in graph[name].inputs or graph[name].type.dtype != anchor.type.dtype:
            return None
    return FusedChain(activation, residual)


def _guarded(call: Callable[[], torch.Tensor], what: str) -> torch.Tensor:
    try:
        return call()
    except (RuntimeError, NotImplementedError) as error:
        raise LibraryUnavailable(f"{what}: {error}") from error


class FusedConvLibrary:
    """conv2d + bias (+ residual) + ReLU as one cuDNN call; its weight is the library form's (`weight_of`: one
    device copy for both forms), its bias on the device on first use."""

    def __init__(self, chain: FusedChain, weight_of: Callable[[], torch.Tensor], x: str, bias: torch.Tensor | None,
                 channels: int, geometry: "ConvGeometry"):
        self.chain, self.weight_of, self.x, self.geometry = chain, weight_of, x, geometry
        self.host_bias, self.channels = bias, channels
        self.bias: torch.Tensor | None = None

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        x, weight, g = values[self.x], self.weight_of(), self.geometry
        if self.bias is None:
            bias = self.host_bias if self.host_bias is not None else torch.zeros(self.channels)
            self.bias = bias.to(device=x.device, dtype=x.dtype)
        if self.chain.residual is None:
            y = _guarded(lambda: torch.cudnn_convolution_relu(x, weight, self.bias, g.stride, g.padding, g.dilation,
                                                              g.groups), "cudnn_convolution_relu")
        else:
            z = values[self.chain.residual]
            y = _guarded(lambda: torch.cudnn_convolution_add_relu(x, weight, z, 1.0, self.bias, g.stride, g.padding,
                                                                  g.dilation, g.groups), "cudnn_convolution_add_relu")
        return [y]


class FusedLinearLibrary:
    """linear + bias + ReLU or tanh-GELU as one cuBLASLt GEMM over the kernel's packed [K, N] weight."""

    def __init__(self, chain: FusedChain, x: str, weight: torch.Tensor, bias: torch.Tensor | None,
                 leading: tuple[int, ...]):
        self.chain, self.x, self.weight, self.leading = chain, x, weight, leading
        n = weight.shape[1]
        bias = bias if bias is not None else torch.zeros(n)
        self.bias = bias.to(device=weight.device, dtype=weight.dtype)

    def __call__(self, values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        k, n = self.weight.shape
        x = values[self.x].reshape(-1, k)
        y = _guarded(lambda: torch._addmm_activation(self.bias, x, self.weight,
                                                     use_gelu=self.chain.activation == "gelu_tanh"),
                     "_addmm_activation")
        return [y.reshape(*self.leading, n)]
