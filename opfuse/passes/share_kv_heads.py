"""Key/value heads repeated for grouped-query attention are read shared, not copied.

Entry point: `share_kv_heads(graph)`. Llama, Mistral, Qwen, Gemma, Phi-3 and Falcon keep fewer key/value heads
than query heads and repeat each for the query heads that share it before attention (transformers' ``repeat_kv``):

    kv [..., Hkv, S, D] -> reshape [..., Hkv, 1, S, D] -> expand [..., Hkv, rep, S, D] -> reshape [..., Hkv*rep, S, D]

The last reshape merges a stride-0 dim into the heads: no view, so PyTorch copies K and V (a kernel each, and the
planner keeps the copy out of every kernel). sdpa takes fewer key/value heads than query heads itself (torch's
enable_gqa; `opfuse.ir.ops.kv_heads_shared`): query head h reads key/value head h // rep, which is exactly what the
repeat computes. So an sdpa whose key or value input is such a repeat reads `kv` instead: the attention kernel maps
each query head to its key/value head on its load, and nothing is copied.

Matched, by ops and shapes: a reshape to [..., Hkv*rep, S, D] of an expand that grows only a size-1 dim right after
the heads to rep, of a [..., Hkv, 1, S, D] value: sdpa reads that value reshaped to [..., Hkv, S, D] (a view; where the
value is itself a reshape, its source reshaped, or that source where it is the shape already). Each of an sdpa's key and value is matched on its own.

Attention written out where `recognize_attention` cannot make it one sdpa (scores clipped, or changed by any other
step that is neither affine nor a softcap) multiplies by the repeat in a batched matmul: q @ repeat(kv)^T and
p @ repeat(kv). Such a matmul of x [..., H, M, K] becomes one of x viewed [..., Hkv, rep, M, K] (a split of its
heads: a view) by kv viewed [..., Hkv, 1, K, N] (the expand's input), which the matmul broadcasts over rep as torch
does, its product [..., Hkv, rep, M, N] merged back to [..., H, M, N] (a view of the matmul's dense result): the
same values, the repeat read through a stride of 0.
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, Node, TensorType
from opfuse.passes.simplify_attention_masks import remove_dead_cone


def share_kv_heads(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each sdpa reads its repeated key/value heads unrepeated."""
    graph = graph.copy()
    changes: list[str] = []
    for node in list(graph):
        if node.op == "matmul":
            change = _broadcast_matmul(graph, node)
            if change:
                changes.append(change)
            continue
        if node.op != "sdpa":
            continue
        for position in (1, 2):
            old = node.inputs[position]
            repeat = _unpermuted(graph, old)
            shared = _unrepeated(graph, repeat, graph[node.inputs[0]].type.shape)
            if shared is None:
                continue
            node.inputs[position] = shared
            changes.append(f"{node.name} reads its {'key' if position == 1 else 'value'} heads from {shared} "
                           f"{graph[shared].type}: {repeat}'s repeat is no copy")
            remove_dead_cone(graph, old)
    if changes:
        graph.sort()
    return graph, changes


