"""The built-in model zoo: models and example inputs for benchmarks, tests and the CLI.

Entry points: `load_builtin(name, batch, seq_len, image_size) -> (model, inputs)` and
`resolve_model(spec, batch) -> (model, inputs, display_name)`, where a spec is a built-in name or
``package.module:factory``.

Weights are random but fixed (seeded) and made to look trained (`opfuse.bench.zoo_models`, which also holds the
builders): batch norms with random affine parameters and the running statistics of a seeded calibration batch,
small residual branches, layer norms near (1, 0). That keeps activations of the order of one through the whole
network, as in a trained model, so fp16 stays finite and BN folding changes the numbers.

`ZOO_MODELS` names the benchmark zoo: ten torchvision models and three transformers models built from their
Config classes (`bert`, `gpt2`, `t5_encoder`; transformers is imported only when one is built:
``pip install 'opfuse[zoo]'``). `bert-base` is the project's own BERT encoder, written here and configurable so
tests can use a tiny one.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
import torchvision

from opfuse.bench.zoo_models import SEED, TEXT_MODELS, randomise_layer_norms, text_builder, vision_builder
from opfuse.ir.graph import GraphError


# ---- BERT ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BertConfig:
    """Sizes of a BERT encoder; the defaults are bert-base."""

    vocab_size: int = 30522
    hidden: int = 768
    layers: int = 12
    heads: int = 12
    ffn: int = 3072
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12


class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings (token type 0 for every token), then LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden)
        self.norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.register_buffer("position_ids", torch.arange(config.max_positions)[None], persistent=False)
        self.register_buffer("token_type_ids", torch.zeros(1, config.max_positions, dtype=torch.long),
                             persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.shape[1]
        x = (self.word_embeddings(input_ids)
             + self.token_type_embeddings(self.token_type_ids[:, :seq_len])
             + self.position_embeddings(self.position_ids[:, :seq_len]))
        return self.norm(x)


class BertLayer(nn.Module):
    """Self-attention (separate Q, K, V projections, no mask) and a GELU feed-forward, each post-LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__()
        if config.hidden % config.heads:
            raise ValueError(f"hidden size {config.hidden} is not a multiple of {config.heads} heads")
        self.heads = config.heads
        self.query = nn.Linear(config.hidden, config.hidden)
        self.key = nn.Linear(config.hidden, config.hidden)
        self.value = nn.Linear(config.hidden, config.hidden)
        self.attention_output = nn.Linear(config.hidden, config.hidden)
        self.attention_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden, config.ffn)
        self.activation = nn.GELU()
        self.output = nn.Linear(config.ffn, config.hidden)
        self.output_norm = nn.LayerNorm(config.hidden, eps=config.layer_norm_eps)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        """[batch, seq, hidden] -> [batch, heads, seq, head_dim]."""
        batch, seq_len, hidden = x.shape
        return x.reshape(batch, seq_len, self.heads, hidden // self.heads).permute(0, 2, 1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq_len, hidden = x.shape
        q, k, v = self.split_heads(self.query(x)), self.split_heads(self.key(x)), self.split_heads(self.value(x))
        context = F.scaled_dot_product_attention(q, k, v)
        context = context.permute(0, 2, 1, 3).reshape(batch, seq_len, hidden)
        x = self.attention_norm(x + self.attention_output(context))
        return self.output_norm(x + self.output(self.activation(self.intermediate(x))))


class BertEncoder(nn.Module):
    """Token ids int64 [batch, seq] -> last hidden state [batch, seq, hidden]."""

    def __init__(self, config: BertConfig = BertConfig()):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.layers))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x)
        return x


# ---- seeded inputs and the registry -----------------------------------------------------------------

def _bert_base() -> nn.Module:
    model = BertEncoder(BertConfig())
    randomise_layer_norms(model)
    return model


def image_inputs(batch: int, image_size: int) -> tuple[torch.Tensor]:
    """A seeded NCHW float32 image batch, standard normal (what a normalised image looks like)."""
    generator = torch.Generator().manual_seed(SEED)
    return (torch.randn(batch, 3, image_size, image_size, generator=generator),)


def token_inputs(batch: int, seq_len: int, vocab_size: int = BertConfig.vocab_size) -> tuple[torch.Tensor]:
    """Seeded random token ids, int64 [batch, seq_len]."""
    generator = torch.Generator().manual_seed(SEED)
    return (torch.randint(0, vocab_size, (batch, seq_len), generator=generator),)


@dataclass(frozen=True)
class BuiltinModel:
    """A zoo entry: how to build the model (weights seeded by `load_builtin`) and what input it takes."""

    build: Callable[[], nn.Module]
    input_kind: str  # "image" (NCHW float32) or "tokens" (int64 ids)
    description: str


def _text(name: str) -> BuiltinModel:
    return BuiltinModel(text_builder(name), "tokens", TEXT_MODELS[name][3])


