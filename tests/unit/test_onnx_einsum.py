"""ONNX's Einsum (`opfuse.frontend.onnx_einsum`): equations written out as views, diagonal gathers, sums and
batched matmuls, compared with onnx.reference.ReferenceEvaluator."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_cases import node, ops, run_node as run
from opfuse.frontend.onnx_einsum import parse

rng = np.random.default_rng(0)


def floats(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_parse_expands_the_ellipsis_right_aligned_and_infers_the_output():
    assert parse("ij,jk", [2, 2]) == ([["i", "j"], ["j", "k"]], ["i", "k"])
    assert parse("...ii->...i", [4]) == ([["...0", "...1", "i", "i"]], ["...0", "...1", "i"])
    assert parse("b...i,...ik", [4, 3]) == ([["b", "...0", "...1", "i"], ["...1", "i", "k"]],
                                            ["...0", "...1", "b", "k"])


@pytest.mark.parametrize("equation, shapes, expected_ops", [
    ("ij->ji", [(3, 4)], ["permute"]),
    ("ij->i", [(3, 4)], ["sum"]),
    ("i,i", [(5,), (5,)], None),
    ("bij,bjk->bik", [(5, 2, 3), (5, 3, 4)], None),
    ("ij,jk", [(2, 3), (3, 4)], None),
    ("bhqd,bhkd->bhqk", [(2, 3, 4, 5), (2, 3, 6, 5)], None),
    ("...ii->...i", [(3, 5, 5)], None),
    ("ii", [(4, 4)], None),
    ("ij,kl->ijkl", [(2, 3), (4, 5)], None),
    ("abc,cd,de->ae", [(2, 3, 4), (4, 5), (5, 6)], None),
    ("i,i->i", [(6,), (6,)], None),
])
def test_einsum(equation, shapes, expected_ops):
    feeds = {f"x{i}": floats(*shape) for i, shape in enumerate(shapes)}
    graph = run(node("Einsum", list(feeds), equation=equation), feeds, opset=12)
    if expected_ops is not None:
        assert ops(graph) == expected_ops
    assert "matmul" in ops(graph) or len(shapes) == 1
