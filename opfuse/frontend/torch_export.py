"""PyTorch frontend: capture an `nn.Module` with torch.export and translate its ATen graph into the opfuse IR.

Entry point: `capture_torch(model, example_inputs, name=None) -> Graph`.

The model is exported on a deep copy in eval mode (the user's module is never touched). Its in-place writes are
translated as out-of-place ops where that is exact, and the program is functionalised first where it is not
(`opfuse.frontend.torch_inplace`). Both the high-level ops (``batch_norm``, ``flatten``) and the lower-level ones
that appear after functionalisation or on other torch versions are translated, each fx node by a handler of
`opfuse.frontend.aten_ops` and a call none maps as an opaque node that re-runs it (`opfuse.frontend.torch_translate`),
so capture never fails on an unknown op.

opfuse compiles forwards whose only state is declared: a buffer a module marks as state (`mark_state`: a KV cache)
becomes a ``state`` node, and what the forward writes into it becomes its update (`Graph.state`), which the compiled
model keeps for its next call. A forward that writes any other buffer or parameter (a call counter, a batch norm in
training mode) is refused naming it and the node that writes it, as a compiled model that never updates it would
differ from eager from its second call on. A forward that writes into one of its inputs in place warns
(`opfuse.frontend.torch_translate.InputWrittenWarning`, naming the input and the node): the graph computes the same
outputs, but the compiled model leaves the input as it was.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings

import torch

from opfuse.frontend.torch_inplace import functionalise_fresh_writes, mutates, rebindable
from opfuse.frontend.torch_translate import Translator
from opfuse.ir.graph import Graph, GraphError, dtype_name
from opfuse.ir.verify import verify


FALLBACK_HINT = ('fall back to torch.compile(model, backend="opfuse"), which handles graph breaks, '
                 'or opfuse.compile(..., fallback="eager")')


STATE_MARK = "_opfuse_state"      # the attribute `mark_state` keeps a module's state buffer names in


def mark_state(module: torch.nn.Module, *names: str) -> None:
    """Declare buffers of `module` the model's state: its forward may write them (a KV cache at the call's
    positions), and the compiled model keeps what it wrote for the next call, as eager does."""
    missing = [name for name in names if name not in dict(module.named_buffers(recurse=False))]
    if missing:
        raise GraphError(f"mark_state: {type(module).__name__} has no buffer {missing[0]!r}")
    module.__dict__.setdefault(STATE_MARK, set()).update(names)


def state_buffers(model: torch.nn.Module) -> set[str]:
    """The dotted names of the buffers the modules of `model` marked as state (`mark_state`)."""
    return {f"{prefix}.{name}" if prefix else name for prefix, module in model.named_modules()
            for name in module.__dict__.get(STATE_MARK, ())}


def capture_torch(model: torch.nn.Module, example_inputs: tuple, name: str | None = None) -> Graph:
    """Export `model` (a copy of it, in eval mode) on `example_inputs` and return the verified IR graph."""
    inputs = tuple(example_inputs)
    for i, x in enumerate(inputs):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"example input {i} is a {type(x).__name__}; capture_torch takes tensors only")
    name = name or type(model).__name__
    try:
        private = copy.deepcopy(model).eval()
    except Exception as error:
        raise GraphError(f"cannot copy model {name} for capture ({type(error).__name__}: {error}); "
                         f"{FALLBACK_HINT}") from error
    narrow = None
    try:
        program = _export(private, inputs)
    except Exception as error:
        narrow = _narrow_dtype(private, inputs)
        program = _export_wide(private, inputs, narrow) if narrow is not None else None
        if program is None:
            raise GraphError(f"torch.export could not capture model {name}: {_describe_export_error(error)}; "
                             f"{FALLBACK_HINT}") from error
        warnings.warn(CapturedWideWarning(
            f"opfuse: torch.export could not capture {name} in {narrow} ({_describe_export_error(error)}); it was "
            f"captured in float32 and cast to {narrow}: what the model does only in {narrow} (transformers' BART "
            "clamps infinite float16 activations) is not in the graph"))
    graph = Translator(program, name, state_buffers(private)).run()
    if narrow is not None:
        from opfuse.passes.cast_precision import cast_precision

        graph, _ = cast_precision(graph, narrow)
    verify(graph)
    return graph


class CapturedWideWarning(UserWarning):
    """A float16 or bfloat16 model torch.export could not capture was captured in float32, then cast."""


def _export(module: torch.nn.Module, inputs: tuple) -> torch.export.ExportedProgram:
    """torch.export of `module` on `inputs`, its in-place writes made functional where they must be."""
    with _no_stack_traces():
        program = torch.export.export(module, inputs, strict=False)
    refused = [node for node in program.graph.nodes if mutates(node) and not rebindable(node)]
    if refused and not functionalise_fresh_writes(program.graph, refused):
        program = program.run_decompositions({})  # functionalise only (seconds): keeps high-level ops
    return program


NARROW_FLOATS = (torch.float16, torch.bfloat16)


def _narrow_dtype(module: torch.nn.Module, inputs: tuple) -> str | None:
    """The one float16 or bfloat16 dtype of the model's floating parameters, buffers and inputs, or None (float32
    already, mixed, or no floating tensor)."""
    tensors = [*module.parameters(), *module.buffers(), *inputs]
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if len(dtypes) != 1 or next(iter(dtypes)) not in NARROW_FLOATS:
        return None
    return dtype_name(next(iter(dtypes)))


def _export_wide(private: torch.nn.Module, inputs: tuple, narrow: str) -> torch.export.ExportedProgram | None:
    """The program of `private` (the capture's own copy, made float32 in place) on `inputs` made float32, or None
    where that fails too: a branch a model takes only in its narrow dtype (BART's ``if hidden_states.dtype ==
    torch.float16 and (isinf(...).any() ...)``, a data-dependent guard torch.export cannot take) is not taken in
    float32. The graph is cast back to `narrow` after translation."""
    wide = tuple(x.float() if x.is_floating_point() else x for x in inputs)
    try:
        return _export(private.float(), wide)
    except Exception:   # noqa: BLE001 - the caller reports the narrow dtype's failure, the one the user met
        return None


@contextlib.contextmanager
def _no_stack_traces():
    """torch.export without the Python stack trace it records of every node (`torch.fx.config.
    do_not_emit_stack_traces`): opfuse names nodes, never their source lines, and the traces cost a quarter of
    analyzing resnet50 (RESULTS.md run 85). A torch without the switch records them."""
    config = getattr(torch.fx, "config", None)
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def _describe_export_error(error: Exception) -> str:
    """The exception's type and first line, plus the user's source line when torch names it."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    user_frames = [m for m in re.finditer(r'File "([^"]+)", line (\d+), in (\S+)', str(error))
                   if "/torch/" not in m.group(1)]
    if user_frames:
        file, line, function = user_frames[-1].groups()
        text += f" (at {file}:{line} in {function})"
    return text
