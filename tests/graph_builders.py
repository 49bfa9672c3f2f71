"""Hand-built IR graphs for tests: the classic fusion patterns, typed by `opfuse.ir.ops.infer_type`.

Each function returns a fresh `Graph` (float16 by default; constants are small random tensors) whose node names
say what they are (``conv1``, ``bn1``, ``relu1``, ...), so tests can assert on names. `GraphBuilder` is the
small helper they share; use it directly for one-off graphs.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from opfuse.ir.graph import Graph, TensorType, torch_dtype
from opfuse.ir.ops import infer_type


LAZY_CONSTANT = 1 << 22


class GraphBuilder:
    """Appends typed nodes to a graph; every method returns the new node's name."""

    def __init__(self, name: str, dtype: str = "float16", seed: int = 0):
        self.graph = Graph(name)
        self.dtype = dtype
        self.generator = torch.Generator().manual_seed(seed)

    def input(self, name: str, shape: Sequence[int], dtype: str | None = None) -> str:
        return self.graph.add_input(name, TensorType(tuple(shape), dtype or self.dtype)).name

    def constant(self, name: str, shape: Sequence[int], positive: bool = False) -> str:
        """A random constant; above LAZY_CONSTANT elements a stride-0 tensor of ones (planning needs the type)."""
        if math.prod(shape) > LAZY_CONSTANT:
            tensor = torch.ones((), dtype=torch_dtype(self.dtype)).expand(tuple(shape))
            return self.graph.add_constant(name, tensor).name
        tensor = torch.randn(tuple(shape), generator=self.generator) * 0.1
        if positive:
            tensor = tensor.abs() + 0.5
        return self.graph.add_constant(name, tensor.to(torch_dtype(self.dtype))).name

    def op(self, op: str, inputs: Sequence[str], attrs: dict[str, Any] | None = None, name: str | None = None) -> str:
        attrs = dict(attrs or {})
        out = infer_type(op, [self.graph[i].type for i in inputs], attrs)
        return self.graph.add_node(op, inputs, out, attrs, name=name).name

    def conv(self, x: str, c_out: int, kernel: int = 1, stride: int = 1, padding: int = 0, dilation: int = 1,
             groups: int = 1, bias: bool = True, name: str = "conv") -> str:
        c_in = self.graph[x].type.shape[1]
        inputs = [x, self.constant(f"{name}_w", (c_out, c_in // groups, kernel, kernel))]
        if bias:
            inputs.append(self.constant(f"{name}_b", (c_out,)))
        attrs = {"stride": (stride, stride), "padding": (padding, padding), "dilation": (dilation, dilation),
                 "groups": groups}
        return self.op("conv2d", inputs, attrs, name)

    def batch_norm(self, x: str, name: str = "bn") -> str:
        c = self.graph[x].type.shape[1]
        params = [self.constant(f"{name}_weight", (c,)), self.constant(f"{name}_bias", (c,)),
                  self.constant(f"{name}_mean", (c,)), self.constant(f"{name}_var", (c,), positive=True)]
        return self.op("batch_norm", [x, *params], {"eps": 1e-5}, name)

    def linear(self, x: str, n: int, bias: bool = True, name: str = "linear") -> str:
        k = self.graph[x].type.shape[-1]
        inputs = [x, self.constant(f"{name}_w", (n, k))]
        if bias:
            inputs.append(self.constant(f"{name}_b", (n,)))
        return self.op("linear", inputs, name=name)

    def layer_norm(self, x: str, name: str = "ln") -> str:
        d = self.graph[x].type.shape[-1]
        return self.op("layer_norm", [x, self.constant(f"{name}_w", (d,)), self.constant(f"{name}_b", (d,))],
                       {"normalized_shape": [d], "eps": 1e-5}, name)

    def unary(self, op: str, x: str, name: str | None = None, **attrs: Any) -> str:
        return self.op(op, [x], attrs, name)

    def output(self, *names: str) -> Graph:
        self.graph.outputs = list(names)
        return self.graph


def conv_bn_relu(batch: int = 1, c_in: int = 32, c_out: int = 64, size: int = 56) -> Graph:
    """The seed's example: conv (no bias) -> batch_norm -> relu, batch norm not folded."""
    b = GraphBuilder("conv_bn_relu")
    x = b.input("x", (batch, c_in, size, size))
    y = b.conv(x, c_out, kernel=3, padding=1, bias=False, name="conv")
    y = b.batch_norm(y, "bn")
    return b.output(b.unary("relu", y, "relu"))


def conv_relu(batch: int = 1, c_in: int = 32, c_out: int = 64, size: int = 56) -> Graph:
    """`conv_bn_relu` with the batch norm folded: conv with bias -> relu."""
    b = GraphBuilder("conv_relu")
    x = b.input("x", (batch, c_in, size, size))
    y = b.conv(x, c_out, kernel=3, padding=1, bias=True, name="conv")
    return b.output(b.unary("relu", y, "relu"))


def resnet_basic_block(batch: int = 1, c_in: int = 64, c_out: int = 128, size: int = 28, stride: int = 2,
                       fold_bn: bool = True) -> Graph:
    """conv3x3-bn-relu, conv3x3-bn, + downsample(conv1x1-bn)(x), relu (torchvision order)."""
    b = GraphBuilder("resnet_basic_block")
    x = b.input("x", (batch, c_in, size, size))
    y = _conv_bn(b, x, c_out, 3, stride, 1, "1", fold_bn)
    y = b.unary("relu", y, "relu1")
    y = _conv_bn(b, y, c_out, 3, 1, 1, "2", fold_bn)
    skip = _conv_bn(b, x, c_out, 1, stride, 0, "_ds", fold_bn) if stride != 1 or c_in != c_out else x
    y = b.op("add", [y, skip], name="add")
    return b.output(b.unary("relu", y, "relu_out"))


def resnet_bottleneck(batch: int = 1, c_in: int = 256, width: int = 64, size: int = 56, stride: int = 1,
                      downsample: bool = True, fold_bn: bool = True) -> Graph:
    """conv1x1-bn-relu, conv3x3-bn-relu, conv1x1-bn, + downsample(x), relu (torchvision order)."""
    b = GraphBuilder("resnet_bottleneck")
    c_out = width * 4
    x = b.input("x", (batch, c_in, size, size))
    y = b.unary("relu", _conv_bn(b, x, width, 1, 1, 0, "1", fold_bn), "relu1")
    y = b.unary("relu", _conv_bn(b, y, width, 3, stride, 1, "2", fold_bn), "relu2")
    y = _conv_bn(b, y, c_out, 1, 1, 0, "3", fold_bn)
    skip = _conv_bn(b, x, c_out, 1, stride, 0, "_ds", fold_bn) if downsample else x
    y = b.op("add", [y, skip], name="add")
    return b.output(b.unary("relu", y, "relu_out"))


def _conv_bn(b: GraphBuilder, x: str, c_out: int, kernel: int, stride: int, padding: int, suffix: str,
             fold_bn: bool) -> str:
    """conv{suffix} with bias (folded) or conv{suffix} without bias -> bn{suffix}."""
    y = b.conv(x, c_out, kernel, stride, padding, bias=fold_bn, name=f"conv{suffix}")
    return y if fold_bn else b.batch_norm(y, f"bn{suffix}")


def inception_siblings(batch: int = 1, c_in: int = 192, size: int = 28, fold_bn: bool = True) -> Graph:
    """An inception block: three 1x1 conv-relu branches on x (two feed 3x3/5x5 convs), a pool branch, cat."""
    b = GraphBuilder("inception")
    x = b.input("x", (batch, c_in, size, size))
    branch1 = b.unary("relu", _conv_bn(b, x, 64, 1, 1, 0, "_1x1", fold_bn), "relu_1x1")
    reduce3 = b.unary("relu", _conv_bn(b, x, 96, 1, 1, 0, "_3x3_reduce", fold_bn), "relu_3x3_reduce")
    branch3 = b.unary("relu", _conv_bn(b, reduce3, 128, 3, 1, 1, "_3x3", fold_bn), "relu_3x3")
    reduce5 = b.unary("relu", _conv_bn(b, x, 16, 1, 1, 0, "_5x5_reduce", fold_bn), "relu_5x5_reduce")
    branch5 = b.unary("relu", _conv_bn(b, reduce5, 32, 5, 1, 2, "_5x5", fold_bn), "relu_5x5")
    pool = b.op("max_pool2d", [x], {"kernel_size": (3, 3), "stride": (1, 1), "padding": (1, 1),
                                    "dilation": (1, 1), "ceil_mode": False}, "pool")
    branch_pool = b.unary("relu", _conv_bn(b, pool, 32, 1, 1, 0, "_pool", fold_bn), "relu_pool")
    return b.output(b.op("cat", [branch1, branch3, branch5, branch_pool], {"dim": 1}, "cat"))


def attention_block(batch: int = 2, seq: int = 128, heads: int = 4, head_dim: int = 32) -> Graph:
    """Self-attention: separate Q/K/V linears, reshape + permute to heads, sdpa, back, output linear."""
    b = GraphBuilder("attention")
    d = heads * head_dim
    x = b.input("x", (batch, seq, d))
    return b.output(_attention(b, x, heads, ""))


def _attention(b: GraphBuilder, x: str, heads: int, suffix: str) -> str:
    batch, seq, d = b.graph[x].type.shape
    projected = []
    for part in "qkv":
        y = b.linear(x, d, name=f"{part}_proj{suffix}")
        y = b.op("reshape", [y], {"shape": [batch, seq, heads, d // heads]}, f"{part}_heads{suffix}")
        projected.append(b.op("permute", [y], {"dims": [0, 2, 1, 3]}, f"{part}_perm{suffix}"))
    y = b.op("sdpa", projected, {"is_causal": False}, f"sdpa{suffix}")
    y = b.op("permute", [y], {"dims": [0, 2, 1, 3]}, f"attn_perm{suffix}")
    y = b.op("reshape", [y], {"shape": [batch, seq, d]}, f"attn_merge{suffix}")
    return b.linear(y, d, name=f"out_proj{suffix}")


def mobilenet_inverted_residual(batch: int = 1, channels: int = 32, expand: int = 6, size: int = 28) -> Graph:
    """1x1 expand conv + relu6, 3x3 depthwise conv + relu6, 1x1 project conv, + x (BN folded)."""
    b = GraphBuilder("inverted_residual")
    hidden = channels * expand
    x = b.input("x", (batch, channels, size, size))
    y = b.unary("clamp", b.conv(x, hidden, 1, name="expand"), "relu6_1", min=0.0, max=6.0)
    y = b.unary("clamp", b.conv(y, hidden, 3, padding=1, groups=hidden, name="depthwise"), "relu6_2",
                min=0.0, max=6.0)
    y = b.conv(y, channels, 1, name="project")
    return b.output(b.op("add", [y, x], name="add"))


def transformer_ffn(batch: int = 2, seq: int = 128, d: int = 256, hidden: int = 1024) -> Graph:
    """linear -> gelu -> linear -> + x -> layer_norm (post-norm, as in BERT)."""
    b = GraphBuilder("ffn")
    x = b.input("x", (batch, seq, d))
    return b.output(_ffn(b, x, hidden, ""))


def _ffn(b: GraphBuilder, x: str, hidden: int, suffix: str) -> str:
    d = b.graph[x].type.shape[-1]
    y = b.unary("gelu", b.linear(x, hidden, name=f"fc1{suffix}"), f"gelu{suffix}")
    y = b.linear(y, d, name=f"fc2{suffix}")
    y = b.op("add", [y, x], name=f"residual{suffix}")
    return b.layer_norm(y, f"ln{suffix}")


def bert_like(layers: int = 12, batch: int = 1, seq: int = 64, heads: int = 4, head_dim: int = 16) -> Graph:
    """A post-norm transformer encoder stack (attention + residual + layer_norm, FFN): ~37 nodes a layer."""
    b = GraphBuilder("bert_like")
    x = b.input("x", (batch, seq, heads * head_dim))
    for i in range(layers):
        y = _attention(b, x, heads, f"_{i}")
        y = b.layer_norm(b.op("add", [y, x], name=f"attn_residual_{i}"), f"attn_ln_{i}")
        x = _ffn(b, y, 4 * heads * head_dim, f"_{i}")
    return b.output(x)
