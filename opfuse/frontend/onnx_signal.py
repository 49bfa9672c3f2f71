"""The ONNX converters of DFT (opsets 17 and 20) and STFT: a discrete Fourier transform as matmuls by constant cosine
and sine matrices. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

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


@converts("STFT", attributes=("onesided",), constant_inputs=(1, 3))
def _stft(importer: Importer, node, xs, attrs):
    """Frames of frame_length every frame_step (an unfold: index maps), times the window, each transformed as DFT
    is: matmuls by the cos and sin of 2 pi k n / frame_length, to [batch, frames, bins, 2] (the bins up to
    frame_length / 2 where onesided, the default, for a real signal)."""
    signal, out = xs[0], node.output[0]
    window = xs[2] if len(xs) > 2 and xs[2] else None
    batch, length, channels = importer.type(signal).shape
    step = importer.ints(node, xs, {}, "frame_step", 1)
    given = importer.ints(node, xs, {}, "frame_length", 3) if len(xs) > 3 and xs[3] else None
    if step is None:
        raise Unsupported("input 1 (frame_step) is not a constant")
    size = given[0] if given else (importer.type(window).shape[0] if window else None)
    if size is None:
        raise Unsupported("neither a window nor a frame_length gives the frame's length")
    onesided = bool(attrs.get("onesided", 1))
    if onesided and channels == 2:
        raise Unsupported("a one-sided STFT of a complex signal")
    frames = importer.emit("unfold", [signal], {"dim": 1, "size": size, "step": step[0]}, name=f"{out}_frames")
    count = importer.type(frames).shape[1]                                  # [batch, frames, channels, size]
    if window is not None:
        frames = importer.emit("mul", [frames, window], name=f"{out}_windowed")
    dtype = torch_dtype(importer.type(signal).dtype)
    bins = size // 2 + 1 if onesided else size
    cos, sin = _matrices(size, bins, size)

    def part(index: int) -> str:
        taken = importer.emit("slice", [frames], {"dim": 2, "start": index, "end": index + 1, "step": 1},
                              name=f"{out}_channel{index}")
        return importer.emit("reshape", [taken], {"shape": (batch, count, size)}, name=f"{out}_signal{index}")

    def times(signal_part: str, matrix: np.ndarray, name: str) -> str:
        basis = importer.add_constant(torch.from_numpy(matrix).to(dtype), f"{out}_{name}_basis")
        return importer.emit("matmul", [signal_part, basis], name=f"{out}_{name}")

    real = part(0)
    terms = [[times(real, cos, "a_cos")], [times(real, -sin, "a_sin")]]    # e^{-i theta}: a cos - i a sin
    if channels == 2:
        imag = part(1)
        terms[0].append(times(imag, sin, "b_sin"))                          # (a + ib)(cos - i sin)
        terms[1].append(times(imag, cos, "b_cos"))
    results = []
    for index, parts in enumerate(terms):
        total = parts[0] if len(parts) == 1 else importer.emit("add", parts, name=f"{out}_sum{index}")
        results.append(importer.emit("reshape", [total], {"shape": (batch, count, bins, 1)}, name=f"{out}_part{index}"))
    return [importer.emit("cat", results, {"dim": 3}, name=out)]
