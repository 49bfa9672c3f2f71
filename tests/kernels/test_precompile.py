"""Recording launches for the compile workers (opfuse.runtime.precompile), on Triton's interpreter: a recorded run
launches nothing, and records what Triton specialises the kernel on."""

from __future__ import annotations

import threading

import pytest
import torch

from opfuse.codegen.base import KernelConfig, LaunchRecord, TensorArg, recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.pointwise import lower_pointwise_group
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.launch_records import record_launches
from opfuse.runtime.precompile import precompile

from tests.kernels.builders import KernelGraph

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def relu_kernel():
    b = KernelGraph()
    b.default_kind = GroupKind.POINTWISE
    y = b.op("relu", b.op("add", b.input("x", (3, 50)), b.const("shift", b.random(50))))
    kernel = lower_pointwise_group(b.graph, b.group([y], GroupKind.POINTWISE), "cpu")
    return kernel, [b.feeds[name] for name in kernel.runtime_inputs]


def test_a_recorded_run_launches_nothing_and_records_the_launch():
    kernel, inputs = relu_kernel()
    kernel.output_fill = float("nan")
    config = kernel.configs()[0]
    with recording_launches() as launches:
        (out,) = kernel.run(inputs, config)
    assert torch.isnan(out).all()                               # nothing ran
    assert len(launches) == 1
    record = launches[0]
    assert isinstance(record, LaunchRecord) and record.function == kernel.name and record.path.endswith(".py")
    tensors = [a for a in record.args if isinstance(a, TensorArg)]
    assert [t.dtype for t in tensors] == ["float32"] * len(tensors) and len(tensors) >= 3   # x, shift, out
    assert all(t.offset == 0 for t in tensors)
    assert dict(record.kwargs)["num_warps"] == config.num_warps
    (again,) = kernel.run(inputs, config)                       # outside the recording it runs
    assert torch.equal(again, torch.relu(inputs[0] + kernel.graph.constants["shift"]))


def test_a_misaligned_tensor_is_recorded_as_misaligned():
    kernel, (x,) = relu_kernel()
    storage = torch.randn(x.numel() + 1)
    shifted = storage[1:].view_as(x)                            # 4 bytes past a 16-byte boundary
    with recording_launches() as launches:
        kernel.run([shifted], kernel.configs()[0])
    assert launches[0].args[0] == TensorArg("float32", 4)


def test_distinct_launches_of_several_configs_and_no_pool_for_few():
    kernel, inputs = relu_kernel()
    configs = kernel.configs()[:2] if len(kernel.configs()) > 1 else kernel.configs()
    records = record_launches([(kernel, inputs, configs + configs)])    # a config given twice is one launch
    assert len(records) == len(configs)
    result = precompile([(kernel, inputs, configs)], workers=4, device_index=0)
    assert result.launches == len(configs) and result.compiled == 0 and result.failed == 0   # too few for a pool


def test_workers_that_cannot_compile_cost_nothing_but_time(monkeypatch):
    """On the CPU the workers find no GPU and compile nothing (nor does the caller meanwhile, here): every launch is
    left to the tuner, no error."""
    from opfuse.runtime import compile_worker, worker_pool
    from opfuse.runtime import precompile as module

    kernel, inputs = relu_kernel()
    monkeypatch.setattr(module, "MIN_LAUNCHES", 1)
    monkeypatch.setattr(compile_worker, "_compile", lambda record, modules, seconds=None: False)
    result = precompile([(kernel, inputs, kernel.configs())], workers=2, device_index=0)
    assert result.launches >= 1 and result.compiled == 0 and result.failed == result.launches
    monkeypatch.setattr(worker_pool, "TIMEOUT_S", 0.0)                  # workers killed at once
    second = precompile([(kernel, inputs, kernel.configs())], workers=2, device_index=0)
    assert second.compiled == 0 and second.failed == second.launches


def test_a_kernel_with_its_launcher_copies():
    import copy

    kernel, inputs = relu_kernel()
    clone = copy.deepcopy(kernel)
    assert torch.equal(clone.run(inputs)[0], kernel.run(inputs)[0])


