"""Bad inputs, failed compiles and unsafe files (issue 7): each case ends in a clear message or in eager's result,
never in a wrong answer, a changed model or a half-written cache.

Runs on the CPU through Triton's interpreter (tests/conftest.py), on tiny models. Sections: ONNX files, models
torch.export cannot capture, inputs unlike the compiled ones, NaN/Inf, empty batches, memory pre-flight, the
autotune cache (corrupt entries, failed compiles, two processes), the user's model left alone, fallback="eager",
and what model loading may execute.
"""

import functools
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper

import opfuse
from opfuse.compiler import EagerFallback, OpfuseModule
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import GraphError
from opfuse.numerics import relative_error
from opfuse.runtime.cache import TuningCache

F32 = opfuse.FusionConfig(dtype="float32")


def tiny_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(6, 4, 1), nn.ReLU6(), nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
    model[1].running_mean.normal_(0, 0.5)
    model[1].running_var.uniform_(0.5, 2.0)
    return model.eval()


def image(batch: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(seed))


# ---- ONNX files ------------------------------------------------------------------------------------------

def onnx_model(nodes, inputs, outputs, initializers=(), opset=17, value_info=(), domains=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers), value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    model = helper.make_model(graph, opset_imports=opsets)
    if opset < 7:
        model.ir_version = 3
    return model


def tensor_info(name, shape, dtype=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, dtype, shape)


def relu_model() -> onnx.ModelProto:
    return onnx_model([helper.make_node("Relu", ["x"], ["y"], name="relu")], [tensor_info("x", [1, 4])],
                      [tensor_info("y", [1, 4])])


def write(path: Path, model_or_bytes) -> Path:
    path.write_bytes(model_or_bytes if isinstance(model_or_bytes, bytes) else model_or_bytes.SerializeToString())
    return path


@pytest.mark.parametrize("case, words", [
    ("missing", "no such ONNX file"),
    ("directory", "not a file"),
    ("empty", "invalid ONNX model"),
    ("garbage", "not a readable ONNX model"),
    ("truncated", "not a readable ONNX model"),
    ("undefined input", "invalid ONNX model"),
    ("bad arity", "invalid ONNX model"),
])
def test_unreadable_or_malformed_onnx_file_is_an_error_naming_the_file(tmp_path, case, words):
    path = tmp_path / "model.onnx"
    good = relu_model().SerializeToString()
    if case == "directory":
        path.mkdir()
    elif case == "empty":
        write(path, b"")
    elif case == "garbage":
        write(path, bytes(range(256)) * 4)
    elif case == "truncated":
        write(path, good[: len(good) // 2])
    elif case == "undefined input":   # a node reads a value nothing defines
        write(path, onnx_model([helper.make_node("Add", ["x", "nowhere"], ["y"])], [tensor_info("x", [1, 4])],
                               [tensor_info("y", [1, 4])]))
    elif case == "bad arity":         # Relu with two inputs
        write(path, onnx_model([helper.make_node("Relu", ["x", "x"], ["y"])], [tensor_info("x", [1, 4])],
                               [tensor_info("y", [1, 4])]))
    with pytest.raises(GraphError) as error:
        opfuse.analyze(str(path))
    assert str(path) in str(error.value) and words in str(error.value)


def test_onnx_op_opfuse_does_not_know_becomes_a_named_opaque_node(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Bernoulli", ["r"], ["h"], name="the_draw"),
             helper.make_node("Frobnicate", ["h"], ["y"], domain="com.example", name="custom")]
    model = onnx_model(nodes, [tensor_info("x", [2, 5])], [tensor_info("y", [2, 5])],
                       value_info=[tensor_info("h", [2, 5])], domains=["com.example"])
    analysis = opfuse.analyze(str(write(tmp_path / "m.onnx", model)))
    opaque = analysis.opaque_ops
    assert any("onnx::Bernoulli" in o and "the_draw" in o for o in opaque), opaque
    assert any("onnx::com.example.Frobnicate" in o and "custom" in o for o in opaque), opaque
    assert any(n.op == "relu" for n in analysis.prepared)          # the known op is still mapped


def test_onnx_attribute_opfuse_does_not_understand_makes_the_node_opaque_and_names_it(tmp_path):
    """Add before opset 7 broadcasts B along `axis` (here per channel); reading it as numpy broadcasting would add
    along the last dim instead, silently wrong when C == W. opfuse refuses to map it and says which attribute."""
    bias = numpy_helper.from_array(np.arange(4, dtype=np.float32), "b")
    model = onnx_model([helper.make_node("Add", ["x", "b"], ["y"], broadcast=1, axis=1, name="old_add")],
                       [tensor_info("x", [1, 4, 4, 4]), tensor_info("b", [4])], [tensor_info("y", [1, 4, 4, 4])],
                       initializers=[bias], opset=6)
    graph = opfuse.analyze(str(write(tmp_path / "old.onnx", model))).prepared
    (node,) = [n for n in graph if n.op == "opaque"]
    assert node.attrs["target"] == "onnx::Add" and node.source == "old_add"
    assert re.search(r"attribute 'axis', 'broadcast' of Add is not understood", node.attrs["reason"])
    assert not any(n.op == "add" for n in graph)


def test_onnx_dropout_in_training_mode_is_not_read_as_identity(tmp_path):
    training = numpy_helper.from_array(np.array(True), "training")
    model = onnx_model([helper.make_node("Dropout", ["x", "", "training"], ["y"])],
                       [tensor_info("x", [2, 4])], [tensor_info("y", [2, 4])], initializers=[training])
    graph = opfuse.analyze(str(write(tmp_path / "d.onnx", model))).prepared
    (node,) = [n for n in graph if n.op == "opaque"]
    assert "training mode" in node.attrs["reason"]


def test_onnx_attributes_a_converter_handles_still_convert(tmp_path):
    model = onnx_model([helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], storage_order=0)],
                       [tensor_info("x", [1, 2, 4, 4])], [tensor_info("y", [1, 2, 3, 3])])
    graph = opfuse.analyze(str(write(tmp_path / "p.onnx", model))).prepared
    assert [n.op for n in graph if n.op not in ("input", "constant")] == ["max_pool2d"]


