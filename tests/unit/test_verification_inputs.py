"""What verification runs the model on (`opfuse.numerics`): random integer inputs keep a divisor's example free of
0 free of it too, and reference runs compute every float cast in their own precision (`float_casts_to`)."""

from __future__ import annotations

import torch

from opfuse.numerics import float_casts_to, random_inputs_like


def test_an_integer_input_without_zero_gets_none():
    divisor = torch.tensor([-3, 2] * 500)
    (fresh,) = random_inputs_like([divisor])
    assert not bool((fresh == 0).any())
    assert set(fresh.tolist()) == {-3, -2, -1, 1, 2}          # every other value of [min, max] still drawn


def test_an_integer_input_with_zero_may_get_it():
    (fresh,) = random_inputs_like([torch.tensor([-3, 0, 2] * 300)])
    assert set(fresh.tolist()) == {-3, -2, -1, 0, 1, 2}
    (indices,) = random_inputs_like([torch.tensor([1, 4] * 300)])   # no zero in range: untouched
    assert set(indices.tolist()) == {1, 2, 3, 4}


class Casts(torch.nn.Module):
    def forward(self, x):
        return x.float(), x.half(), x.to(torch.bfloat16), torch.zeros(2, dtype=torch.float32), x.to(torch.int32)


def test_float_casts_run_in_the_reference_precision():
    x = torch.tensor([1 / 3, 2.5], dtype=torch.float64)
    with float_casts_to(torch.float64):
        as_float, as_half, as_bfloat, zeros, as_int = Casts()(x)
    assert [t.dtype for t in (as_float, as_half, as_bfloat, zeros)] == [torch.float64] * 4
    assert torch.equal(as_half, x)                   # not rounded to float16 on the way
    assert as_int.dtype == torch.int32               # integer casts keep their meaning
    assert Casts()(x)[1].dtype == torch.float16      # outside, casts are as written
    with float_casts_to(torch.float64):
        assert x.view(torch.int64).dtype == torch.int64   # a view as another dtype reinterprets bits: untouched
