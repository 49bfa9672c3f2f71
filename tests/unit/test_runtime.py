"""Runtime: CompiledModel over hand-built plans, lowering dispatch, and the autotuner's resource checks (no GPU)."""

import weakref

import pytest
import torch
import torch.nn.functional as F

from opfuse.codegen import lower
from opfuse.codegen.base import CompiledInfo, GroupKernel, KernelConfig
from opfuse.codegen.expr import Unsupported
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import KIB, get_hardware
from opfuse.ir.graph import Graph, GraphError, TensorType
from opfuse.ir.interpret import interpret
from opfuse.runtime import compiled as compiled_module
from opfuse.runtime.autotune import (EVERY_CONFIG_SPILLS, every_choice_cached, kernel_inputs, resource_violation,
                                     screen_configs, tune)
from opfuse.runtime.cache import TuningCache
from opfuse.runtime.compiled import CompiledModel, build_compiled_model

H200 = get_hardware("h200")


# ---- a hand-built graph and plan ---------------------------------------------------------------------------
# x[B,3,6,6] -> conv2d(w, b) -> relu -> reshape[B,144] -> linear(lw) -> add(y) -> sigmoid ; outputs: sigmoid, relu

def build_graph(batch: int = 2, dtype: str = "float32") -> Graph:
    torch.manual_seed(0)
    g = Graph("tiny")
    g.add_input("x", TensorType((batch, 3, 6, 6), dtype))
    g.add_input("y", TensorType((batch, 5), dtype))
    g.add_constant("w", torch.randn(4, 3, 3, 3))
    g.add_constant("b", torch.randn(4))
    g.add_constant("lw", torch.randn(5, 144))
    g.add_node("conv2d", ["x", "w", "b"], TensorType((batch, 4, 6, 6), dtype),
               {"stride": (1, 1), "padding": (1, 1), "dilation": (1, 1), "groups": 1}, name="conv")
    g.add_node("relu", ["conv"], TensorType((batch, 4, 6, 6), dtype), name="relu")
    g.add_node("reshape", ["relu"], TensorType((batch, 144), dtype), {"shape": (batch, 144)}, name="flat")
    g.add_node("linear", ["flat", "lw"], TensorType((batch, 5), dtype), name="lin")
    g.add_node("add", ["lin", "y"], TensorType((batch, 5), dtype), name="out")
    g.add_node("sigmoid", ["out"], TensorType((batch, 5), dtype), name="sig")
    g.outputs = ["sig", "relu"]
    return g


def build_plan(graph: Graph) -> FusionPlan:
    groups = [
        FusionGroup(0, GroupKind.ANCHOR_EPILOGUE, ["conv", "relu"], anchor="conv", inputs=["x", "w", "b"],
                    outputs=["relu"]),
        FusionGroup(1, GroupKind.VIEW, ["flat"], inputs=["relu"], outputs=["flat"], launches=0),
        FusionGroup(2, GroupKind.ANCHOR_EPILOGUE, ["lin", "out", "sig"], anchor="lin", inputs=["flat", "lw", "y"],
                    outputs=["sig"]),
    ]
    return FusionPlan(graph, groups, [], "h200", FusionConfig(dtype="float32"))


def example_inputs(batch: int = 2):
    return torch.randn(batch, 3, 6, 6), torch.randn(batch, 5)


class FakeKernel(GroupKernel):
    """A GroupKernel whose 'kernel' is PyTorch: the group's nodes run through interpret on a sub-graph."""

    def __init__(self, graph, group, n_configs=3, infos=None):
        super().__init__(graph, group, f"fake_{group.name}", source=f"# fake source of {group.name}")
        self.calls = []
        self.infos = infos or {}
        self._configs = [KernelConfig.of(BLOCK=16 * (i + 1)) for i in range(n_configs)]

    def configs(self):
        return self._configs

    def run(self, inputs, config=None):
        self.calls.append(([x for x in inputs], config))
        self.last_compiled = self.infos.get(config)
        values = dict(zip(self.runtime_inputs, inputs))
        values.update({i: self.graph.constants[i] for i in self.group.inputs if self.graph.is_constant(i)})
        from opfuse.ir.ops import get_op
        for name in self.group.nodes:
            node = self.graph[name]
            values[name] = get_op(node.op).run([values[i] for i in node.inputs], node.attrs)
        return [values[o] for o in self.group.outputs]


def assert_same(outputs, expected):
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---- CompiledModel -----------------------------------------------------------------------------------------

