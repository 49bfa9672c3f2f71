"""ONNX converters of the recurrent operators RNN, GRU and LSTM: each unrolled over its (static) sequence into
the IR's matmuls, elementwise gates and concatenations. Registered in `opfuse.frontend.onnx_converters.CONVERTERS`
(see there for the converter contract).

Per direction and step t: the input and the previous hidden state each times their weights (W and R given as
[gates * hidden, size], used transposed), the two biases, then the gates as ONNX defines them (GRU: z, r, h with
or without linear_before_reset; LSTM: i, o, f, c with peepholes). The reverse direction walks the steps backwards
and writes its outputs in time order. With sequence_lens (forward only) a step past a sequence's length keeps its
state and writes zeros. A long sequence is a long graph; the activations are the default ones and Relu.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from opfuse.frontend.onnx_converters import Unsupported, converts
from opfuse.ir.graph import torch_dtype

if TYPE_CHECKING:
    from opfuse.frontend.onnx_import import Importer

GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {"RNN": ["Tanh"], "GRU": ["Sigmoid", "Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
ACTIVATIONS = {"sigmoid": "sigmoid", "tanh": "tanh", "relu": "relu"}


class _Step:
    """The IR nodes one direction's step is made of, named after the node's output and the step."""

    def __init__(self, importer: Importer, name: str, hidden: int, clip: float | None, activations: list[str]):
        self.importer, self.name, self.hidden, self.clip = importer, name, hidden, clip
        self.functions = [ACTIVATIONS[a.lower()] for a in activations]

    def emit(self, op: str, inputs: list[str], what: str, attrs: dict | None = None) -> str:
        return self.importer.emit(op, inputs, attrs, name=f"{self.name}_{what}")

    def gate(self, x: str, index: int, what: str) -> str:
        """Gate `index` ([batch, hidden]) of a [batch, gates * hidden] value."""
        return self.emit("slice", [x], what, {"dim": 1, "start": index * self.hidden,
                                              "end": (index + 1) * self.hidden, "step": 1})

    def activate(self, x: str, which: int, what: str) -> str:
        if self.clip is not None:
            x = self.emit("clamp", [x], f"{what}_clipped", {"min": -self.clip, "max": self.clip})
        return self.emit(self.functions[which], [x], what)


def _direction_weights(importer: Importer, x: str, direction: int, name: str) -> str:
    """W or R of one direction, [gates * hidden, size] transposed to [size, gates * hidden]."""
    shape = importer.type(x).shape
    one = importer.emit("reshape", [importer.emit("slice", [x], {"dim": 0, "start": direction, "end": direction + 1,
                                                                 "step": 1}, name=f"{name}_dir")],
                        {"shape": shape[1:]}, name=f"{name}_matrix")
    return importer.emit("permute", [one], {"dims": (1, 0)}, name=f"{name}_t")


def _direction_row(importer: Importer, x: str | None, direction: int, width: int, start: int, name: str,
                   dtype: str) -> str:
    """Values [start, start + width) of row `direction` of a [directions, n] input (zeros when it is omitted)."""
    if x is None:
        return importer.add_constant(torch.zeros(width, dtype=torch_dtype(dtype)), f"{name}_zeros")
    row = importer.emit("slice", [x], {"dim": 0, "start": direction, "end": direction + 1, "step": 1},
                        name=f"{name}_dir")
    part = importer.emit("slice", [row], {"dim": 1, "start": start, "end": start + width, "step": 1},
                         name=f"{name}_part")
    return importer.emit("reshape", [part], {"shape": (width,)}, name=f"{name}_row")


def _initial(importer: Importer, x: str | None, direction: int, batch: int, hidden: int, name: str,
             dtype: str) -> str:
    if x is None:
        return importer.add_constant(torch.zeros((batch, hidden), dtype=torch_dtype(dtype)), f"{name}_zeros")
    one = importer.emit("slice", [x], {"dim": 0, "start": direction, "end": direction + 1, "step": 1},
                        name=f"{name}_dir")
    return importer.emit("reshape", [one], {"shape": (batch, hidden)}, name=f"{name}_state")


@converts("RNN", "GRU", "LSTM", attributes=("activation_alpha", "activation_beta", "activations", "clip", "direction",
                                            "hidden_size", "layout", "linear_before_reset", "input_forget"))
def _recurrent(importer: Importer, node, xs, attrs):
    op, out = node.op_type, node.output[0] or node.output[1]
    xs = xs + [None] * (8 - len(xs))
    x, weights, recurrences, biases, lengths, initial_h = xs[:6]
    initial_c, peepholes = (xs[6], xs[7]) if op == "LSTM" else (None, None)
    if "activation_alpha" in attrs or "activation_beta" in attrs:
        raise Unsupported("activations with alpha or beta")
    if attrs.get("input_forget", 0):
        raise Unsupported("LSTM with input_forget")
    direction = attrs.get("direction", "forward")
    directions = 2 if direction == "bidirectional" else 1
    activations = attrs.get("activations", DEFAULT_ACTIVATIONS[op] * directions)
    if any(a.lower() not in ACTIVATIONS for a in activations):
        raise Unsupported(f"activations {activations}: only Sigmoid, Tanh and Relu are mapped")
    if lengths is not None and direction != "forward":
        raise Unsupported("sequence_lens with a reverse direction (each sequence reversed within its length)")
    layout = attrs.get("layout", 0)
    if layout:   # [batch, sequence, ...] -> [sequence, batch, ...]; the initial states [batch, dirs, hidden]
        x = importer.emit("permute", [x], {"dims": (1, 0, 2)}, name=f"{out}_time_major")
        initial_h, initial_c = (None if s is None else importer.emit("permute", [s], {"dims": (1, 0, 2)},
                                                                     name=f"{out}_{n}_direction_major")
                                for s, n in ((initial_h, "h0"), (initial_c, "c0")))
    steps, batch, _ = importer.type(x).shape
    hidden = attrs["hidden_size"]
    gates = GATES[op]
    dtype = importer.type(x).dtype
    per_direction = len(activations) // directions
    ys, last_h, last_c = [], [], []
    for d in range(directions):
        name = f"{out}_dir{d}"
        step = _Step(importer, name, hidden, attrs.get("clip"), activations[d * per_direction:(d + 1) * per_direction])
        w_t = _direction_weights(importer, weights, d, f"{name}_w")
        r_t = _direction_weights(importer, recurrences, d, f"{name}_r")
        w_bias = _direction_row(importer, biases, d, gates * hidden, 0, f"{name}_wb", dtype)
        r_bias = _direction_row(importer, biases, d, gates * hidden, gates * hidden, f"{name}_rb", dtype)
        h = _initial(importer, initial_h, d, batch, hidden, f"{name}_h0", dtype)
        c = _initial(importer, initial_c, d, batch, hidden, f"{name}_c0", dtype) if op == "LSTM" else None
        peep = [_direction_row(importer, peepholes, d, hidden, k * hidden, f"{name}_p{k}", dtype) for k in range(3)] \
            if op == "LSTM" and peepholes is not None else None
        outputs = {}
        order = range(steps) if d == 0 and direction != "reverse" else range(steps - 1, -1, -1)
        for t in order:
            step.name = f"{name}_t{t}"
            x_t = importer.emit("reshape", [importer.emit("slice", [x], {"dim": 0, "start": t, "end": t + 1, "step": 1},
                                                          name=f"{step.name}_x3d")],
                                {"shape": (batch, importer.type(x).shape[2])}, name=f"{step.name}_x")
            x_part = step.emit("add", [step.emit("matmul", [x_t, w_t], "xw"), w_bias], "xwb")
            h_part = step.emit("add", [step.emit("matmul", [h, r_t], "hr"), r_bias], "hrb")
            if op == "RNN":
                new_h = step.activate(step.emit("add", [x_part, h_part], "sum"), 0, "h")
            elif op == "GRU":
                new_h = _gru_step(step, x_part, h_part, h, r_t, r_bias, attrs.get("linear_before_reset", 0))
            else:
                new_h, c = _lstm_step(step, x_part, h_part, c, peep)
            if lengths is not None:   # past a sequence's end: the state stays, the output is 0
                valid = step.emit("reshape", [step.emit("lt", [importer.add_constant(
                    torch.tensor(t, dtype=torch_dtype(importer.type(lengths).dtype)), f"{step.name}_index"), lengths],
                    "running")], "running_column", {"shape": (batch, 1)})
                new_h = step.emit("where", [valid, new_h, h], "h_kept")
                outputs[t] = step.emit("where", [valid, new_h, importer.add_constant(
                    torch.tensor(0, dtype=torch_dtype(dtype)), f"{step.name}_zero")], "y")
            else:
                outputs[t] = new_h
            h = new_h
        ys.append(importer.emit("reshape", [importer.emit("cat", [outputs[t] for t in range(steps)], {"dim": 0},
                                                          name=f"{name}_steps")], {"shape": (steps, 1, batch, hidden)},
                                name=f"{name}_y"))
        last_h.append(importer.emit("reshape", [h], {"shape": (1, batch, hidden)}, name=f"{name}_last_h"))
        if c is not None:
            last_c.append(importer.emit("reshape", [c], {"shape": (1, batch, hidden)}, name=f"{name}_last_c"))
    results = [importer.emit("cat", parts, {"dim": dim}, name=f"{out}_{what}") if len(parts) > 1 else parts[0]
               for parts, dim, what in ((ys, 1, "y_all"), (last_h, 0, "h_all"), (last_c, 0, "c_all")) if parts]
    if layout:   # Y [batch, sequence, dirs, hidden], the states [batch, dirs, hidden]
        results = [importer.emit("permute", [r], {"dims": (2, 0, 1, 3) if i == 0 else (1, 0, 2)},
                                 name=f"{out}_batch_major{i}") for i, r in enumerate(results)]
    return results


def _gru_step(step: _Step, x_part: str, h_part: str, h: str, r_t: str, r_bias: str, linear_before_reset: int) -> str:
    """z and r from the input's and state's parts; the candidate from the input's h part and r times the state's
    (with linear_before_reset), or the state reset by r times R_h plus its bias (without); then (1 - z) h~ + z h."""
    z = step.activate(step.emit("add", [step.gate(x_part, 0, "xz"), step.gate(h_part, 0, "hz")], "z_sum"), 0, "z")
    r = step.activate(step.emit("add", [step.gate(x_part, 1, "xr"), step.gate(h_part, 1, "hr_gate")], "r_sum"), 0,
                      "r")
    if linear_before_reset:
        recurrent = step.emit("mul", [r, step.gate(h_part, 2, "hh")], "reset")
    else:
        hidden = step.hidden
        r_h = step.emit("slice", [r_t], "r_h", {"dim": 1, "start": 2 * hidden, "end": 3 * hidden, "step": 1})
        bias_h = step.emit("slice", [r_bias], "rb_h", {"dim": 0, "start": 2 * hidden, "end": 3 * hidden, "step": 1})
        recurrent = step.emit("add", [step.emit("matmul", [step.emit("mul", [r, h], "reset_h"), r_h], "reset_hr"),
                                      bias_h], "reset")
    candidate = step.activate(step.emit("add", [step.gate(x_part, 2, "xh"), recurrent], "h_sum"), 1, "candidate")
    one = step.importer.scalar(1.0, z)
    keep = step.emit("mul", [z, h], "kept")
    return step.emit("add", [step.emit("mul", [step.emit("sub", [one, z], "one_minus_z"), candidate], "new"), keep],
                     "h")


def _lstm_step(step: _Step, x_part: str, h_part: str, c: str, peep: list[str] | None) -> tuple[str, str]:
    """Gates i, o, f, c (in that order in W and R); peepholes add P_i c and P_f c to i and f, P_o c' to o."""
    gates = step.emit("add", [x_part, h_part], "gates")

    def peeped(index, what, state, peep_index):
        value = step.gate(gates, index, f"{what}_pre")
        if peep is not None:
            value = step.emit("add", [value, step.emit("mul", [peep[peep_index], state], f"{what}_peep")],
                              f"{what}_peeped")
        return step.activate(value, 0, what)

    i = peeped(0, "i", c, 0)
    f = peeped(2, "f", c, 2)
    candidate = step.activate(step.gate(gates, 3, "c_pre"), 1, "c_candidate")
    new_c = step.emit("add", [step.emit("mul", [f, c], "c_kept"), step.emit("mul", [i, candidate], "c_new")], "c")
    o = peeped(1, "o", new_c, 1)
    return step.emit("mul", [o, step.activate(new_c, 2, "c_out")], "h"), new_c
