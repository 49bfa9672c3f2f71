"""ONNX's recurrent operators (`opfuse.frontend.onnx_recurrent`): RNN, GRU and LSTM unrolled into matmuls and
gates, compared with onnx.reference.ReferenceEvaluator in every direction and layout; and sequence_lens, which the
reference ignores, against a step-by-step computation here."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from onnx_cases import node, ops, run_node as run
from opfuse.ir.interpret import interpret

rng = np.random.default_rng(0)
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def floats(*shape):
    return (rng.standard_normal(shape) * 0.5).astype(np.float32)


def feeds_for(op, directions, steps=3, batch=2, size=3, hidden=4, bias=True, initial=True):
    g = GATES[op]
    feeds = {"X": floats(steps, batch, size), "W": floats(directions, g * hidden, size),
             "R": floats(directions, g * hidden, hidden)}
    inputs = ["X", "W", "R", "", "", ""]
    if bias:
        feeds["B"] = floats(directions, 2 * g * hidden)
        inputs[3] = "B"
    if initial:
        feeds["initial_h"] = floats(directions, batch, hidden)
        inputs[5] = "initial_h"
    return feeds, inputs


@pytest.mark.parametrize("op", ["RNN", "GRU", "LSTM"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_recurrent_operators_in_each_direction(op, direction):
    directions = 2 if direction == "bidirectional" else 1
    feeds, inputs = feeds_for(op, directions)
    outputs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    graph = run(node(op, inputs, outputs, hidden_size=4, direction=direction), feeds, opset=14)
    assert ops(graph).count("matmul") == 2 * 3 * directions + (3 * directions if op == "GRU" else 0)


def test_gru_linear_before_reset_and_batch_major_layout():
    feeds, inputs = feeds_for("GRU", 1)
    feeds["X"] = np.ascontiguousarray(feeds["X"].transpose(1, 0, 2))
    feeds["initial_h"] = np.ascontiguousarray(feeds["initial_h"].transpose(1, 0, 2))
    run(node("GRU", inputs, ["Y", "Y_h"], hidden_size=4, linear_before_reset=1, layout=1), feeds, opset=14)


def test_lstm_peepholes_and_initial_cell():
    feeds, inputs = feeds_for("LSTM", 1)
    feeds["initial_c"], feeds["P"] = floats(1, 2, 4), floats(1, 12)
    run(node("LSTM", inputs + ["initial_c", "P"], ["Y", "Y_h", "Y_c"], hidden_size=4), feeds, opset=14)


def test_clip_bounds_what_each_activation_sees():
    """clip=0.1 clamps the pre-activations: an RNN's tanh outputs stay within tanh(0.1) (the reference evaluator
    ignores clip)."""
    feeds, inputs = feeds_for("RNN", 1)
    feeds["X"] = feeds["X"] * 20
    from onnx import TensorProto, helper
    from opfuse.frontend.onnx_import import load_onnx
    model = helper.make_model(helper.make_graph(
        [node("RNN", inputs, ["Y"], hidden_size=4, clip=0.1)], "rnn",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, a.shape) for n, a in feeds.items()],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, (3, 1, 2, 4))]),
        opset_imports=[helper.make_opsetid("", 14)])
    (y,) = interpret(load_onnx(model, runnable=True), [torch.from_numpy(a) for a in feeds.values()])
    assert y.abs().max() <= np.tanh(0.1) + 1e-6 and y.abs().max() > 0.09


def test_sequence_lens_keep_the_state_and_write_zeros_past_each_end():
    """A batch of two sequences of lengths 3 and 1: the second one's state stops at step 0 and its outputs after
    are 0 (the reference evaluator ignores sequence_lens; the expected values are computed here)."""
    feeds, inputs = feeds_for("RNN", 1, bias=False, initial=False)
    lengths = np.array([3, 1], np.int32)
    inputs[4] = "lengths"
    from onnx import TensorProto, helper
    from opfuse.frontend.onnx_import import load_onnx
    model = helper.make_model(helper.make_graph(
        [node("RNN", inputs, ["Y", "Y_h"], hidden_size=4)], "rnn",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
         for n, a in [*feeds.items(), ("lengths", lengths)]],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, (3, 1, 2, 4)),
         helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, (1, 2, 4))]),
        opset_imports=[helper.make_opsetid("", 14)])
    graph = load_onnx(model, runnable=True)
    y, y_h = interpret(graph, [torch.from_numpy(a) for a in [*feeds.values(), lengths]])
    x, w, r = (torch.from_numpy(feeds[k]) for k in "XWR")
    h = torch.zeros(2, 4)
    want = []
    for t in range(3):
        new = torch.tanh(x[t] @ w[0].T + h @ r[0].T)
        running = torch.tensor([t < 3, t < 1]).reshape(2, 1)
        h = torch.where(running, new, h)
        want.append(torch.where(running, h, torch.zeros(())))
    torch.testing.assert_close(y[:, 0], torch.stack(want))
    torch.testing.assert_close(y_h[0], h)
    assert torch.equal(y[1:, 0, 1], torch.zeros(2, 4))
