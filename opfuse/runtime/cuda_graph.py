"""A compiled model's CUDA graph: the warm-up calls, the capture over static input buffers (or the caller's own
tensors, borrowed), the replays, a recapture when a borrowed input moves, and `measure_forward`'s timed replays.
`CudaGraphReplay` is a part of `opfuse.runtime.compiled.CompiledModel` (its `_execute`, `_prepare`, `_input_forms`,
`use_cuda_graph` and device are the model's); `CompiledModel._run` decides which of these a call takes."""

from __future__ import annotations

import statistics
import warnings
from typing import Any, Sequence

import torch

from opfuse.runtime.clock import recover_rng_after_failed_capture
from opfuse.runtime.gate import CAPTURE_GATE
from opfuse.runtime.graph_nodes import kept_graph, kernel_nodes, ready

FORWARD_REPLAYS = 10    # timed replays of the forward `measure_forward` takes the median of


class CudaGraphReplay:
    """The CUDA graph half of a compiled model (module docstring)."""

    def _reset_cuda_graph(self) -> None:
        self._cuda_graph = None
        self._graph_launches: int | None = None     # the kernel nodes of the last graph captured or counted
        self._static_inputs: list[torch.Tensor] = []
        self._static_outputs: list[torch.Tensor] = []
        # per input: (address, strides) of a borrowed caller's tensor as captured, else None
        self._borrowed: list[tuple[int, tuple[int, ...]] | None] = []
        self._eager_calls = 0
        self._borrow_inputs = True     # off once a call passed another tensor where a borrowed one was

    @property
    def static_inputs(self) -> tuple[torch.Tensor, ...]:
        """The captured CUDA graph's input buffers (none before the capture): a caller that writes its next inputs
        into them in place and passes them saves the copy in."""
        return tuple(self._static_inputs)

    def _run_cuda_graph(self, inputs: list[torch.Tensor], own: list[bool]) -> list[torch.Tensor]:
        """The warm-up calls, then the capture (inputs prepared; `own`: which of them are the caller's tensors, which
        the graph may borrow); `_replay` runs every call after it."""
        if self._eager_calls < self.cuda_graph_warmup:   # compiles the Triton kernels outside any capture
            self._eager_calls += 1
            return self._execute(inputs)
        graph = kept_graph()
        try:
            self._capture(graph, inputs, [mine and self._borrow_inputs for mine in own])
        except Exception as error:   # e.g. an opaque op that syncs with the host
            self._recover_from_failed_capture(graph)
            self.cuda_graph_error = f"CUDA graph capture failed, running eagerly: {error}"
            warnings.warn(f"opfuse: {self.cuda_graph_error}", stacklevel=4)
            self._reset_cuda_graph()
            return self._execute(inputs)
        return self._replay(self._static_inputs)

    def _replays(self, inputs: Sequence[torch.Tensor]) -> bool:
        """Whether the captured graph replays these inputs as they are: each borrowed input the very tensor, at the
        address and with the strides captured."""
        return all(where is None or (x is static and x.data_ptr() == where[0] and x.stride() == where[1])
                   for static, x, where in zip(self._static_inputs, inputs, self._borrowed))

    def _replay(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One replay on these inputs (shape and device checked); another tensor where a borrowed one was (or the
        borrowed one with its storage moved or restrided) captures again over private buffers."""
        if not self._replays(inputs):
            return self._capture_private(inputs)
        return self._replay_as_captured(inputs)

    def _replay_as_captured(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One replay on inputs `_replays` accepts. `copy_` casts and lays out as it copies, so an input needs no
        preparing first; one that is its static buffer (a borrowed one always is) is not copied at all."""
        for static, x in zip(self._static_inputs, inputs):
            if x is not static:
                static.copy_(x)
        self._cuda_graph.replay()
        # the static outputs are overwritten by the next replay: the caller gets its own copies
        return [out.clone() for out in self._static_outputs]

    def _capture_private(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Capture again, every input in a private buffer (the borrowing graph is dropped), and run this call."""
        self._reset_cuda_graph()
        self._borrow_inputs = False
        self._eager_calls = self.cuda_graph_warmup     # the kernels are compiled: no warm-up again
        prepared = [self._prepare(x, form) for x, form in zip(inputs, self._input_forms)]
        return self._run_cuda_graph(prepared, [False] * len(prepared))

    @staticmethod
    def _static_buffers(inputs: Sequence[torch.Tensor], borrow: Sequence[bool]) -> list[torch.Tensor]:
        """The graph's input buffers: a borrowed input itself, any other a clone (which keeps the channels-last
        strides of dense inputs)."""
        return [x if keep else x.clone() for x, keep in zip(inputs, borrow)]

    def _captured(self, graph: Any, static: list[torch.Tensor], outputs: list[torch.Tensor],
                  borrow: Sequence[bool]) -> None:
        self._cuda_graph, self._static_inputs, self._static_outputs = graph, static, outputs
        self._borrowed = [(x.data_ptr(), x.stride()) if keep else None for x, keep in zip(static, borrow)]

    def _capture(self, graph: torch.cuda.CUDAGraph, inputs: list[torch.Tensor], borrow: list[bool]) -> None:
        static = self._static_buffers(inputs, borrow)
        outputs = self._record(graph, static)
        ready(graph)
        self._captured(graph, static, outputs, borrow)

    def _record(self, graph: torch.cuda.CUDAGraph, static: list[torch.Tensor]) -> list[torch.Tensor]:
        """Capture the forward on the buffers `static` into `graph` and count its kernels (`_graph_launches`)."""
        # one eager run on exactly these buffers, so no kernel is compiled for new strides during the capture
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._execute(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        # thread_local: another thread's CUDA calls (another model's warm-up allocating, a synchronize) do not
        # invalidate this capture, as under the default "global" mode; this thread makes none while it captures
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outputs = self._execute(static)
        self._graph_launches = kernel_nodes(graph)
        return outputs

    def measure_forward(self, inputs: Sequence[torch.Tensor]) -> None:
        """Capture one forward on these inputs into a CUDA graph of its own, count its kernel nodes (`launches`)
        and time its replays (`forward_ms`: the median of FORWARD_REPLAYS, each from an idle GPU after one untimed
        replay, as the zoo benchmark times a bare replay), then drop it. The compile does this, so that the record
        `opfuse.analyze` reads says what a replay launches and how long it took there. Nothing is measured where the
        model runs without CUDA graphs or the capture fails (`launches` stays the estimate; the first call then
        captures, and reports a failure, as ever)."""
        if not self.use_cuda_graph or self.cuda_graph_error is not None:
            return
        with torch.no_grad():                 # as a call runs the forward (`run_matching`)
            prepared = [self._prepare(x, form) for x, form in zip(inputs, self._input_forms)]
            graph = kept_graph()
            try:
                with CAPTURE_GATE.exclusive():
                    self._record(graph, self._static_buffers(prepared, [False] * len(prepared)))
            except Exception:
                self._recover_from_failed_capture(graph)
                return
        from opfuse.bench.timing import time_once    # the zoo's clock for one call from an idle GPU

        ready(graph)
        graph.replay()
        self.forward_ms = statistics.median(time_once(graph.replay, cuda=True) for _ in range(FORWARD_REPLAYS))

    def _recover_from_failed_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """Undo what a capture that raised leaves behind in PyTorch (`recover_rng_after_failed_capture`). The
        allocator may still hold a pool filter that refers to the graph object, so it is kept alive."""
        self._failed_captures.append(graph)
        recover_rng_after_failed_capture(self.device.index)
