"""The built-in model zoo: seeded, deterministic models and inputs; fp16-safe activations; model specs."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from opfuse.bench.zoo import (BUILTIN_MODELS, BertConfig, BertEncoder, build_seeded, load_builtin,
                              resolve_model, token_inputs)
from opfuse.ir.graph import GraphError


def test_builtin_names():
    assert set(BUILTIN_MODELS) == {"resnet18", "resnet50", "mobilenet_v2", "bert-base"}


def test_load_builtin_is_seeded_eval_and_leaves_the_global_rng_alone():
    rng_before = torch.random.get_rng_state()
    model, (x,) = load_builtin("resnet18", batch=2, image_size=32)
    assert torch.equal(torch.random.get_rng_state(), rng_before)
    assert not model.training
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32 and x.abs().sum() > 0
    again, (y,) = load_builtin("resnet18", batch=2, image_size=32)
    assert torch.equal(x, y)
    state, state_again = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)


def test_batch_norms_are_not_trivial():
    model, _ = load_builtin("resnet18", image_size=32)
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        assert not torch.allclose(bn.running_mean, torch.zeros_like(bn.running_mean))
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
        assert not torch.allclose(bn.weight, torch.ones_like(bn.weight))
        assert bn.bias.abs().sum() > 0


def test_tiny_bert_shapes_and_inputs():
    config = BertConfig(vocab_size=100, hidden=32, layers=2, heads=4, ffn=64, max_positions=32)
    model = build_seeded(lambda: BertEncoder(config))
    (ids,) = token_inputs(3, 20, config.vocab_size)
    assert ids.dtype == torch.int64 and ids.shape == (3, 20) and 0 <= ids.min() and ids.max() < 100
    assert len(set(ids.flatten().tolist())) > 1
    with torch.no_grad():
        out = model(ids)
    assert out.shape == (3, 20, 32) and torch.isfinite(out).all()
    with pytest.raises(ValueError, match="multiple of"):
        BertEncoder(BertConfig(hidden=30, heads=4, layers=1))


def max_activation(model: nn.Module, inputs: tuple) -> float:
    """The largest |value| any module outputs in a forward pass (forward hooks on every module)."""
    peaks = []

    def record(module, args, output):
        if isinstance(output, torch.Tensor) and output.is_floating_point():
            peaks.append(output.abs().max())
    hooks = [m.register_forward_hook(record) for m in model.modules()]
    try:
        with torch.no_grad():
            model(*inputs)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(peaks).max().item()


def test_resnet18_activations_stay_fp16_safe():
    model, inputs = load_builtin("resnet18", image_size=64)
    assert 1.0 < max_activation(model, inputs) < 1e4


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2", "bert-base"])
def test_builtin_activations_stay_fp16_safe(name):
    model, inputs = load_builtin(name, batch=1, seq_len=128, image_size=224)
    assert 1.0 < max_activation(model, inputs) < 1e4


def test_resolve_builtin():
    model, (x,), display = resolve_model("resnet18", batch=3)
    assert display == "resnet18" and x.shape[0] == 3 and isinstance(model, nn.Module)


def test_resolve_factory_spec(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    model, (x,), display = resolve_model("zoo_factory_example:tiny_mlp", batch=5)
    assert display == "tiny_mlp" and x.shape == (5, 8) and model(x).shape == (5, 4)
    model, inputs, _ = resolve_model("zoo_factory_example:fixed_size", batch=5)
    assert isinstance(model, nn.Tanh) and len(inputs) == 1 and inputs[0].shape == (3,)


def test_resolve_errors_are_clear(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    with pytest.raises(GraphError, match="resnet18, resnet50, mobilenet_v2, bert-base"):
        resolve_model("resnet-18")
    with pytest.raises(GraphError, match="cannot import module 'no_such_module_xyz'"):
        resolve_model("no_such_module_xyz:build")
    with pytest.raises(GraphError, match="has no callable 'missing'"):
        resolve_model("os.path:missing")
    with pytest.raises(GraphError, match=r"must return \(model, example_inputs\)"):
        resolve_model("zoo_factory_example:not_a_pair")
    with pytest.raises(GraphError, match="unknown built-in model"):
        load_builtin("vgg16")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_builtin_cnns_are_well_conditioned_in_fp16(name):
    """Eager fp16 stays within 5e-3 of fp64 (random residual branches at full size would give 1e-2 to 3e-2, which
    no fp16 compiler could then match within the 1e-2 acceptance bound)."""
    import copy

    from opfuse.numerics import relative_error

    model, (x,) = load_builtin(name, batch=1)
    with torch.no_grad():
        reference = copy.deepcopy(model).double()(x.double())
        half = copy.deepcopy(model).half()(x.half())
    assert relative_error(half, reference) < 5e-3
