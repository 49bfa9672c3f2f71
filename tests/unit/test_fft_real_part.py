"""The real part of an FFT of a real tensor (FNet's token mixing) as products by constant DFT matrices; an FFT whose
imaginary part is read stays an error naming its node (the IR has no complex values)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.ir.graph import GraphError
from opfuse.ir.interpret import interpret


class Mixing(nn.Module):
    """FNet's Fourier mixing over tokens and features, then a residual; and a 1-D transform of the last dim."""

    def forward(self, x):
        return torch.fft.fftn(x, dim=(1, 2)).real + x, torch.fft.fft(x).real


def test_the_real_part_is_dft_products_and_values_are_unchanged():
    x = torch.randn(2, 6, 10, dtype=torch.float64)
    graph = capture_torch(Mixing().eval(), (x,))
    ops = [node.op for node in graph]
    assert "opaque" not in ops and ops.count("linear") == 3 and ops.count("matmul") == 1 and ops.count("cat") == 1
    for got, want in zip(interpret(graph, [x]), Mixing()(x)):
        assert float((got - want).abs().max() / want.abs().max()) < 1e-12


class Imaginary(nn.Module):
    def forward(self, x):
        return torch.fft.fft(x).imag


def test_an_fft_whose_imaginary_part_is_read_is_refused_naming_it():
    with pytest.raises(GraphError, match=r"node fft_fft .*complex64"):
        capture_torch(Imaginary().eval(), (torch.randn(3, 8),))


def test_fourier_mixing_compiles_and_matches_eager():
    model, x = Mixing().eval(), torch.randn(1, 8, 16)
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(1, 8, 16)
    with torch.no_grad():
        for got, want in zip(compiled(x), model(x)):
            assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_the_2d_transform_is_two_kernels_its_cat_written_in_place():
    """The linears by the feature DFT (siblings: one kernel) store into their halves of the stacked tensor, which one
    matmul by [C, -S] over the tokens reads: two kernels where three ran (two matmuls, one with the difference)."""
    from opfuse.fusion.plan import GroupKind

    class Tokens(nn.Module):
        def forward(self, x):
            return torch.fft.fftn(x, dim=(1, 2)).real

    analysis = opfuse.analyze(Tokens().eval(), (torch.randn(2, 8, 16),), FusionConfig(dtype="float16"))
    kinds = [group.kind for group in analysis.plan.groups if group.launches or group.kind is GroupKind.IN_PLACE]
    assert kinds == [GroupKind.HORIZONTAL, GroupKind.IN_PLACE, GroupKind.SINGLE]
    assert analysis.plan.kernel_launches == 2