# ---- models torch.export cannot capture ------------------------------------------------------------------

class DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:       # control flow on a tensor's value: torch.export cannot trace it
            return x * 2
        return x - 1


def test_model_torch_export_cannot_capture_says_what_failed_and_suggests_the_fallback():
    with pytest.raises(GraphError) as error:
        opfuse.compile(DataDependent(), (torch.ones(3),))
    message = str(error.value)
    assert "torch.export could not capture model DataDependent" in message
    assert "data-dependent" in message.lower()                       # what failed
    assert f"{Path(__file__).name}:" in message and "in forward" in message   # where, in the user's code
    assert 'fallback="eager"' in message and 'backend="opfuse"' in message


# ---- inputs unlike the ones compiled for -----------------------------------------------------------------

@pytest.fixture(scope="module")
def compiled_cnn():
    model = tiny_cnn()
    return model, opfuse.compile(model, (image(),), F32)


@pytest.mark.parametrize("x, words", [
    (image(batch=3), r"input 0 \(input\) is float32\[3,3,6,6\] on cpu, but the model was compiled for "
                     r"float32\[2,3,6,6\] on cpu"),
    (image().double(), r"is float64\[2,3,6,6\] on cpu, but .* compiled for float32\[2,3,6,6\]"),
    (image().half(), r"is float16\[2,3,6,6\]"),
    (torch.empty(2, 3, 6, 6, device="meta"), r"on meta, but .* on cpu"),   # another device
    (torch.zeros(2, 3, 6, 6, dtype=torch.int64), r"is int64\[2,3,6,6\]"),
])
def test_inputs_of_another_shape_dtype_or_device_are_refused_naming_the_input(compiled_cnn, x, words):
    _, compiled = compiled_cnn
    with pytest.raises(GraphError, match=words) as error:
        compiled(x)
    assert "recompile=True" in str(error.value)


def test_wrong_number_or_kind_of_inputs(compiled_cnn):
    _, compiled = compiled_cnn
    with pytest.raises(GraphError, match="compiled for 1 inputs, got 2"):
        compiled(image(), image())
    with pytest.raises(GraphError, match=r"input 0 \(input\) must be a tensor, got list"):
        compiled([1.0, 2.0])


def test_recompile_when_configured_compiles_once_per_new_signature(monkeypatch):
    model = tiny_cnn()
    compiled = opfuse.compile(model, (image(),), opfuse.FusionConfig(dtype="float32", recompile=True))
    calls = []
    real = opfuse.compiler.compile
    monkeypatch.setattr(opfuse.compiler, "compile", lambda *a, **k: calls.append(1) or real(*a, **k))
    for seed in (1, 2):
        x = image(batch=3, seed=seed)
        with torch.no_grad():
            assert relative_error(compiled(x), model(x)) < 1e-5
    assert len(calls) == 1 and len(compiled._variants) == 1
    with pytest.raises(GraphError, match="compiling again for these inputs failed"):
        compiled(image().double())    # float64 inputs into float32 weights: eager cannot run it either


