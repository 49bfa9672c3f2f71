"""Retype a graph to the compute dtype the compiled model runs in (float16, bfloat16 or float32).

Entry point: `cast_precision(graph, dtype)`. Floating inputs and constants take `dtype` (constants as new
tensors), casts to a floating type (and a scan's dtype= of one) become casts to `dtype`, and every other node's
type is re-derived from its op, so batch-norm statistics, biases and the like simply follow. Integer and bool values
(embedding indices, masks) keep their dtype. Besides building the fp16 graph for the kernels, this lets a CPU
machine analyse a model at fp16 without running it.

One exception: a cast with which a narrow model widens the values a choice ranks (`CHOICES`: a mixture of experts'
router softmax, computed in float32 before its topk) keeps its dtype, and with it everything between the cast and
the choice. There the precision decides which element wins: narrowed, near-equal probabilities round to ties that
pick other experts than the model picks. A model wide throughout (no such cast on the way) is narrowed as asked.
"""

from __future__ import annotations

from opfuse.ir.graph import FLOAT_DTYPES, Graph, dtype_name, torch_dtype
from opfuse.ir.ops import SCAN_OPS, infer_type

CASTING = ("cast", *SCAN_OPS)   # ops whose dtype attr casts their input (a scan's dtype=): a float one follows `dtype`
CHOICES = ("topk", "sort")                 # ops that rank their input: which element wins depends on its precision
WIDE = ("float32", "float64")


def cast_precision(graph: Graph, dtype: str) -> tuple[Graph, list[str]]:
    """A copy of `graph` computing in `dtype` (a name such as 'float16' or 'fp16')."""
    dtype = dtype_name(dtype)
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"cast_precision needs a floating dtype, got {dtype!r}")
    graph = graph.copy()
    changes = []
    widening = widening_casts(graph) if dtype not in WIDE else set()
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
        if node.name in widening:
            changes.append(f"{node.op} {node.name} still casts to {dtype_name(node.attrs['dtype'])}: a choice ranks "
                           "what it widens")
        elif node.op in CASTING and node.attrs.get("dtype") is not None \
                and dtype_name(node.attrs["dtype"]) in FLOAT_DTYPES and dtype_name(node.attrs["dtype"]) != dtype:
            changes.append(f"{node.op} {node.name} now casts to {dtype} instead of "
                           f"{dtype_name(node.attrs['dtype'])}")
            node.attrs = {**node.attrs, "dtype": dtype}
        if node.op == "opaque":  # no reference to re-derive from: keep the shape, follow the compute dtype
            node.type = old.with_dtype(dtype) if old.is_float else old
        else:
            node.type = infer_type(node.op, graph.input_types(node), node.attrs)
    return graph, changes


def widening_casts(graph: Graph) -> set[str]:
    """The casts from a narrow float to a wide one (`WIDE`) through which every wide value a choice (`CHOICES`)
    ranks comes: walking back from each choice's input over wide floating values, each path must end at such a cast
    or a constant (a path reaching a wide input or an opaque op means the model is wide there: none kept)."""
    kept: set[str] = set()
    for node in graph:
        if node.op not in CHOICES:
            continue
        casts, stack, seen = set(), [node.inputs[0]], set()
        while stack:
            name = stack.pop()
            value = graph[name]
            if name in seen or value.type.dtype not in WIDE:
                continue
            seen.add(name)
            if value.op == "cast" and graph[value.inputs[0]].type.dtype in FLOAT_DTYPES \
                    and graph[value.inputs[0]].type.dtype not in WIDE:
                casts.add(name)
            elif value.op in ("input", "opaque"):
                break
            elif value.op not in ("constant", "state"):     # (a constant operand says nothing of the model's width)
                stack.extend(value.inputs)
        else:
            kept |= casts
    return kept
