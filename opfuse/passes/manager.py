"""Run graph passes in order, verify the graph after each, and record (and optionally dump) what each changed.

Entry points: `prepare_graph(graph, dtype)` (the pipeline `opfuse.compile` runs between capture and the
fusion planner), `run_passes(graph, passes)` for any list of passes, `default_pipeline()`.
A pass is a function ``Graph -> (new Graph, list of one-line change descriptions)``; it never edits its input.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Callable

from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.verify import verify
from opfuse.passes.cast_precision import cast_precision
from opfuse.passes.eliminate_dead_code import eliminate_dead_code
from opfuse.passes.elementwise_before_unit_reshapes import elementwise_before_unit_reshapes
from opfuse.passes.fold_batchnorm import fold_batchnorm
from opfuse.passes.fold_constants import fold_constants
from opfuse.passes.fold_linear_reshapes import fold_linear_reshapes
from opfuse.passes.flatten_cats import flatten_cats
from opfuse.passes.fold_view_chains import fold_view_chains
from opfuse.passes.matrix_vector_as_reduction import matrix_vector_as_reduction
from opfuse.passes.recognize_attention import recognize_attention
from opfuse.passes.recognize_gelu import recognize_gelu
from opfuse.passes.recognize_rms_norm import recognize_rms_norm
from opfuse.passes.recognize_roll import recognize_roll
from opfuse.passes.remove_noop_layout import remove_noop_layout
from opfuse.passes.share_kv_heads import share_kv_heads
from opfuse.passes.unshare_views import unshare_views
from opfuse.passes.views_before_prologues import views_before_prologues
from opfuse.passes.simplify_attention_masks import simplify_attention_masks
from opfuse.passes.split_gated_linears import split_gated_linears

Pass = Callable[[Graph], tuple[Graph, list[str]]]


@dataclass
class PassRecord:
    """What one pass did: its name, the change descriptions it returned, and how long it took."""

    name: str
    changes: list[str]
    seconds: float


def default_pipeline() -> list[Pass]:
    """The passes run after `cast_precision`: constants first, so a weight reached through a view or a cast is a
    constant for what follows, and attention masks built from shapes are known; then layout no-ops, so attention
    written out, BN and RMS norms are seen without their no-op expands, dropouts and casts; rolls written as slices
    and a cat (ONNX's) next, so they join the kernel that reads them like a captured roll, and a cat read only by a
    cat along its dim is spliced into it, so that its parts are slices of one buffer; attention next, so its
    key/value heads repeated for grouped-query attention are read shared and its mask is simplified like any
    other (a matmul by one column is a sum only after attention is found, which a key of one position would hide);
    then the reshapes around a linear that flatten its rows (GPT-2's Conv1D), so what reads it and what it
    reads may join its kernel; then view chains PyTorch would copy that are views of their source
    (nn.MultiheadAttention's head split), once the reshapes around the linears are settled, and those left views
    of their own where another node shares one; RMS norms and tanh GELUs written out become one node each; a matmul
    by one column becomes a sum of products, so the ops computing its matrix are its prologue, and a linear whose
    two halves make act(gate) * up becomes the two linears of a gated pair; the elementwise ops
    after a 1-D or 3-D conv's view back to its rank move before it, so a batch norm there folds
    into the conv like any other, and a transpose a linear reads moves before the elementwise ops it reads
    (ResMLP's token mixing), so they are the linear's prologue."""
    return [fold_constants, remove_noop_layout, recognize_roll, flatten_cats, recognize_attention, share_kv_heads,
            simplify_attention_masks, fold_linear_reshapes, fold_view_chains, unshare_views, recognize_rms_norm,
            recognize_gelu, matrix_vector_as_reduction, split_gated_linears, elementwise_before_unit_reshapes,
            views_before_prologues, fold_batchnorm, eliminate_dead_code]


def pass_name(graph_pass: Pass) -> str:
    """A pass's name for records and errors; a functools.partial is named after its function."""
    while isinstance(graph_pass, functools.partial):
        graph_pass = graph_pass.func
    return getattr(graph_pass, "__name__", type(graph_pass).__name__)


def run_passes(graph: Graph, passes: list[Pass], debug_dir: str | os.PathLike | None = None
               ) -> tuple[Graph, list[PassRecord]]:
    """Run `passes` in order on copies of `graph`; raise GraphError naming the pass that broke the graph.

    With `debug_dir`, writes ``00_input.txt`` and then ``<index>_<pass>.txt`` (graph.format()) after each pass.
    """
    if debug_dir is not None:
        os.makedirs(debug_dir, exist_ok=True)
        _dump(debug_dir, "00_input.txt", graph)
    try:  # so that a broken capture is not blamed on the first pass
        verify(graph)
    except GraphError as error:
        raise GraphError(f"the graph given to the passes is invalid: {error}") from error
    records = []
    for index, graph_pass in enumerate(passes, start=1):
        name = pass_name(graph_pass)
        start = time.perf_counter()
        try:
            result, changes = graph_pass(graph)
        except GraphError as error:
            raise GraphError(f"pass {name} failed on graph {graph.name}: {error}") from error
        seconds = time.perf_counter() - start
        if result is graph:
            raise GraphError(f"pass {name} returned its input graph; a pass must edit graph.copy()")
        if debug_dir is not None:  # written before verifying, so a broken graph can be inspected
            _dump(debug_dir, f"{index:02d}_{name}.txt", result)
        try:
            verify(result)
        except GraphError as error:
            raise GraphError(f"pass {name} produced an invalid graph: {error}") from error
        records.append(PassRecord(name, list(changes), seconds))
        graph = result
    return graph, records


def prepare_graph(graph: Graph, dtype: str, debug_dir: str | os.PathLike | None = None
                  ) -> tuple[Graph, list[PassRecord]]:
    """`cast_precision` to `dtype`, then the default pipeline: the graph the fusion planner receives."""
    return run_passes(graph, [functools.partial(cast_precision, dtype=dtype), *default_pipeline()], debug_dir)


def _dump(debug_dir: str | os.PathLike, filename: str, graph: Graph) -> None:
    with open(os.path.join(debug_dir, filename), "w") as f:
        f.write(graph.format() + "\n")
