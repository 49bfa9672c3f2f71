"""A depthwise conv with the layer norm over its channels in its epilogue (`FusionConfig.norm_epilogue`:
ConvNeXt's 7x7 conv -> permute -> LayerNorm, one kernel whose tiles span every channel) compiled by the real Triton
backend, fp16, at ConvNeXt-tiny's stage shapes (96 channels at 56x56 to 768 at 7x7, batch 1 and 8). Every candidate
config must write every element and match the float32 reference about as closely as PyTorch's own fp16 conv and
layer norm, at least one config of each shape must compile without register spills; and a whole ConvNeXt block
compiled with the switch on must match eager.

Run on the device machine:
    OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_norm_epilogue_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

import opfuse  # noqa: E402
from opfuse.codegen.conv import lower_conv_group  # noqa: E402
from opfuse.codegen.conv_depthwise import DepthwiseConvKernel  # noqa: E402
from opfuse.fusion.plan import FusionGroup, GroupKind  # noqa: E402
from opfuse.hardware import get_hardware  # noqa: E402
from opfuse.ir.graph import Graph, TensorType  # noqa: E402
from opfuse.ir.ops import infer_type  # noqa: E402
from opfuse.numerics import relative_error, tolerance  # noqa: E402

from tests.gpu.config_checks import check_every_config  # noqa: E402


def depthwise_norm(channels: int, batch: int, size: int, generator: torch.Generator):
    """The kernel of an fp16 group conv2d (7x7 depthwise, bias) -> permute -> layer_norm, and its weights."""
    graph = Graph("dw_ln")
    x = graph.add_input("x", TensorType((batch, channels, size, size), "float16")).name
    weights = {"w": torch.randn(channels, 1, 7, 7, generator=generator) / 7,
               "b": 0.1 * torch.randn(channels, generator=generator),
               "ln_w": 1 + 0.2 * torch.randn(channels, generator=generator),
               "ln_b": 0.2 * torch.randn(channels, generator=generator)}
    for name, tensor in weights.items():
        graph.add_constant(name, tensor.to(torch.float16))

    def add(op, inputs, attrs, name):
        return graph.add_node(op, inputs, infer_type(op, [graph[i].type for i in inputs], attrs), attrs, name=name).name

    conv = add("conv2d", [x, "w", "b"], {"stride": (1, 1), "padding": (3, 3), "dilation": (1, 1), "groups": channels},
               "dw")
    rows = add("permute", [conv], {"dims": [0, 2, 3, 1]}, "perm")
    out = add("layer_norm", [rows, "ln_w", "ln_b"], {"normalized_shape": [channels], "eps": 1e-6}, "ln")
    graph.outputs = [out]
    group = FusionGroup(0, GroupKind.ANCHOR_EPILOGUE, [conv, rows, out], anchor=conv, inputs=[x], outputs=[out])
    return lower_conv_group(graph, group, "cuda", get_hardware("h200")), weights


@pytest.mark.parametrize("channels,size", [(96, 56), (192, 28), (384, 14), (768, 7)])
@pytest.mark.parametrize("batch", [1, 8])
def test_every_config_matches_the_reference_in_fp16(channels, size, batch):
    generator = torch.Generator().manual_seed(channels + batch)
    kernel, weights = depthwise_norm(channels, batch, size, generator)
    assert isinstance(kernel, DepthwiseConvKernel) and kernel.epilogue.whole_rows
    x = torch.randn(batch, channels, size, size, generator=generator).to(torch.float16).cuda()
    x = x.contiguous(memory_format=torch.channels_last)
    w = {name: tensor.cuda() for name, tensor in weights.items()}

    def reference(dtype):
        y = F.conv2d(x.to(dtype), w["w"].to(dtype), w["b"].to(dtype), padding=3, groups=channels)
        return F.layer_norm(y.permute(0, 2, 3, 1), (channels,), w["ln_w"].to(dtype), w["ln_b"].to(dtype), 1e-6)

    expected = reference(torch.float32)
    torch_fp16 = relative_error(reference(torch.float16), expected)
    check_every_config(kernel, [x], kernel.configs(), expected, torch_fp16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_convnext_block_with_the_norm_in_the_conv_matches_eager(dtype):
    from torchvision.models.convnext import CNBlock

    torch.manual_seed(0)
    block = CNBlock(96, layer_scale=0.5, stochastic_depth_prob=0.0).eval().cuda()
    x = torch.randn(2, 96, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last)
    config = opfuse.FusionConfig(dtype="float32" if dtype == torch.float32 else "float16", norm_epilogue=True)
    compiled = opfuse.compile(block, (x.to(dtype),), config)
    graph = compiled.plan.graph
    conv = next(g for g in compiled.plan.groups if any(graph[n].op == "conv2d" for n in g.nodes))
    assert [graph[n].op for n in conv.nodes] == ["conv2d", "permute", "layer_norm"]
    assert conv.name not in compiled.fallbacks
    fresh = torch.randn(2, 96, 28, 28, device="cuda").contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        error = relative_error(compiled(fresh.to(dtype)).float(), block(fresh))
    assert error < tolerance("float32" if dtype == torch.float32 else "float16", "cuda"), error
