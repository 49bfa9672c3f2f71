"""ONNX's DFT and STFT (`opfuse.frontend.onnx_signal`): forward, inverse and one-sided transforms of real and complex
signals, cut or zero-padded to a DFT length, along any axis, against onnx.reference (numpy's FFT)."""

from __future__ import annotations

import numpy as np
import pytest

from onnx_cases import node, ops, run_node as run

rng = np.random.default_rng(0)


@pytest.mark.parametrize("channels, inverse, onesided", [(1, 0, 0), (2, 0, 0), (1, 0, 1), (2, 1, 0)])
@pytest.mark.parametrize("length", [None, 6, 12])
def test_dft_opset_20(channels, inverse, onesided, length):
    """A forward one-sided transform takes a real signal; the inverse one here a complex spectrum."""
    x = rng.standard_normal((2, 9, 3, channels)).astype(np.float32)
    weights = {"axis": np.array(1, np.int64)} | ({"length": np.array(length, np.int64)} if length else {})
    graph = run(node("DFT", ["x", "length" if length else "", "axis"], inverse=inverse, onesided=onesided), {"x": x},
                weights=weights, opset=20)
    assert "matmul" in ops(graph)


@pytest.mark.parametrize("size", [8, 7])
def test_inverse_one_sided_dft_is_a_real_signal(size):
    """numpy's irfft: the bins 0 .. N/2 of a Hermitian spectrum give N real values."""
    spectrum = rng.standard_normal((3, size // 2 + 1, 2)).astype(np.float32)
    run(node("DFT", ["x", "length"], inverse=1, onesided=1), {"x": spectrum},
        weights={"length": np.array(size, np.int64)}, opset=20)


def test_dft_opset_17_axis_attribute_in_float64():
    run(node("DFT", ["x"], axis=2), {"x": rng.standard_normal((2, 3, 5, 2))}, opset=17, tolerance=1e-12)


@pytest.mark.parametrize("channels, onesided, window", [(1, 1, True), (1, 0, False), (2, 0, True)])
def test_stft_frames_a_signal_and_transforms_each_frame(channels, onesided, window):
    """STFT: frames of frame_length every frame_step (an unfold), times the window, each transformed as DFT is; the
    one-sided bins of a real signal up to frame_length / 2, or all of them; a complex signal."""
    x = rng.standard_normal((2, 40, channels)).astype(np.float32)
    weights = {"step": np.array(6, np.int64), "length": np.array(16, np.int64)}
    if window:
        weights["window"] = np.hanning(16).astype(np.float32)
    graph = run(node("STFT", ["x", "step", "window" if window else "", "length"], onesided=onesided), {"x": x},
                weights=weights, opset=17)
    assert ops(graph)[0] == "unfold" and "matmul" in ops(graph)
