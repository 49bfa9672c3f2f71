"""The row analysis (`opfuse.ir.rows.row_dependence`): whether padding a graph's inputs with rows and cutting its
outputs back can change the rows kept.

Every graph here is also run through the ops' references with its last input row changed (`rows_changed`, what
padding does): each graph the analysis passes keeps its other rows, and each refused graph marked `wrong` really
changes them, so those refusals are ones padding would have got wrong. The others are refused because the analysis
cannot prove them safe (an opaque op, a constant as long as the batch).
"""

from __future__ import annotations

import pytest
import torch

from graph_builders import (GraphBuilder, attention_block, bert_like, conv_bn_relu, inception_siblings,
                            mobilenet_inverted_residual, resnet_bottleneck, transformer_ffn)
from opfuse.frontend.torch_export import capture_torch
from opfuse.ir.graph import Graph, torch_dtype
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import REGISTRY
from opfuse.ir.rows import REDUCED_DIMS, RULES, Mixes, Rows, reshape_rows, row_dependence
from opfuse.passes import prepare_graph

B = 3       # the batch every graph is traced at


def rows_changed(graph: Graph, input_dims: dict[str, int] | None = None,
                 output_dims: dict[str, int] | None = None) -> bool:
    """Whether changing the last row of every input (along its dim in `input_dims`, default 0) changes any other
    row of an output (along its dim in `output_dims`, default 0)."""
    generator = torch.Generator().manual_seed(0)

    def draw(node):
        shape, dtype = node.type.shape, torch_dtype(node.type.dtype)
        if node.type.is_float:
            return torch.randn(shape, generator=generator).to(dtype)
        return torch.randint(0, 2, shape, generator=generator).to(dtype)

    first, second = [], []
    for node in graph.input_nodes:
        dim = 0 if input_dims is None else input_dims[node.name]
        x, other = draw(node), draw(node)
        last = x.shape[dim] - 1
        first.append(x)
        second.append(torch.cat([x.narrow(dim, 0, last), other.narrow(dim, last, 1)], dim))
    for name, a, b in zip(graph.outputs, interpret(graph, first), interpret(graph, second)):
        dim = 0 if output_dims is None else output_dims[name]
        kept = a.shape[dim] - 1
        if not torch.allclose(a.narrow(dim, 0, kept).float(), b.narrow(dim, 0, kept).float(), rtol=1e-3, atol=1e-3):
            return True
    return False


def prepared(model: torch.nn.Module, *inputs: torch.Tensor) -> Graph:
    """The graph opfuse plans for `model` (captured, then through the default passes), in float32."""
    return prepare_graph(capture_torch(model.eval(), inputs), "float32")[0]


def builder(name: str) -> GraphBuilder:
    return GraphBuilder(name, dtype="float32")


# ---- graphs whose rows are independent ----------------------------------------------------------------------

def linear_gelu_layer_norm() -> Graph:
    b = builder("mlp")
    y = b.unary("gelu", b.linear(b.input("x", (B, 5, 8)), 16, name="fc1"), "gelu")
    return b.output(b.layer_norm(b.linear(y, 8, name="fc2"), "ln"))


def flattened_transformer_block() -> Graph:
    """What every transformer does: rows flattened [B, S, H] -> [B*S, H] for the projections, split into heads for
    attention, merged back."""
    b = builder("flat_block")
    x = b.input("x", (B, 4, 8))
    flat = b.op("reshape", [x], {"shape": [B * 4, 8]}, "flatten")
    qkv = b.linear(b.layer_norm(flat, "ln"), 24, name="qkv")
    heads = b.op("reshape", [qkv], {"shape": [B, 4, 3, 2, 4]}, "split_heads")
    heads = b.op("permute", [heads], {"dims": [2, 0, 3, 1, 4]}, "heads_first")
    parts = [b.op("reshape", [b.op("slice", [heads], {"dim": 0, "start": i, "end": i + 1, "step": 1})],
                  {"shape": [B, 2, 4, 4]}, f"{'qkv'[i]}_part") for i in range(3)]
    attention = b.op("sdpa", parts, {"is_causal": False}, "sdpa")
    merged = b.op("reshape", [b.op("permute", [attention], {"dims": [0, 2, 1, 3]})], {"shape": [B * 4, 8]},
                  "merge_heads")
    out = b.op("reshape", [b.linear(merged, 8, name="out_proj")], {"shape": [B, 4, 8]}, "unflatten")
    return b.output(b.op("add", [x, out], name="residual"))


