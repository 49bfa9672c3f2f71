"""The library and unfused forms of anchor kernels on the interpreter. Library: the anchor through PyTorch
(cuBLAS/cuDNN on a GPU, ATen on the CPU here), its result read by a generated epilogue kernel; unfused: the group's
ops one by one through PyTorch. For every anchor kind (linear, horizontal linears, batched matmul, conv, grouped,
depthwise, strided 1x1) both must match the float32 reference (the library form with every output element written,
NaN-poisoned), count their launches, and be offered to the autotuner only when asked."""

from __future__ import annotations

import pytest
import torch

from opfuse.codegen.base import recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.codegen.forms import LIBRARY_CONFIGS, LIBRARY_FUSED, UNFUSED, is_flat, is_library, is_unfused
from opfuse.codegen.gemm import _bare_linears, lower_gemm_group
from opfuse.config import FusionConfig
from opfuse.fusion.plan import GroupKind
from opfuse.ir.ops import launches_kernel
from opfuse.runtime.autotune import tune
from tests.kernels.test_conv_kernels import Builder
from tests.kernels.test_gemm_kernels import head_merge, linear


def run_library(b: Builder, outputs: list[str], lower, unfused_launches: int,
                kind: GroupKind = GroupKind.ANCHOR_EPILOGUE):
    """The group lowered and run in its library and unfused forms; checked against the reference and the Triton
    form. Returns the kernel and the library form's results."""
    kernel = lower(b.graph, b.group(outputs, kind), "cpu")
    kernel.epilogue.output_fill = float("nan")
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    fused = [LIBRARY_FUSED] if kernel.library_fused is not None else []    # a chain the library runs itself
    assert kernel.alternatives(library=True) == [*LIBRARY_CONFIGS, *fused, UNFUSED]
    assert kernel.alternatives(library=False) == []
    assert kernel.launches(kernel.configs()[0]) == 1
    triton_form = kernel.run(feeds)
    # computed first: by one generated kernel where the operand nodes compute, else through PyTorch (views)
    prologue = 1 if kernel.operand_kernel is not None else sum(launches_kernel(b.graph, node)
                                                               for node in kernel.operand_nodes)
    for config in fused:
        assert kernel.launches(config) == 1 + prologue
        b.check(outputs, kernel.run(feeds, config))
    for config in LIBRARY_CONFIGS:     # each epilogue tile
        assert kernel.launches(config) == 2 + prologue
        results = kernel.run(feeds, config)
        b.check(outputs, results)
        for x, y in zip(results, triton_form):
            torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    assert kernel.launches(UNFUSED) == unfused_launches
    unfused = kernel.run(feeds, UNFUSED)
    b.check(outputs, unfused)
    for x, y in zip(unfused, triton_form):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-5)
    return kernel, results


def test_linear_with_bias_residual_and_relu():
    b = Builder()
    x = b.input("x", (2, 3, 40))
    r = b.input("r", (2, 3, 24))
    run_library(b, [b.op("relu", b.op("add", linear(b, x, 24), r))], lower_gemm_group, 3, GroupKind.RESIDUAL)


def test_horizontal_linears_keep_their_per_sibling_epilogues():
    b = Builder()
    x = b.input("x", (5, 32))
    ys = [b.op("gelu", b.op("mul", linear(b, x, n), b.const(f"s{n}", b.random(n)))) for n in (7, 12)]
    _, outs = run_library(b, ys, lower_gemm_group, 6, GroupKind.HORIZONTAL)
    assert outs[0].untyped_storage().data_ptr() == outs[1].untyped_storage().data_ptr()


@pytest.mark.parametrize("widths,biases", [((7, 12, 5), (True, False, True)), ((9,), (True,))])
def test_bare_linears_take_one_library_gemm_and_no_epilogue_kernel(widths, biases):
    """Linears with nothing after them but their biases (bert's QKV siblings, one with no bias here): the library
    form is one GEMM with the concatenated bias, its outputs column slices of one result."""
    b = Builder()
    x = b.input("x", (2, 3, 24))
    ys = [linear(b, x, n, bias) for n, bias in zip(widths, biases)]
    kind = GroupKind.HORIZONTAL if len(ys) > 1 else GroupKind.SINGLE
    kernel = lower_gemm_group(b.graph, b.group(ys, kind), "cpu")
    assert kernel.alternatives(library=True) == [LIBRARY_CONFIGS[0], UNFUSED]
    assert kernel.launches(LIBRARY_CONFIGS[0]) == 1 and kernel.launches(UNFUSED) == len(ys)
    outs = kernel.run([b.feeds["x"]], LIBRARY_CONFIGS[0])
    b.check(ys, outs)
    assert [o.shape[-1] for o in outs] == list(widths)
    assert len({o.untyped_storage().data_ptr() for o in outs}) == 1
    b.check(ys, kernel.run([b.feeds["x"]], UNFUSED))


