"""The real part of an FFT of a real tensor as products by constant DFT matrices (FNet's token mixing).

The IR has no complex values, so an FFT is captured only where its real part alone is read: `real_part_only`
decides that when the translator reaches the FFT (`opfuse.frontend.torch_translate.Translator._call`), which then
holds a `RealPartOnly` in its place, and the `real` that reads it emits, for the transform along the last dim N
(Re F x = C x with C[j, k] = cos(2 pi j k / N), symmetric) or along the last two (F_a x F_b, whose real part is
C_a x C_b - S_a x S_b, S the sines): linears by C_b and S_b over the last dim, their results stacked along the one
before (a cat their kernels write in place: `opfuse.fusion.concat_in_place`), and one matmul by [C_a, -S_a] over
both, the difference summed in its K loop. GEMMs of N^2 multiply-adds an output element instead of N log N, which at FNet's
sizes (hundreds of tokens and features) are a few tensor-core GEMMs; torch.fft in float16 takes powers of two only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

from opfuse.frontend.aten_common import Handler, registrar, wrap_dim
from opfuse.ir.graph import FLOAT_DTYPES

if TYPE_CHECKING:
    from opfuse.frontend.torch_translate import Translator

HANDLERS: dict[str, Handler] = {}
maps = registrar(HANDLERS)

FFTS = ("fft_fftn", "fft_fft2", "fft_fft")
MAX_DFT = 4096      # a transform longer than this stays refused: its N x N matrix would pass 32 MB in float16


@dataclass(frozen=True)
class RealPartOnly:
    """An FFT whose real part alone is read: its input tensor and the dims it transforms (the last, or the last
    two)."""

    node: fx.Node
    dims: tuple[int, ...]


def real_part_only(node: fx.Node, args: dict[str, Any]) -> RealPartOnly | None:
    """The `RealPartOnly` of `node`, an op of FFTS (its arguments bound by name), or None: an FFT of a real floating
    tensor, unnormalized and unpadded, over its last dim or its last two, that only `aten.real` reads."""
    value = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
    if not isinstance(value, torch.Tensor) or str(value.dtype).removeprefix("torch.") not in FLOAT_DTYPES:
        return None
    if args.get("norm") not in (None, "backward") or args.get("s", args.get("n")) is not None:
        return None
    rank = value.dim()
    dims = args.get("dim")
    dims = list(range(rank)) if dims is None else [dims] if isinstance(dims, int) else list(dims)
    dims = sorted(wrap_dim(d, rank) for d in dims)
    if dims not in ([rank - 1], [rank - 2, rank - 1]) or any(value.shape[d] > MAX_DFT for d in dims):
        return None
    if not node.users or any(str(user.target) != "aten.real.default" for user in node.users):
        return None
    return RealPartOnly(node, tuple(dims))


def _dft(size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of 2 pi j k / size (j k reduced mod size first, so the angles stay exact)."""
    index = torch.arange(size, dtype=torch.float64)
    angles = 2 * math.pi * torch.remainder(index[:, None] * index[None, :], size) / size
    return torch.cos(angles).to(dtype), torch.sin(angles).to(dtype)


@maps("real")
def _real(t: Translator, a: dict) -> str:
    """The real part: of a real tensor, itself; of an FFT of one (`RealPartOnly`), the DFT's cosine (and sine)
    products."""
    held = t.env.get(a["self"]) if isinstance(a["self"], fx.Node) else None
    if not isinstance(held, RealPartOnly):
        return t.value(a["self"])
    x = t.value(held.node.args[0])
    shape = t.type_of(x).shape
    dtype = getattr(torch, t.type_of(x).dtype)
    cos, sin = _dft(shape[-1], dtype)
    if len(held.dims) == 1:
        return t.emit("linear", [x, t.constant("dft_cos", cos)])      # (a linear: the matrix is symmetric)
    cos_rows, sin_rows = _dft(shape[-2], dtype)
    stacked = t.emit("cat", [t.emit("linear", [x, t.constant("dft_cos", cos)]),
                             t.emit("linear", [x, t.constant("dft_sin", sin)])], {"dim": len(shape) - 2})
    return t.emit("matmul", [t.constant("dft_rows", torch.cat([cos_rows, -sin_rows], dim=1)), stacked])
