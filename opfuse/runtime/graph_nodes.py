"""The kernels a captured CUDA graph launches, counted from the graph itself: `kept_graph()`, `kernel_nodes(graph)`.

A plan knows the kernels opfuse generates, but not those cuBLAS, cuDNN and PyTorch launch for the groups that run
through them: a GEMM may take a split-K reduction kernel, a convolution a transform, and which one the library
picks depends on the shapes and the GPU. A captured graph holds them all, so its kernel nodes are exactly what each
replay launches. `kept_graph()` is a `torch.cuda.CUDAGraph` that keeps its template after the capture
(`keep_graph=True`); `kernel_nodes` walks that template through the CUDA driver (`cuGraphGetNodes`,
`cuGraphNodeGetType`), child graphs included. Memset, memcpy and other non-kernel nodes are not counted (the
profiler lists them apart from kernels too). Where the torch in use cannot keep a template, or the driver cannot be
asked, there is no count (None).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

KERNEL = 0          # CU_GRAPH_NODE_TYPE_KERNEL
CHILD_GRAPH = 4     # CU_GRAPH_NODE_TYPE_GRAPH


def kept_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph that keeps its template after the capture (so that `kernel_nodes` can count it), or a plain one
    on a torch without `keep_graph`. `ready(graph)` instantiates it after the count, before its first replay."""
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        return torch.cuda.CUDAGraph()
    graph.opfuse_kept = True
    return graph


def ready(graph: torch.cuda.CUDAGraph) -> None:
    """Instantiate a kept graph now, so that its first replay does not (a plain graph is instantiated already)."""
    if getattr(graph, "opfuse_kept", False):
        graph.instantiate()


def kernel_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """The kernel nodes of a captured graph made by `kept_graph()`, or None where it cannot be counted."""
    if not getattr(graph, "opfuse_kept", False):
        return None
    try:
        handle = graph.raw_cuda_graph()
        return count_kernels(_driver(), handle)
    except (AttributeError, OSError, RuntimeError):
        return None


def count_kernels(driver: Any, handle: int) -> int:
    """Kernel nodes of the graph `handle` (a cudaGraph_t / CUgraph), those of its child graphs included, asked of
    `driver` (libcuda's cuGraphGetNodes, cuGraphNodeGetType, cuGraphChildGraphNodeGetGraph)."""
    count = ctypes.c_size_t(0)
    _check(driver.cuGraphGetNodes(ctypes.c_void_p(handle), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    _check(driver.cuGraphGetNodes(ctypes.c_void_p(handle), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    kernels = 0
    for node in nodes[:count.value]:
        kind = ctypes.c_int(-1)
        _check(driver.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == KERNEL:
            kernels += 1
        elif kind.value == CHILD_GRAPH:
            child = ctypes.c_void_p()
            _check(driver.cuGraphChildGraphNodeGetGraph(ctypes.c_void_p(node), ctypes.byref(child)),
                   "cuGraphChildGraphNodeGetGraph")
            kernels += count_kernels(driver, child.value or 0)
    return kernels


def _check(status: int, call: str) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUDA driver error {status}")


@functools.cache
def _driver() -> Any:
    """libcuda, with the signatures `count_kernels` calls."""
    driver = ctypes.CDLL("libcuda.so.1")
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    signatures: dict[str, list[Any]] = {
        "cuGraphGetNodes": [pointer, ctypes.POINTER(pointer), ctypes.POINTER(size)],
        "cuGraphNodeGetType": [pointer, ctypes.POINTER(ctypes.c_int)],
        "cuGraphChildGraphNodeGetGraph": [pointer, ctypes.POINTER(pointer)],
    }
    for name, arguments in signatures.items():
        function = getattr(driver, name)
        function.argtypes, function.restype = arguments, ctypes.c_int
    return driver