def test_all_groups_through_pytorch_match_interpret():
    graph = build_graph()
    given = Reason(Code.UNSUPPORTED, "unsupported by the gemm template: x")
    model = CompiledModel(build_plan(graph), {}, "cpu", fallbacks={"g2": given})
    assert model.launches == 5    # conv, relu, linear, add, sigmoid; the graph says the reshape is a view
    x, y = example_inputs()
    assert_same(model(x, y), interpret(graph, [x, y]))
    assert set(model.fallbacks) == {"g0", "g1", "g2"}
    assert model.fallbacks["g2"] is given
    assert model.fallbacks["g1"].code is Code.VIEW and model.fallbacks["g0"].code is Code.NO_KERNEL   # defaults
    assert model.fallbacks["g0"].text       # never empty
    # as it ran: the input went channels-last, so flattening the relu's output in NCHW order copied
    assert model.launches == 6


def test_kernel_gets_runtime_inputs_in_group_order_and_outputs_are_mapped():
    graph = build_graph()
    plan = build_plan(graph)
    conv_kernel, linear_kernel = FakeKernel(graph, plan.groups[0]), FakeKernel(graph, plan.groups[2])
    model = CompiledModel(plan, {"g0": conv_kernel, "g2": linear_kernel}, "cpu")
    x, y = example_inputs()
    assert_same(model(x, y), interpret(graph, [x, y]))
    assert model.fallbacks == {"g1": model.fallbacks["g1"]}
    assert model.fallbacks["g1"].code is Code.VIEW
    (conv_args, conv_config), = conv_kernel.calls
    assert len(conv_args) == 1 and torch.equal(conv_args[0], x)      # constants w, b are not passed
    assert conv_config == conv_kernel.configs()[0]
    (lin_args, _), = linear_kernel.calls
    flat = F.relu(F.conv2d(x, graph.constants["w"], graph.constants["b"], padding=1)).reshape(2, 144)
    assert len(lin_args) == 2                                        # [flat, y]: group.inputs minus lw
    torch.testing.assert_close(lin_args[0], flat)
    assert torch.equal(lin_args[1], y)
    assert model.launches == 3     # the two kernels, and the flatten's copy of the channels-last activation


def test_chosen_config_is_passed_to_the_kernel():
    graph = build_graph()
    plan = build_plan(graph)
    kernel = FakeKernel(graph, plan.groups[0])
    model = CompiledModel(plan, {"g0": kernel}, "cpu", configs={"g0": kernel.configs()[2]})
    model(*example_inputs())
    model.set_configs({"g0": kernel.configs()[1]})
    model(*example_inputs())
    assert [c for _, c in kernel.calls] == [kernel.configs()[2], kernel.configs()[1]]
    with pytest.raises(GraphError, match="g1"):
        model.set_configs({"g1": kernel.configs()[0]})


class RefusingKernel(FakeKernel):
    """A FakeKernel whose configs in `refused` the GPU refuses at launch (out of shared memory)."""

    def __init__(self, graph, group, refused):
        super().__init__(graph, group)
        self.refused = [self._configs[i] for i in refused]

    def run(self, inputs, config=None):
        from triton.runtime.errors import OutOfResources
        if config in self.refused:
            self.calls.append((list(inputs), config))
            raise OutOfResources(262144, 232448, "shared memory")
        return super().run(inputs, config)


def test_a_config_refused_at_launch_gives_way_to_the_next_that_runs():
    graph = build_graph()
    plan = build_plan(graph)
    kernel = RefusingKernel(graph, plan.groups[0], refused=[0, 1])
    model = CompiledModel(plan, {"g0": kernel}, "cpu")
    x, y = example_inputs()
    assert_same(model(x, y), interpret(graph, [x, y]))
    assert model.configs["g0"] == kernel.configs()[2]       # kept: the next call runs it directly
    model(x, y)
    assert [c for _, c in kernel.calls] == kernel.configs() + [kernel.configs()[2]]


def test_a_kernel_no_config_of_which_fits_is_an_error_naming_it():
    graph = build_graph()
    plan = build_plan(graph)
    model = CompiledModel(plan, {"g0": RefusingKernel(graph, plan.groups[0], refused=[0, 1, 2])}, "cpu")
    with pytest.raises(GraphError, match="fake_g0 of group g0: no config fits the GPU.*shared memory"):
        model(*example_inputs())


def test_four_d_float_inputs_become_channels_last_once():
    graph = build_graph()
    plan = build_plan(graph)
    kernel = FakeKernel(graph, plan.groups[0])
    model = CompiledModel(plan, {"g0": kernel}, "cpu")
    x, y = example_inputs()
    assert not x.is_contiguous(memory_format=torch.channels_last)
    model(x, y)
    (args, _), = kernel.calls
    assert args[0].is_contiguous(memory_format=torch.channels_last)
    assert x.is_contiguous()                                          # the caller's tensor is untouched


