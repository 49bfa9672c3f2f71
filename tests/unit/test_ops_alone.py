"""The ops that run alone (`opfuse.ir.ops_alone`): a mixture of experts' routing (topk, sort, histc, index_put,
floor_divide) and grouped GEMM, an LSTM, scatters and grid sampling, as IR ops; their ATen mappings, the grouped GEMM
kernel on Triton's interpreter (empty experts, uneven groups, rows past the last expert, odd sizes), the library
calls, and transformers' Mixtral and a stack of LSTMs compiled with nothing through PyTorch against eager in float32."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.codegen.grouped_gemm import GroupedGemmKernel, LibraryKernel
from opfuse.codegen.lower import choose_lowering, lower_group
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.legality import opaque_rule
from opfuse.fusion.plan import GroupKind
from opfuse.fusion.planner import plan_fusion
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import TensorType
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import get_op, infer_type, node_flops
from tests.kernels.builders import KernelGraph, rel_err

DEVICE = "cuda" if os.environ.get("OPFUSE_GPU_TESTS") == "1" else "cpu"


def grouped_reference(x: torch.Tensor, w: torch.Tensor, ends: list[int]) -> torch.Tensor:
    out = torch.zeros(x.shape[0], w.shape[-1], dtype=torch.float64)
    start = 0
    for expert, end in enumerate(ends):
        out[start:end] = x[start:end].double() @ w[expert].double()
        start = max(start, end)
    return out


# ---- the ops ---------------------------------------------------------------------------------------------------

def test_grouped_mm_reference_skips_empty_experts_and_zeroes_the_rows_past_the_last():
    x, w = torch.randn(9, 5, dtype=torch.float64), torch.randn(3, 5, 4, dtype=torch.float64)
    got = get_op("grouped_mm").run([x, w, torch.tensor([2, 2, 7])], {})
    torch.testing.assert_close(got, grouped_reference(x, w, [2, 2, 7]))
    assert got[7:].abs().sum() == 0
    assert infer_type("grouped_mm", [TensorType((9, 5), "float16"), TensorType((3, 5, 4), "float16"),
                                     TensorType((3,), "int32")], {}) == TensorType((9, 4), "float16")


def test_routing_ops_are_torch_s_and_each_runs_alone():
    x = torch.randn(6, 5)
    assert torch.equal(get_op("topk").run([x], {"k": 2, "dim": 1, "largest": True, "sorted": True, "output": 1}),
                       torch.topk(x, 2, 1).indices)
    assert torch.equal(get_op("sort").run([x], {"dim": 0, "descending": True, "stable": True, "output": 0}),
                       torch.sort(x, 0, descending=True).values)
    assert torch.equal(get_op("histc").run([x], {"bins": 4, "min": -1.0, "max": 1.0}), torch.histc(x, 4, -1, 1))
    a, b = torch.tensor([-7, -6, 7, 6, 0, 5]), torch.tensor([2, -4, -2, 4, 3, 5])
    assert torch.equal(get_op("floor_div").run([a, b], {}), torch.floor_divide(a, b))
    for op in ("topk", "sort", "histc", "index_copy"):
        assert get_op(op).kernel == "library"
    assert get_op("grouped_mm").kernel == "grouped_gemm"


# ---- the frontend ----------------------------------------------------------------------------------------------

class Routing(nn.Module):
    """transformers' experts' routing (integrations/moe.py), the experts' GEMMs as plain matmuls."""

    def __init__(self, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.experts, self.top_k = experts, top_k

    def forward(self, logits, x):
        weights, chosen = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        flat = chosen.reshape(-1)
        order = torch.sort(flat).indices
        tokens = torch.floor_divide(order, self.top_k)
        counts = torch.histc(flat[order].float(), bins=self.experts, min=0, max=self.experts - 1)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel())
        rows = x[tokens] * weights.reshape(-1)[order, None]
        return rows[inverse].reshape(x.shape[0], self.top_k, -1).sum(1), counts.cumsum(0).int()


def test_moe_routing_maps_to_ir_ops_with_nothing_opaque():
    logits, x = torch.randn(7, 4), torch.randn(7, 3)
    graph = capture_torch(Routing().eval(), (logits, x))
    assert not [n for n in graph if n.op == "opaque"], [n.attrs.get("target") for n in graph if n.op == "opaque"]
    ops = {n.op for n in graph}
    assert {"topk", "sort", "floor_div", "histc", "index_copy"} <= ops, ops
    for got, want in zip(interpret(graph, [logits, x]), Routing()(logits, x)):
        torch.testing.assert_close(got, want)