def class_token() -> Graph:
    """A ViT's class token: a [1, 1, H] weight expanded to the batch and put before the patches."""
    b = builder("class_token")
    x = b.input("x", (B, 4, 8))
    token = b.op("expand", [b.constant("cls", (1, 1, 8))], {"shape": [B, 1, 8]}, "cls_expand")
    return b.output(b.layer_norm(b.op("cat", [token, x], {"dim": 1}, "cat"), "ln"))


def token_ids() -> Graph:
    b = builder("embed")
    ids = b.input("ids", (B, 5), dtype="int64")
    table = b.constant("table", (10, 8))
    return b.output(b.unary("softmax", b.op("embedding", [table, ids], name="embed"), "softmax", dim=-1))


def batch_times_matrix() -> Graph:
    """matmul with the batch in M (x @ W) and in a leading dim (per-sample Gram matrices)."""
    b = builder("matmuls")
    x = b.input("x", (B, 4, 8))
    y = b.op("matmul", [x, b.constant("w", (8, 8))], name="project")
    gram = b.op("matmul", [y, b.op("permute", [y], {"dims": [0, 2, 1]})], name="gram")
    return b.output(b.unary("softmax", gram, "softmax", dim=-1))


def sliding_windows() -> Graph:
    """VOLO's and halonet's windows, per image: im2col, col2im back, and overlapping unfolds along H and W."""
    b = builder("windows")
    window = {"kernel_size": [3, 2], "dilation": [1, 1], "padding": [1, 0], "stride": [1, 1]}
    columns = b.op("im2col", [b.input("x", (B, 2, 5, 4))], window, "im2col")
    image = b.op("col2im", [columns], {"output_size": [5, 4]} | window, "col2im")
    rows = b.op("unfold", [b.op("unfold", [image], {"dim": 2, "size": 3, "step": 2}, "rows")],
                {"dim": 3, "size": 2, "step": 1}, "columns")
    return b.output(b.unary("softmax", rows, "softmax", dim=-1))


INDEPENDENT = {
    "conv_bn_relu": lambda: conv_bn_relu(B, 3, 4, 5),
    "resnet_bottleneck": lambda: resnet_bottleneck(B, 8, 2, 5, fold_bn=False),
    "inception": lambda: inception_siblings(B, 8, 5),
    "inverted_residual": lambda: mobilenet_inverted_residual(B, 4, 2, 5),
    "attention": lambda: attention_block(B, 4, 2, 4),
    "ffn": lambda: transformer_ffn(B, 4, 8, 16),
    "bert_like": lambda: bert_like(2, B, 4, 2, 4),
    "linear_layer_norm": linear_gelu_layer_norm,
    "flattened_transformer_block": flattened_transformer_block,
    "class_token": class_token,
    "token_ids": token_ids,
    "matmuls": batch_times_matrix,
    "sliding_windows": sliding_windows,
}


@pytest.mark.parametrize("name", INDEPENDENT)
def test_graphs_whose_rows_are_independent_pass_and_keep_their_rows(name):
    graph = INDEPENDENT[name]()
    assert row_dependence(graph) is None
    assert not rows_changed(graph)


def test_captured_models_whose_rows_are_independent_pass():
    torch.manual_seed(0)
    convnet = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                  torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, 2))
    encoder = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    for graph in (prepared(convnet, torch.randn(B, 3, 8, 8)), prepared(encoder, torch.randn(B, 4, 16))):
        assert row_dependence(graph) is None, graph.name
        assert not rows_changed(graph)


# ---- graphs whose rows interact, or that the analysis cannot follow ---------------------------------------------

def batch_softmax() -> Graph:
    b = builder("batch_softmax")
    y = b.unary("softmax", b.input("x", (B, 4)), "softmax", dim=0)
    return b.output(b.op("mul", [y, b.constant("scale", (4,))], name="scale"))


def centred() -> Graph:
    b = builder("centred")
    x = b.input("x", (B, 4))
    return b.output(b.op("sub", [x, b.op("mean", [x], {"dims": [0], "keepdim": True}, "mean")], name="centre"))


def minus_last_row() -> Graph:
    b = builder("minus_last_row")
    x = b.input("x", (B, 4))
    last = b.op("slice", [x], {"dim": 0, "start": B - 1, "end": B, "step": 1}, "last_row")
    return b.output(b.op("sub", [x, last], name="sub"))