def test_a_record_goes_to_the_workers_as_json_and_back():
    import json

    from opfuse.runtime.compile_worker import decode_launch, encode_launch

    kernel, inputs = relu_kernel()
    with recording_launches() as launches:
        kernel.run(inputs, kernel.configs()[0])
    (record,) = launches
    assert decode_launch(json.loads(json.dumps(encode_launch(record)))) == record


def test_launches_that_compile_alike_are_compiled_once():
    """One kernel whose stride is one multiple of 16 or another is one compile; a stride that is not, a misaligned
    tensor or another constexpr is another compile (what Triton specialises a kernel on)."""
    from opfuse.runtime.launch_records import compile_key, distinct_compiles

    kernel, (x,) = relu_kernel()
    with recording_launches() as launches:
        kernel.run([x], kernel.configs()[0])
    (record,) = launches
    assert record.args[1] == 50                      # x's row stride

    def varied(stride: int = 50, pointer: TensorArg = record.args[0], **options) -> LaunchRecord:
        args = (pointer, stride) + record.args[2:]
        return LaunchRecord(record.path, record.function, args,
                            tuple((k, options.get(k, v)) for k, v in record.kwargs))

    sixteen, thirty_two, fifty, fifty_one = varied(160), varied(320), varied(50), varied(51)
    assert compile_key(sixteen) == compile_key(thirty_two) != compile_key(fifty) == compile_key(fifty_one)
    misaligned = varied(160, TensorArg("float32", 4))
    wider = varied(160, BLOCK=2 * dict(record.kwargs)["BLOCK"])
    assert len({compile_key(r) for r in (sixteen, misaligned, wider)}) == 3
    assert distinct_compiles([sixteen, fifty, thirty_two, fifty_one, sixteen]) == [sixteen, fifty]


def says_ready() -> str:
    """The opening of a stand-in worker's script: the line a worker prints once it takes launches."""
    from opfuse.runtime.compile_worker import READY

    line = READY + b"\n"
    return f"import sys\nsys.stdout.buffer.write({line!r})\nsys.stdout.buffer.flush()\n"


# a stand-in worker: answers each launch as a worker does, after sleeping as long as the launch's first argument
# says (when it is a number); a launch of function "die" kills it, "chatty" prints a line of its own first, "glued"
# output that does not end its line, "fail" does not compile; the answer is `answer`'s bytes
STAND_IN_WORKER = r"""
import json, sys, time, os
for line in sys.stdin.buffer:
    item = json.loads(line)
    if item["function"] == "die":
        os._exit(1)
    if isinstance(item["args"][0], (int, float)):
        time.sleep(item["args"][0])
    if item["function"] == "chatty":
        sys.stdout.buffer.write(b"a warning of its own\n")
    if item["function"] == "glued":
        sys.stdout.buffer.write(b"a progress bar with no newline")
    sys.stdout.buffer.write(ANSWER[item["function"] != "fail"])
    sys.stdout.buffer.flush()
"""


def stand_in_pool(workers: int, build=None):
    import sys

    from opfuse.runtime.compile_worker import answer
    from opfuse.runtime.worker_pool import CompilePool

    script = says_ready() + f"ANSWER = {[answer(False), answer(True)]!r}\n" + STAND_IN_WORKER
    return CompilePool(workers, 0, command=[sys.executable, "-c", script], build=build).start()


def launch(function: str, seconds: float = 0.0) -> LaunchRecord:
    return LaunchRecord("kernel.py", function, (seconds,), ())


def test_a_pool_hands_out_launches_as_its_workers_finish():
    """One slow compile holds one worker: the other compiles every other launch meanwhile."""
    import time

    pool = stand_in_pool(2)
    try:
        pool.compile([launch("warm")] * 2)                 # both workers started
        start = time.monotonic()
        done = pool.compile([launch("slow", 1.5)] + [launch("fast", 0.1 + i / 1000) for i in range(8)]
                            + [launch("fail", 0.1)])
        seconds = time.monotonic() - start
    finally:
        pool.close()
    assert done == 9                                       # all but the one that failed to compile
    assert seconds < 1.5 + 0.5, seconds                    # a static half each would take 1.5 + 0.4 + 0.1
    assert pool.processes == []


