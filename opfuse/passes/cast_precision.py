"""Retype a graph to the compute dtype the compiled model runs in (float16, bfloat16 or float32).

Entry point: `cast_precision(graph, dtype)`. Floating inputs and constants take `dtype` (constants as new
tensors), casts to a floating type (and a cumsum's dtype= of one) become casts to `dtype`, and every other node's
type is re-derived from its op, so batch-norm statistics, biases and the like simply follow. Integer and bool values
(embedding indices, masks) keep their dtype. Besides building the fp16 graph for the kernels, this lets a CPU
machine analyse a model at fp16 without running it.
"""

from __future__ import annotations

from opfuse.ir.graph import FLOAT_DTYPES, Graph, dtype_name, torch_dtype
from opfuse.ir.ops import infer_type

CASTING = ("cast", "cumsum", "cumprod")   # ops whose dtype attr casts their input (a scan's dtype=): a float one
                                           # follows `dtype`


def cast_precision(graph: Graph, dtype: str) -> tuple[Graph, list[str]]:
    """A copy of `graph` computing in `dtype` (a name such as 'float16' or 'fp16')."""
    dtype = dtype_name(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"cast_precision needs a floating dtype, got {dtype!r}")
    graph = graph.copy()
    changes = []
    for node in graph:
        old = node.type
        if node.op in ("constant", "state"):
            tensor = graph.constants[node.name]
            if tensor.is_floating_point() and old.dtype != dtype:
                graph.constants[node.name] = tensor.to(torch_dtype(dtype))  # a new tensor
                node.type = old.with_dtype(dtype)
                changes.append(f"cast constant {node.name} from {old.dtype} to {dtype}")
            continue
        if node.op == "input":
            if old.is_float and old.dtype != dtype:
                node.type = old.with_dtype(dtype)
                changes.append(f"cast input {node.name} from {old.dtype} to {dtype}")
            continue
        if node.op in CASTING and node.attrs.get("dtype") is not None \
                and dtype_name(node.attrs["dtype"]) in FLOAT_DTYPES and dtype_name(node.attrs["dtype"]) != dtype:
            changes.append(f"{node.op} {node.name} now casts to {dtype} instead of "
                           f"{dtype_name(node.attrs['dtype'])}")
            node.attrs = {**node.attrs, "dtype": dtype}
        if node.op == "opaque":  # no reference to re-derive from: keep the shape, follow the compute dtype
            node.type = old.with_dtype(dtype) if old.is_float else old
        else:
            node.type = infer_type(node.op, graph.input_types(node), node.attrs)
    return graph, changes