def shifted_up_by_cat() -> Graph:
    """out[i] = x[i + 1], a zero row after the last: a cat along the batch, then a slice."""
    b = builder("shift_cat")
    x = b.input("x", (B, 4))
    joined = b.op("cat", [x, b.constant("zeros", (1, 4))], {"dim": 0}, "cat")
    return b.output(b.op("slice", [joined], {"dim": 0, "start": 1, "end": B + 1, "step": 1}, "drop_first"))


def shifted_up_by_pad() -> Graph:
    b = builder("shift_pad")
    x = b.input("x", (B, 4))
    padded = b.op("pad", [x], {"pads": [0, 0, 0, 1], "value": 0.0}, "pad")
    return b.output(b.op("slice", [padded], {"dim": 0, "start": 1, "end": B + 1, "step": 1}, "drop_first"))


def rolled() -> Graph:
    b = builder("rolled")
    return b.output(b.op("roll", [b.input("x", (B, 4))], {"shifts": [1], "dims": [0]}, "roll"))


def gathered() -> Graph:
    b = builder("gathered")
    x = b.input("x", (B, 4))
    indices = b.graph.add_constant("order", torch.tensor([B - 1] * B)).name
    return b.output(b.op("take", [x, indices], {"axis": 0}, "take"))


def windows_along_batch() -> Graph:
    b = builder("batch_windows")
    return b.output(b.op("unfold", [b.input("x", (B, 4))], {"dim": 0, "size": 2, "step": 1}, "unfold"))


def unbatched_image_windows() -> Graph:
    """F.unfold of one unbatched image [C, H, W]: its dim 0 holds channels, which the columns merge."""
    b = builder("unbatched_windows")
    window = {"kernel_size": [2, 2], "dilation": [1, 1], "padding": [0, 0], "stride": [1, 1]}
    return b.output(b.op("im2col", [b.input("x", (B, 3, 3))], window, "im2col"))


def batch_in_the_keys() -> Graph:
    """[B, H] rows read as one sequence: every row attends to every other."""
    b = builder("batch_keys")
    x = b.input("x", (B, 8))
    sequence = b.op("reshape", [x], {"shape": [1, B, 8]}, "as_sequence")
    attention = b.op("sdpa", [sequence, sequence, sequence], {"is_causal": False}, "sdpa")
    return b.output(b.op("reshape", [attention], {"shape": [B, 8]}, "back"))


def batch_in_causal_queries() -> Graph:
    b = builder("causal_queries")
    queries = b.op("reshape", [b.input("x", (B, 8))], {"shape": [1, B, 8]}, "as_queries")
    memory = b.constant("memory", (1, 5, 8))
    attention = b.op("sdpa", [queries, memory, memory], {"is_causal": True}, "sdpa")
    return b.output(b.op("reshape", [attention], {"shape": [B, 8]}, "back"))


def batch_merged_into_last_dim() -> Graph:
    """[B, S, H] -> [S, B*H]: a layer norm over that last dim then normalises across the batch."""
    b = builder("merged_last")
    x = b.input("x", (B, 4, 8))
    merged = b.op("reshape", [x], {"shape": [4, B * 8]}, "merge")
    return b.output(b.op("reshape", [b.layer_norm(merged, "ln")], {"shape": [B, 4, 8]}, "unmerge"))


def gram_over_batch() -> Graph:
    """x @ (xᵀ x): the inner product contracts the batch."""
    b = builder("gram")
    x = b.input("x", (B, 4))
    gram = b.op("matmul", [b.op("permute", [x], {"dims": [1, 0]}, "xt"), x], name="gram")
    return b.output(b.op("matmul", [x, gram], name="project"))


def linear_over_batch() -> Graph:
    b = builder("linear_batch")
    x = b.op("permute", [b.input("x", (B, 4))], {"dims": [1, 0]}, "batch_last")
    return b.output(b.op("permute", [b.linear(x, B, name="mix")], {"dims": [1, 0]}, "back"))


def opaque_flip() -> Graph:
    b = builder("opaque")
    x = b.input("x", (B, 4))
    node = b.graph.add_node("opaque", [x], b.graph[x].type, {"target": "aten.flip", "fn": lambda xs: xs[0].flip(0)},
                            name="flip")
    return b.output(node.name)


def batch_sized_constant() -> Graph:
    """x + arange(batch)[:, None]: a constant made for this batch size (right here, but nothing says so)."""
    b = builder("batch_constant")
    x = b.input("x", (B, 4))
    rows = b.graph.add_constant("positions", torch.arange(B, dtype=torch.float32)[:, None]).name
    return b.output(b.op("add", [x, rows], name="add"))