def test_recompile_that_fails_runs_eagerly_with_fallback_eager():
    """Batch 2 fits the memory limit, batch 40 does not: that call runs eagerly, and the reason is kept."""
    from opfuse.runtime.memory import estimate_memory

    model = tiny_cnn()
    need = estimate_memory(opfuse.analyze(model, (image(),), F32), (image(),)).total
    config = opfuse.FusionConfig(dtype="float32", recompile=True, fallback="eager", memory_limit=2 * need)
    compiled = opfuse.compile(model, (image(),), config)
    big = image(batch=40)
    with pytest.warns(UserWarning, match="compiling for these inputs failed"):
        out = compiled(big)
    with torch.no_grad():
        assert torch.equal(out, model(big))
    (reason,) = compiled.call_fallbacks.values()
    assert "refused before allocating" in reason and isinstance(next(iter(compiled._variants.values())), str)


def test_fallback_eager_runs_other_inputs_eagerly_and_records_why():
    model = tiny_cnn()
    compiled = opfuse.compile(model, (image(),), opfuse.FusionConfig(dtype="float32", fallback="eager"))
    x = image(batch=3, seed=4)
    with pytest.warns(UserWarning, match="running Sequential eagerly"):
        out = compiled(x)
    with torch.no_grad():
        assert torch.equal(out, model(x))
    (key, reason), = compiled.call_fallbacks.items()
    assert "float32[3,3,6,6]" in key and "compiled for float32[2,3,6,6]" in reason
    assert compiled.fallbacks[key].code is Code.EAGER_CALL and compiled.fallbacks[key].text == reason


# ---- NaN and Inf -----------------------------------------------------------------------------------------

class ImageOps(nn.Module):
    """conv+BN+relu, max pool, depthwise conv with relu6/hardsigmoid, residual maximum, 1x1 conv, global pool."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.pointwise = nn.Conv2d(6, 4, 1)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        pooled = F.max_pool2d(y, 2, stride=1)
        z = F.hardsigmoid(F.relu6(self.depthwise(y))) * y
        w = torch.clamp(torch.maximum(z, y * 0.5), -1.0, 3.0)
        return pooled, self.pointwise(w), F.adaptive_avg_pool2d(w, 1)


class SequenceOps(nn.Module):
    """linear+relu, layer norm, softmax, mean, sibling linears."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.left, self.right = nn.Linear(8, 5), nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.first(x))
        n = self.norm(h)
        return torch.softmax(self.left(n), -1), torch.sigmoid(self.right(n)), h.mean(-1), torch.softmax(x, -1)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")   # numpy in the interpreter: inf - inf
@pytest.mark.parametrize("model, shape", [(ImageOps, (2, 3, 6, 6)), (SequenceOps, (2, 5, 6))])
def test_nan_and_inf_inputs_give_nan_and_inf_where_eager_does(model, shape):
    torch.manual_seed(0)
    model = model().eval()
    compiled = opfuse.compile(model, (torch.randn(shape),), F32)
    x = torch.randn(shape).flatten()
    x[[1, 17, 40]] = float("nan")
    x[[5, 30]] = float("inf")
    x[[11, 52]] = float("-inf")
    x = x.reshape(shape)
    with torch.no_grad():
        outputs, expected = compiled(x), model(x)
    for index, (out, ref) in enumerate(zip(outputs, expected)):
        assert ref.isnan().any() or ref.isinf().any(), index     # the test reaches every output
        for mask in (torch.isnan, torch.isposinf, torch.isneginf):
            assert torch.equal(mask(out), mask(ref)), (index, mask.__name__)
        assert relative_error(out, ref) < 1e-5, index              # and the finite values agree


# ---- empty batch: refused at compile time, and at call time (run eagerly with fallback="eager") -----------------

def test_empty_batch_cannot_be_compiled_and_the_fallback_returns_eagers_empty_result():
    model = tiny_cnn()
    empty = torch.randn(0, 3, 6, 6)
    with pytest.raises(GraphError, match=r"example input 0 is empty \(shape \[0, 3, 6, 6\]\).*batch of at least 1"):
        opfuse.compile(model, (empty,), F32)
    fallback = opfuse.compile(model, (empty,), opfuse.FusionConfig(dtype="float32", fallback="eager"))
    assert isinstance(fallback, EagerFallback) and fallback.fallbacks["<whole model>"].code is Code.NOT_COMPILED
    assert "is empty" in fallback.reason
    assert fallback(empty).shape == (0, 5)


