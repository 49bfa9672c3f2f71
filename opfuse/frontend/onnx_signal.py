"""The ONNX converter of DFT (opsets 17 and 20): a discrete Fourier transform as matmuls by constant cosine and
sine matrices. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

The signal (real, or complex as a last dim of 2) is moved to put the transformed axis last, cut or zero-padded to
the DFT length, and multiplied by cos and sin of 2 pi k n / N (computed in float64 at import, cast to the signal's
dtype): forward, inverse (divided by N) and inverse one-sided (numpy's irfft: the Hermitian half, each bin but the
first and the Nyquist one counted twice, a real output). The sums are the matmul's, so float32 results carry a few
roundings more than an FFT's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from opfuse.frontend.onnx_converters import Unsupported, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


def _fit(importer: Importer, x: str, length: int, name: str) -> str:
    """x [..., L] cut or zero-padded to [..., length]."""
    have = importer.type(x).shape[-1]
    if have > length:
        return importer.emit("slice", [x], {"dim": len(importer.type(x).shape) - 1, "start": 0, "end": length,
                                            "step": 1}, name=f"{name}_cut")
    if have < length:
        return importer.emit("pad", [x], {"pads": (0, length - have), "value": 0.0}, name=f"{name}_padded")
    return x


def _matrices(rows: int, cols: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of 2 pi r c / size, the angle reduced modulo size first (exact zeros where they should be)."""
    turns = np.outer(np.arange(rows), np.arange(cols)) % size
    angle = 2 * np.pi * turns / size
    return np.cos(angle), np.sin(angle)


@converts("DFT", attributes=("axis", "inverse", "onesided"), constant_inputs=(1, 2))
def _dft(importer: Importer, node, xs, attrs):
    x, out = xs[0], node.output[0]
    shape = importer.type(x).shape
    rank = len(shape)
    if importer.opset >= 20:
        axis = importer.ints(node, xs, {}, "axis", 2)
        axis = -2 if axis is None else axis[0]
    else:
        axis = attrs.get("axis", 1)
    axis %= rank
    if axis == rank - 1 or shape[-1] not in (1, 2):
        raise Unsupported("DFT over the real/imaginary dim, or a last dim other than 1 or 2")
    given = importer.ints(node, xs, {}, "dft_length", 1)
    inverse, onesided = bool(attrs.get("inverse", 0)), bool(attrs.get("onesided", 0))
    size = given[0] if given else (2 * (shape[axis] - 1) if inverse and onesided else shape[axis])
    dtype = torch_dtype(importer.type(x).dtype)
    moved = [d for d in range(rank - 1) if d != axis] + [axis]
    back = tuple(moved.index(d) for d in range(rank - 1))

    def part(index: int, what: str) -> str:
        taken = importer.emit("slice", [x], {"dim": rank - 1, "start": index, "end": index + 1, "step": 1},
                              name=f"{out}_{what}")
        flat = importer.emit("reshape", [taken], {"shape": shape[:-1]}, name=f"{out}_{what}_flat")
        return importer.emit("permute", [flat], {"dims": tuple(moved)}, name=f"{out}_{what}_last")

    real = part(0, "real")
    imag = part(1, "imag") if shape[-1] == 2 else None
    if inverse and onesided:     # irfft: the bins 0 .. N/2 of a Hermitian spectrum, a real signal out
        bins = size // 2 + 1
        cos, sin = _matrices(bins, size, size)
        counted = np.full((bins, 1), 2.0)
        counted[0] = 1.0
        if size % 2 == 0:
            counted[-1] = 1.0
        products = [[cos * counted / size] + ([-sin * counted / size] if imag else [])]
        fitted = bins
    else:
        outputs = size // 2 + 1 if onesided and not inverse else size
        cos, sin = _matrices(size, outputs, size)
        sign = 1.0 if inverse else -1.0        # e^{-i theta} forward, e^{+i theta} inverse
        scale = 1.0 / size if inverse else 1.0
        # (a + ib)(cos + i sign sin) = a cos - sign b sin + i (sign a sin + b cos)
        products = [[cos * scale] + ([-sign * sin * scale] if imag else []),     # the real part's terms,
                    [sign * sin * scale] + ([cos * scale] if imag else [])]      # the imaginary part's
        fitted = size
    real, imag = (None if v is None else _fit(importer, v, fitted, f"{out}_{w}") for v, w in ((real, "re"),
                                                                                           (imag, "im")))
    results = []
    for index, matrices in enumerate(products):   # each a sum of the real part's and the imaginary part's terms
        total = None
        for term, (signal, matrix) in enumerate(zip((real, imag), matrices)):
            constant = importer.add_constant(torch.from_numpy(matrix).to(dtype), f"{out}_basis{index}_{term}")
            product = importer.emit("matmul", [signal, constant], name=f"{out}_product{index}_{term}")
            total = product if total is None else importer.emit("add", [total, product], name=f"{out}_sum{index}")
        placed = importer.emit("permute", [total], {"dims": back}, name=f"{out}_placed{index}")
        results.append(importer.emit("reshape", [placed], {"shape": importer.type(placed).shape + (1,)},
                                     name=f"{out}_part{index}"))
    if len(results) == 1:
        return [importer.emit("identity", [results[0]], name=out)]
    return [importer.emit("cat", results, {"dim": rank - 1}, name=out)]