def test_bare_linears_in_another_output_order_with_constants_on_the_device():
    """The outputs follow the group's order, not the anchors'; a sibling without a bias gets zeros made where
    the other biases live (the graph's constants are on the model's device: "meta" stands in for a GPU)."""
    b = Builder()
    x = b.input("x", (4, 16))
    ys = [linear(b, x, 6, True), linear(b, x, 3, False)]
    group = b.group(ys[::-1], GroupKind.HORIZONTAL)
    assert group.outputs == ys[::-1]
    kernel = lower_gemm_group(b.graph, group, "cpu")
    small, large = kernel.run([b.feeds["x"]], LIBRARY_CONFIGS[0])
    assert (small.shape[-1], large.shape[-1]) == (3, 6)
    b.check(ys[::-1], [small, large])
    weight = torch.empty(16, 9, device="meta", dtype=torch.float16)      # the packed [K, 6 + 3] weight
    bias = b.graph.constants[b.graph[ys[0]].inputs[2]].to("meta")
    run = _bare_linears(b.graph, x, weight, ys, [bias, None], ys[::-1])
    outs = run({x: torch.empty(4, 16, device="meta", dtype=torch.float16)})
    assert [(o.device.type, o.dtype, tuple(o.shape)) for o in outs] == [("meta", torch.float16, (4, 3)),
                                                                         ("meta", torch.float16, (4, 6))]


def test_the_unfused_form_frees_each_intermediate_after_its_last_reader():
    b = Builder()
    x = b.input("x", (3, 8))
    y = linear(b, x, 5)
    kernel = lower_gemm_group(b.graph, b.group([b.op("relu", b.op("add", y, b.op("mul", y, y)))]), "cpu")
    names = [node.name for node in kernel._unfused_nodes]     # linear, mul, add, relu
    frees = dict(zip(names, kernel._unfused_frees))
    assert frees == {names[0]: [], names[1]: [], names[2]: [names[0], names[1]], names[3]: [names[2]]}
    b.check(kernel.group.outputs, kernel.run([b.feeds["x"]], UNFUSED))


def test_batched_matmul_two_outputs():
    b = Builder()
    a = b.input("a", (2, 3, 5, 16))
    m = b.input("m", (2, 3, 16, 9))
    product = b.op("matmul", a, m)
    run_library(b, [product, b.op("mul", product, b.const("s", torch.tensor(0.5)))], lower_gemm_group, 2)


