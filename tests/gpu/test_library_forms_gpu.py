"""The library forms on the GPU: cuDNN/cuBLAS, then each epilogue kernel (the 2-D tiles and the flat one) over their
result, and the fused library form (cuDNN's conv + bias (+ residual) + ReLU, cuBLASLt's linear + bias + ReLU or
tanh-GELU in one call), in fp16, against the float32 reference, every output element written (NaN-poisoned first).
Channel counts that leave no row 16-byte aligned (ShuffleNet's 58, 116) are the case the flat epilogue is for.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_library_forms_gpu.py
"""

import pytest
import torch

from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.forms import LIBRARY_CONFIGS, LIBRARY_FUSED, is_flat
from opfuse.codegen.gemm import lower_gemm_group
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.clock import graph_time
from tests.kernels.test_conv_kernels import Builder
from tests.kernels.test_gemm_kernels import linear

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


def check_every_library_form(b: Builder, outputs: list[str], kernel, fused: bool = False) -> None:
    """Each library form against the reference; with `fused`, the fused library form too (cuDNN's or cuBLASLt's
    call with the epilogue), which must also replay in a CUDA graph as the compiled model runs it."""
    kernel.epilogue.output_fill = float("nan")
    feeds = [b.feeds[name].cuda() for name in kernel.runtime_inputs]
    assert any(is_flat(config) for config in LIBRARY_CONFIGS)
    assert (kernel.library_fused is not None) == fused
    for config in (*LIBRARY_CONFIGS, *((LIBRARY_FUSED,) if fused else ())):
        results = kernel.run(feeds, config)
        torch.cuda.synchronize()
        b.check(outputs, [r.cpu() for r in results])
    if fused:
        assert graph_time(lambda: kernel.run(feeds, LIBRARY_FUSED)) > 0


@pytest.mark.parametrize("cin,cout,residual", [(58, 58, True), (116, 232, False), (64, 96, True)])
def test_a_conv_with_bias_residual_and_relu(cin, cout, residual):
    b = Builder("float16")
    x = b.input("x", (4, cin, 14, 14))
    y = b.conv(x, cout, 1)
    if residual:
        y = b.op("add", y, b.input("r", (4, cout, 14, 14)))
    y = b.op("relu", y)
    kind = GroupKind.RESIDUAL if residual else GroupKind.ANCHOR_EPILOGUE
    check_every_library_form(b, [y], lower_conv_group(b.graph, b.group([y], kind), "cuda"), fused=True)


@pytest.mark.parametrize("kernel_size,stride,groups,dtype", [(3, 2, 1, "float16"), (3, 1, 8, "float16"),
                                                             (7, 2, 1, "float16"), (3, 1, 1, "float32")])
def test_a_conv_with_relu_in_one_cudnn_call(kernel_size, stride, groups, dtype):
    """The implicit-GEMM convs' shapes (strided, grouped as RegNet's, a 7x7 stem), each fused by cuDNN."""
    b = Builder(dtype)
    x = b.input("x", (2, 64, 28, 28))
    y = b.op("relu", b.conv(x, 96, kernel_size, stride=stride, padding=kernel_size // 2, groups=groups))
    allowed = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False          # float32 checked at float32's tolerance
    try:
        check_every_library_form(b, [y], lower_conv_group(b.graph, b.group([y]), "cuda"), fused=True)
    finally:
        torch.backends.cudnn.allow_tf32 = allowed


@pytest.mark.parametrize("n,approximate", [(1000, "none"), (768, "tanh"), (3072, "tanh")])
def test_a_linear_with_gelu(n, approximate):
    """cuBLASLt's GELU epilogue is tanh's: offered for a tanh GELU (GPT-2's) only."""
    b = Builder("float16")
    x = b.input("x", (2, 64, 256))
    y = b.op("gelu", linear(b, x, n), approximate=approximate)
    check_every_library_form(b, [y], lower_gemm_group(b.graph, b.group([y]), "cuda"), fused=approximate == "tanh")


def test_a_linear_with_relu():
    b = Builder("float16")
    x = b.input("x", (2, 64, 256))
    y = b.op("relu", linear(b, x, 512))
    check_every_library_form(b, [y], lower_gemm_group(b.graph, b.group([y]), "cuda"), fused=True)


def test_a_batched_matmul_scaled():
    b = Builder("float16")
    a, m = b.input("a", (2, 12, 128, 64)), b.input("m", (2, 12, 64, 128))
    y = b.op("mul", b.op("matmul", a, m), b.const("s", torch.tensor(0.125)))
    check_every_library_form(b, [y], lower_gemm_group(b.graph, b.group([y]), "cuda"))


def test_a_1x1_conv_with_a_squeeze_excitation_scale_prologue():
    """RegNet's and EfficientNet's projection conv: the SE scale computed by the library forms' operand kernel."""
    b = Builder("float16")
    x = b.input("x", (4, 104, 14, 14))
    scaled = b.op("mul", x, b.input("s", (4, 104, 1, 1)))     # the sigmoid is in the squeeze kernel before
    y = b.op("relu", b.op("add", b.conv(scaled, 208, 1), b.input("r", (4, 208, 14, 14))))
    kernel = lower_conv_group(b.graph, b.group([y], GroupKind.RESIDUAL), "cuda")
    assert kernel.operand_kernel is not None
    check_every_library_form(b, [y], kernel, fused=True)
