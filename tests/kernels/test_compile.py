"""opfuse.compile end to end on the CPU (Triton interpreter, tiny shapes): every stage runs for real."""

import warnings

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.fusion.reasons import Code
from opfuse.ir.graph import GraphError
from opfuse.numerics import relative_error

from tests.kernels.builders import with_random_batch_norms


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=8), nn.BatchNorm2d(8), nn.ReLU6(),
        nn.Conv2d(8, 12, 1), nn.Hardswish(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 5))
    return with_random_batch_norms(model).eval()


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(6, 6, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(6)
        self.conv2 = nn.Conv2d(6, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + x)


def test_compile_matches_eager_and_leaves_the_model_unchanged():
    model = small_cnn()
    model.train()     # a model in training mode: compile must not flip its flag or touch its BN statistics
    state = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 9, 9)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert model.training
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    model.eval()
    with torch.no_grad():
        fresh = torch.randn(2, 3, 9, 9)
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5
    # the kernels really ran: every group with a kernel passed its own check, and the plan fused BN and activations
    assert compiled.checks and all(c.passed for c in compiled.checks)
    assert compiled.launches == compiled.plan.kernel_launches < len(compiled.analysis.op_rows)
    assert {why.code for why in compiled.fallbacks.values()} <= {Code.VIEW}