@pytest.mark.parametrize("cin,cout,kernel_size,stride,groups", [
    (6, 10, 3, 2, 1),      # implicit GEMM
    (8, 12, 3, 1, 2),      # grouped
    (8, 8, 3, 2, 8),       # depthwise
    (12, 10, 1, 2, 1),     # strided 1x1: a GEMM kernel over a strided view
])
def test_conv_with_bias_and_relu6(cin, cout, kernel_size, stride, groups):
    b = Builder()
    x = b.input("x", (2, cin, 7, 9))
    y = b.op("clamp", b.conv(x, cout, kernel_size, stride, kernel_size // 2, groups=groups), min=0.0, max=6.0)
    kernel, (out,) = run_library(b, [y], lower_conv_group, 2)
    assert out.is_contiguous(memory_format=torch.channels_last)
    # the builder's weight is contiguous (as ONNX initializers come): cuDNN gets it channels-last like the input
    (conv,) = [n for n in b.graph if n.op == "conv2d"]
    assert b.graph.constants[conv.inputs[1]].is_contiguous()
    assert kernel.library_anchor.weight.is_contiguous(memory_format=torch.channels_last)
    # its PyTorch-layout weight exists only while the library form may run, the unfused form's constants only
    # while that may run
    assert kernel.library_anchor.weight is not None and kernel._unfused_constants
    kernel.keep_form(kernel.configs()[0])
    assert kernel.library_anchor.weight is None and kernel._unfused_constants is None
    b.check([y], kernel.run([b.feeds["x"]], LIBRARY_CONFIGS[1]))
    b.check([y], kernel.run([b.feeds["x"]], UNFUSED))
    kernel.keep_form(UNFUSED)     # the form that runs keeps its constants
    assert kernel.library_anchor.weight is None and kernel._unfused_constants


def test_autotuner_times_the_library_form_only_when_asked():
    """With a fake clock that makes the library form fastest, the tuner picks it, with its time, and reports that
    the group's epilogue runs apart from its anchor; with library_anchors off it is never run."""
    b = Builder()
    x = b.input("x", (4, 32))
    kernel = lower_gemm_group(b.graph, b.group([b.op("relu", linear(b, x, 16))]), "cpu")
    values = {name: b.feeds[name] for name in kernel.runtime_inputs}
    timed = []

    def clock(fn):
        fn()
        timed.append(fn)
        return 1e-6 if len(timed) == len(kernel.configs()) + 1 else 5e-6   # the first library form is fastest

    chosen = tune({"g": kernel}, values, FusionConfig(tune_top=None), benchmark=clock, quiet=True)
    assert chosen[kernel.group.name] == LIBRARY_CONFIGS[0]
    assert len(timed) == len(kernel.configs()) + len(LIBRARY_CONFIGS) + 2     # the fused library, the unfused
    assert chosen.seconds == {kernel.group.name: 1e-6} and chosen.slower_fused == {}
    assert chosen.epilogue_apart == {kernel.group.name: "fastest with its anchor through the library, its epilogue "
                                                        "apart: 1.0 us"}
    timed.clear()
    chosen = tune({"g": kernel}, values, FusionConfig(tune_top=None, library_anchors=False), benchmark=clock,
                  quiet=True)
    assert not is_library(chosen[kernel.group.name]) and len(timed) == len(kernel.configs())
    assert chosen.seconds == {kernel.group.name: 5e-6} and chosen.epilogue_apart == {}


@pytest.mark.parametrize("form", ["library", "unfused"])
def test_compile_where_another_form_wins_matches_eager_and_says_so(monkeypatch, tmp_path, form):
    """A whole compile whose (fake) clock finds the library (or the unfused) form fastest for every anchor: the
    model runs it, verification passes, the launches count the extra kernels, and `library_anchors` (or `unfused`)
    names each group with its timing against the best Triton config."""
    import opfuse
    from opfuse.runtime import autotune, compiled as runtime

    monkeypatch.setattr(runtime, "tunes", lambda config, device: bool(config.autotune))
    wins = is_library if form == "library" else is_unfused

    def clock(fn) -> float:
        # the tuner's closures bind the config as a default argument
        config = fn.__defaults__[0] if fn.__defaults__ else None
        return 1e-6 if wins(config) else 1e-3

    monkeypatch.setattr(runtime, "tune", lambda *a, **k: autotune.tune(*a, **k | {"benchmark": clock}))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(8, 8, 3, padding=1, groups=8), torch.nn.Flatten(),
                                torch.nn.Linear(8 * 5 * 5, 3), torch.nn.Tanh()).eval()
    x = torch.randn(2, 3, 5, 5)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(cache_dir=str(tmp_path)))
    anchors = [g.name for g in compiled.plan.groups if g.anchor is not None]
    chosen = compiled.compiled.library_anchors if form == "library" else compiled.compiled.unfused
    other = compiled.compiled.unfused if form == "library" else compiled.compiled.library_anchors
    assert len(anchors) == 3 and set(chosen) == set(anchors) and not other
    for why in chosen.values():    # compared with the Triton configs, not the other forms
        assert ("cuBLAS/cuDNN" if form == "library" else "unfused") in why, why
        assert "1.0 us measured against 1000.0 us" in why, why
        assert not {"library:", "unfused:"} & set(why.split("best Triton config")[1].split()), why
    # library: one epilogue kernel more per anchor; unfused: conv+relu and linear+tanh are two ops each, the
    # depthwise conv one; and the flatten copies (it reads the channels-last activation in NCHW order), which the
    # plan, counting from the graph alone, takes for a view
    assert compiled.launches == compiled.plan.kernel_launches + (3 if form == "library" else 2) + 1
    assert all(check.passed for check in compiled.checks)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-5)


def test_library_forms_compute_the_prologue_first():
    """cuBLAS/cuDNN read the anchor's input as PyTorch computes it: the SE scale, then the 1x1 conv."""
    b = Builder()
    x = b.input("x", (2, 6, 3, 4))
    scaled = b.op("mul", x, b.input("s", (2, 6, 1, 1)))
    kernel, _ = run_library(b, [b.op("relu", b.conv(scaled, 5, 1))], lower_conv_group, 3)
    assert kernel.prologue is not None
    # the scale is one generated kernel, not PyTorch's broadcast mul, and the compile workers see its launch
    prologue = kernel.operand_kernel
    assert prologue is not None and prologue.name.startswith("fused_mul_")
    assert kernel.launches(LIBRARY_CONFIGS[0]) == 3                # the scale, cuDNN, the epilogue
    with recording_launches() as launches:
        kernel.run([b.feeds[name] for name in kernel.runtime_inputs], LIBRARY_CONFIGS[0])
    assert [launch.function for launch in launches][0] == prologue.name
    kernel.keep_form(kernel.configs()[0])                          # a Triton form runs: the prologue kernel goes
    assert kernel._operand_kernel is None