def test_a_pool_replaces_a_dying_worker_and_ignores_other_output():
    import time

    pool = stand_in_pool(2)
    try:
        start = time.monotonic()
        done = pool.compile([launch("die"), launch("chatty"), launch("ok"), launch("glued"), launch("chatty")])
        assert time.monotonic() - start < 10.0            # the glued answer was read when it came, not at the deadline
        assert done == 4 and len(pool.processes) == 2      # the launch the dead worker held is the tuner's
        assert pool.compile([launch("ok", 0.01), launch("ok", 0.02), launch("fail")]) == 2
    finally:
        pool.close()


def test_a_pool_replaces_as_many_workers_as_it_started():
    pool = stand_in_pool(1)
    try:
        assert pool.compile([launch("die", 0.0), launch("die", 1.0), launch("ok")]) == 0
        assert pool.processes == [] and pool.restarts == 0  # the first died, then its replacement
    finally:
        pool.close()


def test_a_worker_that_died_between_rounds_is_replaced():
    pool = stand_in_pool(2)
    try:
        assert pool.compile([launch("ok"), launch("ok")]) == 2
        pool.processes[0].kill()
        pool.processes[0].wait()
        assert pool.compile([launch("ok", 0.01), launch("ok", 0.02)]) == 2
        assert len(pool.processes) == 2 and all(p.poll() is None for p in pool.processes) and pool.restarts == 1
    finally:
        pool.close()


def test_a_pool_kills_workers_past_the_deadline_and_starts_others():
    import time

    pool = stand_in_pool(2)
    try:
        start = time.monotonic()
        done = pool.compile([launch("stuck", 30.0), launch("ok")], timeout=1.0)
        assert time.monotonic() - start < 5.0
        assert done == 1 and len(pool.processes) == 2
        assert pool.compile([launch("ok", 0.01), launch("ok", 0.02)]) == 2   # the next round has both workers
    finally:
        pool.close()


def test_a_caller_waits_for_its_first_launches_while_the_workers_go_on():
    """What the tuner does: `submit` returns at once; the first launch is ready while later ones still compile;
    a launch asked for `first` goes ahead of those queued."""
    import time

    pool = stand_in_pool(1)
    try:
        assert pool.compile([launch("ok", 0.0)]) == 1          # the worker started
        start = time.monotonic()
        keys = pool.submit([launch("ok", 0.1), launch("ok", 0.6), launch("ok", 0.61), launch("ok", 0.62)])
        assert time.monotonic() - start < 0.1
        assert pool.wait(keys[:1], timeout=5.0) and not pool.wait(keys[1:], timeout=0.0)
        (urgent,) = pool.submit([launch("ok", 0.01)], first=True)
        assert pool.wait([urgent], timeout=5.0)
        assert time.monotonic() - start < 0.1 + 0.6 + 0.3, "the urgent launch waited for the queue"
        assert not pool.wait(keys[2:], timeout=0.0)             # those queued before it come after it
        assert pool.wait(keys, timeout=5.0) and all(key in pool.done for key in keys)
    finally:
        pool.close()


def test_closing_a_pool_gives_up_what_is_queued():
    pool = stand_in_pool(1)
    keys = pool.submit([launch("ok", 5.0), launch("ok", 0.01)])
    pool.close()
    assert pool.wait(keys, timeout=0.0) and not any(key in pool.done for key in keys)
    assert all(key in pool.failed for key in keys)


def pointwise_kernel(op: str, group_id: int):
    b = KernelGraph()
    b.default_kind = GroupKind.POINTWISE
    y = b.op(op, b.op("add", b.input("x", (3, 50)), b.const("shift", b.random(50))))
    group = b.group([y], GroupKind.POINTWISE)
    group.id = group_id
    kernel = lower_pointwise_group(b.graph, group, "cpu")
    return kernel, [b.feeds[name] for name in kernel.runtime_inputs]