def test_residual_block_is_one_kernel_per_conv():
    torch.manual_seed(1)
    model = Residual().eval()
    x = torch.randn(1, 6, 7, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert compiled.launches == 2
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


def test_inputs_of_another_shape_or_dtype_are_refused_with_the_input_named():
    model = small_cnn()
    compiled = opfuse.compile(model, (torch.randn(1, 3, 8, 8),), opfuse.FusionConfig(dtype="float32"))
    with pytest.raises(GraphError, match=r"input .*\[1,3,8,8\]"):
        compiled(torch.randn(2, 3, 8, 8))


def test_fallback_eager_returns_a_model_that_runs_and_says_why():
    class DataDependent(nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x - 1

    model = DataDependent()
    x = torch.ones(3)
    with pytest.raises(GraphError):
        opfuse.compile(model, (x,))
    fallback = opfuse.compile(model, (x,), opfuse.FusionConfig(fallback="eager"))
    assert torch.equal(fallback(x), model(x))
    whole = fallback.fallbacks["<whole model>"]
    assert whole.code is Code.NOT_COMPILED and "torch.export could not capture" in whole.text     # the error says why


def test_a_wrong_kernel_is_unfused_and_named():
    """A kernel that computes the wrong thing fails its own check: its group runs through PyTorch instead."""
    from opfuse.codegen import lower

    model = small_cnn()
    x = torch.randn(1, 3, 8, 8)
    original = lower.lower_group

    def sabotaged(graph, group, device, reasons=None, hw=None):
        kernel = original(graph, group, device, reasons, hw)
        if kernel is not None and group.anchor and graph[group.anchor].op == "linear":
            run = kernel.run
            kernel.run = lambda inputs, config=None: [out + 1.0 for out in run(inputs, config)]
        return kernel

    lower.lower_group = sabotaged
    try:
        compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    finally:
        lower.lower_group = original
    failed = [c for c in compiled.checks if not c.passed]
    assert len(failed) == 1
    assert compiled.fallbacks[failed[0].group].code is Code.FAILED_VERIFICATION
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


def test_torch_compile_backend():
    model = small_cnn()
    x = torch.randn(2, 3, 8, 8)
    fn = torch.compile(model, backend="opfuse")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")   # a fallback to PyTorch would warn
        out = fn(x)
        assert relative_error(out, model(x)) < 1e-5


def test_a_group_whose_every_config_spills_is_split_back():
    """What the autotuner reports on a GPU (every config of a kernel spilled) re-plans with that group split."""
    from opfuse.api import analyze
    from opfuse.replan import split_back
    from opfuse.fusion.plan import Verdict

    model = Residual().eval()
    analysis = analyze(model, (torch.randn(1, 6, 7, 5),), opfuse.FusionConfig(dtype="float32"))
    residual = next(g for g in analysis.plan.groups if len(g.nodes) == 3)   # conv2 + add + relu
    assert analysis.plan.kernel_launches == 2

    again = split_back(analysis, {residual.name: "over budget: every config spills"})
    assert again.plan.kernel_launches == 3          # the residual group split back into two kernels
    assert not any(set(residual.nodes) <= set(g.nodes) for g in again.plan.groups)
    refused = [d for d in again.plan.decisions if d.verdict is Verdict.OVER_BUDGET]
    assert refused and refused[0].code is Code.SPLIT_BACK and "every config spills" in refused[0].reason   # and why
    assert again.fused.kernel_launches == 3


def test_a_compile_says_where_it_is_unless_quiet(capsys):
    """Issue 19: a long compile (minutes through the interpreter) printed nothing; each stage now says itself."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 8)
    opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"), quiet=False)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "opfuse: capturing the model and planning its fusions"
    assert "launches planned; generating the kernels" in lines[1]
    assert lines[2].startswith("opfuse: verifying 2 kernels, then the whole model") and "interpreter" in lines[2]
    opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert capsys.readouterr().err == ""


class AddmmReLU(nn.Module):
    """addmm with the weight given as an input, then ReLU and a scale: the GEMM template refuses a weight that is not
    a constant, so the linear runs through PyTorch."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(8) * 0.1)

    def forward(self, x, weight):
        return torch.relu(torch.addmm(self.bias, x, weight)) * 2


def test_analysis_counts_launches_as_the_compiled_model_runs_them():
    """Issue 19: analyze printed the plan's launches (one kernel here) while the compiled model launched every node
    of a group whose template refused. The planner now asks the template before it merges: the linear of a computed
    weight stays alone, through PyTorch, and the relu and mul after it are a kernel; the analysis counts what the
    runtime runs."""
    model, inputs = AddmmReLU().eval(), (torch.randn(4, 8), torch.randn(8, 8) * 0.3)
    config = opfuse.FusionConfig(dtype="float32")
    analysis = opfuse.analyze(model, inputs, config)
    assert analysis.plan.kernel_launches == 2
    (why,) = analysis.pytorch_groups.values()
    assert why.code is Code.NOT_CONSTANT
    assert why.text == "unsupported by the gemm template: addmm [linear]: the weight is not a constant"   # names it
    compiled = opfuse.compile(model, inputs, config)
    assert analysis.fused.kernel_launches == compiled.launches == 2     # the linear; relu and the scale's kernel
    assert len(compiled.compiled.kernels) == 1
    assert analysis.to_dict()["pytorch_groups"] == {group: {"code": "not-constant", "reason": why.text}
                                                    for group in analysis.pytorch_groups}


def test_tiny_gpt2_runs_its_conv1d_gemms_as_kernels_and_matches_eager():
    """GPT-2's Conv1D is addmm(b, x, W) with W stored [in, out], captured as a linear of permute(W); with the
    permute folded into a constant every GEMM of the block gets a kernel, and the model still matches eager."""
    pytest.importorskip("transformers")
    from opfuse.bench.zoo import build_seeded, token_inputs
    from opfuse.bench.zoo_models import build_text_model

    model = build_seeded(lambda: build_text_model("gpt2", vocab_size=50, n_embd=16, n_layer=1, n_head=2,
                                                  n_positions=16, bos_token_id=0, eos_token_id=0))
    (ids,) = token_inputs(1, 6, 50)
    compiled = opfuse.compile(model, (ids,), opfuse.FusionConfig(dtype="float32"))
    gemms = [g.name for g in compiled.plan.groups if g.anchor and compiled.plan.graph[g.anchor].op == "linear"]
    assert len(gemms) == 4                                   # c_attn, attn c_proj, c_fc, mlp c_proj
    assert not set(gemms) & set(compiled.fallbacks)
    checked = {c.group for c in compiled.checks if c.passed}
    assert set(gemms) <= checked                             # each GEMM kernel ran and passed its own check
    (fresh,) = token_inputs(1, 6, 50)
    fresh = (fresh * 7 + 3) % 50                             # other tokens than the example's
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5


class ShuffleAndDense(nn.Module):
    """ShuffleNet's unit (chunk, branch, cat, channel shuffle) and DenseNet's layer (cat -> BN -> ReLU -> 1x1)."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Sequential(nn.Conv2d(4, 4, 1), nn.BatchNorm2d(4), nn.ReLU(),
                                    nn.Conv2d(4, 4, 3, padding=1, groups=4), nn.BatchNorm2d(4))
        self.norm = nn.BatchNorm2d(16)
        self.dense = nn.Conv2d(16, 6, 1)

    def forward(self, x):
        kept, rest = x.chunk(2, dim=1)
        joined = torch.cat([kept, torch.relu(self.branch(rest))], dim=1)
        b, c, h, w = joined.shape
        shuffled = joined.view(b, 2, c // 2, h, w).transpose(1, 2).reshape(b, c, h, w)
        features = torch.cat([shuffled, x], dim=1)
        return self.dense(torch.relu(self.norm(features)))


def test_cat_and_channel_shuffle_fuse_and_match_eager():
    torch.manual_seed(3)
    model = with_random_batch_norms(ShuffleAndDense()).eval()
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    with torch.no_grad():
        fresh = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5
    assert compiled.checks and all(c.passed for c in compiled.checks)
    cats = [g for g in compiled.plan.groups if any(compiled.plan.graph[n].op == "cat" for n in g.nodes)]
    assert cats and all(len(g.nodes) > 1 and g.name not in compiled.fallbacks for g in cats)   # kernels of ours
    assert not any(why.code is Code.VIEW_COPY for why in compiled.fallbacks.values())   # the shuffle is written
    assert compiled.launches == compiled.plan.kernel_launches


class OverflowClamp(nn.Module):
    """transformers' T5 in float16: after each residual add, clamp to the dtype's range, 1000 narrower where
    something overflowed; then its RMS norm."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x) + x
        bound = torch.where(torch.isinf(h).any(), 60000.0, 65504.0)
        h = torch.clamp(h, min=-bound, max=bound)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_the_overflow_clamp_runs_as_kernels_and_matches_eager_with_and_without_an_overflow():
    torch.manual_seed(4)
    model = OverflowClamp().eval()
    x = torch.randn(2, 6, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    assert not any(n.op == "opaque" for n in graph) and {"isinf", "any", "where"} <= {n.op for n in graph}
    assert not compiled.fallbacks
    for overflow in (False, True):
        fresh = torch.randn(2, 6, 16)
        if overflow:
            fresh[1, 3] = 3e38                          # fc(x) + x overflows to inf in that row
        with torch.no_grad():
            assert bool(torch.isinf(model.fc(fresh) + fresh).any()) == overflow
            want, got = model(fresh), compiled(fresh)
        assert torch.isfinite(want).all() and relative_error(got, want) < 1e-5


class ViewsAfterReductions(nn.Module):
    def forward(self, x):
        a = torch.relu(torch.softmax(x * 2, -1).permute(0, 2, 1)) + 1
        b = nn.functional.layer_norm(x, (5,)).reshape(2, 15) + 1
        return a, b


def test_a_view_after_a_reduction_joins_its_kernel_at_mapped_coordinates():
    """The reduction template computes its epilogue at the reduction's coordinates, and after a permute or a merging
    reshape at the ones they map to: each softmax and layer norm is one kernel with the ops after the view, and the
    outputs, stored at those coordinates, match eager."""
    x = torch.randn(2, 3, 5)
    compiled = opfuse.compile(ViewsAfterReductions(), (x,), opfuse.FusionConfig(dtype="float32"))
    assert all(why.code.value == "view" for why in compiled.fallbacks.values()), compiled.fallbacks
    graph = compiled.plan.graph
    for reduction, view in (("softmax", "permute"), ("layer_norm", "reshape")):
        group = compiled.plan.group_of(next(n.name for n in graph if n.op == reduction))
        assert view in {graph[n].op for n in group.nodes} and "add" in {graph[n].op for n in group.nodes}
    assert compiled.launches == compiled.plan.kernel_launches == 2
    fresh = torch.randn(2, 3, 5)
    for got, want in zip(compiled(fresh), ViewsAfterReductions()(fresh)):
        assert relative_error(got, want) < 1e-5


class ReturnsAFill(nn.Module):
    def forward(self, x):
        return x.new_zeros(2, 3), (x + 1).reshape(2, 2)


def test_an_output_that_is_a_constant_is_a_new_tensor_at_every_call():
    """x.new_zeros(...) becomes a constant at capture; a caller writing into the output it got must not change
    what the next call returns (eager returns a new tensor each time)."""
    x = torch.randn(4)
    compiled = opfuse.compile(ReturnsAFill(), (x,), opfuse.FusionConfig(dtype="float32"))
    zeros, _ = compiled(x)
    zeros.add_(5)
    again, _ = compiled(x)
    assert torch.equal(again, torch.zeros(2, 3))


class ShiftedWindows(nn.Module):
    """Swin's shifted-window step: roll, partition into windows (view, permute, reshape: a copy in PyTorch), a
    linear per token, windows back, roll back, residual add."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):                                      # x: [1, 6, 9, 6] (N, H, W, C), windows of 3x3
        shifted = torch.roll(torch.relu(x), shifts=(-1, -1), dims=(1, 2))
        windows = shifted.view(1, 2, 3, 3, 3, 6).permute(0, 1, 3, 2, 4, 5).reshape(6, 9, 6)
        windows = self.fc(windows)
        back = windows.view(1, 2, 3, 3, 3, 6).permute(0, 1, 3, 2, 4, 5).reshape(1, 6, 9, 6)
        return x + torch.roll(back, shifts=(1, 1), dims=(1, 2))


def test_shifted_windows_roll_as_index_maps_and_match_eager():
    torch.manual_seed(5)
    model = ShiftedWindows().eval()
    x = torch.randn(1, 6, 9, 6)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    rolls = [g for g in compiled.plan.groups if any(graph[n].op == "roll" for n in g.nodes)]
    assert len(rolls) == 2 and all(len(g.nodes) > 1 and g.name not in compiled.fallbacks for g in rolls)
    linear = next(g for g in compiled.plan.groups if any(graph[n].op == "linear" for n in g.nodes))
    # the partition (a copy in PyTorch) is the linear's operand load, read from the relu + roll kernel's output
    assert [graph[n].op for n in linear.nodes][:3] == ["reshape", "permute", "reshape"]
    assert linear.name not in compiled.fallbacks
    # the window reverse after the linear is read through by the roll + residual kernel: no copy runs anywhere
    assert not [why for why in compiled.fallbacks.values() if why.code.value == "view-copy"], compiled.fallbacks
    fresh = torch.randn(1, 6, 9, 6)
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5


class LargeIds(nn.Module):
    def forward(self, ids, x):
        return torch.where((ids * 2 + 16777217) != 16777219, x, -x)


def test_integer_arithmetic_past_two_to_the_24_runs_exactly():
    """In float32 16777217 is 16777216: a kernel computes int64 values in int64 (`Region.integer`), so the
    comparison eager makes on them is the kernel's too, with nothing through PyTorch."""
    ids, x = torch.tensor([1, 2, 3, 1]), torch.randn(4)
    compiled = opfuse.compile(LargeIds(), (ids, x), opfuse.FusionConfig(dtype="float32"))
    assert torch.equal(compiled(ids, x), LargeIds()(ids, x))
    assert not compiled.fallbacks, compiled.fallbacks


class IdsAndCasts(nn.Module):
    def forward(self, ids, x):
        return (ids + True) * 3 + (x * 10).long()     # a bool scalar operand; floats truncated toward zero


def test_integer_operands_of_every_kind_are_exact():
    ids, x = torch.tensor([[1, 2 ** 40, 5]]), torch.tensor([[0.29, 1.7, -2.5]])
    compiled = opfuse.compile(IdsAndCasts().eval(), (ids, x), opfuse.FusionConfig(dtype="float32"))
    assert not compiled.fallbacks
    assert torch.equal(compiled(ids, x), IdsAndCasts()(ids, x))


@pytest.mark.parametrize("norm", ["apart", "prologue", "epilogue"])
def test_convnext_block_scales_and_adds_its_residual_in_the_second_linear(norm):
    """torchvision's CNBlock: depthwise 7x7, permute to NHWC, layer norm, linear + GELU, linear, permute back,
    layer scale, residual. With `norm_prologue` the layer norm is the first linear's prologue (read through the
    permute), with `norm_epilogue` the depthwise conv's epilogue (the permute with it); the permute back, the scale
    and the residual are the second linear's epilogue."""
    from torchvision.models.convnext import CNBlock

    torch.manual_seed(6)
    block = CNBlock(12, layer_scale=0.5, stochastic_depth_prob=0.0).eval()
    x = torch.randn(2, 12, 5, 6).contiguous(memory_format=torch.channels_last)
    config = opfuse.FusionConfig(dtype="float32", norm_prologue=norm == "prologue", norm_epilogue=norm == "epilogue")
    compiled = opfuse.compile(block, (x,), config)
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    second = [g for g in compiled.plan.groups if any(graph[n].op == "linear" for n in g.nodes)][-1]
    assert [graph[n].op for n in second.nodes] == ["linear", "permute", "mul", "add"]
    first = [g for g in compiled.plan.groups if any(graph[n].op == "linear" for n in g.nodes)][0]
    conv = next(g for g in compiled.plan.groups if any(graph[n].op == "conv2d" for n in g.nodes))
    if norm == "epilogue":
        assert [graph[n].op for n in conv.nodes] == ["conv2d", "permute", "layer_norm"]
        assert not compiled.fallbacks                  # the permute is the conv's epilogue's too
    else:
        assert [why.code for why in compiled.fallbacks.values()] == [Code.VIEW]    # the free permute after the conv
    if norm == "prologue":
        assert [graph[n].op for n in first.nodes] == ["layer_norm", "linear", "gelu"]   # the norm: its prologue
    else:
        assert [graph[n].op for n in first.nodes] == ["linear", "gelu"]
    assert compiled.launches == (4 if norm == "apart" else 3)  # depthwise, [layer norm,] linear + GELU, linear + tail
    fresh = torch.randn(2, 12, 5, 6).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert relative_error(compiled(fresh), block(fresh)) < 1e-5


class SqueezeExcite(nn.Module):
    """EfficientNet's MBConv tail: depthwise conv + SiLU, squeeze-and-excitation, the 1x1 project conv."""

    def __init__(self):
        super().__init__()
        from torchvision.ops import SqueezeExcitation

        self.depthwise = nn.Sequential(nn.Conv2d(6, 6, 3, padding=1, groups=6), nn.SiLU())
        self.excite = SqueezeExcitation(6, 2, activation=nn.SiLU)
        self.project = nn.Conv2d(6, 5, 1)

    def forward(self, x):
        return self.project(self.excite(self.depthwise(x)))


def test_squeeze_excitation_scales_the_project_convs_input_tiles():
    torch.manual_seed(7)
    model = SqueezeExcite().eval()
    x = torch.randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    project = compiled.plan.groups[-1]
    assert [graph[n].op for n in project.nodes] == ["mul", "conv2d"] and not compiled.fallbacks
    fresh = torch.randn(2, 6, 5, 4).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5


def test_the_squeeze_is_one_kernel_that_matches_eager_call_after_call():
    """The pool and the SE block's two small 1x1 convs run as one squeeze kernel (split form: atomics into its
    workspace, which every call leaves zero, so the second call with new inputs is right too)."""
    from opfuse.codegen.squeeze import SqueezeKernel
    from opfuse.fusion.plan import GroupKind

    torch.manual_seed(8)
    model = SqueezeExcite().eval()
    x = torch.randn(3, 6, 7, 5).contiguous(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", squeeze=True))
    squeeze = [g for g in compiled.plan.groups if g.kind is GroupKind.SQUEEZE]
    assert len(squeeze) == 1 and isinstance(compiled.compiled.kernels[squeeze[0].name], SqueezeKernel)
    assert compiled.launches == compiled.plan.kernel_launches == 3 and not compiled.fallbacks
    assert compiled.checks and all(c.passed for c in compiled.checks)
    for seed in (1, 2):
        fresh = torch.randn(3, 6, 7, 5, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            assert relative_error(compiled(fresh.contiguous(memory_format=torch.channels_last)), model(fresh)) < 1e-5


class TokenEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.tokens = nn.Embedding(50, 8)
        self.positions = nn.Parameter(torch.randn(6, 8))

    def forward(self, ids):
        return torch.tanh(self.tokens(ids) + self.positions)


def test_an_embedding_gathers_rows_in_the_kernel_of_what_follows():
    """The token lookup, the position add and the activation are one kernel: the int64 ids are loaded as integers
    and address the table's rows (no group through PyTorch)."""
    torch.manual_seed(8)
    model = TokenEmbedding().eval()
    compiled = opfuse.compile(model, (torch.randint(0, 50, (2, 6)),), opfuse.FusionConfig(dtype="float32"))
    graph = compiled.plan.graph
    assert [[graph[n].op for n in g.nodes] for g in compiled.plan.groups] == [["embedding", "add", "tanh"]]
    assert not compiled.fallbacks and compiled.launches == 1
    ids = torch.tensor([[49, 0, 7, 7, 1, 48], [6, 2, 5, 4, 3, 30]])
    with torch.no_grad():
        assert relative_error(compiled(ids), model(ids)) < 1e-6


def test_an_index_outside_the_table_gives_nan_not_another_row():
    """Eager raises for it; the kernel reads nothing past the table and marks the row NaN."""
    torch.manual_seed(9)
    model = TokenEmbedding().eval()
    compiled = opfuse.compile(model, (torch.randint(0, 50, (2, 6)),), opfuse.FusionConfig(dtype="float32"))
    out = compiled(torch.tensor([[1, 50, -1, 2, 3, 4], [0, 0, 0, 0, 0, 49]]))
    assert torch.isnan(out[0, 1:3]).all() and not torch.isnan(out[0, 3:]).any() and not torch.isnan(out[1]).any()


class PreNormBlock(nn.Module):
    """A pre-LN transformer block: x + attn(ln1(x)), then + mlp(ln2(.))."""

    def __init__(self, width: int = 16, heads: int = 2):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.fc1, self.fc2 = nn.Linear(width, 3 * width), nn.Linear(3 * width, width)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def test_a_pre_norm_block_normalizes_in_its_linears_and_matches_eager():
    """Each layer norm feeds one linear alone: it is that linear's prologue (its row statistics computed in the
    GEMM's kernel), never a kernel of its own, and the block still matches eager."""
    torch.manual_seed(7)
    block = PreNormBlock().eval()
    with torch.no_grad():
        block.ln1.weight.normal_(1, 0.2)
        block.ln1.bias.normal_(0, 0.2)
    x = torch.randn(2, 5, 16)
    compiled = opfuse.compile(block, (x,), opfuse.FusionConfig(dtype="float32", norm_prologue=True))
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    norms = [g for g in compiled.plan.groups if any(graph[n].op == "layer_norm" for n in g.nodes)]
    assert norms and all(g.anchor and graph[g.anchor].op == "linear" for g in norms), [g.nodes for g in norms]
    assert compiled.launches == compiled.plan.kernel_launches
    fresh = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert relative_error(compiled(fresh), block(fresh)) < 1e-5


def test_the_references_convolve_without_cudnn_and_the_setting_is_restored(monkeypatch):
    """Verification's reference runs (every node in float64, then the eager copy) convolve without cuDNN, whatever
    `cudnn.enabled` says; the user's setting is back after the compile."""
    from tests.unit.test_numerics import CudnnSeen

    monkeypatch.setattr(torch.backends.cudnn, "enabled", True)
    x = torch.randn(2, 3, 6, 6)
    with CudnnSeen() as seen:
        opfuse.compile(small_cnn(), (x,), opfuse.FusionConfig(dtype="float32"))
    references = [on for dtype, _, on in seen.calls if dtype == torch.float64]
    assert len(references) >= 6 and not any(references)      # 3 convs in the graph, 3 in the eager copy
    assert torch.backends.cudnn.enabled is True


def test_verification_checks_kernels_on_the_models_layouts_from_float32_examples(monkeypatch):
    """A float16 compile from float32 example inputs still hands verification the compiled model's layouts (its
    stand-in values need inputs in the compute dtype)."""
    from opfuse import verification

    handed = []
    check = verification.check_groups

    def recording(*args, **kwargs):
        handed.append(args[6] if len(args) > 6 else kwargs.get("layouts"))
        return check(*args, **kwargs)

    monkeypatch.setattr(verification, "check_groups", recording)
    x = torch.randn(2, 3, 6, 6)
    compiled = opfuse.compile(small_cnn(), (x,), opfuse.FusionConfig(dtype="float16"))
    (layouts,) = handed
    read = {name for kernel in compiled.compiled.kernels.values() for name in kernel.runtime_inputs}
    assert layouts is not None and read <= set(layouts)
    assert all(layouts[name].dtype == torch.float16 for name in read if layouts[name].dtype.is_floating_point)


def builds_reporting(monkeypatch, report) -> list:
    """Every build_compiled_model of the compile records its plan (the list returned) and gets the TuningResult
    of a fresh TuningRecord, which `report(plan, record, builds_so_far)` fills as the GPU's tuner would."""
    from opfuse.runtime import compiled as runtime
    from opfuse.runtime.autotune import TuningRecord

    plans = []
    build = runtime.build_compiled_model

    def reporting(plan, *args, **kwargs):
        model = build(plan, *args, **kwargs)
        plans.append(plan)
        record = TuningRecord()
        report(plan, record, len(plans))
        model.tuning = record.freeze()
        return model

    monkeypatch.setattr(runtime, "build_compiled_model", reporting)
    return plans


@pytest.mark.parametrize("which,builds", [("single", 1), ("fused", 2)])
def test_a_compile_builds_again_only_where_splitting_back_changes_the_groups(monkeypatch, which, builds):
    """The tuner reports a group whose every Triton config spilled: a fused group is split and the model built
    again; a one-op group has nothing to split, so the first build (with the other form chosen) stands."""
    from opfuse.runtime.autotune import EVERY_CONFIG_SPILLS

    def report(plan, tuning, builds):
        if builds == 1:
            size = 1 if which == "single" else 3       # the first conv alone; conv2 + add + relu
            group = next(g for g in plan.groups if len(g.nodes) == size)
            tuning.over_budget[group.name] = EVERY_CONFIG_SPILLS

    calls = builds_reporting(monkeypatch, report)
    model = nn.Sequential(nn.Conv2d(6, 6, 1), Residual()).eval()
    x = torch.randn(1, 6, 6, 4)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert len(calls) == builds
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


def test_a_conv_conv_group_slower_than_its_ops_is_built_again_one_group_per_conv(monkeypatch):
    """The tuner reports that a depthwise -> 1x1 group ran fastest unfused: the model is planned again with the two
    convs apart (each then has the forms of its own, the library's among them), the decision says why, and the
    result still matches eager."""
    from opfuse.fusion.plan import GroupKind, Verdict

    plans = builds_reporting(monkeypatch, lambda plan, tuning, _: tuning.slower_fused.update(
        {g.name: "slower than its ops through PyTorch: 9.0 us against 4.0 us"
         for g in plan.groups if g.kind is GroupKind.CONV_CONV}))
    model = with_random_batch_norms(nn.Sequential(
        nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.BatchNorm2d(8), nn.Conv2d(8, 16, 1), nn.BatchNorm2d(16),
        nn.ReLU())).eval()
    x = torch.randn(1, 8, 6, 6)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    assert [g.kind for g in plans[0].groups] == [GroupKind.CONV_CONV]
    assert len(plans) == 2 and [g.nodes for g in plans[1].groups] == [["conv2d"], ["conv2d_1", "relu"]]
    refused = [d for d in compiled.plan.decisions if d.code is Code.SPLIT_BACK]
    assert len(refused) == 1 and refused[0].verdict is Verdict.UNPROFITABLE
    assert "conv2d, conv2d_1 measured slower than its ops through PyTorch: 9.0 us against 4.0 us" in refused[0].reason
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


class ResidualNorm(nn.Module):
    """A transformer's linear + residual add, then the layer norm after it."""

    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.head = nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 8)

    def forward(self, x):
        return self.head(self.norm(x + self.fc(x)))


@pytest.mark.parametrize("split_epilogues", [False, True])
def test_a_one_anchor_group_slower_than_its_ops_is_split_only_when_asked(monkeypatch, split_epilogues):
    """The tuner reports that linear + residual add ran fastest unfused. Without `split_epilogues` that stands (one
    build); with it the model is planned again with the linear alone and the add in the layer norm's kernel."""
    from opfuse.fusion.plan import GroupKind

    plans = builds_reporting(monkeypatch, lambda plan, tuning, _: tuning.slower_fused.update(
        {g.name: "slower than its ops through PyTorch: 6.0 us against 5.0 us"
         for g in plan.groups if g.kind is GroupKind.RESIDUAL}))
    model = ResidualNorm().eval()
    x = torch.randn(4, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=split_epilogues))
    assert [g.nodes for g in plans[0].groups] == [["linear", "add"], ["layer_norm"], ["linear_1"]]
    if split_epilogues:
        assert len(plans) == 2 and [g.nodes for g in plans[1].groups] == [["linear"], ["add", "layer_norm"],
                                                                          ["linear_1"]]
    else:
        assert len(plans) == 1
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


def residual_norm_seconds(kept_us: dict[tuple[str, ...], float]):
    """A report for `builds_reporting`: the first build's linear + add group ran fastest unfused; each build's
    groups get the times in `kept_us` (microseconds by node tuple, 1 us for any other)."""
    from opfuse.fusion.plan import GroupKind

    def report(plan, tuning, builds):
        if builds == 1:
            tuning.slower_fused.update({g.name: "slower than its ops through PyTorch"
                                        for g in plan.groups if g.kind is GroupKind.RESIDUAL})
        tuning.seconds.update({g.name: kept_us.get(tuple(g.nodes), 1.0) * 1e-6 for g in plan.groups})
    return report


@pytest.mark.parametrize("split_us,kept", [(3.0, True), (7.0, False)])
def test_a_split_back_is_kept_only_where_its_kernels_measure_faster(monkeypatch, split_us, kept):
    """linear + add (5 us) and the layer norm (2 us) against the split's linear and add + norm (`split_us` in sum):
    the model built again is kept where that is less than the 7 us of the groups it replaces; otherwise the first
    build, with the unfused form the tuner chose, stands. The groups both plans share (the head) do not count."""
    first = {("linear", "add"): 5.0, ("layer_norm",): 2.0, ("linear_1",): 50.0}
    second = {("linear",): split_us / 2, ("add", "layer_norm"): split_us / 2, ("linear_1",): 1.0}
    plans = builds_reporting(monkeypatch, residual_norm_seconds(first | second))
    model = ResidualNorm().eval()
    x = torch.randn(4, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=True))
    assert len(plans) == 2
    assert [g.nodes for g in compiled.plan.groups] == [g.nodes for g in plans[1 if kept else 0].groups]
    # and says so, with the times it compared
    assert compiled.compiled.replan_note == (f"split back: 2 groups in place of 2, their kernels {split_us:.1f} us "
                                             f"against 7.0 us; kept the {'new plan' if kept else 'first build'}")
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


def pairs_ran_apart(plan, tuning, builds) -> None:
    """A report for `builds_reporting`: every group of two of the first build ran fastest with its anchor through
    the library and its epilogue apart."""
    if builds == 1:
        tuning.epilogue_apart.update({g.name: "fastest with its anchor through the library, its epilogue apart"
                                      for g in plan.groups if len(g.nodes) == 2})


class ResidualNormThenGelu(ResidualNorm):
    """`ResidualNorm`, its head's GELU the model's output: split from the head, the GELU joins nothing."""

    def forward(self, x):
        return nn.functional.gelu(super().forward(x))


def test_a_split_that_joins_nothing_is_not_built_again(monkeypatch):
    """Both linear groups ran fastest with their anchor apart: the first's add joins the layer norm when split (so
    the model is built again, with that split only), the head's GELU joins nothing (the first build runs it apart
    already: not split, and the note says so)."""
    plans = builds_reporting(monkeypatch, pairs_ran_apart)
    model = ResidualNormThenGelu().eval()
    x = torch.randn(4, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=True))
    assert [g.nodes for g in plans[0].groups] == [["linear", "add"], ["layer_norm"], ["linear_1", "gelu"]]
    assert len(plans) == 2 and [g.nodes for g in plans[1].groups] == [["linear"], ["add", "layer_norm"],
                                                                      ["linear_1", "gelu"]]
    assert compiled.compiled.replan_note.endswith("1 of the 2 groups measured fastest apart only split (the first "
                                                  "build runs their parts apart already): not built again")
    plans.clear()
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU()).eval()        # nothing to join: one build
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=True))
    assert len(plans) == 1 and [g.nodes for g in compiled.plan.groups] == [["linear", "gelu"]]
    assert "1 of the 1 groups" in compiled.compiled.replan_note
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


