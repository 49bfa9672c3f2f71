"""Whole models on the GPU (issues 3, 15 and 16): the fp16 compile matches eager, and launches what `opfuse analyze`
says it does. Run on the device machine: OPFUSE_GPU_TESTS=1 python3 -m pytest -m gpu tests/gpu"""

import copy

import pytest
import torch

from opfuse.bench.zoo import ZOO_MODELS

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]
MODELS = ["resnet18", "resnet50", "mobilenet_v2", "bert-base"]


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("name", MODELS)
def test_model_matches_eager_and_plan(name, batch):
    # tuning picks among configs that compute the same function; it is off here to keep the run short
    compile_and_check(name, batch, dict(autotune=False))


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_launches_what_analyze_says(name, batch):
    """Every zoo model as a user compiles it (tuned: library and unfused forms where they measure faster): what
    `opfuse analyze` reports after the compile is what its CUDA graph launches, cuBLAS/cuDNN helpers included."""
    compile_and_check(name, batch, {})


@pytest.mark.parametrize("name", ZOO_MODELS)
def test_zoo_model_in_float32_matches_float64_eager(name):
    """Every zoo model compiled in float32 (tuned, as a user compiles it) matches float64 eager on fresh inputs
    within float32's bound on a GPU (tf32 where PyTorch's own settings allow it: `opfuse.numerics.tolerance`), or,
    where eager PyTorch in float32 is itself over that bound, within EAGER_ERROR_MARGIN of eager's error."""
    import opfuse
    from opfuse.bench.zoo import load_builtin
    from opfuse.numerics import EAGER_ERROR_MARGIN, relative_error, tolerance

    model, inputs = load_builtin(name, batch=1)
    reference_model = copy.deepcopy(model).double().cuda()
    model = model.float().cuda()
    inputs = tuple(x.cuda() for x in inputs)
    compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype="float32"))
    torch.manual_seed(1)
    # fresh images; token ids shuffled along the sequence (the same vocabulary, another sentence)
    fresh = tuple(torch.randn_like(x) if x.is_floating_point() else x[..., torch.randperm(x.shape[-1])]
                  for x in inputs)
    with torch.inference_mode():
        for _ in range(1 + compiled.compiled.cuda_graph_warmup):    # the warm-up call(s), then the capture
            out = compiled(*fresh)
        reference = reference_model(*(x.double() if x.is_floating_point() else x for x in fresh))
        eager_error = relative_error(model(*fresh), reference)
    error, bound = relative_error(out, reference), tolerance("float32", "cuda")
    assert error < bound or error <= EAGER_ERROR_MARGIN * eager_error, (error, eager_error)


def compile_and_check(name: str, batch: int, config: dict):
    """Compile a built-in model in fp16 with `FusionConfig(dtype="float16", **config)` and check it: the model's
    state is unchanged, the output matches fp32 eager within 1e-2, and the launches `opfuse.analyze` then reports
    (the compile's record), the compiled model's count and the kernels the profiler sees in one replay of its CUDA
    graph are one number. Returns the compiled model."""
    import opfuse
    from opfuse.bench.harness import kernel_profile
    from opfuse.bench.zoo import load_builtin
    from opfuse.numerics import relative_error

    model, inputs = load_builtin(name, batch=batch)
    reference_model = copy.deepcopy(model).float().cuda()
    model = model.half().cuda()
    inputs = tuple(x.cuda() for x in inputs)
    fp16_inputs = tuple(x.half().contiguous(memory_format=torch.channels_last) if x.is_floating_point() else x
                        for x in inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}

    fusion_config = opfuse.FusionConfig(dtype="float16", **config)
    compiled = opfuse.compile(model, fp16_inputs, fusion_config)

    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    as_compiled = opfuse.analyze(model, fp16_inputs, fusion_config).as_compiled
    assert as_compiled is not None and not as_compiled.failed, as_compiled
    assert as_compiled.forward_ms is not None and as_compiled.forward_ms > 0     # a replay timed at the compile
    with torch.inference_mode():
        for _ in range(1 + compiled.compiled.cuda_graph_warmup):    # the warm-up call(s), then the capture
            out = compiled(*fp16_inputs)
        reference = reference_model(*inputs)
    assert relative_error(out.float(), reference.float()) < 1e-2
    graph = compiled.compiled._cuda_graph
    assert graph is not None, compiled.compiled.cuda_graph_error
    with torch.inference_mode():
        kernels, _ = kernel_profile(graph.replay, ())
    print(name, batch, "launches: planned", compiled.plan.kernel_launches, "analyze", as_compiled.launches,
          "graph", compiled.launches, "profiled", kernels, f"forward {as_compiled.forward_ms:.3f} ms at the compile")
    assert as_compiled.launches == compiled.launches == kernels, (as_compiled.summary(), compiled.launches, kernels)
    return compiled


@pytest.mark.parametrize("name,batch", [("resnet50", 1), ("bert-base", 64)])
def test_tuned_model_with_library_anchors(name, batch):
    """Autotuned with the library form on offer, one config a kernel: whatever it picks matches eager, and the
    kernels per forward are what the compiled model counts."""
    compiled = compile_and_check(name, batch, dict(tune_top=1))
    print(name, batch, "library anchors:", len(compiled.compiled.library_anchors), "unfused:",
          len(compiled.compiled.unfused), "of", len(compiled.compiled.kernels))