def test_every_default_config_is_built_first_then_each_kernels_other_candidates(tmp_path):
    """`Compiling`: the example values' run needs every kernel's default config, the tuner then one kernel's
    candidates at a time; a worker is handed them in that order, and each kernel is ready once its own are
    built."""
    import json
    import sys

    from opfuse.hardware import get_hardware
    from opfuse.runtime.autotune import Compiling
    from opfuse.runtime.compile_worker import answer
    from opfuse.runtime.worker_pool import CompilePool

    log = tmp_path / "handed-out"
    script = says_ready() + (f"import json, sys\nfor line in sys.stdin.buffer:\n    item = json.loads(line)\n"
              f"    open({str(log)!r}, 'a').write(json.dumps([item['function'], dict(item['kwargs'])]) + '\\n')\n"
              f"    sys.stdout.buffer.write({answer(True)!r})\n    sys.stdout.buffer.flush()\n")
    pool = CompilePool(1, 0, command=[sys.executable, "-c", script], build=None).start()
    others = [KernelConfig.of(BLOCK=512, num_warps=4), KernelConfig.of(BLOCK=1024, num_warps=4)]
    jobs = [(kernel, inputs, kernel.configs()[:1] + others) for kernel, inputs in      # the interpreter's one
            (pointwise_kernel("relu", 1), pointwise_kernel("sigmoid", 2))]               # config, and two more
    (relu, relu_inputs, relu_configs), (sigmoid, sigmoid_inputs, sigmoid_configs) = jobs
    try:
        compiling = Compiling(pool, False, jobs, get_hardware("h200"), 3)
        compiling.ready_default("g2")
        assert pool.wait(compiling.defaults["g1"], timeout=0.0)        # built before g2's default
        for group, inputs in (("g1", relu_inputs), ("g2", sigmoid_inputs)):
            compiling.ready(group, inputs)
            assert all(key in pool.done for key in compiling.keys[group])
        counts = compiling.close()
    finally:
        pool.close()
    handed = [json.loads(line) for line in log.read_text().splitlines()]
    blocks = [options["BLOCK"] for _, options in handed]
    assert [name for name, _ in handed] == [relu.name, sigmoid.name] + [relu.name] * 2 + [sigmoid.name] * 2
    assert blocks == [dict(c.params)["BLOCK"] for c in relu_configs[:1] + sigmoid_configs[:1] + relu_configs[1:]
                      + sigmoid_configs[1:]]
    assert (counts.launches, counts.compiled, counts.failed) == (6, 6, 0)
    assert pool.processes == []                                    # not its pool to close, but closed above


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dispatcher_that_fails_leaves_no_caller_waiting(monkeypatch):
    """Whatever ends the dispatcher thread, every launch queued counts as not compiled (the tuner builds it) at once,
    and so does every launch queued after."""
    import time

    def broken(process):
        raise RuntimeError("cannot replace a worker")

    pool = stand_in_pool(1)
    monkeypatch.setattr(pool, "_drop", broken)
    try:
        start = time.monotonic()
        assert pool.compile([launch("die"), launch("ok", 0.01)], timeout=30.0) == 0
        assert pool.compile([launch("ok", 0.02)], timeout=30.0) == 0
        assert time.monotonic() - start < 5.0
    finally:
        pool.close()


def test_a_launch_no_worker_can_read_is_the_tuners_alone(monkeypatch):
    from opfuse.runtime import worker_pool

    encode = worker_pool.encode_launch
    monkeypatch.setattr(worker_pool, "encode_launch", lambda r: encode(r) if r.function != "odd" else object())
    pool = stand_in_pool(1)
    try:
        assert pool.compile([launch("ok", 0.0), launch("odd"), launch("ok", 0.01)], timeout=30.0) == 2
    finally:
        pool.close()