class MlpNorm(nn.Module):
    """A transformer's MLP (linear, GELU, linear), residual add, layer norm."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(16, 64), nn.Linear(64, 16), nn.LayerNorm(16)

    def forward(self, x):
        return self.norm(x + self.fc2(nn.functional.gelu(self.fc1(x))))


def test_an_op_split_from_its_anchor_joins_no_later_anchor_as_a_prologue(monkeypatch):
    """Both linears ran fastest with their epilogues apart: the residual add joins the layer norm, the GELU does not
    become the second linear's prologue, so its group only splits and stays whole (one build more, not two
    changed linear kernels); split, the plan's decision names the pair left apart."""
    plans = builds_reporting(monkeypatch, pairs_ran_apart)
    model = MlpNorm().eval()
    x = torch.randn(4, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=True))
    assert [g.nodes for g in plans[0].groups] == [["linear", "gelu"], ["linear_1", "add"], ["layer_norm"]]
    assert len(plans) == 2 and [g.nodes for g in plans[1].groups] == [["linear", "gelu"], ["linear_1"],
                                                                      ["add", "layer_norm"]]
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5
    from opfuse.replan import split_back                  # both split: the GELU alone, and the plan says why

    analysis = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float32"))
    both = {g.name: "fastest apart" for g in analysis.plan.groups if len(g.nodes) == 2}
    again = split_back(analysis, {}, both)
    assert [g.nodes for g in again.plan.groups] == [["linear"], ["gelu"], ["linear_1"], ["add", "layer_norm"]]
    refused = [d.reason for d in again.plan.decisions if d.code is Code.SPLIT_BACK]
    assert any("gelu, linear_1" in r and "a prologue of a later anchor is not tried" in r for r in refused)


