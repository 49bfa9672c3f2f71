"""A 3-D convolution as the 2-D one the conv templates take (`conv3d_as_conv2d`), for the ATen and ONNX frontends.

One spatial dim, the fold dim, goes into the batch: the one whose window is smallest (a (r, r, 1) window folds its
1 away with no copy). Its window's taps go into the channels: tap k of the fold dim is the input's strided slice
starting at k * dilation (after zero padding), and the taps of each group are concatenated in front of the group's
channels, so that input channel (group, tap, channel) meets the weight's [Co, taps x Ci/g, Ka, Kb], the 3-D weight
permuted. The conv2d then runs over the other two dims with their stride, padding and dilation, [N * out_f, taps x
C, A, B], and its [N * out_f, Co, Oa, Ob] result is viewed and permuted back to [N, Co, O_D, O_H, O_W]. The arithmetic
is the 3-D convolution's (each output sums the same products); the concatenated taps are a copy of taps x the
input where the window along the fold dim is longer than 1.
"""

from __future__ import annotations

from typing import Callable, Sequence

# (op, inputs, attrs) -> the new node's name
Emit = Callable[[str, list, dict], str]


def fold_dim(kernel: Sequence[int], stride: Sequence[int], padding: Sequence[int]) -> int:
    """The spatial dim (0-2) that goes into the batch: the smallest window, then one without stride or padding."""
    return min(range(3), key=lambda d: (kernel[d], stride[d] != 1 or padding[d] != 0, d))


def conv3d_as_conv2d(emit: Emit, finish: Emit, x: str, x_shape: Sequence[int], weight: str,
                     w_shape: Sequence[int], bias: str | None, stride: Sequence[int], padding: Sequence[int],
                     dilation: Sequence[int], groups: int) -> str:
    """The conv3d of x [N, C, D, H, W] with weight [Co, C/groups, KD, KH, KW] (and bias [Co]), symmetric `padding`
    per spatial dim, as IR nodes around one conv2d; `finish` emits the last (the result)."""
    n, channels, sizes = x_shape[0], x_shape[1], list(x_shape[2:])
    out_channels, per_group, kernel = w_shape[0], w_shape[1], list(w_shape[2:])
    f = fold_dim(kernel, stride, padding)
    a, b = [d for d in range(3) if d != f]
    out = [(sizes[d] + 2 * padding[d] - dilation[d] * (kernel[d] - 1) - 1) // stride[d] + 1 for d in range(3)]
    # the input with the fold dim next to the channels: [N, C, S_f, A, B]
    if f != 0:
        x = emit("permute", [x], {"dims": [0, 1, 2 + f, 2 + a, 2 + b]})
    if padding[f]:
        x = emit("pad", [x], {"pads": [0, 0, 0, 0, padding[f], padding[f]], "value": 0.0})
    span = (out[f] - 1) * stride[f] + 1
    taps = []
    for k in range(kernel[f]):
        start = k * dilation[f]
        whole = start == 0 and span == sizes[f] + 2 * padding[f] and stride[f] == 1
        taps.append(x if whole else emit("slice", [x], {"dim": 2, "start": start, "end": start + span,
                                                        "step": stride[f]}))
    rest = [out[f], sizes[a], sizes[b]]
    if len(taps) == 1:
        stacked = taps[0]
    else:   # [N, g, taps x C/g, out_f, A, B], viewed [N, taps x C, out_f, A, B]
        shaped = [emit("reshape", [t], {"shape": [n, groups, channels // groups] + rest}) for t in taps]
        stacked = emit("reshape", [emit("cat", shaped, {"dim": 2})], {"shape": [n, len(taps) * channels] + rest})
    image = emit("reshape", [emit("permute", [stacked], {"dims": [0, 2, 1, 3, 4]})],
                 {"shape": [n * out[f], len(taps) * channels, sizes[a], sizes[b]]})
    kernel2d = emit("reshape", [emit("permute", [weight], {"dims": [0, 2 + f, 1, 2 + a, 2 + b]})],
                    {"shape": [out_channels, kernel[f] * per_group, kernel[a], kernel[b]]})
    y = emit("conv2d", [image, kernel2d] + ([bias] if bias is not None else []),
             {"stride": (stride[a], stride[b]), "padding": (padding[a], padding[b]),
              "dilation": (dilation[a], dilation[b]), "groups": groups})
    y = emit("reshape", [y], {"shape": [n, out[f], out_channels, out[a], out[b]]})
    # [N, out_f, Co, Oa, Ob] -> [N, Co, O_D, O_H, O_W]
    return finish("permute", [y], {"dims": [0, 2] + [1 if d == f else 3 + [a, b].index(d) for d in range(3)]})