def test_past_its_deadline_a_build_gives_up_once_and_the_pool_keeps_its_workers(monkeypatch):
    """review of 9da76f6: a hung compile past the build's deadline (`TIMEOUT_S`) must not cost a worker per later
    kernel (each killed as it waited for launches just handed to the replacements), or the compile's next build
    would find no worker left: the build gives up all it queued once."""
    import sys
    import time

    from opfuse.hardware import get_hardware
    from opfuse.runtime import autotune
    from opfuse.runtime.compile_worker import answer
    from opfuse.runtime.worker_pool import CompilePool

    script = says_ready() + ("import json, sys, time\nfor line in sys.stdin.buffer:\n    item = json.loads(line)\n"
              "    time.sleep(30.0 if 'sigmoid' in item['function'] else 0.3)\n"
              f"    sys.stdout.buffer.write({answer(True)!r})\n    sys.stdout.buffer.flush()\n")
    monkeypatch.setattr(autotune, "TIMEOUT_S", 1.0)
    pool = CompilePool(2, 0, command=[sys.executable, "-c", script], build=None).start()
    ops = ("relu", "sigmoid", "tanh", "silu", "hardswish", "hardsigmoid", "abs", "neg")
    jobs = [(kernel, inputs, kernel.configs()) for kernel, inputs in
            (pointwise_kernel(op, i) for i, op in enumerate(ops, start=1))]
    try:
        compiling = autotune.Compiling(pool, False, jobs, get_hardware("h200"), 1)
        start = time.monotonic()
        for kernel, inputs, _ in jobs:
            compiling.ready(kernel.group.name, inputs)
        assert time.monotonic() - start < 5.0 and compiling.expired
        assert len(pool.processes) == 2
        start = time.monotonic()
        assert pool.compile([launch("ok", 0.01), launch("ok", 0.02)]) == 2     # the next build has its workers
        assert time.monotonic() - start < 5.0
    finally:
        pool.close()


def test_precompile_uses_the_compile_pool_it_runs_in(monkeypatch):
    """Inside `compile_pool` every precompile goes to the one pool, however few its launches."""
    from opfuse.runtime import precompile as module

    kernel, inputs = relu_kernel()
    pool = stand_in_pool(2)
    token = module._POOL.set(pool)
    try:
        result = precompile([(kernel, inputs, kernel.configs()[:1])], workers=2, device_index=0)
    finally:
        module._POOL.reset(token)
        pool.close()
    assert result.launches == 1 and result.compiled == 1 and result.failed == 0   # the stand-in "compiled" it


def test_a_pool_compiles_each_launch_once():
    """A launch compiled in an earlier round (the stand-in values' round before the tuner's) is not handed out
    again, and counts as compiled; one that failed is tried again."""
    import time

    pool = stand_in_pool(2)
    try:
        assert pool.compile([launch("slow", 1.0), launch("fail")]) == 1
        start = time.monotonic()
        assert pool.compile([launch("slow", 1.0), launch("fail")]) == 1
        assert time.monotonic() - start < 0.8
    finally:
        pool.close()