@pytest.mark.parametrize("change, named", [
    (lambda x, y: (torch.randn(3, 3, 6, 6), y), "x"),
    (lambda x, y: (x, y.double()), "y"),
    (lambda x, y: (x, torch.empty(2, 5, device="meta")), "y"),
])
def test_other_signature_is_a_clear_error(change, named):
    graph = build_graph()
    model = CompiledModel(build_plan(graph), {}, "cpu")
    with pytest.raises(GraphError) as error:
        model(*change(*example_inputs()))
    message = str(error.value)
    assert f"input {named}:" in message
    assert "float32[2,3,6,6] on cpu" in message and "compiled for" in message and "called with" in message


def test_wrong_number_of_inputs():
    model = CompiledModel(build_plan(build_graph()), {}, "cpu")
    with pytest.raises(GraphError, match="takes 2 inputs"):
        model(torch.randn(2, 3, 6, 6))


def test_recompile_once_per_new_signature():
    graph = build_graph()
    built = []

    def recompile(inputs):
        batch = inputs[0].shape[0]
        built.append(batch)
        return CompiledModel(build_plan(build_graph(batch)), {}, "cpu")

    model = CompiledModel(build_plan(graph), {}, "cpu", recompile=recompile)
    for batch in (2, 3, 3, 4, 3, 4, 2):
        x, y = example_inputs(batch)
        assert_same(model(x, y), interpret(build_graph(batch), [x, y]))
    assert built == [3, 4]


def test_intermediates_are_freed_after_their_last_use():
    g = Graph("chain")
    g.add_input("x", TensorType((8, 8), "float32"))
    g.add_node("relu", ["x"], TensorType((8, 8), "float32"), name="a")
    g.add_node("sigmoid", ["a"], TensorType((8, 8), "float32"), name="b")
    g.add_node("neg", ["b"], TensorType((8, 8), "float32"), name="c")
    g.outputs = ["c"]
    groups = [FusionGroup(i, GroupKind.SINGLE, [n], inputs=[i_], outputs=[n])
              for i, (n, i_) in enumerate([("a", "x"), ("b", "a"), ("c", "b")])]
    plan = FusionPlan(g, groups, [], "h200")
    seen = {}

    class First(FakeKernel):
        def run(self, inputs, config=None):
            out = super().run(inputs, config)
            seen["a"] = weakref.ref(out[0])
            return out

    class Last(FakeKernel):
        def run(self, inputs, config=None):
            seen["a alive at c"] = seen["a"]() is not None
            return super().run(inputs, config)

    model = CompiledModel(plan, {"g0": First(g, groups[0]), "g2": Last(g, groups[2])}, "cpu")
    x = torch.randn(8, 8)
    torch.testing.assert_close(model(x), -torch.sigmoid(torch.relu(x)))
    assert seen["a alive at c"] is False


def test_constants_are_private_copies_and_not_parameters():
    graph = build_graph()
    model = CompiledModel(build_plan(graph), {}, "cpu")
    assert list(model.parameters()) == [] and list(model.buffers()) == [] and model.state_dict() == {}
    assert set(model._constants) == {"w", "b", "lw"}
    assert model._constants["w"].data_ptr() != graph.constants["w"].data_ptr()
    w_before = graph.constants["w"].clone()
    model.double()
    assert graph.constants["w"].dtype == torch.float32 and torch.equal(graph.constants["w"], w_before)


def test_a_conv_run_through_pytorch_reads_its_weight_channels_last():
    """cuDNN transposes a weight whose layout is not the activations' on every call: a conv a group runs through
    PyTorch (no kernel, or the unfused form) holds its weight channels-last, like its input; other constants keep
    their layout (densenet121 from ONNX, whose weights come contiguous: 58 kernels more, run 37)."""
    from opfuse.codegen.forms import EpilogueKernel

    graph = build_graph()
    graph.add_constant("k", torch.randn(1, 4, 6, 6))
    graph.add_node("mul", ["relu", "k"], TensorType((2, 4, 6, 6), "float32"), name="scaled")
    graph.outputs = ["sig", "relu", "scaled"]
    plan = build_plan(graph)
    plan.groups.append(FusionGroup(3, GroupKind.POINTWISE, ["scaled"], inputs=["relu", "k"], outputs=["scaled"]))
    model = CompiledModel(plan, {}, "cpu")
    assert model._constants["w"].is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(model._constants["w"], graph.constants["w"])
    assert model._constants["k"].is_contiguous() and model._constants["lw"].is_contiguous()
    x, y = example_inputs()
    assert_same(model(x, y), interpret(graph, [x, y]))
    kernel = lower.lower_group(graph, plan.groups[0], "cpu")
    assert isinstance(kernel, EpilogueKernel)
    kernel.run_unfused([x.contiguous(memory_format=torch.channels_last)])
    assert kernel._unfused_constants["w"].is_contiguous(memory_format=torch.channels_last)
    # the unfused form reads the graph's own constants where they are on the device: no second copy while tuning
    assert kernel._unfused_constants["b"].data_ptr() == graph.constants["b"].data_ptr()