def test_the_library_form_reads_the_prologues_constants():
    """A [C] scale and a scalar: the library form's prologue kernel reads the graph's constants."""
    b = Builder()
    x = b.input("x", (2, 3, 6))
    scaled = b.op("mul", b.op("mul", x, b.const("gamma", b.random(6))), b.const("half", torch.tensor(0.5)))
    kernel, _ = run_library(b, [b.op("relu", linear(b, scaled, 4))], lower_gemm_group, 4)
    assert kernel.operand_kernel is not None and "prologue as a generated kernel" in kernel.describe_library_form()


def test_library_forms_read_a_linears_operand_through_its_views():
    """The head merge before a linear (a permute, then a reshape PyTorch copies): the library forms compute the
    linear's input through the kernel's operand nodes first, as they do a prologue."""
    b = Builder()
    attention = b.input("attention", (2, 3, 5, 6), b.random(2, 3, 5, 6))
    r = b.input("r", (10, 7))
    y = b.op("add", linear(b, head_merge(b, attention), 7), r)
    kernel, _ = run_library(b, [y], lower_gemm_group, 3, GroupKind.RESIDUAL)
    assert [node.op for node in kernel.operand_nodes] == ["permute", "reshape"]


def test_bare_linears_read_their_operand_through_its_views():
    b = Builder()
    attention = b.input("attention", (2, 3, 5, 6), b.random(2, 3, 5, 6))
    y = linear(b, head_merge(b, attention), 7)
    kernel = lower_gemm_group(b.graph, b.group([y], GroupKind.SINGLE), "cpu")
    assert kernel.library_outputs is not None and kernel.operand_nodes
    b.check([y], kernel.run([b.feeds["attention"]], LIBRARY_CONFIGS[0]))


def test_the_library_form_counts_the_copies_its_operand_views_made():
    """Whether the head merge's reshape copies depends on the strides the attention came with, which the graph
    does not say: an attention written head-merged already (our attention kernel's output) is merged by views
    alone. The library form counts what its last run launched (bert-base bs64 on the GPU: counted 3, launched 2)."""
    b = Builder()
    attention = b.input("attention", (2, 3, 5, 6), b.random(2, 3, 5, 6))
    r = b.input("r", (10, 7))
    y = b.op("add", linear(b, head_merge(b, attention), 7), r)
    kernel = lower_gemm_group(b.graph, b.group([y], GroupKind.RESIDUAL), "cpu")
    library = LIBRARY_CONFIGS[0]
    assert kernel.launches(library) == 3                       # before a run: the reshape of a permute copies
    merged = b.feeds["attention"].permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)    # [B, T, H, D] in memory
    b.check([y], kernel.run([merged if name == "attention" else b.feeds[name] for name in kernel.runtime_inputs],
                            library))
    assert kernel.launches(library) == 2                       # the views copied nothing
    kernel.run([b.feeds[name] for name in kernel.runtime_inputs], library)
    assert kernel.launches(library) == 3                       # a contiguous attention: the reshape copies
    kernel.run([merged if name == "attention" else b.feeds[name] for name in kernel.runtime_inputs], UNFUSED)
    assert kernel.launches(UNFUSED) == 2                       # the GEMM, the add: the views copied nothing


def flat_launch(kernel, feeds: list[torch.Tensor]) -> tuple[bool, ...]:
    """The DENSE flags the flat library form's epilogue kernel launches with (operands, then outputs)."""
    with recording_launches() as launches:
        kernel.run(feeds, FLAT)
    (epilogue,) = [launch for launch in launches if launch.function == kernel._flat_epilogue.name]
    return tuple(arg for arg in epilogue.args if isinstance(arg, bool))


FLAT = next(config for config in LIBRARY_CONFIGS if is_flat(config))