# name: (graph, node refused, words of why, whether padding really changes the rows kept)
DEPENDENT = {
    "softmax_over_batch": (batch_softmax, "softmax", "reduces over the batch (dim 0 of x)", True),
    "minus_batch_mean": (centred, "mean", "reduces over the batch", True),
    "slice_of_batch": (minus_last_row, "last_row", "slices the batch", True),
    "cat_along_batch": (shifted_up_by_cat, "cat", "concatenates along the batch", True),
    "pad_along_batch": (shifted_up_by_pad, "pad", "pads the batch", True),
    "roll_along_batch": (rolled, "roll", "rolls the batch", True),
    "gather_along_batch": (gathered, "take", "gathers along the batch", True),
    "windows_along_batch": (windows_along_batch, "unfold", "slides windows along the batch", False),
    "unbatched_image_windows": (unbatched_image_windows, "im2col", "into sliding windows", True),
    "batch_in_keys": (batch_in_the_keys, "sdpa", "as its key/value sequence", True),
    "batch_merged_into_last_dim": (batch_merged_into_last_dim, "merge", "reshapes to [4, 24]", True),
    "gram_over_batch": (gram_over_batch, "gram", "as the K of its product", True),
    "linear_over_batch": (linear_over_batch, "mix", "as the K of its product", True),
    "opaque_op": (opaque_flip, "flip", "opaque op (aten.flip)", True),
    "causal_batch_queries": (batch_in_causal_queries, "sdpa", "query rows while causal", False),
    "batch_sized_constant": (batch_sized_constant, "add", "reads positions, which does not depend on the inputs",
                             False),
}


@pytest.mark.parametrize("name", DEPENDENT)
def test_graphs_that_may_mix_rows_are_refused_naming_the_node(name):
    make, node, words, wrong = DEPENDENT[name]
    graph = make()
    found = row_dependence(graph)
    assert found is not None and found.node.name == node, found
    assert words in found.why
    assert str(found).startswith(found.node.describe())
    assert rows_changed(graph) == wrong


def test_captured_models_that_mix_rows_are_refused_naming_the_node():
    class BatchSoftmax(torch.nn.Module):
        def forward(self, x):
            return torch.softmax(x, dim=0) * 2.0

    class Centred(torch.nn.Module):
        def forward(self, x):
            return x - x.mean(0)

    for model, op in ((BatchSoftmax(), "softmax"), (Centred(), "mean")):
        graph = prepared(model, torch.randn(B, 4))
        found = row_dependence(graph)
        assert found is not None and found.node.op == op and "reduces over the batch" in found.why
        assert rows_changed(graph)


def test_a_sequence_first_encoder_has_its_batch_in_dim_1():
    """nn.MultiheadAttention's own layout, [S, B, E]: dim 0 is the sequence (attention reads all of it), dim 1 the
    batch, merged with the heads and back on the way."""
    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=False)
    graph = prepared(encoder, torch.randn(4, B, 16))
    found = row_dependence(graph)
    assert found is not None and found.node.op == "sdpa" and "key/value sequence" in found.why
    assert rows_changed(graph)
    by_dim_1 = ({n.name: 1 for n in graph.input_nodes}, {o: 1 for o in graph.outputs})
    assert row_dependence(graph, *by_dim_1) is None
    assert not rows_changed(graph, *by_dim_1)


def test_padding_a_sequence_is_refused_where_attention_reads_it():
    """The same analysis over another dim (a sequence, for shape buckets): a feed-forward block's tokens are
    independent, attention's are not (padding adds keys)."""
    ffn = transformer_ffn(2, 4, 8, 16)
    assert row_dependence(ffn, {"x": 1}, {ffn.outputs[0]: 1}) is None
    attention = attention_block(2, 4, 2, 4)
    found = row_dependence(attention, {"x": 1}, {attention.outputs[0]: 1})
    assert found is not None and found.node.name == "sdpa" and "key/value sequence" in found.why


def windows_plus(mask: torch.Tensor) -> Graph:
    """Swin's shifted-window mask: the batch's rows split into 2 windows each, [B*2, 4], plus a constant mask."""
    b = builder("window_mask")
    windows = b.op("reshape", [b.input("x", (B, 2, 4))], {"shape": [B * 2, 4]}, "windows")
    masked = b.op("add", [windows, b.graph.add_constant("mask", mask).name], name="masked")
    return b.output(b.op("reshape", [b.unary("softmax", masked, "softmax", dim=-1)], {"shape": [B, 2, 4]}, "back"))