def test_a_library_form_with_its_epilogue_apart_is_split_with_split_epilogues(monkeypatch):
    """The tuner reports that linear + add ran fastest with the linear through the library and the add as an
    epilogue kernel of its own: with `split_epilogues` the add joins the layer norm's kernel instead."""
    from opfuse.fusion.plan import GroupKind

    def report(plan, tuning, builds):
        if builds == 1:
            tuning.epilogue_apart.update({g.name: "fastest with its anchor through the library, its epilogue apart"
                                          for g in plan.groups if g.kind is GroupKind.RESIDUAL})

    plans = builds_reporting(monkeypatch, report)
    model = ResidualNorm().eval()
    x = torch.randn(4, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", split_epilogues=True))
    assert len(plans) == 2 and [g.nodes for g in compiled.plan.groups] == [["linear"], ["add", "layer_norm"],
                                                                          ["linear_1"]]
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5


class ThreeSiblings(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        return torch.cat([self.q(x), self.k(x), self.v(x)], -1)


def test_a_horizontal_group_slower_than_its_ops_is_split_into_every_sibling():
    """Siblings merge one at a time: keeping the three anchors apart as a set would refuse only the last merge;
    every pair is kept apart, so each linear gets its own group."""
    from opfuse.api import analyze
    from opfuse.replan import split_back
    from opfuse.fusion.plan import GroupKind

    analysis = analyze(ThreeSiblings().eval(), (torch.randn(4, 16),), opfuse.FusionConfig(dtype="float32"))
    (horizontal,) = [g for g in analysis.plan.groups if g.kind is GroupKind.HORIZONTAL]
    assert len([n for n in horizontal.nodes if n.startswith("linear")]) == 3
    again = split_back(analysis, {}, {horizontal.name: "slower than its ops through PyTorch"})
    anchors = [[n for n in g.nodes if n.startswith("linear")] for g in again.plan.groups]
    assert sorted(a for a in anchors if a) == [["linear"], ["linear_1"], ["linear_2"]]


def test_a_shuffled_value_read_in_halves_is_stored_as_the_halves_and_matches_eager():
    """Two ShuffleNet units: the second chunks the first's shuffled concat, whose kernel then stores the two
    halves as tensors of their own (the next unit's branch conv reads a dense one)."""
    from torchvision.models.shufflenetv2 import InvertedResidual

    torch.manual_seed(5)
    model = with_random_batch_norms(nn.Sequential(InvertedResidual(8, 8, 1), InvertedResidual(8, 8, 1))).eval()
    x = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
    graph = compiled.plan.graph
    stored = [g for g in compiled.plan.groups if g.outputs and all(graph[o].op == "slice" for o in g.outputs)]
    assert stored and all(len(g.outputs) == 2 for g in stored)
    with torch.no_grad():
        fresh = torch.randn(2, 8, 5, 5).to(memory_format=torch.channels_last)
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5
    assert compiled.launches == compiled.plan.kernel_launches


class RMSNormQKV(nn.Module):
    """Llama's attention input written as transformers writes it: an RMS norm (in float32, then weight) read by the
    q, k and v projections alone, then a second RMS norm read by one linear."""

    def __init__(self, width: int = 24):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width) * 0.2 + 1)
        self.q, self.k, self.v = nn.Linear(width, width, bias=False), nn.Linear(width, 8), nn.Linear(width, 8)
        self.out = nn.Linear(width + 16, 5, bias=False)

    @staticmethod
    def norm(x, weight=None):
        x32 = x.float()
        y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)
        return y if weight is None else weight * y

    def forward(self, x):
        h = self.norm(x, self.weight)
        qkv = torch.cat([self.q(h), self.k(h), self.v(h)], -1)
        return self.out(self.norm(qkv))


