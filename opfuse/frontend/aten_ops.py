"""ATen op -> IR op handlers for the PyTorch frontend (`opfuse.frontend.torch_export`).

Entry point: `HANDLERS`, keyed by ATen op name ('conv2d' for aten.conv2d.default; overloads are told apart by
their arguments). The handler contract (`Unmapped`, `MultiOutput`) and the helpers handlers share are in
`opfuse.frontend.aten_common`; the handlers themselves, one module per family of ops:

- `opfuse.frontend.aten_anchors`: convolutions, linear layers, matmuls, einsum, attention
- `opfuse.frontend.aten_reductions`: normalisations, softmax, reductions, pooling
- `opfuse.frontend.aten_elementwise`: arithmetic, comparisons, activations, casts, copies, fills
- `opfuse.frontend.aten_layout`: views, permutes, repeats, cat, slices and splits, padding, upsampling
- `opfuse.frontend.aten_index`: gather, slice and select scatters, fills and copies of a value
- `opfuse.frontend.aten_routing`: a mixture of experts' topk, sort, histc, index_put and grouped GEMMs
- `opfuse.frontend.aten_fft`: the real part of an FFT of a real tensor, as products by DFT matrices

Canonical IR attrs (pairs as int tuples, non-negative dims, concrete shapes) are documented on each op in
`opfuse.ir.ops`.
"""

from __future__ import annotations

from opfuse.frontend import (aten_anchors, aten_elementwise, aten_fft, aten_index, aten_layout, aten_reductions,
                             aten_routing)
from opfuse.frontend.aten_common import Handler


def _join(*tables: dict[str, Handler]) -> dict[str, Handler]:
    """The families' tables in one; an op two families both map is a bug, refused at import."""
    joined: dict[str, Handler] = {}
    for table in tables:
        twice = joined.keys() & table.keys()
        if twice:
            raise ImportError(f"ATen ops mapped by two handler families: {sorted(twice)}")
        joined.update(table)
    return joined


HANDLERS: dict[str, Handler] = _join(aten_anchors.HANDLERS, aten_reductions.HANDLERS, aten_elementwise.HANDLERS,
                                     aten_layout.HANDLERS, aten_index.HANDLERS, aten_routing.HANDLERS,
                                     aten_fft.HANDLERS)