def test_empty_batch_at_call_time_is_refused_or_run_eagerly(compiled_cnn):
    model, compiled = compiled_cnn
    empty = torch.randn(0, 3, 6, 6)
    with pytest.raises(GraphError, match=r"input 0 \(input\) is empty \(float32\[0,3,6,6\] on cpu\)"):
        compiled(empty)
    tolerant = opfuse.compile(model, (image(),), opfuse.FusionConfig(dtype="float32", fallback="eager",
                                                                     recompile=True))
    with pytest.warns(UserWarning, match="does not run empty batches"):
        assert tolerant(empty).shape == (0, 5)
    assert not tolerant._variants      # an empty batch is never compiled, even with recompile=True


# ---- memory pre-flight ---------------------------------------------------------------------------------

def test_a_model_over_the_memory_limit_is_refused_before_anything_is_built(monkeypatch):
    from opfuse.runtime import compiled as runtime

    monkeypatch.setattr(runtime, "build_compiled_model", lambda *a, **k: pytest.fail("built despite the limit"))
    model = nn.Linear(64, 32)
    with pytest.raises(GraphError) as error:
        opfuse.compile(model, (torch.randn(8, 64),), opfuse.FusionConfig(dtype="float32", memory_limit=4096))
    message = str(error.value)
    assert re.search(r"needs about [\d.]+ KiB on cpu", message) and "only 4.0 KiB is available" in message
    assert "FusionConfig.memory_limit" in message and "verify=False" in message and "smaller batch" in message


def test_memory_estimate_counts_weights_inputs_peak_and_verification():
    from opfuse.runtime.memory import available_memory, estimate_memory

    model = nn.Linear(64, 32)
    x = torch.randn(8, 64)
    analysis = opfuse.analyze(model, (x,), F32)
    estimate = estimate_memory(analysis, (x,), verify=True)
    weights = (32 * 64 + 32) * 4
    assert estimate.weights == weights and estimate.inputs == 8 * 64 * 4
    assert estimate.intermediates == 8 * 32 * 4                     # the one output
    # float64 values (all live at the linear's check) and weights, and the end-to-end check's float64 weights
    assert estimate.verification == (8 * 64 + 8 * 32) * 8 + weights * 2 + weights * 2
    assert estimate_memory(analysis, (x,), verify=False).verification == 0
    limit, source = available_memory("cpu", F32)
    assert (limit is None) or (limit > 0 and "MemAvailable" in source)
    assert available_memory("cpu", opfuse.FusionConfig(memory_limit=123)) == (123, "FusionConfig.memory_limit")


def test_on_cuda_the_limit_is_the_free_device_memory(monkeypatch):
    from opfuse.runtime.memory import available_memory

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (5 * 2 ** 30, 80 * 2 ** 30))
    limit, source = available_memory("cuda:0", opfuse.FusionConfig())
    assert limit == 5 * 2 ** 30 and "torch.cuda.mem_get_info" in source


# ---- the autotune cache ---------------------------------------------------------------------------------

def tune_on_the_cpu(monkeypatch, benchmark=None):
    """Make compile autotune on the CPU (interpreter), timing with a fake clock, so the tuning cache is used."""
    from opfuse.runtime import autotune, compiled as runtime

    monkeypatch.setattr(runtime, "tunes", lambda config, device: bool(config.autotune))
    monkeypatch.setattr(runtime, "tune", functools.partial(autotune.tune, benchmark=benchmark or fake_clock))


def fake_clock(fn) -> float:
    return 1e-3


def cache_problems(directory: Path) -> list[str]:
    """Files in the cache directory (and its `compiled/` records) that are not complete, valid entries."""
    problems = []
    for path in directory.rglob("*"):
        if path.is_dir():
            continue
        if path.suffix != ".json":
            problems.append(f"stray file {path.name}")
        elif TuningCache(path.parent).load(path.stem) is None:
            problems.append(f"invalid entry {path.name}")
    return problems


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).eval()


X5 = torch.randn(1, 3, 5, 5, generator=torch.Generator().manual_seed(0))


