"""The ONNX converter of Einsum: an Einstein summation written out as the IR's views, diagonal gathers, sums and
batched matmuls. Registered in `opfuse.frontend.onnx_converters.CONVERTERS` (see there for the converter contract).

Each operand's repeated labels become its diagonal (a `take` of constant indices from the two dims merged), labels
no other operand and not the output has are summed away, then the operands are combined left to right: the labels
both have and a later operand or the output needs are batch dims, those only they have are contracted, so each
pair is one `matmul` of [batch, left, contracted] by [batch, contracted, right]. The result is permuted to the
output's order. An ellipsis stands for the same leading dims in each operand.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import Unsupported, converts

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer


def parse(equation: str, ranks: list[int]) -> tuple[list[list[str]], list[str]]:
    """Each operand's labels and the output's, an ellipsis expanded to labels of its own ("...0", "...1", ...)
    right-aligned across operands; without "->" the output is the ellipsis then the labels used once, sorted."""
    equation = equation.replace(" ", "")
    inputs, arrow, output = equation.partition("->")
    terms = inputs.split(",")
    if len(terms) != len(ranks):
        raise Unsupported(f"Einsum equation {equation!r} for {len(ranks)} inputs")
    splits, widths = [term.partition("...") for term in terms], []
    for (head, dots, tail), term, rank in zip(splits, terms, ranks):
        width = rank - len(head) - len(tail) if dots else 0
        if width < 0 or (not dots and len(term) != rank):
            raise Unsupported(f"Einsum term {term!r} for an input of rank {rank}")
        widths.append(width)
    widest = max(widths, default=0)
    # right-aligned: an operand with fewer ellipsis dims has the last of them
    operands = [list(head) + [f"...{widest - width + k}" for k in range(width)] + list(tail)
                for (head, _, tail), width in zip(splits, widths)]
    ellipsis = [f"...{k}" for k in range(widest)]
    if arrow:
        head, dots, tail = output.partition("...")
        result = list(head) + (ellipsis if dots else []) + list(tail)
    else:
        counts: dict[str, int] = {}
        for labels in operands:
            for label in labels:
                counts[label] = counts.get(label, 0) + 1
        result = ellipsis + sorted(label for label, n in counts.items() if n == 1 and not label.startswith("..."))
    return operands, result


def _diagonal(importer: Importer, x: str, labels: list[str], name: str) -> tuple[str, list[str]]:
    """x with each repeated label's dims replaced by their diagonal (one dim, last)."""
    while len(set(labels)) < len(labels):
        label = next(lab for lab in labels if labels.count(lab) > 1)
        first, second = [i for i, lab in enumerate(labels) if lab == label][:2]
        shape = importer.type(x).shape
        if shape[first] != shape[second]:
            raise Unsupported(f"Einsum label {label!r} on dims of sizes {shape[first]} and {shape[second]}")
        rest = [i for i in range(len(labels)) if i not in (first, second)]
        moved = importer.emit("permute", [x], {"dims": tuple(rest + [first, second])}, name=f"{name}_to_diagonal")
        n = shape[first]
        merged = importer.emit("reshape", [moved], {"shape": tuple(shape[i] for i in rest) + (n * n,)},
                               name=f"{name}_pairs")
        picks = importer.add_constant(torch.arange(n) * (n + 1), f"{name}_diagonal_index")
        x = importer.emit("take", [merged, picks], {"axis": len(rest)}, name=f"{name}_diagonal")
        labels = [labels[i] for i in rest] + [label]
    return x, labels


def _sum_away(importer: Importer, x: str, labels: list[str], keep: set[str], name: str) -> tuple[str, list[str]]:
    dims = [i for i, label in enumerate(labels) if label not in keep]
    if not dims:
        return x, labels
    summed = importer.emit("sum", [x], {"dims": dims, "keepdim": False}, name=f"{name}_summed")
    return summed, [label for label in labels if label in keep]


def _contract(importer: Importer, a: str, a_labels: list[str], b: str, b_labels: list[str], needed: set[str],
              name: str) -> tuple[str, list[str]]:
    """a and b combined by one batched matmul: shared labels still needed are batch dims, other shared ones are
    contracted."""
    size = {label: n for labels, x in ((a_labels, a), (b_labels, b))
            for label, n in zip(labels, importer.type(x).shape)}
    for label in set(a_labels) & set(b_labels):
        if importer.type(a).shape[a_labels.index(label)] != importer.type(b).shape[b_labels.index(label)]:
            raise Unsupported(f"Einsum label {label!r} of two sizes (broadcasting is not mapped)")
    batch = [label for label in a_labels if label in b_labels and label in needed]
    summed = [label for label in a_labels if label in b_labels and label not in needed]
    left = [label for label in a_labels if label not in b_labels]
    right = [label for label in b_labels if label not in a_labels]

    def arranged(x, labels, order, shape, what):
        permuted = x if labels == order else importer.emit(
            "permute", [x], {"dims": tuple(labels.index(label) for label in order)}, name=f"{name}_{what}_ordered")
        return importer.emit("reshape", [permuted], {"shape": shape}, name=f"{name}_{what}_3d")

    count = lambda labels: math.prod(size[label] for label in labels)  # noqa: E731
    lhs = arranged(a, a_labels, batch + left + summed, (count(batch), count(left), count(summed)), "left")
    rhs = arranged(b, b_labels, batch + summed + right, (count(batch), count(summed), count(right)), "right")
    product = importer.emit("matmul", [lhs, rhs], name=f"{name}_product")
    labels = batch + left + right
    return importer.emit("reshape", [product], {"shape": tuple(size[label] for label in labels)},
                         name=f"{name}_unflat"), labels


@converts("Einsum", attributes=("equation",))
def _einsum(importer: Importer, node, xs, attrs):
    out = node.output[0]
    operands, output = parse(attrs["equation"], [len(importer.type(x).shape) for x in xs])
    prepared = []
    for index, (x, labels) in enumerate(zip(xs, operands)):
        x, labels = _diagonal(importer, x, labels, f"{out}_in{index}")
        elsewhere = set(output).union(*[set(other) for k, other in enumerate(operands) if k != index])
        prepared.append(_sum_away(importer, x, labels, elsewhere, f"{out}_in{index}"))
    result, labels = prepared[0]
    for index, (other, other_labels) in enumerate(prepared[1:], start=1):
        needed = set(output).union(*[set(labels) for _, labels in prepared[index + 1:]])
        result, labels = _contract(importer, result, labels, other, other_labels, needed, f"{out}_pair{index}")
    result, labels = _sum_away(importer, result, labels, set(output), f"{out}_rest")
    if labels != output:
        result = importer.emit("permute", [result], {"dims": tuple(labels.index(label) for label in output)},
                               name=out)
    return [result if result not in xs else importer.emit("identity", [result], name=out)]
