"""A linear with its layer norm as a GEMM prologue (`opfuse.codegen.prologue`: row statistics in a pass over K, then
every A tile normalized before its dot) compiled by the real Triton backend: GPT-2's ln -> c_attn in fp16 (M=128,
K=768, N=2304). Every Triton config the H200 profile gives, and the library form (F.layer_norm, then cuBLAS), must
match the float32 reference about as closely as PyTorch's own fp16 layer norm + linear, write every element, and at
least one config must compile without register spills.

Run on the device machine:
    OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_layer_norm_prologue_gpu.py
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

from opfuse.codegen.base import FORM_TRITON  # noqa: E402
from opfuse.codegen.forms import LIBRARY_CONFIGS  # noqa: E402
from opfuse.fusion.plan import FusionGroup, GroupKind  # noqa: E402
from opfuse.hardware import get_hardware  # noqa: E402
from opfuse.ir.graph import Graph, TensorType  # noqa: E402
from opfuse.ir.ops import infer_type  # noqa: E402
from opfuse.numerics import relative_error, tolerance  # noqa: E402

from tests.gpu.config_checks import check_every_config  # noqa: E402

M, K, N = 128, 768, 2304


def layer_norm_linear(generator: torch.Generator):
    """The kernel of an fp16 group layer_norm -> linear (+ bias), its weights, and the graph."""
    from opfuse.codegen.gemm import lower_gemm_group

    graph = Graph("ln_linear")
    x = graph.add_input("x", TensorType((1, M, K), "float16")).name
    weights = {"ln_w": 1 + 0.2 * torch.randn(K, generator=generator), "ln_b": 0.2 * torch.randn(K, generator=generator),
               "w": torch.randn(N, K, generator=generator) / K ** 0.5, "b": 0.1 * torch.randn(N, generator=generator)}
    for name, tensor in weights.items():
        graph.add_constant(name, tensor.to(torch.float16))

    def add(op, inputs, attrs, name):
        return graph.add_node(op, inputs, infer_type(op, [graph[i].type for i in inputs], attrs), attrs, name=name).name

    ln = add("layer_norm", [x, "ln_w", "ln_b"], {"normalized_shape": [K], "eps": 1e-5}, "ln")
    out = add("linear", [ln, "w", "b"], {}, "linear")
    graph.outputs = [out]
    group = FusionGroup(0, GroupKind.ANCHOR_EPILOGUE, [ln, out], anchor=out, inputs=[x], outputs=[out])
    return lower_gemm_group(graph, group, "cuda", get_hardware("h200")), weights


def test_every_config_and_the_library_form_match_the_reference_in_fp16():
    generator = torch.Generator().manual_seed(0)
    kernel, weights = layer_norm_linear(generator)
    assert kernel.prologue is not None and kernel.prologue.norm == "ln" and kernel.split is None
    # a residual stream: an offset and a few large channels, as GPT-2's are
    x = torch.randn(1, M, K, generator=generator) + 3.0
    x[..., :4] *= 20
    x = x.to(torch.float16).cuda()
    w = {name: tensor.cuda() for name, tensor in weights.items()}
    reference = F.linear(F.layer_norm(x.float(), (K,), w["ln_w"].float(), w["ln_b"].float(), 1e-5),
                         w["w"].float(), w["b"].float())
    half = w["ln_w"].half(), w["ln_b"].half(), w["w"].half(), w["b"].half()
    torch_fp16 = relative_error(F.linear(F.layer_norm(x, (K,), half[0], half[1], 1e-5), half[2], half[3]), reference)
    configs = [c for c in kernel.configs() if c.form == FORM_TRITON] + list(LIBRARY_CONFIGS[:1])
    assert len(configs) > 1, "no Triton config fits the H200"
    assert reference.shape == (1, M, N)
    check_every_config(kernel, [x], configs, reference, torch_fp16)
    assert kernel.launches(configs[0]) == 1 and kernel.launches(LIBRARY_CONFIGS[0]) == 2   # F.layer_norm + addmm
