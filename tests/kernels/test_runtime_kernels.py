"""The runtime running real lowered kernels through Triton's interpreter, against the IR reference."""

import pytest
import torch

from opfuse.codegen.lower import lower_plan
from opfuse.config import FusionConfig
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.interpret import interpret
from opfuse.runtime.compiled import CompiledModel, build_compiled_model


def small_net() -> Graph:
    """conv+bias -> relu -> reshape -> linear+bias -> softmax -> sigmoid, with odd sizes."""
    torch.manual_seed(0)
    g = Graph("small_net")
    f = "float32"
    g.add_input("x", TensorType((2, 5, 7, 7), f))
    g.add_constant("w", torch.randn(6, 5, 3, 3) * 0.2)
    g.add_constant("b", torch.randn(6))
    g.add_constant("lw", torch.randn(9, 6 * 4 * 4) * 0.1)
    g.add_constant("lb", torch.randn(9))
    g.add_node("conv2d", ["x", "w", "b"], TensorType((2, 6, 4, 4), f),
               {"stride": (2, 2), "padding": (1, 1), "dilation": (1, 1), "groups": 1}, name="conv")
    g.add_node("relu", ["conv"], TensorType((2, 6, 4, 4), f), name="relu")
    g.add_node("reshape", ["relu"], TensorType((2, 96), f), {"shape": (2, 96)}, name="flat")
    g.add_node("linear", ["flat", "lw", "lb"], TensorType((2, 9), f), name="lin")
    g.add_node("softmax", ["lin"], TensorType((2, 9), f), {"dim": -1}, name="soft")
    g.add_node("sigmoid", ["soft"], TensorType((2, 9), f), name="sig")
    g.outputs = ["sig", "relu"]
    return g


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_hand_built_plan_with_real_kernels_matches_interpret():
    graph = small_net()
    groups = [
        FusionGroup(0, GroupKind.ANCHOR_EPILOGUE, ["conv", "relu"], anchor="conv", inputs=["x", "w", "b"],
                    outputs=["relu"]),
        FusionGroup(1, GroupKind.VIEW, ["flat"], inputs=["relu"], outputs=["flat"], launches=0),
        FusionGroup(2, GroupKind.SINGLE, ["lin"], anchor="lin", inputs=["flat", "lw", "lb"], outputs=["lin"]),
        FusionGroup(3, GroupKind.REDUCTION, ["soft", "sig"], inputs=["lin"], outputs=["sig"]),
    ]
    plan = FusionPlan(graph, groups, [], "h200", FusionConfig(dtype="float32"))
    kernels, reasons = lower_plan(plan, "cpu")
    assert set(kernels) == {"g0", "g2", "g3"}, reasons
    model = CompiledModel(plan, kernels, "cpu", fallbacks=reasons)
    assert set(model.fallbacks) == {"g1"}
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(2, 5, 7, 7)
        probabilities, features = model(x)
        expected = interpret(graph, [x])
        assert features.is_contiguous(memory_format=torch.channels_last)
        assert relative_error(features, expected[1]) < 1e-4
        assert relative_error(probabilities, expected[0]) < 1e-4


def test_planned_and_built_end_to_end():
    planner = pytest.importorskip("opfuse.fusion.planner")
    graph = small_net()
    config = FusionConfig(dtype="float32", use_cost_model=False)
    plan = planner.plan_fusion(graph, config)
    model = build_compiled_model(plan, "cpu", config=config)
    assert model.kernels, model.fallbacks
    x = torch.randn(2, 5, 7, 7)
    outputs = model(x)
    for got, want in zip(outputs, interpret(graph, [x])):
        assert relative_error(got, want) < 1e-4
