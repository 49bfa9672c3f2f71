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
"""

from __future__ import annotations

from opfuse.ir.graph import Graph, TensorType
from opfuse.passes.eliminate_dead_code import remove_if_unused


def share_kv_heads(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` where each sdpa reads its repeated key/value heads unrepeated."""
    graph = graph.copy()
    changes: list[str] = []
    for node in list(graph):
        if node.op != "sdpa":
            continue
        for position in (1, 2):
            repeat = node.inputs[position]
            shared = _unrepeated(graph, repeat, graph[node.inputs[0]].type.shape)
            if shared is None:
                continue
            node.inputs[position] = shared
            chain = [repeat, graph[repeat].inputs[0], graph[graph[repeat].inputs[0]].inputs[0]]
            for name in chain:
                if not remove_if_unused(graph, name):
                    break
            changes.append(f"{node.name} reads its {'key' if position == 1 else 'value'} heads from {shared} "
                           f"{graph[shared].type}: {repeat}'s repeat is no copy")
    if changes:
        graph.sort()
    return graph, changes


def _unrepeated(graph: Graph, name: str, q_shape: tuple[int, ...]) -> str | None:
    """The [..., Hkv, S, D] value whose heads `name` repeats for the query heads of `q_shape` (made as a reshape of
    the expand's input where no reshape gives it), or None where `name` is no such repeat."""
    merge = graph[name]
    if merge.op != "reshape" or len(merge.type.shape) < 3 or len(merge.type.shape) != len(q_shape):
        return None
    grown = graph[merge.inputs[0]]
    if grown.op != "expand":
        return None
    source = graph[grown.inputs[0]]
    out, expanded, before = merge.type.shape, grown.type.shape, source.type.shape
    rank = len(out)
    heads = rank - 3                    # the heads' dim in the merged value; rep follows it in the expanded one
    if len(expanded) != rank + 1 or len(before) != rank + 1:
        return None
    kv_heads, rep = expanded[heads], expanded[heads + 1]
    if (rep < 2 or out[heads] != kv_heads * rep or out[heads] != q_shape[heads] or before[heads + 1] != 1
            or expanded[:heads + 1] + expanded[heads + 2:] != out[:heads] + (kv_heads,) + out[heads + 1:]
            or before[:heads + 1] + before[heads + 2:] != expanded[:heads + 1] + expanded[heads + 2:]):
        return None
    shape = before[:heads + 1] + before[heads + 2:]
    if source.op == "reshape":      # (the unsqueeze before the expand): the reshape of what it reshapes
        source = graph[source.inputs[0]]
        if source.type.shape == shape:
            return source.name
    view = graph.add_node("reshape", [source.name], TensorType(shape, source.type.dtype), {"shape": list(shape)},
                          name=f"{source.name}_heads", source=source.source)
    return view.name