def test_plan_in_wrong_order_names_the_group():
    graph = build_graph()
    plan = build_plan(graph)
    plan.groups = [plan.groups[1], plan.groups[0], plan.groups[2]]
    with pytest.raises(GraphError, match="group g1 reads 'relu'"):
        CompiledModel(plan, {}, "cpu")


def test_kernel_returning_the_wrong_number_of_outputs():
    graph = build_graph()
    plan = build_plan(graph)

    class Broken(FakeKernel):
        def run(self, inputs, config=None):
            return super().run(inputs, config) * 2

    model = CompiledModel(plan, {"g0": Broken(graph, plan.groups[0])}, "cpu")
    with pytest.raises(GraphError, match="fake_g0 of group g0 returned 2 outputs"):
        model(*example_inputs())


def test_unflatten_and_cuda_graph_off_on_cpu():
    graph = build_graph()
    model = CompiledModel(build_plan(graph), {}, "cpu", unflatten=lambda outs: {"prob": outs[0], "feat": outs[1]})
    assert model.use_cuda_graph is False          # config.cuda_graph is True, but this is the CPU
    x, y = example_inputs()
    result = model(x, y)
    expected = interpret(graph, [x, y])
    torch.testing.assert_close(result["prob"], expected[0])
    torch.testing.assert_close(result["feat"], expected[1])


def test_collect_values_keeps_every_value():
    graph = build_graph()
    model = CompiledModel(build_plan(graph), {}, "cpu")
    x, y = example_inputs()
    values = model.collect_values(x, y)
    assert {"x", "y", "conv", "relu", "flat", "lin", "out", "sig"} <= set(values)
    torch.testing.assert_close(values["sig"], interpret(graph, [x, y])[0])


# ---- lowering dispatch -------------------------------------------------------------------------------------

def dispatch_graph() -> Graph:
    g = build_graph()
    t = TensorType((2, 5), "float32")
    g.add_node("matmul", ["lin", "lw"], TensorType((2, 144), "float32"), name="mm")
    g.add_node("softmax", ["sig"], t, {"dim": -1}, name="soft")
    g.add_node("cat", ["sig", "lin"], TensorType((2, 10), "float32"), {"dim": 1}, name="joined")
    q = g.add_input("q", TensorType((1, 2, 4, 8), "float32"))
    g.add_node("sdpa", [q.name, q.name, q.name], TensorType((1, 2, 4, 8), "float32"), name="attn")
    g.add_node("opaque", ["sig"], t, {"target": "custom"}, name="custom")
    return g


@pytest.mark.parametrize("kind, nodes, anchor, expected", [
    (GroupKind.ANCHOR_EPILOGUE, ["conv", "relu"], "conv", "conv"),
    (GroupKind.SINGLE, ["conv"], None, "conv"),
    (GroupKind.ANCHOR_EPILOGUE, ["lin", "out"], "lin", "gemm"),
    (GroupKind.SINGLE, ["mm"], "mm", "gemm"),
    (GroupKind.POINTWISE, ["out", "sig"], None, "pointwise"),
    (GroupKind.SINGLE, ["sig"], None, "pointwise"),
    (GroupKind.HORIZONTAL_POINTWISE, ["relu", "sig"], None, "pointwise"),
    (GroupKind.REDUCTION, ["soft"], None, "reduction"),
    (GroupKind.SINGLE, ["soft"], None, "reduction"),
    (GroupKind.SINGLE, ["joined"], None, "pointwise"),     # a lone cat: an index map of the template
    (GroupKind.ANCHOR_EPILOGUE, ["attn"], "attn", "attention"),
    (GroupKind.SINGLE, ["attn"], None, "attention"),
])
def test_dispatch_picks_the_template(kind, nodes, anchor, expected):
    graph = dispatch_graph()
    assert lower.choose_lowering(graph, FusionGroup(0, kind, nodes, anchor=anchor)) == expected


@pytest.mark.parametrize("kind, nodes, anchor, code", [
    (GroupKind.VIEW, ["flat"], None, Code.VIEW),
    (GroupKind.OPAQUE, ["custom"], None, Code.OPAQUE),
    (GroupKind.SINGLE, ["custom"], None, Code.OPAQUE),
    (GroupKind.INJECTIVE, ["joined"], None, Code.COPYING_OP),
])
def test_dispatch_gives_a_reason_for_groups_without_a_kernel(kind, nodes, anchor, code, monkeypatch):
    def called(*args, **kwargs):
        pytest.fail("no template should be called")

    for name in lower.TEMPLATES:
        monkeypatch.setitem(lower.TEMPLATES, name, lower.Template(called, called))
    graph = dispatch_graph()
    group = FusionGroup(7, kind, nodes, anchor=anchor)
    reasons = {}
    assert lower.lower_group(graph, group, "cpu", reasons) is None
    assert reasons["g7"].code is code


