"""A mixture of experts and the other library calls on the GPU: the grouped GEMM kernel in every config against a
float64 reference (empty experts, uneven groups, rows past the last expert); transformers' Mixtral compiled end to
end in float32 and float16 with nothing through PyTorch, captured in one CUDA graph (the routing reads nothing back
to the host) and replayed against eager; scatters and grid sampling replayed in a CUDA graph likewise.

Run on the device machine: OPFUSE_GPU_TESTS=1 PYTHONPATH=. python3 -m pytest -q -m gpu tests/gpu/test_moe_gpu.py
"""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")]


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_grouped_gemm_every_config(dtype):
    from opfuse.codegen.lower import lower_group
    from opfuse.fusion.plan import GroupKind
    from tests.kernels.builders import rel_err
    from tests.unit.test_ops_alone import Grouped, grouped_reference

    ends = [0, 130, 130, 900, 1000]                       # an empty first and third expert, 24 rows past the last
    b = Grouped(dtype)
    out = b.moe(1024, 512, 704, ends)
    kernel = lower_group(b.graph, b.group([out], GroupKind.OPAQUE), "cuda")
    want = grouped_reference(b.feeds["x"], b.graph.constants["w"], ends)
    for config in kernel.configs():
        got, = kernel.run([b.feeds[name].cuda() for name in kernel.runtime_inputs], config)
        assert rel_err(got, want) < (1e-3 if dtype == "float32" else 1e-2), config
        assert got[1000:].abs().sum() == 0


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_mixtral_compiles_into_one_cuda_graph(dtype):
    transformers = pytest.importorskip("transformers")
    import opfuse
    from tests.kernels.builders import rel_err
    from tests.unit.test_ops_alone import mixtral

    torch.manual_seed(0)
    model = mixtral(transformers, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=64, num_local_experts=8, vocab_size=1024).cuda()
    ids = torch.randint(0, 1024, (2, 96), device="cuda")
    reference = model(ids).last_hidden_state.detach()
    model = model.to(getattr(torch, dtype))
    fusion = opfuse.FusionConfig(dtype=dtype)
    analysis = opfuse.analyze(model, (ids,), fusion)
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    compiled = opfuse.compile(model, (ids,), fusion)
    with torch.inference_mode():
        for _ in range(2 + compiled.compiled.cuda_graph_warmup):
            out = compiled(ids).last_hidden_state
    assert compiled.compiled._cuda_graph is not None, compiled.compiled.cuda_graph_error
    with torch.inference_mode():
        eager = model(ids).last_hidden_state
    # fp16 routing may pick other experts on near-ties than float32's: bounded by eager fp16's own error, doubled
    bound = 1e-4 if dtype == "float32" else max(2e-2, 2 * rel_err(eager, reference))
    assert rel_err(out, reference) < bound, (rel_err(out, reference), rel_err(eager, reference))


def test_scatters_and_grid_sampling_replay_in_one_cuda_graph():
    """The library calls that write at run-time indices (scatter, index_add, an accumulating index_put) and grid
    sampling run in the model's CUDA graph: new indices each call, results equal to eager's."""
    import opfuse
    from tests.unit.test_ops_alone import Scatters

    torch.manual_seed(0)
    x, grid = torch.randn(3, 2, 2, 3, device="cuda"), torch.rand(3, 4, 5, 2, device="cuda") * 2.4 - 1.2

    def indices():
        return (torch.stack([torch.randperm(12)[:3] for _ in range(3)]).cuda(), torch.randint(0, 3, (2,)).cuda())

    model = Scatters().eval()
    compiled = opfuse.compile(model, (x, *indices(), grid), opfuse.FusionConfig(dtype="float32"))
    with torch.inference_mode():
        for _ in range(2 + compiled.compiled.cuda_graph_warmup):
            index, rows = indices()
            got, want = compiled(x, index, rows, grid), model(x, index, rows, grid)
        assert compiled.compiled._cuda_graph is not None, compiled.compiled.cuda_graph_error
        for ours, theirs in zip(got, want):
            torch.testing.assert_close(ours, theirs)
