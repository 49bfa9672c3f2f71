"""The fused library form (`opfuse.codegen.library_fused`): which groups' epilogues the library runs itself (cuDNN's
conv + bias (+ residual) + ReLU, cuBLASLt's linear + bias + ReLU / tanh-GELU), the linear's form run against the
float32 reference (ATen on the CPU), and a library that refuses the call left out of tuning, not an error."""

from __future__ import annotations

import pytest
import torch

from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.epilogue import siblings_and_chains
from opfuse.codegen.forms import LIBRARY_FUSED, UNFUSED, is_library_fused
from opfuse.codegen.gemm import lower_gemm_group
from opfuse.codegen.library_fused import FusedChain, FusedConvLibrary, fused_chain
from opfuse.config import FusionConfig
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.autotune import compile_configs, tune
from tests.kernels.test_conv_kernels import Builder
from tests.kernels.test_gemm_kernels import linear


def chain_of(b: Builder, outputs: list[str], kind: GroupKind = GroupKind.ANCHOR_EPILOGUE, anchor_ops=("conv2d",),
             device: str = "cuda"):
    group = b.group(outputs, kind)
    anchors, chains = siblings_and_chains(b.graph, group, anchor_ops)
    return fused_chain(b.graph, group, anchors, chains, torch.device(device))


def test_conv_relu_and_conv_residual_relu_are_fused_chains():
    b = Builder()
    x = b.input("x", (1, 4, 6, 6))
    y = b.op("relu", b.conv(x, 8, 3, padding=1))
    assert chain_of(b, [y]) == FusedChain("relu")
    assert chain_of(b, [y], device="cpu") is None       # cuDNN's alone
    b = Builder()
    x, r = b.input("x", (1, 4, 6, 6)), b.input("r", (1, 8, 6, 6))
    y = b.op("relu", b.op("add", r, b.conv(x, 8, 3, padding=1)))      # the residual on either side of the add
    assert chain_of(b, [y], GroupKind.RESIDUAL) == FusedChain("relu", residual=r)


@pytest.mark.parametrize("case", ["gelu", "relu6", "two outputs", "broadcast residual", "constant residual",
                                  "no activation", "mul before relu"])
def test_other_conv_epilogues_are_not(case):
    b = Builder()
    x = b.input("x", (1, 4, 6, 6))
    conv = b.conv(x, 8, 3, padding=1)
    kind = GroupKind.ANCHOR_EPILOGUE
    if case == "gelu":
        outputs = [b.op("gelu", conv)]
    elif case == "relu6":
        outputs = [b.op("clamp", conv, min=0.0, max=6.0)]
    elif case == "two outputs":
        outputs = [conv, b.op("relu", conv)]
    elif case == "broadcast residual":
        outputs, kind = [b.op("relu", b.op("add", conv, b.input("r", (1, 8, 1, 6))))], GroupKind.RESIDUAL
    elif case == "constant residual":
        outputs = [b.op("relu", b.op("add", conv, b.const("c", b.random(1, 8, 6, 6))))]
    elif case == "no activation":
        outputs = [conv]
    else:
        outputs = [b.op("relu", b.op("mul", conv, b.const("s", b.random(8, 1, 1))))]
    assert chain_of(b, outputs, kind) is None


@pytest.mark.parametrize("case,expected", [("gelu tanh", FusedChain("gelu_tanh")), ("relu", FusedChain("relu")),
                                           ("gelu erf", None), ("residual relu", None)])
def test_linear_chains(case, expected):
    b = Builder()
    x = b.input("x", (5, 16))
    y, kind = linear(b, x, 8, bias=case != "relu"), GroupKind.ANCHOR_EPILOGUE
    if case == "gelu tanh":
        y = b.op("gelu", y, approximate="tanh")
    elif case == "gelu erf":
        y = b.op("gelu", y)
    elif case == "residual relu":
        y, kind = b.op("relu", b.op("add", y, b.input("r", (5, 8)))), GroupKind.RESIDUAL
    else:
        y = b.op("relu", y)
    assert chain_of(b, [y], kind, ("linear",)) == expected
    # elsewhere ATen's addmm and ReLU; its CPU GELU is erf's, not tanh's
    assert chain_of(b, [y], kind, ("linear",), "cpu") == (expected if case == "relu" else None)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_fused_form_matches_the_reference_in_one_launch(bias):
    b = Builder()
    x = b.input("x", (2, 3, 24))
    y = b.op("relu", linear(b, x, 12, bias))
    kernel = lower_gemm_group(b.graph, b.group([y]), "cpu")
    assert kernel.alternatives(library=True)[-2:] == [LIBRARY_FUSED, UNFUSED]
    assert kernel.launches(LIBRARY_FUSED) == 1
    (out,) = kernel.run([b.feeds["x"]], LIBRARY_FUSED)
    assert out.shape == (2, 3, 12)
    b.check([y], [out])
    assert "one cuDNN/cuBLASLt call" in kernel.describe_library_form(LIBRARY_FUSED)


def test_a_refused_library_call_is_left_out_of_tuning():
    """cuDNN's fused conv does not run here (no CUDA): the form is reported refused and another form is chosen."""
    b = Builder()
    x = b.input("x", (1, 4, 6, 6))
    y = b.op("relu", b.conv(x, 8, 3, padding=1))
    kernel = lower_conv_group(b.graph, b.group([y]), "cpu")
    assert kernel.library_fused is None              # offered on CUDA devices only
    kernel.library_fused = FusedConvLibrary(FusedChain("relu"), kernel.library_anchor.device_weight, x, None, 8,
                                            kernel.library_anchor.geometry)
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    assert compile_configs(kernel, feeds, [LIBRARY_FUSED])[LIBRARY_FUSED].startswith("library refused")
    chosen = tune({"g": kernel}, dict(zip(kernel.runtime_inputs, feeds)), FusionConfig(tune_top=None),
                  benchmark=lambda fn: (fn(), 1e-6)[1], quiet=True)
    assert not is_library_fused(chosen[kernel.group.name])