class EmbedThenLookUp(torch.nn.Module):
    """A generated kernel's output read as indices by an op PyTorch runs (the stand-ins must keep it in range)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(7, 6)
        self.linear = torch.nn.Linear(6, 6)

    def forward(self, ids):
        hidden = torch.relu(self.linear(self.table(ids)))
        picked = (hidden.sum(-1) * 1000).long().clamp(0, 6)        # computed ids, then a lookup with them
        return self.table(picked) + hidden


def test_stand_in_values_run_no_generated_kernel_and_keep_every_layout():
    """What the compile workers are given before any kernel runs: every value with collect_values' shape, strides
    and dtype, the generated kernels' outputs zeros (nothing ran), the example inputs untouched."""
    import opfuse
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.compiled import CompiledModel

    from tests.kernels.test_compile import small_cnn

    for model, x in ((small_cnn(), torch.randn(2, 3, 8, 8)), (EmbedThenLookUp().eval(), torch.tensor([[1, 5, 2]]))):
        analysis = opfuse.analyze(model, (x,), opfuse.FusionConfig())
        kernels, _ = lower_plan(analysis.plan, "cpu")
        assert kernels
        compiled = CompiledModel(analysis.plan, kernels, "cpu")
        before = x.clone()
        stand_ins = compiled.stand_in_values(x)
        assert torch.equal(x, before)
        values = compiled.collect_values(x)
        assert stand_ins.keys() == values.keys()
        for name, value in values.items():
            assert (stand_ins[name].shape, stand_ins[name].stride(), stand_ins[name].dtype) == \
                (value.shape, value.stride(), value.dtype), name
        written = [name for step in compiled._steps if step.kernel is not None for name in step.writes]
        assert written and all(not stand_ins[name].any() for name in written)
        assert any(values[name].any() for name in written)
    # small_cnn runs nothing through PyTorch on a kernel's output; the lookup model's computed ids, gathered
    # by PyTorch or an opaque call, would index with stand-in zeros' arithmetic: no stand-ins for it
    assert CompiledModel(*_plan_and_kernels(small_cnn(), torch.randn(2, 3, 8, 8)), "cpu").stand_ins_are_safe()


def test_closing_a_pool_waits_for_no_worker_still_starting():
    """A compile whose every kernel was cached ends before its workers are ready: closing them costs no wait."""
    import sys
    import time

    from opfuse.runtime.worker_pool import CompilePool

    pool = CompilePool(3, 0, command=[sys.executable, "-c", "import time; time.sleep(30)"]).start()
    start = time.monotonic()
    pool.close()
    assert time.monotonic() - start < 2.0 and pool.processes == []


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="reads the worker's /proc entry")
def test_a_worker_imports_the_opfuse_that_started_it(monkeypatch, tmp_path):
    """A caller in a directory holding another `opfuse` package: its workers start where this opfuse is, so that
    `python -m opfuse.runtime.compile_worker` imports this one, not the directory's."""
    import os
    import sys
    from pathlib import Path

    import opfuse
    from opfuse.runtime.worker_pool import CompilePool

    (tmp_path / "opfuse").mkdir()
    (tmp_path / "opfuse" / "__init__.py").write_text("raise ImportError('the other opfuse')\n")
    monkeypatch.chdir(tmp_path)
    pool = CompilePool(1, 0, command=[sys.executable, "-c", "import sys; sys.stdin.read()"]).start()
    try:
        process = pool.processes[0]
        assert Path(os.readlink(f"/proc/{process.pid}/cwd")) == Path(opfuse.__file__).resolve().parents[1]
    finally:
        pool.close()


def _plan_and_kernels(model, *inputs):
    """(plan, kernels) of `model` on the CPU."""
    import opfuse
    from opfuse.codegen.lower import lower_plan

    analysis = opfuse.analyze(model, inputs, opfuse.FusionConfig())
    return analysis.plan, lower_plan(analysis.plan, "cpu")[0]


def test_no_stand_ins_where_pytorch_indexes_with_a_kernels_output():
    """review of 3ec3207: ids computed from a kernel's output (zeros in the stand-in pass, NaN after a remainder)
    and gathered by PyTorch would be out of range; on a GPU a device-side assert ends the process's CUDA use."""
    from opfuse.runtime.compiled import CompiledModel

    class Gathers(torch.nn.Module):
        def forward(self, x, ids):
            n = torch.relu(x).sum(-1, keepdim=True) + 1
            picked = torch.remainder(ids, n).long()
            return torch.gather(x, 1, picked) * 2

    x, ids = torch.randn(2, 6), torch.randint(0, 6, (2, 3)).float()
    model = CompiledModel(*_plan_and_kernels(Gathers(), x, ids), "cpu")
    gathered_by_pytorch = any(step.kernel is None and step.node.op in ("gather", "opaque") for step in model._steps)
    assert model.stand_ins_are_safe() is not gathered_by_pytorch