def test_corrupt_or_truncated_cache_entries_are_ignored_and_rebuilt(tmp_path, monkeypatch):
    tune_on_the_cpu(monkeypatch)
    config = opfuse.FusionConfig(dtype="float32", cache_dir=str(tmp_path), tune_top=2)
    first = opfuse.compile(small_model(), (X5,), config)
    entries = sorted(tmp_path.glob("*.json"))
    assert len(entries) == len(first.compiled.kernels) >= 2 and not cache_problems(tmp_path)
    damage = [lambda t: t[: len(t) // 2], lambda t: "\x00\xff garbage", lambda t: "[1, 2, 3]",
              lambda t: t.replace('"BLOCK', '"NO_SUCH_PARAM'), lambda t: ""]
    for i, path in enumerate(entries):
        path.write_text(damage[i % len(damage)](path.read_text()))
    second = opfuse.compile(small_model(), (X5,), config)     # succeeds, re-tunes every kernel
    assert second.compiled.tuning.from_cache == set()
    assert not cache_problems(tmp_path)                        # and rewrote every entry
    third = opfuse.compile(small_model(), (X5,), config)
    assert third.compiled.tuning.from_cache == set(third.compiled.kernels)
    with torch.no_grad():
        assert relative_error(third(X5), small_model()(X5)) < 1e-5


def test_a_compile_failing_half_way_leaves_no_temp_or_partial_files(tmp_path, monkeypatch):
    calls = []

    def failing_clock(fn):
        calls.append(1)
        if len(calls) > 1:      # the first kernel is tuned and stored, the second one fails
            raise RuntimeError("the GPU fell off the bus")
        return 1e-3

    tune_on_the_cpu(monkeypatch, failing_clock)
    kernels = tmp_path / "kernels"
    monkeypatch.setenv("OPFUSE_KERNEL_DIR", str(kernels))
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="the GPU fell off the bus"):
        # one timing per kernel: the library form (a second timing) is not offered
        opfuse.compile(small_model(), (X5,), opfuse.FusionConfig(dtype="float32", cache_dir=str(cache), tune_top=2,
                                                                 library_anchors=False))
    assert len(list(cache.glob("*.json"))) == 1 and not cache_problems(cache)
    assert not [p.name for p in kernels.glob("*") if p.suffix != ".py"]   # generated sources: whole files only


def test_an_interrupted_cache_write_leaves_no_temp_file(tmp_path, monkeypatch):
    cache = TuningCache(tmp_path)

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        cache.store("k" * 64, {"config": {"BLOCK": 16}})
    assert list(tmp_path.iterdir()) == []


CONCURRENT_COMPILE = textwrap.dedent("""
    import functools, os, sys, time
    from pathlib import Path
    import torch, torch.nn as nn
    import opfuse
    from opfuse.runtime import autotune, compiled as runtime
    runtime.tunes = lambda config, device: bool(config.autotune)
    runtime.tune = functools.partial(autotune.tune, benchmark=lambda fn: 1e-3)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 1), nn.Sigmoid(),
                          nn.Flatten(), nn.Linear(4 * 5 * 5, 3)).eval()
    x = torch.randn(1, 3, 5, 5)
    go = Path(sys.argv[1])
    (go.parent / f"ready-{os.getpid()}").touch()
    while not go.exists():
        time.sleep(0.01)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", cache_dir=sys.argv[2], tune_top=2))
    with torch.no_grad():
        assert (compiled(x) - model(x)).abs().max() < 1e-4
    print(len(compiled.compiled.kernels), len(compiled.compiled.tuning.from_cache))
""")


@pytest.mark.slow
def test_two_processes_compiling_into_one_cache_directory_both_succeed(tmp_path):
    script = tmp_path / "compile_one.py"
    script.write_text(CONCURRENT_COMPILE)
    cache, go = tmp_path / "cache", tmp_path / "go"
    env = dict(os.environ, TRITON_INTERPRET="1", OPFUSE_KERNEL_DIR=str(tmp_path / "kernels"))
    processes = [subprocess.Popen([sys.executable, str(script), str(go), str(cache)], env=env, text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    deadline = time.time() + 120
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.time() < deadline:
        time.sleep(0.05)
    go.touch()   # both processes are past their imports: they compile at the same moment
    results = [p.communicate(timeout=300) for p in processes]
    for process, (out, err) in zip(processes, results):
        assert process.returncode == 0, err[-3000:]
    kernels = {int(out.split()[0]) for out, _ in results}
    assert len(kernels) == 1 and not cache_problems(cache)
    assert len(list(cache.glob("*.json"))) == kernels.pop()
    assert not [p.name for p in (tmp_path / "kernels").iterdir() if p.suffix != ".py"]


# ---- the user's model is never changed ------------------------------------------------------------------------

class TrainingModel(nn.Module):
    def __init__(self, fail: bool = False):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 2)
        self.fail = fail

    def forward(self, x):
        y = self.drop(torch.relu(self.bn(self.conv(x))))
        if self.fail and y.sum() > 0:    # torch.export cannot capture this
            y = y * 2
        return self.head(y.mean((2, 3)))


def snapshot(model: nn.Module) -> dict:
    return {"state": {k: v.clone() for k, v in model.state_dict().items()},
            "objects": {k: id(v) for k, v in model.named_parameters()},
            "requires_grad": {k: v.requires_grad for k, v in model.named_parameters()},
            "training": {name: m.training for name, m in model.named_modules()},
            "grads": {k: v.grad for k, v in model.named_parameters()}}


def assert_unchanged(model: nn.Module, before: dict) -> None:
    after = snapshot(model)
    assert after["state"].keys() == before["state"].keys()
    assert all(torch.equal(before["state"][k], v) for k, v in after["state"].items())
    for key in ("objects", "requires_grad", "training", "grads"):
        assert after[key] == before[key], key


def user_model(fail: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = TrainingModel(fail)
    model.train()
    model.head.eval()                       # mixed training flags must survive too
    model.conv.bias.requires_grad_(False)
    return model


@pytest.mark.parametrize("how", ["succeeds", "export fails", "memory refused", "kernel build fails"])
def test_compiling_never_changes_the_users_model(how, monkeypatch):
    model = user_model(fail=how == "export fails")
    before = snapshot(model)
    x = torch.randn(2, 3, 6, 6)
    config = opfuse.FusionConfig(dtype="float32", memory_limit=1024 if how == "memory refused" else None)
    if how == "kernel build fails":
        from opfuse.runtime import compiled as runtime

        def broken(*args, **kwargs):
            raise RuntimeError("codegen exploded")
        monkeypatch.setattr(runtime, "lower_plan", broken)
    if how == "succeeds":
        opfuse.compile(model, (x,), config)
    else:
        with pytest.raises((GraphError, RuntimeError)):
            opfuse.compile(model, (x,), config)
    assert_unchanged(model, before)
    fallback = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", fallback="eager",
                                                               memory_limit=config.memory_limit))
    fallback(x)          # running what compile returned does not touch the model either (BN statistics, dropout)
    assert_unchanged(model, before)


