"""Builders of the zoo's torchvision and transformers models, and the weights that make them look trained.

Entry points: `vision_builder(factory)` and `text_builder(name)` return the zero-argument builders that
`opfuse.bench.zoo.BUILTIN_MODELS` registers (`build_seeded` there runs them under a fixed seed);
`build_text_model(name, **config_overrides)` builds a transformers model directly (tests use tiny sizes).

Random weights are not left as the libraries initialise them: a freshly initialised network is not what a user
deploys, and it hides what a compiler does. Batch norms with unit scale and zero statistics fold into nothing;
ConvNeXt's layer scales start at 1e-6, so its residual branches contribute nothing; full-size random residual
branches make activations grow block after block until fp16 rounding dominates. So:

- batch norms get random affine parameters and the running statistics of a seeded calibration batch, and the
  last BN of every residual branch a small scale (`calibrate_batch_norms`, `residual_tail_batch_norms`);
- layer scales are set to [0.1, 0.2] (`set_layer_scales`), zero-initialised layers (ViT's head) get their
  default initialisation (`reset_zero_layers`);
- layer and RMS norms get weights near 1 and biases near 0 (`randomise_layer_norms`);
- everything else keeps its library's initialiser (transformers: normal, std 0.02 or T5's own).

transformers is imported only when a text model is built, so `import opfuse` never needs it.
"""

from __future__ import annotations

import importlib
import operator
from typing import Callable

import torch
import torch.fx
import torch.nn as nn

from opfuse.ir.graph import GraphError

SEED = 0


# ---- trained-looking weights ------------------------------------------------------------------------

