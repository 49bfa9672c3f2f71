"""Runtime on a real GPU: CUDA graph capture and replay, timing-based autotuning with real Triton compiles.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from opfuse.codegen import lower  # noqa: E402
from opfuse.codegen.base import GroupKernel, KernelConfig, compiled_info  # noqa: E402
from opfuse.codegen.expr import Unsupported  # noqa: E402
from opfuse.config import FusionConfig  # noqa: E402
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind  # noqa: E402
from opfuse.ir.graph import Graph, TensorType  # noqa: E402
from opfuse.ir.interpret import interpret  # noqa: E402
from opfuse.runtime.autotune import tune  # noqa: E402
from opfuse.runtime.cache import TuningCache  # noqa: E402
from opfuse.runtime.compiled import CompiledModel, build_compiled_model  # noqa: E402


@triton.jit
def relu_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(y_ptr + offsets, tl.maximum(x, 0.0).to(y_ptr.dtype.element_ty), mask=mask)


class TritonRelu(GroupKernel):
    """relu over a dense tensor, in its memory order (so channels-last stays channels-last)."""

    def __init__(self, graph, group):
        super().__init__(graph, group, "fused_relu_test", "relu_kernel")
        self.calls = 0

    def configs(self):
        return [KernelConfig.of(BLOCK=128, num_warps=4), KernelConfig.of(BLOCK=1024, num_warps=8),
                KernelConfig.of(BLOCK=256, num_warps=2)]

    def run(self, inputs, config=None):
        self.calls += 1
        (x,) = inputs
        config = config or self.configs()[0]
        y = torch.empty_like(x)
        n = x.numel()
        compiled = relu_kernel[(triton.cdiv(n, config["BLOCK"]),)](
            x, y, n, BLOCK=config["BLOCK"], num_warps=config.num_warps, num_stages=config.num_stages)
        self.last_compiled = compiled_info(compiled)
        return [y]


def conv_relu_sigmoid(batch=2):
    torch.manual_seed(0)
    g = Graph("conv_relu_sigmoid")
    t = TensorType((batch, 8, 10, 10), "float16")
    g.add_input("x", TensorType((batch, 3, 10, 10), "float16"))
    g.add_constant("w", torch.randn(8, 3, 3, 3, dtype=torch.float16))
    g.add_node("conv2d", ["x", "w"], t, {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1},
               name="conv")
    g.add_node("relu", ["conv"], t, name="relu")
    g.add_node("sigmoid", ["relu"], t, name="sig")
    g.outputs = ["sig"]
    groups = [FusionGroup(0, GroupKind.SINGLE, ["conv"], anchor="conv", inputs=["x", "w"], outputs=["conv"]),
              FusionGroup(1, GroupKind.SINGLE, ["relu"], inputs=["conv"], outputs=["relu"]),
              FusionGroup(2, GroupKind.SINGLE, ["sig"], inputs=["relu"], outputs=["sig"])]
    return FusionPlan(g, groups, [], "h200", FusionConfig(dtype="float16"))


def test_cuda_graph_captures_once_and_replays():
    plan = conv_relu_sigmoid()
    kernel = TritonRelu(plan.graph, plan.groups[1])
    model = CompiledModel(plan, {"g1": kernel}, "cuda")
    assert model.use_cuda_graph
    inputs = [torch.randn(2, 3, 10, 10, device="cuda", dtype=torch.float16) for _ in range(4)]
    outputs = [model(x) for x in inputs]
    assert model.cuda_graph_error is None and model._cuda_graph is not None
    assert kernel.calls == 3        # warm-up call, then the eager run and the capture of call 2; then replays
    for x, out in zip(inputs, outputs):   # every output is the caller's own (replays do not overwrite them)
        torch.testing.assert_close(out, interpret(plan.graph, [x])[0], rtol=1e-2, atol=1e-2)
    model.set_cuda_graph(False)
    torch.testing.assert_close(model(inputs[0]), outputs[0], rtol=1e-2, atol=1e-2)
    assert kernel.calls == 4


def test_failed_capture_falls_back_to_eager():
    plan = conv_relu_sigmoid()
    g = plan.graph
    sig = g.nodes.pop("sig")
    def host_sync(xs):   # .item() waits for the GPU: not allowed while a CUDA graph is being captured
        return xs[0] * float(xs[0].max().item() > -1)

    g.add_node("opaque", ["relu"], sig.type, {"target": "host_sync", "fn": host_sync}, name="sig")
    model = CompiledModel(plan, {"g1": TritonRelu(g, plan.groups[1])}, "cuda")
    x = torch.randn(2, 3, 10, 10, device="cuda", dtype=torch.float16)
    expected = interpret(g, [x])[0]
    model.measure_forward([x])            # as a compile ends: its capture fails quietly, and measures nothing
    assert model.forward_ms is None and model.cuda_graph_error is None
    model(x)
    with pytest.warns(UserWarning, match="capture failed"):
        second = model(x)
    assert model.cuda_graph_error is not None
    torch.testing.assert_close(second, expected)
    torch.testing.assert_close(model(x), expected)
    torch.manual_seed(3)                  # the failed capture left the CUDA RNG usable and deterministic
    a = torch.randn(5, device="cuda")
    torch.manual_seed(3)
    assert torch.equal(a, torch.randn(5, device="cuda"))
    fresh = CompiledModel(conv_relu_sigmoid(), {}, "cuda")          # and later captures still work
    y = torch.randn(2, 3, 10, 10, device="cuda", dtype=torch.float16)
    for _ in range(3):
        torch.testing.assert_close(fresh(y), interpret(fresh.graph, [y])[0], rtol=1e-2, atol=1e-2)
    assert fresh._cuda_graph is not None


def test_tune_times_real_kernels_and_caches(tmp_path):
    plan = conv_relu_sigmoid(batch=64)
    kernel = TritonRelu(plan.graph, plan.groups[1])
    values = {"conv": torch.randn(64, 8, 10, 10, device="cuda", dtype=torch.float16)}
    cache = TuningCache(tmp_path)
    result = tune([kernel], values, FusionConfig(), cache, quiet=True)
    assert result["g1"] in kernel.configs() and result.over_budget == {} and result.rejected["g1"] == {}
    assert set(result.timings["g1"]) == set(kernel.configs()) and all(t > 0 for t in result.timings["g1"].values())
    assert kernel.last_compiled.registers is not None and kernel.last_compiled.spills == 0
    calls = kernel.calls
    again = tune([kernel], values, FusionConfig(), cache, quiet=True)
    assert again == result and again.from_cache == {"g1"} and kernel.calls == calls


def test_build_compiled_model_end_to_end(tmp_path, monkeypatch):
    plan = conv_relu_sigmoid()

    def relu_only(graph, group, device, **_):
        if group.nodes != ["relu"]:
            raise Unsupported("only relu in this test")
        return TritonRelu(graph, group)

    def unsupported(graph, group, device, **_):
        raise Unsupported("not in this test")

    for name, template in lower.TEMPLATES.items():
        monkeypatch.setitem(lower.TEMPLATES, name, template._replace(
            lower=relu_only if name == "pointwise" else unsupported))
    x = torch.randn(2, 3, 10, 10, device="cuda", dtype=torch.float16)
    config = FusionConfig(dtype="float16", cache_dir=str(tmp_path))
    model = build_compiled_model(plan, "cuda", [x], config=config, quiet=True)
    assert list(model.kernels) == ["g1"] and model.tuning is not None and "g1" in model.tuning
    for _ in range(3):
        torch.testing.assert_close(model(x), interpret(plan.graph, [x])[0], rtol=1e-2, atol=1e-2)
    assert any(tmp_path.iterdir())


def test_real_lowered_kernels_tuned_and_graphed(tmp_path):
    """The other helpers' templates through the whole runtime stage: lower, tune, CUDA graph."""
    planner = pytest.importorskip("opfuse.fusion.planner")
    torch.manual_seed(0)
    g = Graph("small_net")
    f = "float16"
    g.add_input("x", TensorType((8, 16, 14, 14), f))
    g.add_constant("w", (torch.randn(32, 16, 3, 3) * 0.1).half())
    g.add_constant("b", torch.randn(32).half())
    g.add_constant("lw", (torch.randn(40, 32 * 7 * 7) * 0.02).half())
    g.add_node("conv2d", ["x", "w", "b"], TensorType((8, 32, 7, 7), f),
               {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 1}, name="conv")
    g.add_node("relu", ["conv"], TensorType((8, 32, 7, 7), f), name="relu")
    g.add_node("reshape", ["relu"], TensorType((8, 32 * 49), f), {"shape": (8, 32 * 49)}, name="flat")
    g.add_node("linear", ["flat", "lw"], TensorType((8, 40), f), name="lin")
    g.add_node("softmax", ["lin"], TensorType((8, 40), f), {"dim": -1}, name="soft")
    g.outputs = ["soft", "relu"]
    config = FusionConfig(dtype=f, use_cost_model=False, cache_dir=str(tmp_path))
    plan = planner.plan_fusion(g, config)
    x = torch.randn(8, 16, 14, 14, device="cuda", dtype=torch.float16)
    model = build_compiled_model(plan, "cuda", [x], config=config, quiet=True)
    print("kernels", list(model.kernels), "fallbacks", model.fallbacks, "tuning", dict(model.tuning or {}),
          "over budget", getattr(model.tuning, "over_budget", None))
    assert model.kernels and model.tuning is not None and set(model.tuning) == set(model.kernels)
    for _ in range(3):
        x = torch.randn(8, 16, 14, 14, device="cuda", dtype=torch.float16)
        expected = interpret(g, [x])
        for got, want in zip(model(x), expected):
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 1e-2
    assert model._cuda_graph is not None and model.cuda_graph_error is None


def test_measure_forward_counts_and_times_a_replay_it_then_drops():
    """What a compile ends with: one capture of the forward (cuDNN's conv, the Triton relu, PyTorch's sigmoid), its
    kernels counted and a replay of it timed, then dropped; the model's own graph is still captured at its second
    call, and counts what the profiler sees it launch."""
    plan = conv_relu_sigmoid()
    model = CompiledModel(plan, {"g1": TritonRelu(plan.graph, plan.groups[1])}, "cuda")
    x = torch.randn(2, 3, 10, 10, device="cuda", dtype=torch.float16)
    model(x)                               # compiles the kernels (a compile has run them in verification)
    model.measure_forward([x])
    measured = model.launches
    assert model.forward_ms is not None and model.forward_ms > 0 and model._cuda_graph is None
    from opfuse.bench.harness import kernel_profile
    model(x)                               # the capture
    assert model._cuda_graph is not None and model.launches == measured
    kernels, _ = kernel_profile(model._cuda_graph.replay, ())
    assert kernels == measured
    torch.testing.assert_close(model(x), interpret(plan.graph, [x])[0], rtol=1e-2, atol=1e-2)