# ---- fallback="eager": a model that always runs, every fallback with its reason --------------------------------

@pytest.mark.parametrize("how, words", [
    ("export fails", "torch.export could not capture"),
    ("memory refused", "refused before allocating"),
    ("empty batch", "is empty"),
])
def test_fallback_eager_always_returns_a_model_that_runs_with_the_reason(how, words):
    model = user_model(fail=how == "export fails").eval()
    x = torch.randn(0 if how == "empty batch" else 2, 3, 6, 6)
    config = opfuse.FusionConfig(dtype="float32", fallback="eager",
                                 memory_limit=1024 if how == "memory refused" else None)
    result = opfuse.compile(model, (x,), config)
    assert isinstance(result, EagerFallback) and result.fallbacks["<whole model>"].code is Code.NOT_COMPILED
    assert words in result.reason                                   # the error that stopped the compile
    with torch.no_grad():
        assert torch.equal(result(x), model(x))


def test_fallback_eager_runs_a_call_the_compiled_model_fails_on(monkeypatch):
    model = tiny_cnn()
    compiled = opfuse.compile(model, (image(),), opfuse.FusionConfig(dtype="float32", fallback="eager"))
    assert isinstance(compiled, OpfuseModule)
    # every group that runs through PyTorch says why
    assert set(compiled.fallbacks) == {g.name for g in compiled.plan.groups} - set(compiled.compiled.kernels)
    assert all(isinstance(why.code, Code) and why.text for why in compiled.fallbacks.values())
    kernel = next(iter(compiled.compiled.kernels.values()))

    def crash(inputs, config=None):
        raise RuntimeError("illegal memory access")
    monkeypatch.setattr(kernel, "run", crash)
    with pytest.warns(UserWarning, match="illegal memory access"):
        out = compiled(image(seed=3))
    with torch.no_grad():
        assert torch.equal(out, model(image(seed=3)))
    assert any("illegal memory access" in reason for reason in compiled.call_fallbacks.values())


# ---- safety: loading runs no code from the files ------------------------------------------------------

def test_onnx_loading_never_unpickles_and_refuses_external_data_outside_its_directory(tmp_path, monkeypatch):
    import pickle

    def forbidden(*args, **kwargs):
        raise AssertionError("model loading must not unpickle anything")

    for module, name in ((pickle, "load"), (pickle, "loads"), (torch, "load"), (np, "load")):
        monkeypatch.setattr(module, name, forbidden)
    weight = numpy_helper.from_array(np.ones((4, 3), dtype=np.float32), "w")
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [2, 4])],
                       [tensor_info("y", [2, 3])], initializers=[weight])
    assert opfuse.analyze(str(write(tmp_path / "ok.onnx", model))).prepared is not None

    outside = TensorProto(name="b", data_type=TensorProto.FLOAT, dims=[4], data_location=TensorProto.EXTERNAL)
    entry = outside.external_data.add()
    entry.key, entry.value = "location", "../../../../etc/hostname"
    evil = onnx_model([helper.make_node("Add", ["x", "b"], ["y"])], [tensor_info("x", [2, 4])],
                      [tensor_info("y", [2, 4])], initializers=[outside])
    (tmp_path / "sub").mkdir()
    with pytest.raises(GraphError, match="points outside the directory"):
        opfuse.analyze(str(write(tmp_path / "sub" / "evil.onnx", evil)))