def _is_norm_with_weight(module: nn.Module) -> bool:
    """LayerNorm and its subclasses (torchvision's LayerNorm2d), nn.RMSNorm, and library norms named so
    (transformers' T5LayerNorm, an RMS norm with a weight only)."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return True
    return type(module).__name__.endswith(("LayerNorm", "RMSNorm")) and isinstance(
        getattr(module, "weight", None), nn.Parameter)


def randomise_layer_norms(model: nn.Module) -> None:
    """Layer and RMS norm weights near 1 and biases near 0 but not equal to them, so fusing them is visible."""
    for module in model.modules():
        if not _is_norm_with_weight(module):
            continue
        weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
        if isinstance(weight, nn.Parameter):
            weight.copy_(1.0 + 0.1 * torch.randn_like(weight))
        if isinstance(bias, nn.Parameter):
            bias.copy_(0.1 * torch.randn_like(bias))


def set_layer_scales(model: nn.Module, low: float = 0.1, high: float = 0.2) -> None:
    """Every parameter named `layer_scale` (ConvNeXt's per-channel residual branch scale, 1e-6 at init) drawn
    uniformly from [low, high]: the branches contribute, and stay small as in a trained model."""
    for name, parameter in model.named_parameters():
        if name.rsplit(".", 1)[-1] == "layer_scale":
            parameter.uniform_(low, high)


def reset_zero_layers(model: nn.Module) -> None:
    """Layers initialised to zero (torchvision ViT's classification head) get their default initialisation:
    a trained layer is not zero, and a zero output hides every numerical error of what comes before it."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() >= 2 and not weight.any() \
                and hasattr(module, "reset_parameters"):
            module.reset_parameters()


_ADDS = {operator.add, operator.iadd, torch.add}


def _merged_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The tensors a residual merge joins: the two operands of an add, or the parts of a concatenation (the
    channel-split blocks of ShuffleNet concatenate an untouched half with the branch); [] for other nodes."""
    if (node.op == "call_function" and node.target in _ADDS) or (
            node.op == "call_method" and node.target in ("add", "add_")):
        operands = node.args[:2]
    elif node.op == "call_function" and node.target is torch.cat and isinstance(node.args[0], (list, tuple)):
        operands = node.args[0]
    else:
        return []
    operands = [a for a in operands if isinstance(a, torch.fx.Node)]
    return operands if len(operands) >= 2 else []


def _producing_batch_norm(node: torch.fx.Node, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The batch norm whose output reaches `node` through parameter-free single-input ops (ReLU, stochastic
    depth, dropout, identity), or None."""
    while True:
        module = modules.get(node.target) if node.op == "call_module" else None
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return module
        parameter_free = module is None or next(module.parameters(), None) is None
        if node.op not in ("call_module", "call_function", "call_method") or not parameter_free \
                or len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]


def residual_tail_batch_norms(model: nn.Module) -> list[nn.Module]:
    """The last BN of every residual branch, in registration order.

    The rule, over the traced graph rather than block classes: where tensors merge (an add, or a concatenation),
    the branch is the operand with the strictly longest path from the graph's inputs (the shortcut is the block's
    input itself, a slice of it, or a short projection of it); its tail is the BN producing it. That finds
    ResNet/ResNeXt `bn3` / `bn2`, MobileNetV2's `conv[-1]`, EfficientNet MBConv's `block[-1][1]` (through
    stochastic depth), RegNet's `f.c[1]` (not the `proj` BN of a projection shortcut) and ShuffleNetV2's
    `branch2[-2]` (through its ReLU); DenseNet's concatenated layers end in a conv, so none there.

    Trained networks keep these branches small; random ones with full-size branches are chaotic: fp16 rounding
    grows block after block. Relative error of eager fp16 against fp64 on the CPU, BN scales in [0.5, 1]
    everywhere -> with the tails in [0.1, 0.2]: resnet50 2.8e-2 -> 1.5e-3 and mobilenet_v2 1.3e-2 -> 3.5e-3
    (batch 2), shufflenet_v2_x1_0 1.5e-2 -> 3.8e-3 (batch 1, 224 px).
    """
    if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
        return []
    graph = torch.fx.symbolic_trace(model).graph
    modules = dict(model.named_modules())
    depth: dict[torch.fx.Node, int] = {}
    for node in graph.nodes:   # topological order
        depth[node] = 1 + max((depth[n] for n in node.all_input_nodes), default=0)
    tails: set[int] = set()
    for node in graph.nodes:
        operands = sorted(_merged_operands(node), key=depth.__getitem__)
        if not operands or depth[operands[-1]] == depth[operands[-2]]:
            continue   # nothing merged, or no operand stands out as the branch
        batch_norm = _producing_batch_norm(operands[-1], modules)
        if batch_norm is not None:
            tails.add(id(batch_norm))
    return [m for m in model.modules() if id(m) in tails]


def calibrate_batch_norms(model: nn.Module, image_size: int = 128) -> None:
    """Random BN affine parameters, then running statistics set to those of a seeded calibration batch.

    With momentum None a BN's running statistics after one training-mode batch are exactly that batch's, so in
    eval mode every BN normalises its input much like a trained one: activations stay of the order of one. Only
    the BNs run in training mode: dropout and stochastic depth stay off during calibration.
    """
    batch_norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not batch_norms:
        return
    momenta = [bn.momentum for bn in batch_norms]
    for bn in batch_norms:
        bn.weight.uniform_(0.5, 1.0)
        bn.bias.normal_(0.0, 0.1)
        bn.reset_running_stats()
        bn.momentum = None
    for bn in residual_tail_batch_norms(model):
        bn.weight.uniform_(0.1, 0.2)
    generator = torch.Generator().manual_seed(SEED + 1)
    model.eval()
    for bn in batch_norms:
        bn.train()
    model(torch.randn(2, 3, image_size, image_size, generator=generator))
    for bn, momentum in zip(batch_norms, momenta):
        bn.momentum = momentum
    model.eval()


# ---- torchvision ------------------------------------------------------------------------------------

def vision_builder(factory: Callable[..., nn.Module]) -> Callable[[], nn.Module]:
    """A builder of `factory(weights=None)` with trained-looking norms, layer scales and batch norms."""
    def build() -> nn.Module:
        model = factory(weights=None)
        reset_zero_layers(model)
        randomise_layer_norms(model)
        set_layer_scales(model)
        calibrate_batch_norms(model)
        return model
    return build


# ---- transformers -----------------------------------------------------------------------------------

# name -> (config class, model class, config arguments, description); sizes are the base models'
TEXT_MODELS: dict[str, tuple[str, str, dict, str]] = {
    "bert": ("BertConfig", "BertModel", {"attn_implementation": "sdpa"},
             "transformers BertModel, bert-base sizes (12 layers, hidden 768, 12 heads), SDPA attention"),
    "gpt2": ("GPT2Config", "GPT2Model", {"use_cache": False, "attn_implementation": "sdpa"},
             "transformers GPT2Model, gpt2 (124M) sizes (12 layers, hidden 768, 12 heads), SDPA attention, "
             "no KV cache"),
    # T5Config()'s defaults are t5-small's; these are t5-base's (ReLU feed-forward, as the original checkpoint)
    "t5_encoder": ("T5Config", "T5EncoderModel",
                   {"d_model": 768, "num_layers": 12, "num_heads": 12, "d_ff": 3072, "d_kv": 64,
                    "feed_forward_proj": "relu", "vocab_size": 32128, "use_cache": False},
                   "transformers T5EncoderModel, t5-base sizes (12 layers, d_model 768, 12 heads, d_ff 3072, "
                   "ReLU)"),
}


def import_transformers(purpose: str):
    """The transformers module, or a GraphError saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as error:
        raise GraphError(f"{purpose} needs the 'transformers' package, which is not installed ({error}); "
                         "install it with: pip install 'opfuse[zoo]'") from error


class LastHiddenState(nn.Module):
    """A transformers model called with token ids (and, where given, an attention mask: 1 attends, 0 masks),
    returning its last hidden state [batch, seq, hidden].

    The transformers module is `self.model`, unchanged: what runs is the library's own code path.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        if attention_mask is None:
            return self.model(input_ids=input_ids).last_hidden_state
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def text_model_config(name: str, **config_overrides):
    """The transformers Config of `name` in `TEXT_MODELS`, its sizes changed by `config_overrides`."""
    config_class, _, arguments, _ = TEXT_MODELS[name]
    transformers = import_transformers(f"built-in model {name!r}")
    return getattr(transformers, config_class)(**{**arguments, **config_overrides})


def build_text_model(name: str, **config_overrides) -> LastHiddenState:
    """The transformers model `name` of `TEXT_MODELS` (sizes changed by `config_overrides`) with layer norms
    near (1, 0), wrapped to return its last hidden state. Run it under `build_seeded` for fixed weights."""
    config = text_model_config(name, **config_overrides)
    transformers = import_transformers(f"built-in model {name!r}")
    model = getattr(transformers, TEXT_MODELS[name][1])(config)
    randomise_layer_norms(model)
    return LastHiddenState(model).eval()


def text_builder(name: str) -> Callable[[], nn.Module]:
    """A zero-argument builder of `build_text_model(name)`."""
    def build() -> nn.Module:
        return build_text_model(name)
    return build
