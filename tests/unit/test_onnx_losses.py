"""ONNX's loss operators (`opfuse.frontend.onnx_losses`) against onnx.reference.ReferenceEvaluator: every
reduction, with and without class weights and ignore_index."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_cases import node, run_node as run

rng = np.random.default_rng(0)


def floats(*shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


# ---- losses -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
@pytest.mark.parametrize("weighted, ignore_index", [(False, None), (True, None), (True, 1), (False, -5)])
def test_negative_log_likelihood_loss(reduction, weighted, ignore_index):
    x = floats(3, 4, 2, 5)
    target = rng.integers(0, 4, (3, 2, 5)).astype(np.int64)
    if ignore_index is not None:
        target[0, 0, :2] = ignore_index
    attrs = {"reduction": reduction} | ({} if ignore_index is None else {"ignore_index": ignore_index})
    weights = {"w": np.abs(floats(4)) + 0.1} if weighted else {}
    run(node("NegativeLogLikelihoodLoss", ["x", "target"] + (["w"] if weighted else []), **attrs),
        {"x": x, "target": target}, weights=weights)


@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_softmax_cross_entropy_loss_and_its_log_probabilities(reduction):
    x, target = floats(3, 5), rng.integers(0, 5, (3,)).astype(np.int32)
    run(node("SoftmaxCrossEntropyLoss", ["x", "target"], ["loss", "log_prob"], reduction=reduction, ignore_index=2),
        {"x": x, "target": target})
