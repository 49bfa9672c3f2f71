"""The call path on a captured CUDA graph, emulated on the CPU: what a call does before and after its replay.

A call on a captured graph copies each input into its static buffer (the copy casts and lays it out as compiled;
an input that is its static buffer is not copied), replays, and returns a copy of each static output, so the
caller owns what it gets. OpfuseModule checks a call's inputs once, building nothing when they match, and still
refuses an input unlike the compiled ones with its message.

`torch.cuda.CUDAGraph` and `CompiledModel._capture` are replaced by CPU stand-ins (`cpu_graphs`): the real
warm-up, capture and replay control flow runs, and a replay recomputes the static outputs from the static inputs
as the captured kernels would. `OpLog` records the aten ops a call runs outside the replay.
"""

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import opfuse
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.ir.graph import Graph, GraphError, TensorType
from opfuse.ir.interpret import interpret
from opfuse.runtime.compiled import CompiledModel


class OpLog(TorchDispatchMode):
    """The aten ops run while active, by name, with "replay" where the graph replayed (its own ops left out)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []
        self.in_replay = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_replay:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def around_replay(self) -> tuple[list[str], list[str]]:
        """(ops before the replay, ops after it)."""
        assert self.ops.count("replay") == 1, self.ops
        at = self.ops.index("replay")
        return self.ops[:at], self.ops[at + 1:]


LOGS: list[OpLog] = []     # the OpLog a replay marks (the innermost active one)


class CpuGraph:
    """Stands in for torch.cuda.CUDAGraph: replay() writes the forward of the static inputs into the static
    outputs, in place."""

    def __init__(self):
        self.model = None
        self.replays = 0

    def replay(self):
        self.replays += 1
        log = LOGS[-1] if LOGS else None
        if log is not None:
            log.ops.append("replay")
            log.in_replay = True
        try:
            for static, value in zip(self.model._static_outputs, self.model._execute(self.model._static_inputs)):
                static.copy_(value)
        finally:
            if log is not None:
                log.in_replay = False


def capture_on_cpu(self, graph, inputs, borrow):
    """CompiledModel._capture without CUDA: static buffers as the real one makes them, bound to a CpuGraph."""
    static = self._static_buffers(inputs, borrow)
    graph.model = self
    self._captured(graph, static, self._execute(static), borrow)


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CpuGraph)
    monkeypatch.setattr(CompiledModel, "_capture", capture_on_cpu)


class logged:
    """`with logged() as log:` an OpLog that a CpuGraph replay marks."""

    def __enter__(self) -> OpLog:
        self.log = OpLog()
        LOGS.append(self.log)
        self.log.__enter__()
        return self.log

    def __exit__(self, *exc):
        self.log.__exit__(*exc)
        LOGS.pop()


# ---- a hand-built model: x[2,3,4,4] -> relu -> reshape[2,48] -> add(y) ; outputs: the sum, the relu ----------

def build_graph() -> Graph:
    g = Graph("call_path")
    g.add_input("x", TensorType((2, 3, 4, 4), "float32"))
    g.add_input("y", TensorType((2, 48), "float32"))
    g.add_node("relu", ["x"], TensorType((2, 3, 4, 4), "float32"), name="r")
    g.add_node("reshape", ["r"], TensorType((2, 48), "float32"), {"shape": (2, 48)}, name="flat")
    g.add_node("add", ["flat", "y"], TensorType((2, 48), "float32"), name="s")
    g.outputs = ["s", "r"]
    return g


def plain_model() -> CompiledModel:
    """The model with every group run through PyTorch, without a CUDA graph (as on the CPU)."""
    groups = [FusionGroup(0, GroupKind.SINGLE, ["r"], inputs=["x"], outputs=["r"]),
              FusionGroup(1, GroupKind.VIEW, ["flat"], inputs=["r"], outputs=["flat"], launches=0),
              FusionGroup(2, GroupKind.SINGLE, ["s"], inputs=["flat", "y"], outputs=["s"])]
    return CompiledModel(FusionPlan(build_graph(), groups, [], "h200", FusionConfig(dtype="float32")), {}, "cpu")


def graphed_model(private: bool = True) -> tuple[CompiledModel, tuple]:
    """The model on the CUDA graph path (as on a GPU), warmed up and captured on example inputs, and those of the
    capturing call. With `private`, a call with other tensors has moved it to private input buffers."""
    model = plain_model()
    model.use_cuda_graph = True
    for seed in range(1 + model.cuda_graph_warmup):      # the warm-up call(s), then the capture
        captured = inputs(seed)
        model(*captured)
    assert isinstance(model._cuda_graph, CpuGraph) and len(model.static_inputs) == 2
    if private:
        model(*inputs(99))
        assert model._borrowed == [None, None]
    return model, captured


def inputs(seed: int, dtype=torch.float32):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 4, 4, generator=generator, dtype=dtype),
            torch.randn(2, 48, generator=generator, dtype=dtype))


def expected(x, y):
    return interpret(build_graph(), [x.float(), y.float()])


# ---- CompiledModel on a captured graph ----------------------------------------------------------------------

def test_a_replayed_call_copies_each_input_once_and_returns_outputs_the_caller_owns(cpu_graphs):
    model, _ = graphed_model()
    x, y = inputs(7)
    assert x.is_contiguous() and not x.is_contiguous(memory_format=torch.channels_last)
    with logged() as log:
        first = model(x, y)
    before, after = log.around_replay()
    assert before == ["copy_", "copy_"]     # the layout change is the copy's: no channels-last copy before it
    assert after == ["clone", "clone"]
    for got, want in zip(first, expected(x, y)):
        torch.testing.assert_close(got, want)
    static_storages = {out.untyped_storage().data_ptr() for out in model._static_outputs}
    assert not static_storages & {out.untyped_storage().data_ptr() for out in first}
    kept = [out.clone() for out in first]
    model(*inputs(8))                       # the next replay overwrites the static outputs, not the caller's
    assert all(torch.equal(a, b) for a, b in zip(first, kept))
    assert model._static_inputs[0].is_contiguous(memory_format=torch.channels_last)


def test_an_input_that_is_its_static_buffer_is_not_copied(cpu_graphs):
    model, _ = graphed_model()
    x, y = inputs(9)
    static_x, static_y = model.static_inputs
    static_x.copy_(x)                       # the caller writes its next input into the buffer in place
    with logged() as log:
        out, _ = model(static_x, y)
    before, _ = log.around_replay()
    assert before == ["copy_"]              # y only
    torch.testing.assert_close(out, expected(x, y)[0])
    assert torch.equal(static_y, y)


def test_the_capturing_calls_own_tensor_is_read_in_place_and_never_written(cpu_graphs):
    model, (x0, y0) = graphed_model(private=False)
    # x0 is contiguous where the model computes channels-last: its buffer is a private copy; y0 is borrowed
    assert model._borrowed[0] is None and model._borrowed[1] == (y0.data_ptr(), y0.stride())
    assert model.static_inputs[1] is y0
    x, y = inputs(21)
    y0.copy_(y)                              # the caller writes its next input into its own tensor
    with logged() as log:
        out, _ = model(x, y0)
    before, _ = log.around_replay()
    assert before == ["copy_"]               # x only
    torch.testing.assert_close(out, expected(x, y)[0])
    y_kept = y0.clone()
    x2, y2 = inputs(22)
    out, _ = model(x2, y2)                   # another tensor where y0 was: captured again over private buffers
    torch.testing.assert_close(out, expected(x2, y2)[0])
    assert model._borrowed == [None, None] and model.static_inputs[1] is not y0
    assert torch.equal(y0, y_kept)           # the caller's tensor was never written
    out, _ = model(x, y0)                    # y0 again: copied in now, like any other tensor
    torch.testing.assert_close(out, expected(x, y)[0])
    assert torch.equal(y0, y_kept)


def test_a_borrowed_tensor_whose_storage_moved_is_not_read_at_its_old_address(cpu_graphs):
    model, (_, y0) = graphed_model(private=False)
    x, y = inputs(23)
    y0.data = y.clone()                      # same tensor object, another storage
    out, _ = model(x, y0)
    torch.testing.assert_close(out, expected(x, y)[0])
    assert model._borrowed == [None, None]


def test_a_borrowed_tensor_restrided_in_place_is_not_read_with_its_old_strides(cpu_graphs):
    """`t_()` or `as_strided_` keeps the object and its address; the captured kernels would read it with the old
    strides (the CPU stand-in recomputes from the object, so what shows the fix is the capture again)."""
    model, (_, y0) = graphed_model(private=False)
    y0.as_strided_((2, 48), (1, 2))              # same object, same address, other strides
    assert y0.data_ptr() == model._borrowed[1][0] and y0.stride() != model._borrowed[1][1]
    x, _ = inputs(24)
    out, _ = model(x, y0)
    torch.testing.assert_close(out, expected(x, y0)[0])
    assert model._borrowed == [None, None]


def test_a_float_input_is_cast_and_laid_out_by_its_copy(cpu_graphs):
    model, _ = graphed_model()
    x, y = inputs(3, dtype=torch.float64)   # run_matching's contract: shape and device checked, float dtype cast
    with logged() as log:
        out, _ = model.run_matching([x, y])
    before, _ = log.around_replay()
    assert before == ["copy_", "copy_"]
    assert model._static_inputs[0].dtype == torch.float32 and out.dtype == torch.float32
    torch.testing.assert_close(out, expected(x, y)[0])


def test_without_a_graph_a_float_input_is_cast_and_laid_out_in_one_step():
    model = plain_model()
    x, y = inputs(4, dtype=torch.float64)
    with logged() as log:
        out, _ = model.run_matching([x, y])
    assert log.ops[:3] == ["_to_copy", "_to_copy", "relu"]      # one cast-and-layout per input, then the model
    torch.testing.assert_close(out, expected(x, y)[0])
    same = inputs(5)[0].contiguous(memory_format=torch.channels_last)
    assert CompiledModel._prepare(same, model._input_forms[0]) is same      # already as compiled: itself


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_a_call_in_any_grad_mode_records_no_autograd_graph(cpu_graphs, mode):
    model, _ = graphed_model()
    x, y = inputs(11)
    x.requires_grad_(True)
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}[mode]
    with context():
        outputs = model(x, y)
        assert torch.is_grad_enabled() == (mode == "grad")       # the call leaves the caller's mode as it was
    assert all(not out.requires_grad and out.grad_fn is None for out in outputs)
    assert all(not static.requires_grad for static in model._static_inputs + model._static_outputs)
    torch.testing.assert_close(outputs[0], expected(x.detach(), y)[0])


# ---- OpfuseModule: one check per call -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_small():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU()).eval()
    return model, opfuse.compile(model, (torch.randn(1, 3, 5, 5),), FusionConfig(dtype="float32"))


def test_a_matching_call_is_checked_once_and_describes_nothing(compiled_small, monkeypatch):
    model, compiled = compiled_small
    described = []
    real_describe = opfuse.module.describe_input
    monkeypatch.setattr(opfuse.module, "describe_input", lambda x: described.append(x) or real_describe(x))

    def second_check(self, inputs):
        raise AssertionError("the inputs were checked a second time")
    monkeypatch.setattr(CompiledModel, "input_signature", second_check)
    x = torch.randn(1, 3, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
    assert described == []
    with pytest.raises(GraphError, match=r"input 0 \(input\) is float32\[2,3,5,5\] on cpu, but the model was "
                                         r"compiled for float32\[1,3,5,5\] on cpu"):
        compiled(torch.randn(2, 3, 5, 5))      # a wrong input after a right one: refused with its message
    assert described                           # described only for the message
    with pytest.raises(GraphError, match=r"is float64\[1,3,5,5\] on cpu"):
        compiled(x.double())
    with pytest.raises(GraphError, match=r"on meta, but .* on cpu"):
        compiled(torch.empty(1, 3, 5, 5, device="meta"))
    with pytest.raises(GraphError, match=r"must be a tensor, got list"):
        compiled([1.0])
    with pytest.raises(GraphError, match="compiled for 1 inputs, got 2"):
        compiled(x, x)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)    # and right again


def test_the_module_call_on_a_captured_graph_copies_only_its_input(compiled_small, cpu_graphs):
    model, compiled = compiled_small
    inner = compiled.compiled
    inner.use_cuda_graph = True
    try:
        for _ in range(1 + inner.cuda_graph_warmup):
            compiled(torch.randn(1, 3, 5, 5))
        assert isinstance(inner._cuda_graph, CpuGraph)
        x = torch.randn(1, 3, 5, 5)
        with logged() as log, torch.inference_mode():
            out = compiled(x)
        before, after = log.around_replay()
        assert before == ["copy_"] and after == ["clone"]
        with torch.no_grad():
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
        assert out.data_ptr() != inner._static_outputs[0].data_ptr()
    finally:
        inner.set_cuda_graph(False)