def test_a_free_view_launches_nothing():     # (one that copies is a copy kernel: test_index_map_kernels)
    free = FusionGroup(8, GroupKind.VIEW, ["flat"], launches=0, reason="view (reshape): no kernel, no traffic")
    assert lower.choose_lowering(dispatch_graph(), free).code is Code.VIEW


def test_lower_group_records_unsupported_and_refuses_missing_dependencies(monkeypatch):
    graph = build_graph()
    group = build_plan(graph).groups[0]
    reasons = {}

    def unsupported(graph, group, device, hw=None):
        raise Unsupported("dilation 2 conv")

    takes = lower.TEMPLATES["conv"].supports
    monkeypatch.setitem(lower.TEMPLATES, "conv", lower.Template(takes, unsupported))
    assert lower.lower_group(graph, group, "cpu", reasons) is None
    assert reasons["g0"] == Reason(Code.UNSUPPORTED, "unsupported by the conv template: dilation 2 conv")  # its words

    def missing(graph, group, device, hw=None):
        raise ModuleNotFoundError("No module named 'cudnn'")

    monkeypatch.setitem(lower.TEMPLATES, "conv", lower.Template(takes, missing))   # its needs not installed: an error
    with pytest.raises(GraphError, match=r"group g0: the conv template needs what this install lacks "
                                         r"\(No module named 'cudnn'\)"):
        lower.lower_group(graph, group, "cpu", reasons)

    made = {}
    monkeypatch.setitem(lower.TEMPLATES, "conv", lower.Template(takes, lambda g, grp, dev, hw=None: made.setdefault(
        "kernel", FakeKernel(g, grp))))
    assert lower.lower_group(graph, group, "cpu") is made["kernel"]


def test_build_compiled_model_on_cpu(monkeypatch):
    graph = build_graph()
    plan = build_plan(graph)

    def refuse(g, group, device, hw=None):
        raise Unsupported("not this group")

    for name, template in lower.TEMPLATES.items():
        monkeypatch.setitem(lower.TEMPLATES, name, template._replace(
            lower=(lambda g, group, device, hw=None: FakeKernel(g, group)) if name == "conv" else refuse))
    model = build_compiled_model(plan, "cpu", example_inputs())
    assert list(model.kernels) == ["g0"] and set(model.fallbacks) == {"g1", "g2"}
    assert model.fallbacks["g2"].code is Code.UNSUPPORTED
    assert model.tuning is None          # nothing to time on the CPU
    x, y = example_inputs()
    assert_same(model(x, y), interpret(graph, [x, y]))


# ---- autotuning --------------------------------------------------------------------------------------------

CFG = [KernelConfig.of(BLOCK=16), KernelConfig.of(BLOCK=32, num_warps=8), KernelConfig.of(BLOCK=64)]


def test_resource_violation():
    assert resource_violation(None, H200, CFG[0]) is None
    assert resource_violation(CompiledInfo(), H200, CFG[0]) is None           # interpreter: nothing known
    assert resource_violation(CompiledInfo(96, 0, 48 * KIB), H200, CFG[0]) is None
    assert "spills" in resource_violation(CompiledInfo(255, 24, 0), H200, CFG[0])
    assert "shared memory" in resource_violation(CompiledInfo(64, 0, 300 * KIB), H200, CFG[0])
    assert resource_violation(CompiledInfo(64, 0, 160 * KIB), H200, CFG[0]) is None
    a100 = get_hardware("a100")                                                 # 163 KiB per block
    assert "shared memory" in resource_violation(CompiledInfo(64, 0, 170 * KIB), a100, CFG[0])
    assert "registers/thread" in resource_violation(CompiledInfo(300, 0, 0), H200, CFG[0])
    # 160 registers x 16 warps x 32 threads = 81920 > 65536 per SM: cannot launch even one block
    assert "per SM" in resource_violation(CompiledInfo(160, 0, 0), H200, KernelConfig.of(16, BLOCK=1))


def test_screen_configs_accepts_what_fits():
    screening = screen_configs({CFG[0]: CompiledInfo(64, 0, 1024), CFG[1]: CompiledInfo(255, 8, 1024),
                                CFG[2]: CompiledInfo(64, 0, 400 * KIB)}, H200)
    assert screening.accepted == [CFG[0]]
    assert set(screening.rejected) == {CFG[1], CFG[2]} and screening.over_budget is None


