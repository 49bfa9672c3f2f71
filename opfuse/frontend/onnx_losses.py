"""ONNX converters of the two loss operators of the standard domain, NegativeLogLikelihoodLoss and
SoftmaxCrossEntropyLoss (opsets 12 on): a loss is a function of its inputs like any other, so an exported training
graph's loss head runs too. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the
converter contract).

The loss of each position is -input[n, target[n, ...], ...] times the target class's weight: the class is picked
with a one-hot comparison of the target against the class numbers and a sum over the class dim, which adds one
value to zeros, so it is exact (and a target equal to ignore_index, in range or not, weighs 0). "mean" divides by
the sum of the weights (by the count without weights or ignore_index), as ONNX's reference does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import _log_softmax, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


def _negative_log_likelihood(importer: Importer, log_probs: str, target: str, weight: str | None,
                             ignore_index: int | None, reduction: str, out: str) -> str:
    shape = importer.type(log_probs).shape
    n, classes, rest = shape[0], shape[1], shape[2:]
    x_dtype = torch_dtype(importer.type(log_probs).dtype)
    target_dtype = torch_dtype(importer.type(target).dtype)
    zero = importer.add_constant(torch.tensor(0, dtype=x_dtype), f"{out}_zero")
    numbers = importer.add_constant(torch.arange(classes, dtype=target_dtype).reshape((1, classes) + (1,) * len(rest)),
                                    f"{out}_classes")
    spread = importer.emit("reshape", [target], {"shape": (n, 1, *rest)}, name=f"{out}_target")
    hot = importer.emit("eq", [spread, numbers], name=f"{out}_hot")
    over_classes = {"dims": [1], "keepdim": False}
    picked = importer.emit("sum", [importer.emit("where", [hot, log_probs, zero], name=f"{out}_hot_values")],
                           over_classes, name=f"{out}_picked")
    loss = importer.emit("neg", [picked], name=f"{out}_position")
    weights = None
    if weight is not None:
        per_class = importer.emit("reshape", [weight], {"shape": (1, classes) + (1,) * len(rest)},
                                  name=f"{out}_class_weights")
        weights = importer.emit("sum", [importer.emit("where", [hot, per_class, zero], name=f"{out}_hot_weights")],
                                over_classes, name=f"{out}_weights")
    if ignore_index is not None:
        ignored = importer.emit("eq", [target, importer.add_constant(torch.tensor(ignore_index, dtype=target_dtype),
                                                                     f"{out}_ignore_index")], name=f"{out}_ignored")
        loss = importer.emit("where", [ignored, zero, loss], name=f"{out}_kept")
        kept = weights if weights is not None else importer.add_constant(torch.tensor(1, dtype=x_dtype),
                                                                           f"{out}_one")
        weights = importer.emit("where", [ignored, zero, kept], name=f"{out}_kept_weights")
    if weights is not None:
        loss = importer.emit("mul", [weights, loss], name=f"{out}_weighted")
    everything = {"dims": list(range(len(importer.type(loss).shape))), "keepdim": False}
    if reduction == "none":
        return loss
    if reduction == "sum":
        return importer.emit("sum", [loss], everything, name=out)
    if weights is None:
        return importer.emit("mean", [loss], everything, name=out)
    total = importer.emit("sum", [loss], everything, name=f"{out}_total")
    return importer.emit("div", [total, importer.emit("sum", [weights], everything, name=f"{out}_weight_total")],
                         name=out)


@converts("NegativeLogLikelihoodLoss", attributes=("ignore_index", "reduction"))
def _nll_loss(importer: Importer, node, xs, attrs):
    weight = xs[2] if len(xs) > 2 else None
    return [_negative_log_likelihood(importer, xs[0], xs[1], weight, attrs.get("ignore_index"),
                                     attrs.get("reduction", "mean"), node.output[0])]


@converts("SoftmaxCrossEntropyLoss", attributes=("ignore_index", "reduction"))
def _softmax_cross_entropy(importer: Importer, node, xs, attrs):
    """The NegativeLogLikelihoodLoss of log_softmax(scores) over the classes (dim 1), and that log_softmax as the
    optional second output."""
    log_probs = _log_softmax(importer, xs[0], 1)
    weight = xs[2] if len(xs) > 2 else None
    loss = _negative_log_likelihood(importer, log_probs, xs[1], weight, attrs.get("ignore_index"),
                                    attrs.get("reduction", "mean"), node.output[0])
    return [loss, log_probs]