def _broadcast_matmul(graph: Graph, node: Node) -> str | None:
    """Make matmul `node` read the head repeat one operand is (maybe through a transpose of its last two dims) as a
    broadcast of its unrepeated value (module docstring); what it did, or None where neither operand is one."""
    rank = len(node.type.shape)
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    for position in (0, 1):
        operand = graph[node.inputs[position]]
        transposed = operand.op == "permute" and list(operand.attrs["dims"]) == swap
        repeat = graph[operand.inputs[0]] if transposed else operand
        other = graph[node.inputs[1 - position]]
        grown = _head_repeat(graph, repeat.name, other.type.shape) if len(other.type.shape) == rank >= 3 else None
        if grown is None:
            continue
        single = graph[grown.inputs[0]]            # [..., Hkv, 1, S, D]: the expand's input
        kv_heads, rep = grown.type.shape[rank - 3], grown.type.shape[rank - 2]
        if transposed:
            dims = list(range(rank + 1 - 2)) + [rank, rank - 1]
            shape = tuple(single.type.shape[d] for d in dims)
            single = graph.add_node("permute", [single.name], TensorType(shape, single.type.dtype), {"dims": dims},
                                    name=f"{operand.name}_shared", source=operand.source)
        split = other.type.shape[:rank - 3] + (kv_heads, rep) + other.type.shape[rank - 2:]
        grouped = graph.add_node("reshape", [other.name], TensorType(split, other.type.dtype), {"shape": list(split)},
                                 name=f"{other.name}_grouped", source=other.source)
        inputs = [grouped.name, single.name] if position == 1 else [single.name, grouped.name]
        product_shape = node.type.shape[:rank - 3] + (kv_heads, rep) + node.type.shape[rank - 2:]
        product = graph.add_node("matmul", inputs, TensorType(product_shape, node.type.dtype),
                                 name=f"{node.name}_grouped", source=node.source)
        merged = graph.add_node("reshape", [product.name], node.type, {"shape": list(node.type.shape)},
                                name=f"{node.name}_heads", source=node.source)
        graph.replace_uses(node.name, merged.name)
        remove_dead_cone(graph, node.name)
        return (f"{node.name} reads {repeat.name}'s repeated heads as a broadcast of {single.name}: matmul "
                f"{product.name} {product.type}")
    return None


def _unpermuted(graph: Graph, name: str) -> str:
    """`name`, or the value a chain of permutes reading it composes to the identity from (recognize_attention's
    keys: the transpose of the transposed keys)."""
    order, value = None, name
    while graph[value].op == "permute":
        dims = [d % len(graph[value].type.shape) for d in graph[value].attrs["dims"]]
        order = dims if order is None else [dims[d] for d in order]
        value = graph[value].inputs[0]
        if order == sorted(order):
            return value
    return name


def _head_repeat(graph: Graph, name: str, heads_shape: tuple[int, ...]) -> Node | None:
    """The expand whose [..., Hkv, rep, S, D] value `name` merges into [..., Hkv*rep, S, D] heads as many as the heads
    (dim -3) of `heads_shape`, its input being [..., Hkv, 1, S, D]; None where `name` is no such repeat."""
    merge = graph[name]
    if merge.op != "reshape" or len(merge.type.shape) < 3 or len(merge.type.shape) != len(heads_shape):
        return None
    grown = graph[merge.inputs[0]]
    if grown.op != "expand":
        return None
    out, expanded, before = merge.type.shape, grown.type.shape, graph[grown.inputs[0]].type.shape
    rank = len(out)
    heads = rank - 3                    # the heads' dim in the merged value; rep follows it in the expanded one
    if len(expanded) != rank + 1 or len(before) != rank + 1:
        return None
    kv_heads, rep = expanded[heads], expanded[heads + 1]
    if (rep < 2 or out[heads] != kv_heads * rep or out[heads] != heads_shape[heads] or before[heads + 1] != 1
            or expanded[:heads + 1] + expanded[heads + 2:] != out[:heads] + (kv_heads,) + out[heads + 1:]
            or before[:heads + 1] + before[heads + 2:] != expanded[:heads + 1] + expanded[heads + 2:]):
        return None
    return grown


def _unrepeated(graph: Graph, name: str, q_shape: tuple[int, ...]) -> str | None:
    """The [..., Hkv, S, D] value whose heads `name` repeats for the query heads of `q_shape` (made as a reshape of
    the expand's input where no reshape gives it), or None where `name` is no such repeat."""
    grown = _head_repeat(graph, name, q_shape)
    if grown is None:
        return None
    source = graph[grown.inputs[0]]
    heads = len(q_shape) - 3
    shape = source.type.shape[:heads + 1] + source.type.shape[heads + 2:]
    if source.op == "reshape":      # (the unsqueeze before the expand): the reshape of what it reshapes
        source = graph[source.inputs[0]]
        if source.type.shape == shape:
            return source.name
    view = graph.add_node("reshape", [source.name], TensorType(shape, source.type.dtype), {"shape": list(shape)},
                          name=f"{source.name}_heads", source=source.source)
    return view.name