def test_screen_configs_every_config_spills():
    screening = screen_configs({CFG[0]: CompiledInfo(255, 40, 0), CFG[1]: CompiledInfo(255, 8, 0),
                                CFG[2]: CompiledInfo(255, 16, 0)}, H200)
    assert screening.accepted == [] and screening.over_budget == EVERY_CONFIG_SPILLS
    assert screening.fallback == CFG[1]                                          # the fewest spills


def test_screen_configs_every_config_rejected_for_mixed_reasons():
    screening = screen_configs({CFG[0]: CompiledInfo(255, 40, 0), CFG[1]: "out of resources: shared memory"}, H200)
    assert screening.over_budget.startswith("over budget: every config rejected")
    assert "out of resources" in screening.over_budget and screening.fallback == CFG[0]


def tuned_kernel(infos=None):
    graph = build_graph()
    kernel = FakeKernel(graph, build_plan(graph).groups[0], infos=infos)
    x, y = example_inputs()
    return kernel, {"x": x, "y": y}


def test_tune_without_gpu_takes_the_first_config_and_runs_nothing():
    kernel, values = tuned_kernel()
    result = tune([kernel], values, FusionConfig(), quiet=True)
    assert result == {"g0": kernel.configs()[0]} and kernel.calls == []


def test_tune_times_the_configs_that_fit_and_keeps_the_fastest(tmp_path):
    cfgs = [KernelConfig.of(BLOCK=16 * (i + 1)) for i in range(3)]
    kernel, values = tuned_kernel({cfgs[0]: CompiledInfo(64, 0, 1024), cfgs[1]: CompiledInfo(200, 12, 1024),
                                   cfgs[2]: CompiledInfo(64, 0, 2048)})
    clock = {cfgs[0]: 3e-5, cfgs[1]: 1e-5, cfgs[2]: 2e-5}      # the spilling config would be fastest
    timed = []

    def benchmark(fn):
        fn()
        config = kernel.calls[-1][1]
        timed.append(config)
        return clock[config]

    cache = TuningCache(tmp_path)
    result = tune({"g0": kernel}, values, FusionConfig(), cache, quiet=True, benchmark=benchmark)
    assert result["g0"] == cfgs[2] and timed == [cfgs[0], cfgs[2]]
    assert "spills" in result.rejected["g0"][cfgs[1]] and result.over_budget == {}
    assert result.timings["g0"] == {cfgs[0]: 3e-5, cfgs[2]: 2e-5}
    assert [args[0].shape for args, _ in kernel.calls][0] == (2, 3, 6, 6)   # runtime inputs from the values

    kernel.calls.clear()
    again = tune({"g0": kernel}, values, FusionConfig(), cache, quiet=True, benchmark=benchmark)
    assert again["g0"] == cfgs[2] and again.from_cache == {"g0"} and kernel.calls == []


def test_a_tuning_result_is_read_only(tmp_path):
    """What the tuner returns is a frozen record: the replanning and the report read it, nothing writes it after."""
    import dataclasses

    kernel, values = tuned_kernel({KernelConfig.of(BLOCK=16): CompiledInfo(64, 0, 1024)})
    result = tune({"g0": kernel}, values, FusionConfig(), quiet=True, benchmark=lambda fn: 1e-5)
    assert dict(result) == {"g0": KernelConfig.of(BLOCK=16)} and result.seconds == {"g0": 1e-5}
    with pytest.raises(TypeError):
        result.over_budget["g0"] = "spills"            # type: ignore[index]
    with pytest.raises(TypeError):
        result.timings["g0"][KernelConfig.of(BLOCK=32)] = 1.0     # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.seconds = {}                            # type: ignore[misc]


def test_every_choice_cached_reads_shapes_and_strides_not_values(tmp_path):
    kernel, values = tuned_kernel()
    cache, cpu = TuningCache(tmp_path), torch.device("cpu")

    def inputs(of):
        return {kernel.group.name: kernel_inputs(kernel, of)}

    assert not every_choice_cached([kernel], inputs(values), FusionConfig(), cache, cpu)        # nothing tuned yet
    tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=lambda fn: 1.0)
    zeros = {name: torch.zeros_like(v) for name, v in values.items()}
    assert every_choice_cached([kernel], inputs(zeros), FusionConfig(), cache, cpu)            # stand-ins will do
    assert not every_choice_cached([kernel], inputs(values), FusionConfig(), None, cpu)
    assert not every_choice_cached([kernel], inputs(values), FusionConfig(tune_top=1), cache, cpu)   # other candidates
    wider = {name: torch.zeros(*v.shape[:-1], v.shape[-1] + 1) for name, v in values.items()}
    assert not every_choice_cached([kernel], inputs(wider), FusionConfig(), cache, cpu)


