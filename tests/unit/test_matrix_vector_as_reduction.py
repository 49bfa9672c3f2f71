"""`matrix_vector_as_reduction`: a matmul by one column is a sum of products, so the elementwise ops computing its
matrix join it as a prologue (Mamba's sequential scan: the state update and the state times C, one kernel a step);
values unchanged."""

from __future__ import annotations

import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.plan import GroupKind
from opfuse.ir.interpret import interpret
from opfuse.passes.matrix_vector_as_reduction import matrix_vector_as_reduction


class Scan(nn.Module):
    """Mamba's reference selective scan over `steps` positions: state = A * state + B, then state @ C as a column."""

    def forward(self, decay, drive, readout):           # [N, D, L, S], [N, D, L, S], [N, L, S]
        state = torch.zeros_like(decay[:, :, 0])
        outputs = []
        for i in range(decay.shape[2]):
            state = decay[:, :, i] * state + drive[:, :, i]
            outputs.append(torch.matmul(state, readout[:, i].unsqueeze(-1))[..., 0])
        return torch.stack(outputs, dim=-1)


def _inputs(dtype=torch.float32, steps=3):
    generator = torch.Generator().manual_seed(0)
    shape = (2, 5, steps, 4)
    return (torch.rand(shape, generator=generator, dtype=dtype), torch.randn(shape, generator=generator, dtype=dtype),
            torch.randn(2, steps, 4, generator=generator, dtype=dtype))


def test_each_column_matmul_becomes_a_sum_and_values_are_unchanged():
    inputs = _inputs(torch.float64)
    graph = capture_torch(Scan(), inputs)
    rewritten, changes = matrix_vector_as_reduction(graph)
    assert len(changes) == 3
    assert not [node for node in rewritten if node.op == "matmul"]
    assert len([node for node in rewritten if node.op == "sum"]) == 3
    (got,), want = interpret(rewritten, list(inputs)), Scan()(*inputs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


def test_a_float16_product_is_summed_in_float32_and_cast_back():
    inputs = tuple(x.half() for x in _inputs(steps=1))
    rewritten, _ = matrix_vector_as_reduction(capture_torch(Scan(), inputs))
    total = next(node for node in rewritten if node.op == "sum")
    assert total.type.dtype == "float32"
    assert [node.op for node in rewritten if total.name in node.inputs] == ["cast"]


class Product(nn.Module):
    def forward(self, a, b):
        return a @ b


def test_a_matmul_of_several_columns_stays_a_matmul():
    graph = capture_torch(Product(), (torch.randn(3, 4), torch.randn(4, 2)))
    rewritten, changes = matrix_vector_as_reduction(graph)
    assert changes == [] and [node.op for node in rewritten] == [node.op for node in graph]


def test_a_scan_step_is_one_kernel_and_matches_eager():
    """Before the pass: per step, the state update in a kernel of its own, then the GEMM."""
    model, inputs = Scan().eval(), _inputs(steps=2)
    analysis = opfuse.analyze(model, inputs, FusionConfig(dtype="float32"))
    kernels = [group for group in analysis.plan.groups if group.kind is not GroupKind.VIEW]
    steps = [group for group in kernels if "sum" in [analysis.prepared[n].op for n in group.nodes]]
    assert len(steps) == 2 and all(group.kind is GroupKind.REDUCTION for group in steps)
    assert all({"mul", "add"} <= {analysis.prepared[n].op for n in group.nodes} for group in steps)
    compiled = opfuse.compile(model, inputs, FusionConfig(dtype="float32"))
    inputs = _inputs(steps=2)
    inputs = (inputs[0].flip(0), inputs[1] * 2, inputs[2])
    with torch.no_grad():
        got, want = compiled(*inputs), model(*inputs)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5
