"""3-D convolutions as 2-D ones (`opfuse.frontend.conv3d`) from ATen and ONNX, and avg_pool1d as a 2-D pool: nothing
opaque, the IR graph equal to PyTorch's (ONNX's reference) in float64, and a small video block compiled on Triton's
interpreter against eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.config import FusionConfig
from opfuse.frontend.conv3d import fold_dim
from opfuse.frontend.onnx_import import load_onnx
from opfuse.frontend.torch_export import capture_torch
from opfuse.ir.interpret import interpret

CONV3D = [
    dict(cin=4, cout=6, kernel_size=3, padding=1),                                   # every dim tapped
    dict(cin=4, cout=6, kernel_size=(3, 3, 1), padding=(1, 1, 0)),                  # lambda's window: W folds
    dict(cin=6, cout=6, kernel_size=(3, 1, 3), stride=(2, 1, 1), padding=(1, 0, 1), groups=3),
    dict(cin=4, cout=4, kernel_size=(2, 3, 3), dilation=(2, 1, 1), groups=4, bias=False),   # depthwise
    dict(cin=2, cout=3, kernel_size=1),
    dict(cin=3, cout=5, kernel_size=(3, 2, 3), stride=(2, 2, 1), padding="valid"),
    dict(cin=4, cout=4, kernel_size=3, padding="same", dilation=2),
    dict(cin=4, cout=8, kernel_size=3, stride=2, padding=1, groups=2),
]


@pytest.mark.parametrize("config", CONV3D, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_a_conv3d_maps_to_one_conv2d_and_equals_pytorchs(config):
    config = dict(config)
    torch.manual_seed(0)
    model = nn.Conv3d(config.pop("cin"), config.pop("cout"), **config).eval().double()
    x = torch.randn(2, model.in_channels, 5, 6, 7, dtype=torch.float64)
    graph = capture_torch(model, (x,))
    ops = [node.op for node in graph]
    assert "opaque" not in ops and ops.count("conv2d") == 1
    (got,) = interpret(graph, [x])
    want = model(x).detach()
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-12


def test_the_fold_dim_is_the_smallest_window_then_one_without_stride_or_padding():
    assert fold_dim((3, 3, 1), (1, 1, 1), (1, 1, 0)) == 2
    assert fold_dim((3, 3, 3), (2, 1, 1), (1, 1, 1)) == 0      # all alike: the first
    assert fold_dim((3, 3, 3), (2, 1, 2), (1, 0, 1)) == 1      # the one neither strided nor padded
    assert fold_dim((1, 3, 3), (2, 1, 1), (0, 1, 1)) == 0


def _onnx_conv(x_shape, w_shape, bias: bool, **attrs):
    import onnx
    import onnx.reference
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    x = rng.standard_normal(x_shape).astype(np.float32)
    initializers = [numpy_helper.from_array(rng.standard_normal(w_shape).astype(np.float32), "w")]
    if bias:
        initializers.append(numpy_helper.from_array(rng.standard_normal(w_shape[0]).astype(np.float32), "b"))
    node = helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []), ["y"], **attrs)

    def model(y_shape):
        graph = helper.make_graph([node], "conv3d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], initializers)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    want = onnx.reference.ReferenceEvaluator(model(None)).run(None, {"x": x})[0]
    return model(want.shape), x, want


@pytest.mark.parametrize("x_shape, w_shape, bias, attrs", [
    ((1, 2, 4, 5, 6), (3, 2, 3, 3, 3), True, dict(pads=[1, 1, 1, 1, 1, 1])),
    ((2, 4, 5, 5, 5), (4, 2, 2, 3, 1), False, dict(group=2, strides=[2, 1, 1], dilations=[1, 2, 1])),
    ((1, 2, 4, 5, 6), (3, 2, 3, 3, 3), True, dict(auto_pad="SAME_UPPER", strides=[2, 2, 2])),
    ((1, 2, 4, 5, 6), (3, 2, 2, 2, 2), True, dict(pads=[0, 1, 0, 1, 0, 1])),     # asymmetric: an explicit pad
])
def test_an_onnx_3d_conv_equals_onnx_reference(x_shape, w_shape, bias, attrs):
    model, x, want = _onnx_conv(x_shape, w_shape, bias, **attrs)
    graph = load_onnx(model)
    assert [node.op for node in graph].count("conv2d") == 1
    (got,) = interpret(graph, [torch.from_numpy(x)])
    assert tuple(got.shape) == want.shape
    assert float(np.abs(got.numpy() - want).max() / np.abs(want).max()) < 1e-6


class VideoBlock(nn.Module):
    """A (2+1)-D style block: a 3-D conv, batch norm, ReLU, a grouped (3, 3, 1) conv with a residual, then a 1-D
    average pool over the flattened volume."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv3d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm3d(8)
        self.spatial = nn.Conv3d(8, 8, (3, 3, 1), padding=(1, 1, 0), groups=2)
        self.pool = nn.AvgPool1d(3, stride=2, padding=1)

    def forward(self, x):
        y = torch.relu(self.norm(self.stem(x)))
        y = self.spatial(y) + y
        return self.pool(y.flatten(2))


def test_a_video_block_compiles_with_nothing_through_pytorch_and_matches_eager():
    """The stem's batch norm folds into its conv and its ReLU is the conv's epilogue, through the view back to 5-D."""
    torch.manual_seed(0)
    model = VideoBlock().eval()
    with torch.no_grad():
        model.norm.running_mean.uniform_(-0.5, 0.5)
        model.norm.running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 4, 6, 5)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    prepared = analysis.prepared
    assert "avg_pool2d" in {node.op for node in prepared} and "batch_norm" not in {node.op for node in prepared}
    stem = next(group for group in analysis.plan.groups if group.anchor and "conv3d" in group.anchor)
    assert [prepared[name].op for name in stem.nodes] == ["conv2d", "relu"]
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 3, 4, 6, 5)
    with torch.no_grad():
        got, want = compiled(x), model(x)
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


@pytest.mark.parametrize("shape, kwargs", [((2, 3, 11), dict(kernel_size=3, stride=2, padding=1)),
                                           ((3, 10), dict(kernel_size=2, ceil_mode=True)),
                                           ((2, 4, 9), dict(kernel_size=3, padding=1, count_include_pad=False))])
def test_avg_pool1d_maps_to_a_2d_pool_and_equals_pytorchs(shape, kwargs):
    model = nn.AvgPool1d(**kwargs)
    x = torch.randn(*shape, dtype=torch.float64)
    graph = capture_torch(model, (x,))
    assert "avg_pool2d" in [node.op for node in graph] and "opaque" not in [node.op for node in graph]
    (got,) = interpret(graph, [x])
    torch.testing.assert_close(got, model(x))