class ArgSorts(nn.Module):
    """ViT-MAE's random masking keeps the patches argsort(noise) puts first."""

    def forward(self, x):
        return torch.argsort(x, dim=1), torch.argsort(x, descending=True), x.argsort(dim=0, stable=True)


def test_argsort_is_a_sorts_indices():
    x = torch.randn(4, 6)
    graph = capture_torch(ArgSorts(), (x,))
    assert [(n.op, n.attrs["output"]) for n in graph if n.op != "input"] == [("sort", 1)] * 3
    for got, want in zip(interpret(graph, [x]), ArgSorts()(x)):
        assert torch.equal(got, want)


def test_torch_grouped_mm_with_offsets_maps_to_the_ir_op():
    """torch._grouped_mm leaves the rows past the last offset unspecified (NaN on the CPU): zeros are one choice."""
    class Experts(nn.Module):
        def forward(self, x, w, offs):
            return torch._grouped_mm(x, w, offs=offs)

    x, w = torch.randn(10, 16, dtype=torch.bfloat16), torch.randn(3, 16, 8, dtype=torch.bfloat16)
    offs = torch.tensor([2, 2, 7], dtype=torch.int32)
    try:
        want = Experts()(x, w, offs)
    except (RuntimeError, NotImplementedError) as error:       # a torch without its CPU kernel
        pytest.skip(f"torch._grouped_mm on the CPU: {error}")
    graph = capture_torch(Experts().eval(), (x, w, offs))
    assert [n.op for n in graph if n.op not in ("input", "constant")] == ["grouped_mm"]
    got, = interpret(graph, [x, w, offs])
    torch.testing.assert_close(got[:7], want[:7])
    assert got[7:].abs().sum() == 0