def test_a_worker_builds_the_launcher_of_each_kernel_it_compiles(monkeypatch):
    """Triton 3.6 builds a C launcher per kernel signature when a kernel loads: the worker builds it into the cache
    too, so that the compiling process does not build them one after the other; a launcher that fails to build
    there leaves the compile counted as done."""
    from types import SimpleNamespace

    from triton.runtime.driver import driver

    from opfuse.runtime.compile_worker import _compile

    compiled = SimpleNamespace(src="the kernel's source", metadata="its metadata")
    built = []

    def launcher(src, metadata):
        built.append((src, metadata))
        if len(built) > 1:
            raise RuntimeError("no C compiler")

    monkeypatch.setattr(driver, "_active", SimpleNamespace(launcher_cls=launcher))
    record = LaunchRecord(path="/nowhere/kernel.py", function="kernel", args=(1,), kwargs=())
    modules = {record.path: SimpleNamespace(kernel=SimpleNamespace(warmup=lambda *args, **kwargs: compiled))}
    assert _compile(record, modules) and built == [("the kernel's source", "its metadata")]
    assert _compile(record, modules) and len(built) == 2

    def failing(*args, **kwargs):
        raise RuntimeError("does not compile")
    modules[record.path].kernel = SimpleNamespace(warmup=failing)
    assert not _compile(record, modules) and len(built) == 2


def test_the_unit_of_a_launch_is_the_largest_power_of_two_below_16_dividing_its_integers():
    from opfuse.codegen.base import unit_of

    assert unit_of([24, 144, 24 * 56, 0]) == 8        # MobileNet's 24-channel rows
    assert unit_of([116, 116 * 28]) == 4 and unit_of([58, 58 * 28]) == 2
    assert unit_of([32, 64, 0]) == 1                   # multiples of 16: Triton knows them so, nothing to rebind
    assert unit_of([24, 1]) == 1 and unit_of([0, 0]) == 1 and unit_of([7, 24]) == 1


def test_triton_hashes_itself_in_a_thread_of_its_own():
    from triton.runtime.cache import triton_key

    from opfuse.runtime.precompile import prefetch_triton_hash

    triton_key.cache_clear()
    thread = prefetch_triton_hash()
    assert thread.daemon and thread is not threading.current_thread()
    thread.join(timeout=60)
    assert not thread.is_alive() and triton_key.cache_info().currsize == 1     # the first lookup finds it made


def test_a_worker_logs_each_launch_it_builds_where_asked(monkeypatch, tmp_path):
    """With OPFUSE_WORKER_LOG set, a worker appends one JSON line per launch: its answer and its seconds."""
    import io
    import json
    import sys

    from opfuse.runtime import compile_worker
    from opfuse.runtime.launch_records import distinct_compiles

    kernel, inputs = relu_kernel()
    (record,) = distinct_compiles(record_launches([(kernel, inputs, kernel.configs()[:1])]))
    line = json.dumps(compile_worker.encode_launch(record)) + "\n"
    log = tmp_path / "workers.jsonl"
    monkeypatch.setenv("OPFUSE_WORKER_LOG", str(log))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    monkeypatch.setattr(compile_worker, "_compile", lambda rec, modules, seconds: seconds.update(compile=0.5) or True)
    stdout = io.BytesIO()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(line.encode() * 2)))
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(stdout))
    assert compile_worker.serve(0) == 0
    rows = [json.loads(entry) for entry in log.read_text().splitlines()]
    assert [row["ok"] for row in rows] == [True, True] and rows[0]["compile_s"] == 0.5
    assert rows[0]["kernel"] == record.function and rows[0]["ready"] <= rows[0]["came"] <= rows[0]["done"]
    assert rows[0]["done"] <= rows[1]["came"] and stdout.getvalue().count(compile_worker.REPLY) == 2
    assert stdout.getvalue().startswith(compile_worker.READY + b"\n")           # said before the first launch came


