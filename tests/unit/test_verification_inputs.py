"""What verification runs the model on (`opfuse.numerics`): random integer inputs hold only their example's values
(a divisor free of 0 stays so, a sentinel stays one), and reference runs compute every float cast in their own
precision (`float_casts_to`)."""

from __future__ import annotations

import torch

from opfuse.numerics import float_casts_to, random_inputs_like


def test_integer_inputs_hold_the_examples_own_values():
    """A divisor's example free of 0 gives fresh inputs free of it; a sentinel (an ignore index of -100 among class
    labels) stays one and no value between it and the labels appears, which a gather would read out of range."""
    (fresh,) = random_inputs_like([torch.tensor([-3, 2] * 500)])
    assert set(fresh.tolist()) == {-3, 2}
    labels = torch.tensor([0, 3, -100, 1, 2, -100] * 100)
    (fresh,) = random_inputs_like([labels])
    assert set(fresh.tolist()) == {-100, 0, 1, 2, 3} and not torch.equal(fresh, labels)


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
