"""A matmul by a single column as a row reduction: A [..., M, K] @ v [..., K, 1] = sum(A * v^T, -1, keepdim).

Entry point: `matrix_vector_as_reduction(graph)`. A matrix-vector product does one multiply-add per element of A
that it reads: a GEMM kernel's tiles of N = 1 leave its MMA idle and its operand cannot be computed in its loads by
the ops that produce it, so the elementwise ops before it (Mamba's sequential scan: each step's state update, then
the state by the step's C as a column) were a kernel of their own beside the GEMM's, one pair a step. As a sum over
the last dim of the product, the row template reads A along K as it lies, the elementwise ops computing A are its
prologue (a value they compute that something else reads is stored on the way) and what reads the result its
epilogue. The product and the sum are computed in float32 (at least), and the result cast to the matmul's dtype,
as a GEMM accumulates; integer matmuls are left alone.
"""

from __future__ import annotations

from opfuse.ir.graph import FLOAT_DTYPES, Graph, TensorType
from opfuse.passes.eliminate_dead_code import remove_if_unused

WIDE_FLOATS = ("float32", "float64")


def matrix_vector_as_reduction(graph: Graph) -> tuple[Graph, list[str]]:
    """A copy of `graph` with each floating matmul whose second operand is one column ([..., K, 1], rank 2 or more)
    computed as a product and a sum over K."""
    graph = graph.copy()
    changes: list[str] = []
    for node in graph:
        if node.op != "matmul" or node.type.dtype not in FLOAT_DTYPES:
            continue
        a, v = (graph[name] for name in node.inputs)
        if len(a.type.shape) < 2 or len(v.type.shape) < 2 or v.type.shape[-1] != 1:
            continue
        dtype = node.type.dtype if node.type.dtype in WIDE_FLOATS else "float32"
        k = v.type.shape[-2]
        row_shape = tuple(v.type.shape[:-2]) + (1, k)
        row = graph.add_node("reshape", [v.name], TensorType(row_shape, v.type.dtype), {"shape": list(row_shape)},
                             name=f"{node.name}_row", source=node.source)
        operands = [_widened(graph, name, dtype, node.source) for name in (a.name, row.name)]
        product_shape = tuple(node.type.shape[:-1]) + (k,)
        product = graph.add_node("mul", operands, TensorType(product_shape, dtype), name=f"{node.name}_products",
                                 source=node.source)
        total = graph.add_node("sum", [product.name], TensorType(tuple(node.type.shape), dtype),
                               {"dims": [len(product_shape) - 1], "keepdim": True}, name=f"{node.name}_sum",
                               source=node.source)
        result = total if dtype == node.type.dtype else graph.add_node(
            "cast", [total.name], node.type, {"dtype": node.type.dtype}, name=f"{node.name}_cast", source=node.source)
        graph.replace_uses(node.name, result.name)
        remove_if_unused(graph, node.name)
        changes.append(f"matmul {node.name} by one column ({k} x 1) as a sum over {k} of products")
    if changes:
        graph.sort()
    return graph, changes


def _widened(graph: Graph, name: str, dtype: str, source: str) -> str:
    """`name` cast to `dtype` where it is another dtype."""
    node = graph[name]
    if node.type.dtype == dtype:
        return name
    return graph.add_node("cast", [name], TensorType(node.type.shape, dtype), {"dtype": dtype},
                          name=f"{name}_{dtype}", source=source).name