def test_a_worker_not_yet_ready_gets_no_launch_and_the_caller_builds_meanwhile():
    """Workers still importing torch take nothing: the caller waiting for its launches builds them itself, in the
    order it queued them, and they count as compiled."""
    import sys
    import time

    from opfuse.runtime.worker_pool import CompilePool

    built = []
    starting = "import time\ntime.sleep(30)\n" + says_ready() + "import sys\nsys.stdin.read()\n"
    pool = CompilePool(2, 0, command=[sys.executable, "-c", starting], build=lambda r: built.append(r) or True)
    pool.start()
    try:
        start = time.monotonic()
        launches = [launch("a"), launch("b"), launch("c")]
        assert pool.compile(launches, timeout=20.0) == 3
        assert time.monotonic() - start < 5.0 and built == launches and len(pool.built_here) == 3
    finally:
        pool.close()


def test_a_caller_builds_what_no_ready_worker_has_taken():
    """With its one worker busy, a caller builds the launches it waits for that are still queued; the worker builds
    the one it took: three half-second builds in about two lengths, not three."""
    import time

    pool = stand_in_pool(1)
    try:
        assert pool.compile([launch("warm")]) == 1                        # the worker is ready and idle
        pool.build = lambda record: time.sleep(0.3) or True
        start = time.monotonic()
        assert pool.compile([launch("ok", 0.5), launch("ok", 0.51), launch("ok", 0.52)], timeout=20.0) == 3
        assert len(pool.built_here) == 2 and time.monotonic() - start < 1.2
    finally:
        pool.close()


def test_the_row_unit_of_a_launch_needs_a_tensor_contiguous_along_its_rows():
    from opfuse.codegen.base import row_unit_of

    assert row_unit_of([56 * 56], [64 * 56, 64, 64 * 56 * 56]) == 1     # channels-last: nothing runs along rows
    assert row_unit_of([56 * 56], [56, 1]) == 16 and row_unit_of([0], [1]) == 16
    assert row_unit_of([14 * 14], [14, 1]) == 1 and row_unit_of([7 * 7], [7, 1]) == 1


def test_a_row_count_is_no_compile_of_its_own(monkeypatch):
    """Launches of one template at row counts 16 does and does not divide (3136 and 196 pixels) are one compile
    where the kernel's decorator leaves the row count unspecialised on alignment (`rows_jit`); a channel count
    still splits them, and so does ROW_UNIT (a constexpr). The decorator and the launcher must agree."""
    from triton.runtime.jit import JITFunction

    from opfuse.codegen.base import Launcher
    from opfuse.runtime.launch_records import compile_key, loaded_module
    from tests.kernels.test_conv_kernels import Builder

    b = Builder()
    y = b.op("relu", b.conv(b.input("x", (1, 6, 4, 4)), 6, 3, padding=1))
    kernel = lower_conv_group(b.graph, b.group([y]), "cpu")
    with recording_launches() as launches:
        kernel.run([b.feeds[name] for name in kernel.runtime_inputs])
    (record,) = launches
    module = loaded_module(record)
    interpreted = getattr(module, record.function)
    jitted = JITFunction(interpreted.fn, do_not_specialize_on_alignment=["M"])   # as on a GPU
    monkeypatch.setattr(module, record.function, jitted)
    names = jitted.arg_names

    def varied(**values) -> LaunchRecord:
        args = tuple(values.get(name, arg) for name, arg in zip(names, record.args))
        kwargs = tuple((k, values.get(k, v)) for k, v in record.kwargs)
        return LaunchRecord(record.path, record.function, args, kwargs)

    assert compile_key(varied(M=3136)) == compile_key(varied(M=196)) == compile_key(varied(M=49))
    assert compile_key(varied(M=3136, COUT_G=48)) != compile_key(varied(M=3136, COUT_G=40))
    assert compile_key(varied(M=3136, ROW_UNIT=16)) != compile_key(varied(M=3136))
    assert compile_key(varied(M=1)) != compile_key(varied(M=196))            # 1 stays a constant
    with pytest.raises(ValueError, match="row counts"):
        Launcher(jitted, record.path, record.function, rows=())
