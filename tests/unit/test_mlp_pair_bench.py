"""benchmarks/mlp_pair.py's fused MLP kernel on the CPU (Triton's interpreter): it computes what the GEMMs apart do,
with sizes that are no multiple of its blocks; nothing timed."""

from pathlib import Path

import pytest
import torch

from opfuse.codegen.base import import_file

mlp_pair = import_file(Path(__file__).resolve().parents[2] / "benchmarks" / "mlp_pair.py", "mlp_pair")


@pytest.mark.parametrize("m,k,hidden,n", [(10, 12, 40, 20), (33, 16, 64, 16)])
def test_fused_mlp_matches_the_gemms_apart(m, k, hidden, n):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=generator)
    w1, b1 = torch.randn(hidden, k, generator=generator) / k ** 0.5, torch.randn(hidden, generator=generator)
    w2, b2 = torch.randn(n, hidden, generator=generator) / hidden ** 0.5, torch.randn(n, generator=generator)
    out = mlp_pair.fused_mlp(x, w1.t().contiguous(), b1, w2.t().contiguous(), b2, (16, 16, 1, 1))
    torch.testing.assert_close(out, mlp_pair.apart(x, w1, b1, w2, b2), rtol=1e-4, atol=1e-4)


def test_fused_mlp_refuses_outputs_wider_than_its_accumulator():
    x, w1, b1 = torch.randn(4, 16), torch.randn(16, 32), torch.randn(32)
    w2, b2 = torch.randn(32, mlp_pair.MAX_OUT + 1), torch.randn(mlp_pair.MAX_OUT + 1)
    with pytest.raises(ValueError, match="do not fit"):
        mlp_pair.fused_mlp(x, w1, b1, w2, b2, (16, 16, 1, 1))