def test_sibling_linears_normalize_their_shared_rms_norm_input_and_match_eager():
    """With `norm_prologue`, both RMS norms are prologues (the first shared by the horizontal q/k/v GEMM, the
    second of the one linear reading it): no kernel computes a norm alone, and the results match eager's."""
    torch.manual_seed(3)
    model = RMSNormQKV().eval()
    x = torch.randn(2, 3, 24) * 3 + 1
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", norm_prologue=True))
    assert compiled.checks and all(c.passed for c in compiled.checks)
    graph = compiled.plan.graph
    norms = [g for g in compiled.plan.groups if any(graph[n].op == "rms_norm" for n in g.nodes)]
    assert len(norms) == 2 and all(g.anchor and graph[g.anchor].op == "linear" for g in norms)
    assert any(g.kind.value == "horizontal" for g in norms)
    fresh = torch.randn(2, 3, 24) * 3 + 1
    with torch.no_grad():
        assert relative_error(compiled(fresh), model(fresh)) < 1e-5



def test_a_deferred_rms_norm_prologue_keeps_float16_tiles_in_range():
    """An RMS norm that only row views follow to its linears is deferred: the GEMM's K loop sums the rows' squares
    and the accumulator takes rstd after it (no statistics pass of its own before the loop). Its tiles are
    x * w / max|w|: with activations near 3000 and weights up to 40, whose product float16 cannot hold, the model
    compiled in float16 still matches eager in float64."""
    from opfuse.codegen.gemm import GemmKernel

    torch.manual_seed(3)
    model = RMSNormQKV().eval()
    with torch.no_grad():
        model.weight.uniform_(-40, 40)
    x = torch.randn(2, 3, 24) * 3000
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float16", norm_prologue=True))
    prologues = [kernel.prologue for kernel in compiled.compiled.kernels.values()
                 if isinstance(kernel, GemmKernel) and kernel.prologue is not None]
    assert len(prologues) == 2 and all(prologue.deferred for prologue in prologues)
    assert all("ln_k" not in kernel.source for kernel in compiled.compiled.kernels.values())   # no stats pass
    fresh = torch.randn(2, 3, 24) * 3000
    with torch.no_grad():
        got, want = compiled(fresh), model.double()(fresh.double())
    assert torch.isfinite(got).all() and relative_error(got.double(), want) < 1e-2

def test_kernels_built_to_launch_dependently_run_plainly_where_the_gpu_cannot():
    """With FusionConfig.dependent_launch every launcher of the plan is built to launch dependently; on the CPU
    (Triton's interpreter) no launch does (`launches_dependently`), weight_prefetch plans no prefetch, and the
    model matches eager."""
    from opfuse.codegen.base import launches_dependently

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)).eval()
    x = torch.randn(3, 16)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32", dependent_launch=True,
                                                               weight_prefetch=True))
    kernels = list(compiled.compiled.kernels.values())
    assert kernels and all(k.kernel.dependent for k in kernels)
    assert all(step.ahead is None for step in compiled.compiled._steps)
    assert not launches_dependently([x])
    with torch.no_grad():
        assert relative_error(compiled(x), model(x)) < 1e-5