def test_no_code_in_opfuse_unpickles_or_evaluates_files():
    """Checkpoint loading, should it ever be added, must use torch.load(weights_only=True); nothing may eval,
    exec or unpickle what it reads."""
    root = Path(opfuse.__file__).parent
    offending = []
    for path in root.rglob("*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if (re.search(r"\btorch\.load\(", code) and "weights_only=True" not in code) or re.search(
                    r"\bpickle\.loads?\(|\bmarshal\.loads?\(|(?<![.\w])(eval|exec)\(|allow_pickle=True", code):
                offending.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    assert not offending, offending


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package on sys.path: models.target (a factory), models.sibling (marks itself imported), models.broken."""
    root = tmp_path / "pkg_issue7"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "target.py").write_text(textwrap.dedent("""
        import torch, torch.nn as nn
        def build(batch=1):
            return nn.Linear(4, 2), (torch.randn(batch, 4),)
        def explodes():
            raise ValueError("no weights here")
    """))
    (root / "sibling.py").write_text("raise RuntimeError('the sibling module was imported')\n")
    (root / "broken.py").write_text("def oops(:\n")
    (root / "raises.py").write_text("raise RuntimeError('import-time failure')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "pkg_issue7"
    for name in [m for m in sys.modules if m.startswith("pkg_issue7")]:
        del sys.modules[name]


def test_a_factory_spec_imports_only_the_module_it_names(package):
    from opfuse.bench.zoo import resolve_model

    model, (x,), name = resolve_model(f"{package}.target:build", batch=3)
    assert name == "build" and model(x).shape == (3, 2)
    assert f"{package}.target" in sys.modules and f"{package}.sibling" not in sys.modules


@pytest.mark.parametrize("spec, words", [
    ("{p}.missing:build", r"cannot import module '{p}.missing'"),
    ("{p}.broken:oops", r"importing module '{p}.broken' failed \(SyntaxError"),
    ("{p}.raises:f", r"importing module '{p}.raises' failed \(RuntimeError: import-time failure"),
    ("{p}.target:nothing", r"has no callable 'nothing'"),
    ("{p}.target:explodes", r"explodes\(\) raised ValueError: no weights here"),
    ("{p}.target:", r"give it as package.module:factory"),
    (":build", r"give it as package.module:factory"),
])
def test_a_factory_spec_that_cannot_be_used_is_a_clear_error(package, spec, words):
    from opfuse.bench.zoo import resolve_model

    with pytest.raises(GraphError, match=words.format(p=package)):
        resolve_model(spec.format(p=package))


def test_verification_inputs_stay_in_the_examples_integer_range():
    """Fresh verification inputs for indices keep to the example's values: a negative-offset or narrow
    index range is never overrun (an embedding table is no larger than what the example used)."""
    from opfuse.numerics import random_inputs_like

    indices = torch.tensor([[-3, 5, 2], [0, -1, 4]])
    flags = torch.tensor([True, False, True])
    fresh_indices, fresh_flags = random_inputs_like([indices, flags])
    assert fresh_indices.dtype == indices.dtype and fresh_indices.shape == indices.shape
    assert int(fresh_indices.min()) >= -3 and int(fresh_indices.max()) <= 5
    assert fresh_flags.dtype == torch.bool
    floats = random_inputs_like([torch.zeros(64)])[0]
    assert floats.abs().sum() > 0          # never zeros, whatever the example was


# ---- ONNX: what cannot be run is refused at import, naming it; nothing is left behind ----------------------

def external_weight_model(tmp_path: Path) -> Path:
    weight = numpy_helper.from_array(np.ones((4, 3), dtype=np.float32), "w")
    model = onnx_model([helper.make_node("MatMul", ["x", "w"], ["y"])], [tensor_info("x", [2, 4])],
                       [tensor_info("y", [2, 3])], initializers=[weight])
    path = tmp_path / "external.onnx"
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path


def test_a_missing_external_data_file_is_named_with_its_tensor(tmp_path):
    path = external_weight_model(tmp_path)
    assert opfuse.analyze(str(path)).prepared is not None           # with the file there, it loads
    (tmp_path / "weights.bin").unlink()
    for load in (lambda: opfuse.analyze(str(path)), lambda: opfuse.compile(str(path), (torch.ones(2, 4),))):
        with pytest.raises(GraphError, match=r"external\.onnx: tensor 'w' keeps its data in the external file "
                                             r"'weights\.bin', which is missing"):
            load()


def test_an_onnx_operator_opfuse_cannot_run_is_refused_at_import_naming_operator_node_and_opset(tmp_path):
    """analyze keeps it as an opaque node (it can be planned around); compile, the CLI's bench and the backend
    refuse it before anything is built, listing the supported operators."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Bernoulli", ["r"], ["y"], name="pick")]
    path = write(tmp_path / "bernoulli.onnx", onnx_model(nodes, [tensor_info("x", [2, 5])],
                                                         [tensor_info("y", [2, 5])], opset=15))
    assert any("onnx::Bernoulli" in o for o in opfuse.analyze(str(path)).opaque_ops)
    from opfuse.frontend.onnx_import import UnsupportedOnnxNode
    from opfuse.frontend.onnx_module import onnx_module

    cache = tmp_path / "cache"
    for load in (lambda: onnx_module(str(path)),
                 lambda: opfuse.compile(str(path), (torch.ones(2, 5),), opfuse.FusionConfig(cache_dir=str(cache),
                                                                                            fallback="eager"))):
        with pytest.raises(UnsupportedOnnxNode, match=r"bernoulli\.onnx: ONNX operator Bernoulli \(opset 15\) at "
                                                      r"node 'pick' is not supported by opfuse: no converter for "
                                                      r"Bernoulli; "
                                                      r"the supported operators are Abs, Acos, Acosh, Add, .*Conv"
                                                      ) as refused:
            load()
        assert (refused.value.op_type, refused.value.node, refused.value.opset) == ("Bernoulli", "pick", 15)
    assert not cache.exists() or not list(cache.iterdir())          # nothing cached for a refused model


