"""The built-in model zoo: seeded, deterministic models and inputs; fp16-safe activations; model specs."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from opfuse.bench.zoo import (BUILTIN_MODELS, ZOO_MODELS, BertConfig, BertEncoder, build_seeded, load_builtin,
                              resolve_model, token_inputs)
from opfuse.bench.zoo_models import (build_text_model, reset_zero_layers, residual_tail_batch_norms,
                                     text_model_config)
from opfuse.ir.graph import GraphError


def test_builtin_names():
    assert ZOO_MODELS == ("resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "regnet_y_400mf",
                          "resnext50_32x4d", "densenet121", "shufflenet_v2_x1_0", "vit_b_16", "swin_t",
                          "bert", "gpt2", "t5_encoder")
    assert set(BUILTIN_MODELS) == {"resnet18", "bert-base", *ZOO_MODELS}
    assert list(BUILTIN_MODELS)[:4] == ["resnet18", "resnet50", "mobilenet_v2", "bert-base"]
    text = {name for name, entry in BUILTIN_MODELS.items() if entry.input_kind == "tokens"}
    assert text == {"bert-base", "bert", "gpt2", "t5_encoder"}
    assert {entry.input_kind for entry in BUILTIN_MODELS.values()} == {"image", "tokens"}


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
@pytest.mark.parametrize("name", ["bert-base", *ZOO_MODELS])
def test_builtin_models_are_fp16_safe_and_well_conditioned(name):
    """Activations stay far inside fp16's range and eager fp16 stays within 6e-3 of fp64, well under the 1e-2 bound
    the compiler verifies against (random residual branches at full size give 1e-2 to 3e-2, which no fp16
    compiler could then match). DenseNet-121 is the highest, 5.2e-3: it has no residual branch to keep small.
    The output must not be trivially small: a zero output (ViT's zero-initialised head) has no error."""
    import copy

    from opfuse.numerics import relative_error

    model, inputs = load_builtin(name, batch=1, seq_len=128, image_size=224)
    assert 1.0 < max_activation(model, inputs) < 1e4

    def run(dtype):
        cast = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
        with torch.no_grad():
            return copy.deepcopy(model).to(dtype)(*cast)

    reference = run(torch.float64)
    assert reference.std() > 0.1
    assert relative_error(run(torch.float16), reference) < 6e-3


# ---- how the zoo's weights are made to look trained ----------------------------------------------------

def expected_residual_tails(model: nn.Module) -> list[nn.Module]:
    """The last BN of each residual branch, named block class by block class (what the rule must find)."""
    from torchvision.models.efficientnet import MBConv
    from torchvision.models.mobilenetv2 import InvertedResidual
    from torchvision.models.regnet import ResBottleneckBlock
    from torchvision.models.resnet import BasicBlock, Bottleneck
    from torchvision.models.shufflenetv2 import InvertedResidual as ShuffleBlock

    tails = []
    for module in model.modules():
        if isinstance(module, Bottleneck):
            tails.append(module.bn3)
        elif isinstance(module, BasicBlock):
            tails.append(module.bn2)
        elif isinstance(module, (InvertedResidual, MBConv)) and module.use_res_connect:
            tails.append(module.conv[-1] if isinstance(module, InvertedResidual) else module.block[-1][1])
        elif isinstance(module, ResBottleneckBlock):
            tails.append(module.f.c[1])
        elif isinstance(module, ShuffleBlock):
            tails.append(module.branch2[-2])   # branch2 ends BN, ReLU
    return tails


@pytest.mark.parametrize("name, count", [("resnet18", 8), ("resnext50_32x4d", 16), ("mobilenet_v2", 10),
                                         ("efficientnet_b0", 9), ("regnet_y_400mf", 16),
                                         ("shufflenet_v2_x1_0", 16), ("densenet121", 0)])
def test_residual_tails_are_the_last_batch_norm_of_each_branch(name, count):
    import torchvision

    model = getattr(torchvision.models, name)(weights=None)
    tails = residual_tail_batch_norms(model)
    assert len(tails) == count
    assert [id(bn) for bn in tails] == [id(bn) for bn in expected_residual_tails(model)]
    projections = [m.proj[1] for m in model.modules() if getattr(m, "proj", None) is not None]
    assert all(id(bn) not in map(id, tails) for bn in projections)


@pytest.mark.parametrize("name", ["efficientnet_b0", "regnet_y_400mf", "shufflenet_v2_x1_0"])
def test_zoo_cnns_build_deterministically_with_small_residual_branches(name):
    rng_before = torch.random.get_rng_state()
    model, (x,) = load_builtin(name, image_size=64)
    again, _ = load_builtin(name, image_size=64)
    assert torch.equal(torch.random.get_rng_state(), rng_before) and not model.training
    state, state_again = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    tails = {id(bn) for bn in residual_tail_batch_norms(model)}
    batch_norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert tails and len(tails) < len(batch_norms)
    for bn in batch_norms:
        low, high = (0.1, 0.2) if id(bn) in tails else (0.5, 1.0)
        assert low <= bn.weight.min() and bn.weight.max() <= high
        assert not torch.allclose(bn.running_var, torch.ones_like(bn.running_var))
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()


def test_convnext_layer_scales_and_layer_norms_look_trained():
    model = build_seeded(BUILTIN_MODELS["convnext_tiny"].build)
    scales = [p for n, p in model.named_parameters() if n.endswith("layer_scale")]
    assert len(scales) == 18   # one per block: depths 3, 3, 9, 3
    assert all(0.1 <= s.min() and s.max() <= 0.2 for s in scales)
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert {type(m).__name__ for m in norms} == {"LayerNorm", "LayerNorm2d"}
    for norm in norms:
        assert not torch.allclose(norm.weight, torch.ones_like(norm.weight)) and norm.bias.abs().sum() > 0
        assert (norm.weight - 1).abs().max() < 1.0


def test_zero_initialised_layers_get_their_default_initialisation():
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    nn.init.zeros_(model[0].bias)
    nn.init.zeros_(model[1].weight)
    nn.init.zeros_(model[1].bias)
    first = model[0].weight.clone()
    with torch.no_grad():
        reset_zero_layers(model)
    assert model[1].weight.all() and model[1].bias.any()
    assert torch.equal(model[0].weight, first) and not model[0].bias.any()   # a zero bias alone is left


# ---- transformers models -------------------------------------------------------------------------------

TINY_TEXT_CONFIGS = {
    "bert": dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64),
    "gpt2": dict(vocab_size=100, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "t5_encoder": dict(vocab_size=100, d_model=32, num_layers=2, num_heads=4, d_kv=8, d_ff=64),
}


@pytest.mark.parametrize("name, model_class", [("bert", "BertModel"), ("gpt2", "GPT2Model"),
                                               ("t5_encoder", "T5EncoderModel")])
def test_tiny_text_models_return_the_last_hidden_state(name, model_class):
    def build():
        return build_text_model(name, **TINY_TEXT_CONFIGS[name])

    model, again = build_seeded(build), build_seeded(build)
    assert type(model.model).__name__ == model_class and not model.training
    state, state_again = model.state_dict(), again.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    norms = [m for m in model.modules() if type(m).__name__.endswith("LayerNorm")]   # T5LayerNorm too
    assert norms and all(not torch.allclose(m.weight, torch.ones_like(m.weight)) for m in norms)
    (ids,) = token_inputs(2, 12, model.config.vocab_size)
    with torch.no_grad():
        out = model(ids)
    assert isinstance(out, torch.Tensor) and out.shape == (2, 12, 32) and torch.isfinite(out).all()


def test_text_models_have_base_sizes():
    bert = text_model_config("bert")
    assert (bert.hidden_size, bert.num_hidden_layers, bert.num_attention_heads, bert.intermediate_size,
            bert.vocab_size) == (768, 12, 12, 3072, 30522)
    assert bert._attn_implementation == "sdpa"
    gpt2 = text_model_config("gpt2")
    assert (gpt2.n_embd, gpt2.n_layer, gpt2.n_head, gpt2.vocab_size, gpt2.use_cache) == (768, 12, 12, 50257, False)
    t5 = text_model_config("t5_encoder")   # t5-base, not T5Config()'s t5-small defaults
    assert (t5.d_model, t5.num_layers, t5.num_heads, t5.d_ff, t5.d_kv, t5.vocab_size) == (768, 12, 12, 3072, 64,
                                                                                          32128)
    assert t5.feed_forward_proj == "relu"


def test_text_models_need_transformers_and_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)   # `import transformers` now raises ImportError
    with pytest.raises(GraphError, match=r"'bert' needs the 'transformers' package.*pip install 'opfuse\[zoo\]'"):
        load_builtin("bert")
    load_builtin("resnet18", image_size=32)   # the other built-ins do not need it


@pytest.mark.slow   # a fresh interpreter importing torch and opfuse: ~9 s on 2 cores
def test_importing_opfuse_does_not_import_transformers():
    code = ("import sys, opfuse, opfuse.bench.zoo; "
            "assert 'transformers' not in sys.modules, 'transformers was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