_vision = torchvision.models
BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "resnet18": BuiltinModel(vision_builder(_vision.resnet18), "image", "torchvision ResNet-18"),
    "resnet50": BuiltinModel(vision_builder(_vision.resnet50), "image", "torchvision ResNet-50"),
    "mobilenet_v2": BuiltinModel(vision_builder(_vision.mobilenet_v2), "image", "torchvision MobileNetV2"),
    "bert-base": BuiltinModel(_bert_base, "tokens", "BERT-base encoder (12 layers, hidden 768, 12 heads)"),
    "efficientnet_b0": BuiltinModel(vision_builder(_vision.efficientnet_b0), "image", "torchvision EfficientNet-B0"),
    "convnext_tiny": BuiltinModel(vision_builder(_vision.convnext_tiny), "image",
                                  "torchvision ConvNeXt-Tiny (layer scales in [0.1, 0.2])"),
    "regnet_y_400mf": BuiltinModel(vision_builder(_vision.regnet_y_400mf), "image", "torchvision RegNetY-400MF"),
    "resnext50_32x4d": BuiltinModel(vision_builder(_vision.resnext50_32x4d), "image",
                                    "torchvision ResNeXt-50 32x4d"),
    "densenet121": BuiltinModel(vision_builder(_vision.densenet121), "image", "torchvision DenseNet-121"),
    "shufflenet_v2_x1_0": BuiltinModel(vision_builder(_vision.shufflenet_v2_x1_0), "image",
                                       "torchvision ShuffleNetV2 x1.0"),
    "vit_b_16": BuiltinModel(vision_builder(_vision.vit_b_16), "image", "torchvision ViT-B/16 (224 px only)"),
    "swin_t": BuiltinModel(vision_builder(_vision.swin_t), "image", "torchvision Swin-T"),
    "bert": _text("bert"),
    "gpt2": _text("gpt2"),
    "t5_encoder": _text("t5_encoder"),
}

# The benchmark zoo: CNNs, vision transformers and transformers' text models (transformers needed for the last 3)
ZOO_MODELS: tuple[str, ...] = (
    "resnet50", "mobilenet_v2", "efficientnet_b0", "convnext_tiny", "regnet_y_400mf", "resnext50_32x4d",
    "densenet121", "shufflenet_v2_x1_0", "vit_b_16", "swin_t", "bert", "gpt2", "t5_encoder",
)


def build_seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` under a fixed seed, without disturbing the caller's random state; returned in eval mode."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(SEED)
        return build().eval()


def load_builtin(name: str, batch: int = 1, seq_len: int = 128, image_size: int = 224
                 ) -> tuple[nn.Module, tuple]:
    """A built-in model (eval mode, seeded random weights) and seeded example inputs for it."""
    entry = BUILTIN_MODELS.get(name)
    if entry is None:
        raise GraphError(f"unknown built-in model {name!r}; built-ins: {', '.join(BUILTIN_MODELS)}")
    model = build_seeded(entry.build)
    if entry.input_kind == "image":
        return model, image_inputs(batch, image_size)
    return model, token_inputs(batch, seq_len, model.config.vocab_size)


def resolve_model(spec: str, batch: int = 1) -> tuple[nn.Module, tuple, str]:
    """A built-in name or ``package.module:factory`` -> (model, example inputs, display name).

    The factory is called with ``batch=batch`` when it takes a `batch` argument and must return
    ``(model, example_inputs)``.
    """
    if spec in BUILTIN_MODELS:
        model, inputs = load_builtin(spec, batch=batch)
        return model, inputs, spec
    if ":" not in spec:
        raise GraphError(f"unknown model {spec!r}: give a built-in ({', '.join(BUILTIN_MODELS)}) "
                         "or package.module:factory")
    module_name, _, factory_name = spec.partition(":")
    if not module_name or not factory_name or not factory_name.isidentifier():
        raise GraphError(f"model spec {spec!r}: give it as package.module:factory (a module to import and the name "
                         "of a function in it)")
    # import_module runs the named module (and its parent packages' __init__), nothing else: no sibling modules
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise GraphError(f"model spec {spec!r}: cannot import module {module_name!r} ({error})") from error
    except Exception as error:   # the module itself failed: a syntax error, an exception at import time
        raise GraphError(f"model spec {spec!r}: importing module {module_name!r} failed "
                         f"({type(error).__name__}: {error})") from error
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise GraphError(f"model spec {spec!r}: module {module_name} ({module.__file__}) has no callable "
                         f"{factory_name!r}")
    parameters = inspect.signature(factory).parameters
    takes_batch = "batch" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    try:
        result = factory(batch=batch) if takes_batch else factory()
    except Exception as error:
        raise GraphError(f"model spec {spec!r}: {factory_name}() raised {type(error).__name__}: {error}") from error
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise GraphError(f"model spec {spec!r}: {factory_name}() in {module.__file__} must return "
                         f"(model, example_inputs), got {type(result).__name__}")
    model, inputs = result
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return model, inputs, factory_name