@pytest.mark.parametrize("case", ["truncated", "missing external data", "unknown operator"])
def test_a_bad_onnx_file_leaves_nothing_in_the_cache(tmp_path, case):
    if case == "truncated":
        path = write(tmp_path / "m.onnx", relu_model().SerializeToString()[:20])
    elif case == "missing external data":
        path = external_weight_model(tmp_path)
        (tmp_path / "weights.bin").unlink()
    else:
        path = write(tmp_path / "m.onnx", onnx_model([helper.make_node("Bernoulli", ["x"], ["y"])],
                                                     [tensor_info("x", [1, 4])], [tensor_info("y", [1, 4])],
                                                     opset=15))
    cache, kernels = tmp_path / "cache", tmp_path / "kernels"
    with pytest.raises(GraphError, match=re.escape(str(path))):
        opfuse.compile(str(path), (torch.ones(1, 4),), opfuse.FusionConfig(cache_dir=str(cache)))
    assert not [p for d in (cache, kernels) if d.exists() for p in d.iterdir()]


def test_an_onnx_model_with_int64_inputs_and_several_outputs_compiles_and_names_a_wrong_input(tmp_path):
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4) - 20, "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["e"]), helper.make_node("Relu", ["e"], ["r"]),
             helper.make_node("Neg", ["e"], ["n"])]
    model = onnx_model(nodes, [tensor_info("ids", ["batch", 3], TensorProto.INT64)],
                       [tensor_info("r", ["batch", 3, 4]), tensor_info("n", ["batch", 3, 4])], initializers=[table])
    path = str(write(tmp_path / "two_outputs.onnx", model))
    ids = torch.tensor([[0, 9, 3], [4, 4, 1]])
    compiled = opfuse.compile(path, (ids,), F32)
    relu, neg = compiled(ids)
    expected = torch.from_numpy(numpy_helper.to_array(table).copy())[ids]
    assert torch.equal(relu, expected.relu()) and torch.equal(neg, -expected)
    for wrong, words in ((ids.int(), r"input 'ids' is int64\[2,3\] in the model, the example input is int32"),
                         (ids[:, :2], r"input 'ids' is int64\[2,3\] in the model, the example input is int64\[2, 2\]"),
                         (ids.float(), r"input 'ids' is int64\[2,3\] in the model, the example input is float32")):
        with pytest.raises(GraphError, match=r"two_outputs\.onnx: " + words):
            opfuse.compile(path, (wrong,), F32)
    with pytest.raises(GraphError, match=r"input 0 \(ids\) is int32\[2,3\]"):
        compiled(ids.int())


class FourierMagnitude(torch.nn.Module):
    """The magnitude of a 2-D FFT: complex values in between (the real part alone would be DFT products)."""

    def forward(self, x):
        return torch.fft.fftn(x, dim=(-1, -2)).abs() * 2


def test_a_complex_intermediate_is_an_error_naming_its_node():
    with pytest.raises(GraphError, match=r"^node fft_fftn \(aten.fft_fftn.default\) computes a complex64 tensor, "
                                         r"a dtype opfuse's IR has no values of"):
        opfuse.analyze(FourierMagnitude(), (torch.randn(2, 8, 16),))
