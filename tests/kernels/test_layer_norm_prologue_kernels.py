"""A linear that absorbs the layer norm before it (a GEMM prologue with row statistics), on the interpreter.

The kernel computes each row's mean and rstd in a pass over K, then normalizes every A tile before its dot; odd M
and K leave the interpreter's tiles partial on both. Checked against the float32 reference (NaN-poisoned outputs),
in the Triton, library (F.layer_norm, then the GEMM) and unfused forms.
"""

from __future__ import annotations

import pytest
import torch

from opfuse.codegen.forms import LIBRARY_CONFIGS, UNFUSED
from opfuse.codegen.gemm import GemmKernel, lower_gemm_group
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.tiles import INTERPRETER, tile_key
from tests.kernels.test_conv_kernels import Builder, run_group
from tests.kernels.test_gemm_kernels import linear
from tests.kernels.test_library_anchor_kernels import run_library


def layer_norm(b: Builder, x: str, affine: bool = True, eps: float = 1e-5) -> str:
    k = b.graph[x].type.shape[-1]
    params = [b.const("ln_w", 1 + 0.3 * b.random(k)), b.const("ln_b", 0.3 * b.random(k))] if affine else []
    return b.op("layer_norm", x, *params, normalized_shape=[k], eps=eps)


@pytest.mark.parametrize("dtype,m,k,n,affine", [
    ("float32", 5, 24, 16, True),
    ("float32", 33, 40, 24, False),
    ("float16", 17, 40, 16, True),
    ("float16", 9, 24, 24, False),
])
def test_a_linear_normalizes_its_input_tiles(dtype, m, k, n, affine):
    b = Builder(dtype)
    x = b.input("x", (m, k))
    kernel, (out,) = run_group(b, [b.op("gelu", linear(b, layer_norm(b, x, affine), n))], lower=lower_gemm_group)
    assert isinstance(kernel, GemmKernel) and kernel.prologue.norm is not None
    assert kernel.runtime_inputs == ["x"]
    assert out.dtype == b.feeds["x"].dtype


def test_rows_with_a_large_mean_keep_their_variance():
    """Rows offset by 300 with unit spread (a transformer residual stream's outlier channels): the merged
    per-block statistics keep the variance that E[x^2] - mean^2 would lose to cancellation in float32."""
    b = Builder()
    x = b.input("x", (7, 40), 300 + torch.randn(7, 40, generator=torch.Generator().manual_seed(1)))
    run_group(b, [linear(b, layer_norm(b, x), 16)], lower=lower_gemm_group)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_the_norm_of_a_residual_sum_read_from_outside(dtype):
    """GPT-2's block: the residual sum is computed (and stored) elsewhere; the linear normalizes it as it reads it,
    here a 3-D activation whose sum the kernel gets as its input."""
    b = Builder(dtype)
    h = b.input("h", (3, 5, 24))
    r = b.input("r", (3, 5, 24))
    total = b.op("add", h, r)
    graph_group = b.group([linear(b, layer_norm(b, total), 16)])
    group = type(graph_group)(0, GroupKind.ANCHOR_EPILOGUE, [n for n in graph_group.nodes if n != total],
                              anchor=graph_group.anchor, inputs=[total], outputs=graph_group.outputs)
    kernel = lower_gemm_group(b.graph, group, "cpu")
    kernel.epilogue.output_fill = float("nan")
    summed = b.feeds["h"] + b.feeds["r"]
    (out,) = kernel.run([summed])
    b.check(graph_group.outputs, [out])


def test_the_library_form_computes_the_layer_norm_first():
    """cuBLAS reads the normalized activation: F.layer_norm (one launch more), then the GEMM and its epilogue."""
    b = Builder()
    x = b.input("x", (2, 5, 40))
    kernel, _ = run_library(b, [b.op("relu", linear(b, layer_norm(b, x), 24))], lower_gemm_group, 3)
    assert [node.op for node in kernel.operand_nodes] == ["layer_norm"]
    assert kernel.launches(LIBRARY_CONFIGS[0]) == 3 and kernel.launches(UNFUSED) == 3


def test_a_bare_linear_library_form_counts_the_layer_norm():
    """A linear with only its bias: the library form is one addmm after F.layer_norm, two launches."""
    b = Builder("float16")
    x = b.input("x", (11, 24))
    kernel, (out,) = run_group(b, [linear(b, layer_norm(b, x, affine=False), 16)], lower=lower_gemm_group)
    assert kernel.library_outputs is not None
    from opfuse.codegen.forms import LIBRARY
    assert kernel.launches(LIBRARY) == 2
    b.check(kernel.group.outputs, kernel.run([b.feeds["x"]], LIBRARY))


def test_split_k_is_not_offered_with_row_statistics():
    """A slice sees part of K: a group the planner marked for split-K still runs its stats over all of K, unsplit."""
    b = Builder()
    x = b.input("x", (5, 40))
    group = b.group([linear(b, layer_norm(b, x), 16)])
    group.split_k = {tile_key(INTERPRETER): 4}
    kernel = lower_gemm_group(b.graph, group, "cpu")
    assert kernel.split is None and kernel.alternatives(library=False) == []


@pytest.mark.parametrize("view", ["reshape", "permute", "windows"])
def test_the_linear_reads_the_normalized_rows_through_row_views(view):
    """GPT-2 flattens [1, T, C] to [T, C] before its addmm, ViT's attention transposes [N, T, C] to [T, N, C]
    before its in_proj, Swin partitions [1, H, W, C] into windows: the norm over C commutes with each, so the kernel
    reads the norm's input through the views' strided map (no copy) and normalizes the rows it loads."""
    b = Builder()
    x = b.input("x", (3, 6, 24) if view != "windows" else (1, 4, 6, 24))
    normalized = layer_norm(b, x)
    if view == "reshape":
        rows = b.op("reshape", normalized, shape=[18, 24])
    elif view == "permute":
        rows = b.op("permute", normalized, dims=(1, 0, 2))
    else:     # 2 x 3 windows of 2 x 2 pixels
        tiles = b.op("permute", b.op("reshape", normalized, shape=[1, 2, 2, 3, 2, 24]), dims=(0, 1, 3, 2, 4, 5))
        rows = b.op("reshape", tiles, shape=[6, 4, 24])
    kernel, _ = run_group(b, [linear(b, rows, 16)], lower=lower_gemm_group)
    assert kernel.prologue.norm is not None and kernel.a_map is not None
    assert kernel.a_map.groups(b.feeds["x"]) is not None       # a strided map: no copy
    from opfuse.codegen.forms import LIBRARY
    b.check(kernel.group.outputs, kernel.run([b.feeds["x"]], LIBRARY))