def test_the_flat_epilogue_addresses_dense_tensors_flat_and_others_through_their_strides():
    """A conv + residual + ReLU: a channels-last residual is read (and the output written) at the element's
    position in memory, an NCHW one through its strides; both give the reference."""
    b = Builder()
    x = b.input("x", (2, 5, 3, 7))
    r = b.input("r", (2, 6, 3, 7))                   # channels-last, as the builder makes 4-D inputs
    y = b.op("relu", b.op("add", b.conv(x, 6, 3, padding=1), r))
    kernel = lower_conv_group(b.graph, b.group([y], GroupKind.RESIDUAL), "cpu")
    kernel.epilogue.output_fill = float("nan")
    feeds = {name: b.feeds[name] for name in kernel.runtime_inputs}
    assert flat_launch(kernel, list(feeds.values())) == (True, True)
    b.check([y], kernel.run(list(feeds.values()), FLAT))
    nchw = [feed.contiguous() if name == r else feed for name, feed in feeds.items()]
    assert flat_launch(kernel, nchw) == (False, True)
    (out,) = kernel.run(nchw, FLAT)
    b.check([y], [out])
    assert out.is_contiguous(memory_format=torch.channels_last)
    # the kept form keeps its epilogue kernel, any other frees it with its copies of the constants
    kernel.keep_form(FLAT)
    assert kernel._flat_epilogue is not None and kernel.epilogue._flat_form is not None
    kernel.keep_form(UNFUSED)
    assert kernel._flat_epilogue is None and kernel.epilogue._flat_form is None


def test_the_flat_epilogue_poisons_its_outputs_whenever_the_test_asks():
    """`output_fill` set after the flat form first ran still reaches it (tests poison outputs with NaN)."""
    b = Builder()
    x = b.input("x", (2, 5, 3, 4))
    y = b.op("relu", b.conv(x, 6, 1))
    kernel = lower_conv_group(b.graph, b.group([y]), "cpu")
    feeds = [b.feeds[name] for name in kernel.runtime_inputs]
    kernel.run(feeds, FLAT)
    kernel.epilogue.output_fill = float("nan")
    with recording_launches():               # no kernel runs: what it would have written stays poisoned
        (out,) = kernel.run(feeds, FLAT)
    assert torch.isnan(out).all()


def test_the_flat_epilogue_of_a_batched_matmul_and_of_a_permuted_tail():
    """Batch dims on the grid (a dense [B, H, M, N] output), and ConvNeXt's tail permuted back to NCHW, whose
    [C, 1, 1] layer scale becomes a per-channel vector and whose residual is read through the permute."""
    b = Builder()
    a, m = b.input("a", (2, 3, 5, 16)), b.input("m", (2, 3, 16, 9))
    product = b.op("matmul", a, m)
    kernel, _ = run_library(b, [b.op("mul", product, b.const("s", torch.tensor(0.5)))], lower_gemm_group, 2)
    assert flat_launch(kernel, [b.feeds[name] for name in kernel.runtime_inputs]) == (True,)

    b = Builder()
    x = b.input("x", (2, 3, 5, 6))
    skip = b.input("skip", (2, 7, 3, 5))
    nchw = b.op("permute", linear(b, x, 7), dims=(0, 3, 1, 2))
    y = b.op("add", b.op("mul", nchw, b.const("gamma", b.random(7, 1, 1))), skip)
    kernel, (out,) = run_library(b, [y], lower_gemm_group, 3, GroupKind.RESIDUAL)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert flat_launch(kernel, [b.feeds[name] for name in kernel.runtime_inputs]) == (True, True)


def test_the_tuner_frees_the_other_forms_of_each_kernel_as_soon_as_it_has_chosen():
    """Every form ran while the tuner timed a conv (cuDNN's channels-last weight, the flat epilogue's constants,
    the unfused form's weights were made); once the Triton config wins, they are gone before the next kernel."""
    b = Builder()
    x = b.input("x", (2, 5, 4, 4))
    kernel = lower_conv_group(b.graph, b.group([b.op("relu", b.conv(x, 6, 3, padding=1))]), "cpu")
    made = {}

    def clock(fn):
        fn()
        made.update(library=kernel.library_anchor.weight is not None, flat=kernel._flat_epilogue is not None,
                    unfused=kernel._unfused_constants is not None) if is_unfused(fn.__defaults__[0]) else None
        return 5e-6 if is_library(fn.__defaults__[0]) or is_unfused(fn.__defaults__[0]) else 1e-6

    chosen = tune({"g": kernel}, {x: b.feeds[x]}, FusionConfig(tune_top=None), benchmark=clock, quiet=True)
    assert made == {"library": True, "flat": True, "unfused": True}      # the unfused form is timed last
    assert not is_library(chosen[kernel.group.name]) and not is_unfused(chosen[kernel.group.name])
    assert kernel.library_anchor.weight is None and kernel._flat_epilogue is None
    assert kernel._unfused_constants is None and kernel.epilogue._flat_form is None