def test_the_tuner_times_cold_the_kernels_that_mostly_read_weights_once_weights_outgrow_l2():
    """`cold_groups`: a linear reading 2 rows through a 64 KB weight is timed cold, one reading 512 rows through a
    256-byte weight is not; and none is where the weights together fit in L2. A cold timing is another cache key."""
    import opfuse
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.clock import cold_groups
    from opfuse.runtime.cache import tuning_key

    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wide, self.narrow = torch.nn.Linear(64, 256), torch.nn.Linear(8, 8)

        def forward(self, x, y):
            return self.wide(x), self.narrow(y)

    torch.manual_seed(0)
    plan = opfuse.analyze(TwoLinears(), (torch.randn(2, 64), torch.randn(512, 8))).plan
    kernels, _ = lower_plan(plan, "cpu")
    by_anchor = {plan.graph[k.group.anchor].inputs[0]: name for name, k in kernels.items() if k.group.anchor}
    assert cold_groups(list(kernels.values()), l2_bytes=1024) == {by_anchor["x"]}
    assert cold_groups(list(kernels.values()), l2_bytes=1 << 30) == set()
    x = torch.randn(2, 64)
    assert tuning_key("src", [x], "gpu", cold=True) != tuning_key("src", [x], "gpu")

@pytest.mark.parametrize("cached", [True, False])
def test_a_build_whose_every_choice_is_cached_tunes_on_stand_ins(cached, monkeypatch):
    graph = build_graph()
    for name, template in lower.TEMPLATES.items():
        monkeypatch.setitem(lower.TEMPLATES, name, template._replace(
            lower=lambda g, group, device, hw=None: FakeKernel(g, group)))
    monkeypatch.setattr(compiled_module, "tunes", lambda config, device: True)
    monkeypatch.setattr(compiled_module, "every_choice_cached", lambda *args: cached)
    ran = []
    monkeypatch.setattr(CompiledModel, "collect_values", lambda self, *inputs: ran.append("collect") or
                        self.stand_in_values(*inputs))
    model = build_compiled_model(build_plan(graph), "cpu", example_inputs(), config=FusionConfig())
    assert ran == ([] if cached else ["collect"])
    assert model.tuning == {name: kernel.configs()[0] for name, kernel in model.kernels.items()}


def test_tune_reports_a_group_whose_every_config_spills(tmp_path):
    cfgs = [KernelConfig.of(BLOCK=16 * (i + 1)) for i in range(3)]
    kernel, values = tuned_kernel({c: CompiledInfo(255, 10 + i, 0) for i, c in enumerate(cfgs)})
    cache = TuningCache(tmp_path)
    result = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert result.over_budget == {"g0": EVERY_CONFIG_SPILLS}
    assert result["g0"] == cfgs[0]                       # still runnable: the least bad config
    cached = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert cached.over_budget == {"g0": EVERY_CONFIG_SPILLS} and cached.from_cache == {"g0"}


def test_a_group_whose_own_configs_all_spill_is_reported_even_when_another_form_runs(tmp_path):
    """Every Triton config spills but another form (the unfused ops, say: no compiled info) was accepted: that form
    runs, and the group is still reported over budget so the compiler splits it into smaller fused kernels."""
    cfgs = [KernelConfig.of(BLOCK=16 * (i + 1)) for i in range(3)]
    other = KernelConfig.of(num_warps=1, num_stages=1, form="unfused")
    kernel, values = tuned_kernel({c: CompiledInfo(255, 10 + i, 0) for i, c in enumerate(cfgs)})
    kernel.alternatives = lambda library=True: [other] if library else []
    cache = TuningCache(tmp_path)
    result = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert result["g0"] == other and result.over_budget == {"g0": EVERY_CONFIG_SPILLS}
    cached = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert cached["g0"] == other and cached.over_budget == {"g0": EVERY_CONFIG_SPILLS}
    # one own config that fits: nothing to report
    kernel.infos[cfgs[1]] = CompiledInfo(64, 0, 1024)
    fits = tune([kernel], values, FusionConfig(), quiet=True, benchmark=lambda fn: 1.0)
    assert fits.over_budget == {}


def conv_conv_kernel():
    """A FakeKernel over a depthwise -> 1x1 conv group (two anchors), and its example values."""
    torch.manual_seed(0)
    g = Graph("dwpw")
    g.add_input("x", TensorType((2, 4, 6, 6), "float32"))
    g.add_constant("dw_w", torch.randn(4, 1, 3, 3))
    g.add_constant("pw_w", torch.randn(8, 4, 1, 1))
    conv = {"stride": (1, 1), "dilation": (1, 1)}
    g.add_node("conv2d", ["x", "dw_w"], TensorType((2, 4, 6, 6), "float32"), conv | {"padding": (1, 1), "groups": 4},
               name="dw")
    g.add_node("conv2d", ["dw", "pw_w"], TensorType((2, 8, 6, 6), "float32"), conv | {"padding": (0, 0), "groups": 1},
               name="pw")
    g.add_node("relu", ["pw"], TensorType((2, 8, 6, 6), "float32"), name="relu")
    g.outputs = ["relu"]
    group = FusionGroup(0, GroupKind.CONV_CONV, ["dw", "pw", "relu"], anchor="pw", inputs=["x", "dw_w", "pw_w"],
                        outputs=["relu"])
    return FakeKernel(g, group), {"x": torch.randn(2, 4, 6, 6)}