def test_a_constant_along_the_batch_passes_only_where_it_is_the_same_for_every_row():
    """Where a constant has the batch's rows, only one equal across them is known not to be made from the batch."""
    per_window = torch.randn(2, 4)
    assert row_dependence(windows_plus(per_window.repeat(B, 1))) is None           # one mask per window, tiled
    found = row_dependence(windows_plus(torch.randn(B * 2, 4)))
    assert found.node.name == "masked" and "reads mask, which does not depend on the inputs yet varies" in found.why


def test_an_output_must_hold_the_batch_alone_in_the_dim_cut_back():
    b = builder("outputs")
    x = b.input("x", (B, 4))
    b.output(b.op("permute", [x], {"dims": [1, 0]}, "transposed"))
    found = row_dependence(b.graph)
    assert found.node.name == "transposed" and "batch in dim 1, not dim 0" in found.why
    b = builder("outputs")
    b.output(b.op("reshape", [b.input("x", (B, 4, 2))], {"shape": [B * 4, 2]}, "flat"))
    assert "merged with dims of sizes [4]" in row_dependence(b.graph).why


# ---- reshapes -----------------------------------------------------------------------------------------------

def reshaped(source: tuple[int, ...], target: list[int], rows: Rows) -> Rows:
    b = builder("reshape")
    name = b.op("reshape", [b.input("x", source)], {"shape": target}, "r")
    return reshape_rows(b.graph, b.graph[name], rows)


def test_a_reshape_keeps_the_batch_as_one_digit_of_its_dim():
    assert reshaped((B, 4, 8), [B * 4, 8], Rows(0)) == Rows(0, (), (4,))       # rows flattened: row = i // 4
    assert reshaped((B * 4, 8), [B, 4, 2, 4], Rows(0, (), (4,))) == Rows(0)    # and back, heads split off
    assert reshaped((4, B, 8), [4 * B, 8], Rows(1)) == Rows(0, (4,), ())       # sequence-first: row = i % B
    assert reshaped((4 * B, 8), [4, B, 2, 4], Rows(0, (4,), ())) == Rows(1)
    assert reshaped((B, 4, 8), [1, B, 32], Rows(0)) == Rows(1)                 # size-1 dims are no digits
    with pytest.raises(Mixes, match="splitting the batch"):
        reshaped((B, 4, 8), [4, B * 8], Rows(0))       # the batch between fixed digits it was not next to
    with pytest.raises(Mixes, match="splitting the batch"):
        reshaped((B * 4, 8), [B * 2, 16], Rows(0, (), (4,)))


def test_every_registered_op_is_followed_or_refused_on_purpose():
    """A new op has no rule until one is written: the analysis refuses it (conservative), and this test names it."""
    followed = {name for name, op in REGISTRY.items() if op.kind.elementwise} | set(REDUCED_DIMS) | set(RULES)
    assert set(REGISTRY) - followed - {"input", "constant", "state", "reshape"} == {"opaque"}


def test_an_unfolded_value_of_constants_the_same_for_every_row_lets_the_batch_pad():
    """BERT's token-type embedding at a size too large to fold: embedding(table, expand(ids)) + x, computed from
    constants alone and the same for every row; a table read by ids that vary along the batch is refused."""
    from opfuse.ir.graph import TensorType
    from opfuse.ir.ops import infer_type

    def graph_of(ids: torch.Tensor) -> Graph:
        graph = Graph("token_types")
        x = graph.add_input("x", TensorType((B, 4, 8), "float32")).name
        table = graph.add_constant("table", torch.randn(2, 8)).name
        index = graph.add_constant("ids", ids).name
        if ids.shape[0] == 1:
            index = graph.add_node("expand", [index], TensorType((B, 4), "int64"), {"shape": [B, 4]}).name
        types = [graph[table].type, graph[index].type]
        picked = graph.add_node("embedding", [table, index], infer_type("embedding", types, {}), {}).name
        graph.outputs = [graph.add_node("add", [x, picked], TensorType((B, 4, 8), "float32")).name]
        return graph

    assert row_dependence(graph_of(torch.zeros(1, 4, dtype=torch.int64))) is None
    refused = row_dependence(graph_of((torch.arange(B)[:, None] % 2).expand(B, 4).contiguous()))
    assert refused is not None and refused.node.op == "add"
