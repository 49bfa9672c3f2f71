"""Whole models on the GPU (issue 3 acceptance): fp16 compile matches eager, and launches no more kernels than
the plan says. Run on the device machine: OPFUSE_GPU_TESTS=1 python3 -m pytest -m gpu tests/gpu"""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]

MODELS = ["resnet18", "resnet50", "mobilenet_v2", "bert-base"]


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("name", MODELS)
def test_model_matches_eager_and_plan(name, batch):
    # tuning picks among configs that compute the same function; it is off here to keep the run short
    compile_and_check(name, batch, dict(autotune=False))


def compile_and_check(name: str, batch: int, config: dict):
    """Compile a built-in model in fp16 with `FusionConfig(dtype="float16", **config)` and check it: the model's
    state is unchanged, `opfuse.analyze` then reports the compiled model's launches, the output matches fp32 eager
    within 1e-2, and the kernels launched per forward (torch.profiler) are no more than the runtime counts, plus the
    helper kernels cuBLAS/cuDNN add to the groups that run through them (profiled alone). Returns the compiled
    model."""
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
    # what analyze says after the compile is what the compiled model runs (its launches, whatever the tuning chose)
    as_compiled = opfuse.analyze(model, fp16_inputs, fusion_config).as_compiled
    assert as_compiled is not None and as_compiled.launches == compiled.launches, as_compiled
    with torch.inference_mode():
        out = compiled(*fp16_inputs)
        reference = reference_model(*inputs)
    assert relative_error(out.float(), reference.float()) < 1e-2
    compiled.compiled.set_cuda_graph(False)
    with torch.inference_mode():
        kernels, _ = kernel_profile(compiled, fp16_inputs)
    # the library form (an anchor through cuBLAS/cuDNN, chosen by the autotuner) adds the epilogue's launch, the
    # unfused form one launch per op of its group after the first
    runtime = compiled.compiled
    library, unfused = runtime.library_anchors, runtime.unfused
    extra = sum(runtime.kernels[g].launches(runtime.configs[g]) - 1 for g in [*library, *unfused])
    assert compiled.launches <= compiled.plan.kernel_launches + extra
    # cuBLAS/cuDNN choose their own kernels (a convolution may take two): those groups are profiled alone, and
    # everything else launches no more than the runtime counts
    helpers = 0
    if library or unfused:
        values = runtime.collect_values(*fp16_inputs)
        for g in [*library, *unfused]:
            kernel, config = runtime.kernels[g], runtime.configs[g]
            args = [values[n] for n in kernel.runtime_inputs]
            with torch.inference_mode():
                alone, _ = kernel_profile(lambda *a: kernel.run(a, config), args)
            assert alone >= kernel.launches(config), (g, alone, kernel.launches(config))   # never over-counted
            helpers += alone - kernel.launches(config)
        print(name, batch, "cuBLAS/cuDNN helper kernels:", helpers)
    assert kernels <= compiled.launches + helpers, (compiled.fallbacks, library, unfused)
    return compiled


@pytest.mark.parametrize("name,batch", [("resnet50", 1), ("bert-base", 64)])
def test_tuned_model_with_library_anchors(name, batch):
    """Autotuned with the library form on offer (the default): whatever it picks matches eager, and the kernels
    per forward stay within what the compiled model counts."""
    compiled = compile_and_check(name, batch, dict(tune_top=1))
    print(name, batch, "library anchors:", len(compiled.compiled.library_anchors), "unfused:",
          len(compiled.compiled.unfused), "of", len(compiled.compiled.kernels))