UNFUSED_FORM = KernelConfig.of(num_warps=1, num_stages=1, form="unfused")


@pytest.mark.parametrize("anchors", [2, 1])
def test_a_group_of_anchors_that_loses_to_its_ops_unfused_is_reported(tmp_path, anchors):
    """Unfused fastest: an anchor group (depthwise -> 1x1; a conv + relu) is reported with both times, from the
    cache too (the compiler decides what to split)."""
    kernel, values = conv_conv_kernel() if anchors == 2 else tuned_kernel()
    kernel.alternatives = lambda library=True: [UNFUSED_FORM] if library else []

    def benchmark(fn):
        fn()
        return 1e-5 if kernel.calls[-1][1] == UNFUSED_FORM else 2e-5 + kernel.calls[-1][1]["BLOCK"] * 1e-9

    cache = TuningCache(tmp_path)
    result = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=benchmark)
    assert result["g0"] == UNFUSED_FORM
    assert result.slower_fused == {"g0": "slower than its ops through PyTorch: 20.0 us fused (BLOCK=16 warps=4 "
                                         "stages=2) against 10.0 us"}
    cached = tune([kernel], values, FusionConfig(), cache, quiet=True, benchmark=benchmark)
    assert cached.from_cache == {"g0"} and cached.slower_fused == result.slower_fused
    assert result.seconds == cached.seconds == {"g0": 1e-5} and result.epilogue_apart == {}
    # a fused config faster than the ops: nothing to report
    faster = tune([kernel], values, FusionConfig(), quiet=True, benchmark=lambda fn: (fn(), 1e-5)[1])
    assert faster["g0"] != UNFUSED_FORM and faster.slower_fused == {}


def test_tune_goes_past_tune_top_while_every_config_so_far_spills(tmp_path):
    """tune_top 2 of 5 configs: the first two spill, so the next two are compiled; the fourth fits and is kept,
    the fifth is never compiled, and the cache restores the fourth."""
    graph = build_graph()
    kernel = FakeKernel(graph, build_plan(graph).groups[0], n_configs=5)
    cfgs = kernel.configs()
    kernel.infos = {c: CompiledInfo(255, 8, 0) for c in cfgs[:3]} | {c: CompiledInfo(64, 0, 0) for c in cfgs[3:]}
    x, y = example_inputs()
    cache = TuningCache(tmp_path)
    result = tune([kernel], {"x": x, "y": y}, FusionConfig(tune_top=2), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert result["g0"] == cfgs[3] and result.over_budget == {}
    assert cfgs[4] not in {config for _, config in kernel.calls}
    assert set(result.rejected["g0"]) == set(cfgs[:3])
    kernel.calls.clear()
    again = tune([kernel], {"x": x, "y": y}, FusionConfig(tune_top=2), cache, quiet=True, benchmark=lambda fn: 1.0)
    assert again["g0"] == cfgs[3] and again.from_cache == {"g0"} and kernel.calls == []
    # every config spills: all five were tried, the group is over budget and runs the least bad one
    kernel.infos = {c: CompiledInfo(255, 8 - i, 0) for i, c in enumerate(cfgs)}
    spills = tune([kernel], {"x": x, "y": y}, FusionConfig(tune_top=2), quiet=True, benchmark=lambda fn: 1.0)
    assert spills.over_budget == {"g0": EVERY_CONFIG_SPILLS} and spills["g0"] == cfgs[4]


def test_tune_with_autotune_off_and_missing_values():
    kernel, values = tuned_kernel()
    off = tune([kernel], values, FusionConfig(autotune=False), quiet=True, benchmark=lambda fn: 1.0)
    assert off == {"g0": kernel.configs()[0]} and kernel.calls == []
    with pytest.raises(GraphError, match="needs values"):
        tune([kernel], {"y": values["y"]}, FusionConfig(), quiet=True, benchmark=lambda fn: 1.0)


def test_tune_turns_a_failing_config_into_an_error_naming_it():
    kernel, values = tuned_kernel()

    def broken(inputs, config=None):
        raise RuntimeError("bad tile")

    kernel.run = broken
    with pytest.raises(GraphError, match="fake_g0 .*BLOCK=16.*bad tile"):
        tune([kernel], values, FusionConfig(), quiet=True, benchmark=lambda fn: 1.0)