def test_floor_and_trunc_division_of_integers_compute_in_a_kernel_exactly():
    class Divisions(nn.Module):
        def forward(self, a, b):
            return torch.floor_divide(a, b) * 3, torch.div(a, b, rounding_mode="trunc") + 1, a // 4

    a = torch.tensor([[-7, -6, 7, 6, 0, 5, -1, 9]])
    b = torch.tensor([[2, -4, -2, 4, 3, 5, 3, -3]])
    model = Divisions().eval()
    analysis = opfuse.analyze(model, (a, b), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    compiled = opfuse.compile(model, (a, b), FusionConfig(dtype="float32"))
    for got, want in zip(compiled(a, b), model(a, b)):
        assert torch.equal(got, want)


def test_float_floor_division_stays_opaque():
    class Floats(nn.Module):
        def forward(self, a):
            return torch.floor_divide(a, 0.3)

    graph = capture_torch(Floats().eval(), (torch.randn(4),))
    assert [n.attrs["target"] for n in graph if n.op == "opaque"] == ["aten.floor_divide.default"]


# ---- the kernels -----------------------------------------------------------------------------------------------

class Grouped(KernelGraph):
    def moe(self, rows: int, k: int, n: int, ends: list[int], ends_dtype: str = "int32") -> str:
        x = self.input("x", (rows, k))
        w = self.const("w", self.random(len(ends), k, n) / k ** 0.5)
        self.graph.add_input("ends", TensorType((len(ends),), ends_dtype))
        self.feeds["ends"] = torch.tensor(ends, dtype=getattr(torch, ends_dtype))
        return self.op("grouped_mm", x, w, "ends")


@pytest.mark.parametrize("rows,k,n,ends", [
    (9, 16, 16, [2, 2, 7, 9]),          # an empty expert, the last one full
    (70, 20, 24, [33, 33, 34, 64]),     # groups over one tile, one row, rows past the last expert (zero)
    (5, 7, 3, [0, 0, 5]),               # odd K and N, every row to the last expert
    (40, 16, 16, [40]),                 # one expert
    (6, 16, 16, [5, 3]),                # ends that decrease: the later expert gets no rows
], ids=["empty-expert", "uneven", "odd", "one", "decreasing"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_grouped_gemm_kernel(rows, k, n, ends, dtype):
    b = Grouped(dtype)
    out = b.moe(rows, k, n, ends)
    group = b.group([out], GroupKind.OPAQUE)
    assert choose_lowering(b.graph, group) == "grouped_gemm"
    kernel = lower_group(b.graph, group, DEVICE)
    assert isinstance(kernel, GroupedGemmKernel)
    got, = kernel.run([b.feeds[name].to(DEVICE) for name in kernel.runtime_inputs])
    assert kernel.last_compiled is not None and got.dtype == getattr(torch, dtype)
    want = grouped_reference(b.feeds["x"], b.graph.constants["w"], ends)
    assert rel_err(got, want) < (1e-4 if dtype == "float32" else 1e-2)
    assert got[max(ends):].abs().sum() == 0


def gated(b: Grouped, rows: int, k: int, n: int, ends: list[int], activation: str = "silu") -> str:
    experts = b.moe(rows, k, n, ends)
    gate = b.op("slice", experts, dim=1, start=0, end=n // 2, step=1)
    up = b.op("slice", experts, dim=1, start=n // 2, end=n, step=1)
    return b.op("mul", b.op(activation, gate), up)


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_gated_experts_plan_as_one_group_and_one_kernel(activation, dtype):
    """act(gate) * up of a grouped GEMM's two column halves: one group, one kernel over the halves interleaved."""
    b = Grouped(dtype)
    ends = [20, 20, 33, 40]
    product = gated(b, 45, 24, 64, ends, activation)
    b.graph.outputs = [product]
    plan = plan_fusion(b.graph, FusionConfig(dtype=dtype))
    (group,) = [g for g in plan.groups if g.launches]
    assert len(group.nodes) == 5 and group.outputs == [product]
    assert [d.verdict.value for d in plan.decisions if d.fusion.value == "gated"] == ["fused"]
    kernel = lower_group(b.graph, group, DEVICE)
    assert isinstance(kernel, GroupedGemmKernel) and kernel.gated is not None
    got, = kernel.run([b.feeds[name].to(DEVICE) for name in kernel.runtime_inputs])
    both = grouped_reference(b.feeds["x"], b.graph.constants["w"], ends)
    act = torch.nn.functional.silu if activation == "silu" else torch.nn.functional.gelu
    want = act(both[:, :32]) * both[:, 32:]
    assert got.shape == (45, 32) and rel_err(got, want) < (1e-4 if dtype == "float32" else 1e-2)
    assert got[40:].abs().sum() == 0


def test_a_half_read_elsewhere_keeps_the_grouped_gemm_alone():
    b = Grouped()
    product = gated(b, 9, 16, 32, [4, 9])
    gate = b.graph[b.graph[product].inputs[0]].inputs[0]
    b.graph.outputs = [product, gate]
    plan = plan_fusion(b.graph, FusionConfig(dtype="float32"))
    experts = next(g for g in plan.groups if any(b.graph[n].op == "grouped_mm" for n in g.nodes))
    assert [b.graph[n].op for n in experts.nodes] == ["grouped_mm"]


def test_the_flops_are_the_rows_times_the_expert_gemm():
    b = Grouped()
    out = b.moe(9, 16, 8, [3, 9])
    assert node_flops(b.graph, b.graph[out]) == 2 * 9 * 16 * 8


def test_the_outputs_of_one_call_are_one_group_that_calls_once(monkeypatch):
    b = KernelGraph()
    x = b.input("x", (5, 6))
    attrs = dict(k=3, dim=1, largest=False, sorted=True)
    values, indices = (b.op("topk", x, **attrs, output=i) for i in (0, 1))
    other = b.op("topk", x, **attrs | {"k": 2}, output=0)          # another call: a group of its own
    b.graph.outputs = [values, indices, other]
    plan = plan_fusion(b.graph, FusionConfig(dtype="float32"))
    assert sorted(sorted(g.nodes) for g in plan.groups if g.launches) == [sorted([values, indices]), [other]]
    pair = next(g for g in plan.groups if values in g.nodes)
    kernel = lower_group(b.graph, pair, DEVICE)
    calls, topk = [], torch.topk
    monkeypatch.setattr(torch, "topk", lambda *args, **kwargs: calls.append(args) or topk(*args, **kwargs))
    got = dict(zip(pair.outputs, kernel.run([b.feeds["x"].to(DEVICE)])))
    want = topk(b.feeds["x"], 3, 1, largest=False)
    assert len(calls) == 1
    assert torch.equal(got[values].cpu(), want.values) and torch.equal(got[indices].cpu(), want.indices)


def test_a_routing_op_is_a_library_call_alone():
    b = KernelGraph()
    top = b.op("topk", b.input("x", (5, 6)), k=2, dim=1, largest=True, sorted=True, output=1)
    group = b.group([top], GroupKind.OPAQUE)
    assert opaque_rule(b.graph, [top]).code is Code.ALONE
    kernel = lower_group(b.graph, group, DEVICE)
    assert isinstance(kernel, LibraryKernel) and "topk" in kernel.describe_library_form()
    got, = kernel.run([b.feeds["x"].to(DEVICE)])
    assert torch.equal(got.cpu(), torch.topk(b.feeds["x"], 2, 1).indices)


# ---- a model ---------------------------------------------------------------------------------------------------

def mixtral(transformers, **sizes) -> nn.Module:
    """A MixtralModel in eval mode of these sizes: two experts a token, through transformers' grouped_mm experts
    (the default differs between its versions), no cache."""
    config = transformers.MixtralConfig(num_experts_per_tok=2, max_position_embeddings=512, use_cache=False,
                                        experts_implementation="grouped_mm", **sizes)
    return transformers.MixtralModel(config).eval()


def test_mixtral_compiles_with_nothing_through_pytorch_and_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = mixtral(transformers, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, head_dim=16, num_local_experts=4, vocab_size=64)
    ids = torch.randint(0, 64, (2, 7))
    analysis = opfuse.analyze(model, (ids,), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    ops = {analysis.prepared[n].op for g in analysis.plan.groups for n in g.nodes}
    assert "grouped_mm" in ops and "topk" in ops
    compiled = opfuse.compile(model, (ids,), FusionConfig(dtype="float32"))
    with torch.no_grad():
        got, want = compiled(ids).last_hidden_state, model(ids).last_hidden_state
    assert rel_err(got, want) < 1e-5


class Recurrent(nn.Module):
    def __init__(self, bidirectional: bool, batch_first: bool):
        super().__init__()
        self.lstm = nn.LSTM(6, 5, num_layers=2, bidirectional=bidirectional, batch_first=batch_first)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out.relu() + 1, h * c


@pytest.mark.parametrize("bidirectional,batch_first", [(False, True), (True, False)])
def test_an_lstm_is_a_library_call_alone_and_matches_eager(bidirectional, batch_first):
    torch.manual_seed(0)
    model, x = Recurrent(bidirectional, batch_first).eval(), torch.randn(3, 4, 6)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    (lstm,) = [g for g in analysis.plan.groups if analysis.prepared[g.nodes[0]].op == "lstm"]
    assert len(lstm.nodes) == 3 and lstm.launches == 1         # the sequence, h and c: one call
    assert sorted(analysis.prepared[n].attrs["output"] for n in lstm.nodes) == [0, 1, 2]
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    with torch.no_grad():
        for got, want in zip(compiled(x), model(x)):
            torch.testing.assert_close(got, want)


def test_routing_and_an_lstm_survive_a_package_round_trip(tmp_path):
    """The ops that run alone are data in a package (attrs checked at load): reloaded, bit-identical."""
    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.routing, self.recurrent = Routing(), Recurrent(False, True)

        def forward(self, logits, x, sequence):
            return *self.routing(logits, x), *self.recurrent(sequence)

    torch.manual_seed(0)
    inputs = (torch.randn(7, 4), torch.randn(7, 3), torch.randn(3, 4, 6))
    compiled = opfuse.compile(Both().eval(), inputs, FusionConfig(dtype="float32"))
    loaded = opfuse.load(opfuse.save(compiled, tmp_path / "alone.opfuse"))
    with torch.no_grad():
        for got, want in zip(loaded(*inputs), compiled(*inputs)):
            assert torch.equal(got, want)


class Scatters(nn.Module):
    """Every ATen write at run-time indices that maps to `scatter`, and grid sampling, each between kernels."""

    def forward(self, x, index, rows, grid):
        flat = x.flatten(1) * 2
        values = flat[:, :3] + 1
        written = flat.scatter(1, index, values) + flat.scatter(1, index, 0.5)
        reduced = flat.scatter_add(1, index, values) * flat.scatter_reduce(1, index, values, "amax", include_self=False)
        added = flat.index_add(0, rows, flat[:2], alpha=-1.5)
        accumulated = flat.clone()
        accumulated.index_put_((rows - 3,), values[:2].repeat(1, 4) * 3, accumulate=True)   # negative: wrapped
        sampled = torch.nn.functional.grid_sample(x.relu(), grid, mode="bilinear", padding_mode="border",
                                                  align_corners=True)
        return written.tanh(), reduced, added + accumulated, sampled.exp()


def test_scatters_and_grid_sampling_are_library_calls_alone_and_match_eager():
    torch.manual_seed(0)
    x, grid = torch.randn(3, 2, 2, 3), torch.rand(3, 4, 5, 2) * 2.4 - 1.2
    index = torch.stack([torch.randperm(12)[:3] for _ in range(3)])        # distinct per row: scatter is defined
    rows = torch.tensor([2, 0])
    model = Scatters().eval()
    analysis = opfuse.analyze(model, (x, index, rows, grid), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    alone = sorted(analysis.prepared[g.nodes[0]].op for g in analysis.plan.groups
                   if analysis.prepared[g.nodes[0]].op in ("scatter", "grid_sample"))
    assert alone == ["grid_sample"] + ["scatter"] * 6
    compiled = opfuse.compile(model, (x, index, rows, grid), FusionConfig(dtype="float32"))
    other = torch.stack([torch.randperm(12)[:3] for _ in range(3)]), torch.tensor([1, 1])
    with torch.no_grad():
        for got, want in zip(compiled(x, other[0], other[1], grid), model(x, other[0], other[1], grid)):
            torch.testing.assert_close(got, want)


class BitsAndDeterminants(nn.Module):
    def forward(self, x, y):
        return torch.linalg.det(x) + 1, (y * 2).view(torch.int32) + 1, torch.det(x * 2)


class ViewAsInt16(nn.Module):
    def forward(self, y):
        return y.view(torch.int16)


def test_a_determinant_and_a_view_as_another_dtype_map_to_det_and_bitcast():
    """torch.linalg.det and torch.det are `det`, Tensor.view(dtype) of one width a `bitcast`: nothing opaque, the
    bits equal eager's exactly; a view as a dtype of another width stays opaque."""
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 3), torch.randn(4, 5)
    graph = capture_torch(BitsAndDeterminants().eval(), (x, y))
    assert not [n for n in graph if n.op == "opaque"]
    assert sorted(n.op for n in graph if n.op in ("det", "bitcast")) == ["bitcast", "det", "det"]
    # in float64 the view gives twice the elements: verified against eager float32 instead, saying why
    with pytest.warns(UserWarning, match=r"verified against eager in float32, not float64: .*output 1 is \[4, 10\]"):
        compiled = opfuse.compile(BitsAndDeterminants().eval(), (x, y), FusionConfig(dtype="float32"))
    x, y = torch.randn(2, 3, 3), torch.randn(4, 5)
    got, want = compiled(x, y), BitsAndDeterminants()(x, y)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[2], want[2])
    wide = capture_torch(ViewAsInt16().eval(), (y,))
    assert [n.attrs["target"] for n in wide if n.op == "opaque"] == ["aten.view.dtype"]


class PoolAndUnpool(nn.Module):
    """SegNet's decoder step: a max pool's indices put its (scaled) values back where they came from."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.pool = nn.MaxPool2d(3, 2, padding=1, return_indices=True)
        self.unpool = nn.MaxUnpool2d(3, 2, padding=1)

    def forward(self, x):
        y, indices = self.pool(torch.relu(self.conv(x)))
        return self.unpool(y * 2, indices, output_size=x.shape[-2:]), indices


def test_max_pool_indices_and_max_unpool_map_with_nothing_opaque_and_match_eager():
    torch.manual_seed(0)
    model, x = PoolAndUnpool().eval(), torch.randn(2, 3, 8, 7)
    analysis = opfuse.analyze(model, (x,), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    assert {"max_pool2d", "max_pool2d_indices", "scatter"} <= {n.op for n in analysis.prepared}
    compiled = opfuse.compile(model, (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 3, 8, 7)
    (unpooled, indices), (want, want_indices) = compiled(x), model(x)
    assert torch.equal(indices, want_indices)
    torch.testing.assert_close(unpooled, want)


class AdaptiveMaxPools(nn.Module):
    """bat_resnext26ts's attention pools its map to a grid with adaptive max pooling; an uneven grid stays opaque."""

    def forward(self, x):
        values, indices = nn.functional.adaptive_max_pool2d(torch.relu(x), (2, 3), return_indices=True)
        return values * 2, indices, nn.functional.adaptive_max_pool2d(x, 1)


def test_an_even_adaptive_max_pool_is_a_max_pool_and_matches_eager():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, 9)
    analysis = opfuse.analyze(AdaptiveMaxPools(), (x,), FusionConfig(dtype="float32"))
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    compiled = opfuse.compile(AdaptiveMaxPools(), (x,), FusionConfig(dtype="float32"))
    x = torch.randn(2, 3, 8, 9)
    for got, want in zip(compiled(x), AdaptiveMaxPools()(x)):
        assert torch.equal(got, want)
    uneven = capture_torch(nn.AdaptiveMaxPool2d(3), (x,))
    assert [n.attrs["target"] for n in uneven if n.op == "opaque"] == ["aten.adaptive_max_pool2d.default[0]"]
