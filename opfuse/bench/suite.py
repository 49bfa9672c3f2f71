"""The coverage suite: what of a broad set of timm and transformers models runs through opfuse's kernels.

    python -m opfuse.bench.suite [--only REGEX] [--family NAME] [--batch N] [--workers N] [--json FILE]
                                 [--markdown FILE]

For every model of `SUITE` (CNNs, ViTs, hybrids, MLP-mixers, encoders, decoders, encoder-decoders, audio, MoE,
state-space; random weights, nothing downloaded) it runs what `opfuse analyze MODEL --dtype fp16 --batch N` runs on
the CPU (batch 1 by default; another repeats each example input's first row, `at_batch`): the model in float16
(channels-last for images, `protocol_form`), captured, prepared and planned, every group lowered. Per model it
reports whether it analysed, what runs through PyTorch (opaque ops by their ATen name, and the groups that launch
work yet get no kernel, by code and ops), and the launches of the compiled model; over the suite, the share of
models with nothing through PyTorch (views cost nothing and do not count).

transformers models are built from their Config classes with small sizes (2 layers, hidden 256, head dim 64, a
vocabulary of 1024): the architecture, and so every op kind the analysis meets, is the full model's, in a fraction
of the capture time. timm models are the library's own definitions at their default input size. A library that
is not installed (timm is optional: ``pip install 'opfuse[suite]'``) skips its models, and says so.

Each model runs in a process of its own, forked from this one once torch and the libraries are imported (a model
that hangs or crashes costs its own slot, `--timeout`). Entry points: `run_suite(models, workers) -> [ModelResult]`,
`analyze_model(entry) -> ModelResult`, `summarize(results)`, `markdown(results)`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn as nn

SEED = 0
Inputs = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class SuiteModel:
    """One model of the suite: `build()` returns (model, example inputs) in float32; `library` must import."""

    name: str
    family: str
    library: str
    build: Callable[[], tuple[nn.Module, Inputs]]


@dataclass
class ModelResult:
    """What the analysis of one model found. `status`: clean (nothing through PyTorch), pytorch (something is),
    failed (capture or analysis raised: `error`), skipped (its library is not installed: `error` says which). A
    group whose kernel is a library call alone (torch's attention for head dims the template cannot tile) is no run
    through PyTorch, but is listed (`library_calls`)."""

    name: str
    family: str
    library: str
    status: str
    error: str = ""
    launches: int = 0                   # kernel launches of the compiled model (groups, and PyTorch's ops)
    pytorch_launches: int = 0           # of those, the launches of ops run through PyTorch
    opaque: dict[str, int] = field(default_factory=dict)     # ATen op -> opaque nodes of it
    no_kernel: dict[str, int] = field(default_factory=dict)  # "code: ops" -> groups with no kernel for another reason
    library_calls: dict[str, int] = field(default_factory=dict)   # ops -> groups whose kernel is a library call
    examples: dict[str, str] = field(default_factory=dict)   # "code: ops" -> one group's reason, in words
    seconds: float = 0.0

    @property
    def analysed(self) -> bool:
        return self.status in ("clean", "pytorch")


# ---- building the models -------------------------------------------------------------------------------------

def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(SEED)


def timm_model(name: str, family: str, **kwargs) -> SuiteModel:
    """A timm model at its default input size (batch 1)."""
    def build() -> tuple[nn.Module, Inputs]:
        import timm

        model = timm.create_model(name, pretrained=False, **kwargs).eval()
        size = tuple(model.pretrained_cfg.get("input_size", (3, 224, 224)))
        return model, (torch.randn(1, *size, generator=_generator()),)
    return SuiteModel(name, family, "timm", build)


class Call(nn.Module):
    """A transformers model called with one tensor as keyword `argument` (or as each of several: an encoder-decoder's
    input_ids and decoder_input_ids), returning its first output tensor (the last hidden state): what runs is the
    library's own forward."""

    def __init__(self, model: nn.Module, argument: str | tuple[str, ...], **fixed):
        super().__init__()
        self.model, self.fixed = model, fixed
        self.arguments = (argument,) if isinstance(argument, str) else tuple(argument)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.model(**dict.fromkeys(self.arguments, x), **self.fixed)
        hidden = getattr(output, "last_hidden_state", None)
        return hidden if hidden is not None else output[0]


# the small sizes every text model shares (each config spells them its own way)
HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ = 256, 2, 4, 512, 1024, 128


def hf_model(name: str, family: str, model_class: str, config_class: str, config: dict, inputs: str = "text",
             seq: int = SEQ, part: str | None = None, argument: str | tuple[str, ...] | None = None,
             **call) -> SuiteModel:
    """A transformers model from `config_class(**config)`; `inputs`: text (token ids [1, seq]), image ([1, 3, 224,
    224] pixels, or the config's image_size), features ([1, mels, frames] for speech encoders: `seq` frames), frames
    ([1, seq, features]: Speech2Text's filter banks), wave ([1, seq] samples); `part`: the attribute to analyse
    instead of the whole model (a speech model's encoder); `argument`: the forward's keyword for the input, where it
    is not the usual one, or several keywords the input is given as (an encoder-decoder's token ids, as both)."""
    argument_name = argument

    def build() -> tuple[nn.Module, Inputs]:
        import transformers

        configuration = getattr(transformers, config_class)(**config)
        model = getattr(transformers, model_class)(configuration).eval()
        if part is not None:
            model = getattr(model, part)
        generator = _generator()
        if inputs == "text":
            argument, x = "input_ids", torch.randint(0, config.get("vocab_size", VOCAB), (1, seq),
                                                     generator=generator)
        elif inputs == "image":
            size = config.get("image_size", 224)
            channels = config.get("num_channels", 3)
            argument, x = "pixel_values", torch.randn(1, channels, size, size, generator=generator)
        elif inputs == "features":
            argument, x = "input_features", torch.randn(1, config["num_mel_bins"], seq, generator=generator)
        elif inputs == "frames":
            argument, x = "input_features", torch.randn(1, seq, config["input_feat_per_channel"], generator=generator)
        elif inputs == "wave":
            argument, x = "input_values", torch.randn(1, seq, generator=generator)
        else:
            raise ValueError(f"unknown inputs {inputs!r}")
        return Call(model, argument_name or argument, **call).eval(), (x,)
    return SuiteModel(name, family, "transformers", build)


def _llama_like(**extra) -> dict:
    return dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=2,
                intermediate_size=FFN, vocab_size=VOCAB, max_position_embeddings=512, use_cache=False) | extra


BERT_LIKE = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
                 vocab_size=VOCAB, max_position_embeddings=512)
TOKENS_IN_VOCABULARY = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)   # defaults lie past the small vocabulary
VISION_HF = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN)
NO_CACHE = {"use_cache": False}
T5_SMALL = dict(d_model=HIDDEN, num_layers=LAYERS, num_heads=HEADS, d_kv=64, d_ff=FFN, vocab_size=VOCAB,
                use_cache=False)
SEQ2SEQ = dict(d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
               decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
               use_cache=False)

SUITE: list[SuiteModel] = [
    # CNNs
    timm_model("resnet50", "cnn"),
    timm_model("resnetv2_50x1_bit", "cnn"),
    timm_model("cspdarknet53", "cnn"),
    timm_model("darknet53", "cnn"),
    timm_model("efficientnet_b0", "cnn"),
    timm_model("tf_efficientnet_b0", "cnn"),
    timm_model("mobilenetv3_large_100", "cnn"),
    timm_model("mobilenetv4_conv_small", "cnn"),
    timm_model("regnety_016", "cnn"),
    timm_model("convnext_atto", "cnn"),
    timm_model("convnextv2_atto", "cnn"),
    timm_model("densenet121", "cnn"),
    timm_model("dla34", "cnn"),
    timm_model("dpn68", "cnn"),
    timm_model("ghostnet_100", "cnn"),
    timm_model("ghostnetv2_100", "cnn"),
    timm_model("hrnet_w18_small", "cnn"),
    timm_model("inception_v3", "cnn"),
    timm_model("mixnet_s", "cnn"),
    timm_model("nfnet_l0", "cnn"),
    timm_model("rexnet_100", "cnn"),
    timm_model("res2net50_26w_4s", "cnn"),
    timm_model("resnest14d", "cnn"),
    timm_model("selecsls42b", "cnn"),
    timm_model("repvgg_a2", "cnn"),
    timm_model("lcnet_050", "cnn"),
    timm_model("mobileone_s0", "cnn"),
    timm_model("hgnetv2_b0", "cnn"),
    timm_model("ese_vovnet19b_dw", "cnn"),
    timm_model("regnetz_b16", "cnn"),
    timm_model("vgg11", "cnn"),
    timm_model("inception_next_tiny", "cnn"),
    timm_model("rdnet_tiny", "cnn"),
    timm_model("mambaout_femto", "cnn"),
    # ViTs
    timm_model("deit_tiny_patch16_224", "vit"),
    timm_model("vit_small_patch16_224", "vit"),
    timm_model("eva02_tiny_patch14_224", "vit"),
    timm_model("swin_tiny_patch4_window7_224", "vit"),
    timm_model("swinv2_tiny_window8_256", "vit"),
    timm_model("xcit_nano_12_p16_224", "vit"),
    timm_model("davit_tiny", "vit"),
    timm_model("pvt_v2_b0", "vit"),
    timm_model("cait_xxs24_224", "vit"),
    timm_model("crossvit_tiny_240", "vit"),
    timm_model("beit_base_patch16_224", "vit"),
    timm_model("hiera_tiny_224", "vit"),
    timm_model("gcvit_xxtiny", "vit"),
    timm_model("focalnet_tiny_srf", "vit"),
    timm_model("volo_d1_224", "vit"),
    # hybrids
    timm_model("halonet26t", "hybrid"),
    timm_model("botnet26t_256", "hybrid"),
    timm_model("lambda_resnet26t", "hybrid"),       # its lambda layer's positional conv is a 3-D conv
    timm_model("nextvit_small", "hybrid"),          # its attention pools keys with avg_pool1d
    timm_model("coatnet_nano_rw_224", "hybrid"),
    timm_model("maxvit_nano_rw_256", "hybrid"),
    timm_model("levit_128s", "hybrid"),
    timm_model("mobilevit_xxs", "hybrid"),
    timm_model("mobilevitv2_050", "hybrid"),
    timm_model("edgenext_xx_small", "hybrid"),
    timm_model("efficientvit_b0", "hybrid"),
    timm_model("fastvit_t8", "hybrid"),
    timm_model("efficientformer_l1", "hybrid"),
    timm_model("efficientformerv2_s0", "hybrid"),
    timm_model("tiny_vit_5m_224", "hybrid"),
    timm_model("poolformer_s12", "hybrid"),
    # MLP-mixers
    timm_model("mixer_b16_224", "mlp"),
    timm_model("resmlp_12_224", "mlp"),
    timm_model("gmlp_ti16_224", "mlp"),
    timm_model("convmixer_768_32", "mlp"),
    timm_model("sequencer2d_s", "mlp"),
    # encoders
    hf_model("bert", "encoder", "BertModel", "BertConfig", BERT_LIKE),
    hf_model("roberta", "encoder", "RobertaModel", "RobertaConfig", BERT_LIKE),
    hf_model("distilbert", "encoder", "DistilBertModel", "DistilBertConfig",
             dict(dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN, vocab_size=VOCAB)),
    hf_model("albert", "encoder", "AlbertModel", "AlbertConfig", BERT_LIKE | dict(embedding_size=128)),
    hf_model("electra", "encoder", "ElectraModel", "ElectraConfig", BERT_LIKE | dict(embedding_size=128)),
    hf_model("deberta_v2", "encoder", "DebertaV2Model", "DebertaV2Config", BERT_LIKE),
    hf_model("squeezebert", "encoder", "SqueezeBertModel", "SqueezeBertConfig",     # grouped 1-D convs
             BERT_LIKE | dict(embedding_size=HIDDEN)),
    hf_model("convbert", "encoder", "ConvBertModel", "ConvBertConfig",              # span-based dynamic conv
             BERT_LIKE | dict(embedding_size=HIDDEN)),
    hf_model("fnet", "encoder", "FNetModel", "FNetConfig",                           # Fourier token mixing
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, intermediate_size=FFN, vocab_size=VOCAB)),
    hf_model("mobilebert", "encoder", "MobileBertModel", "MobileBertConfig",
             dict(num_hidden_layers=LAYERS, vocab_size=VOCAB)),
    hf_model("modernbert", "encoder", "ModernBertModel", "ModernBertConfig",
             BERT_LIKE | TOKENS_IN_VOCABULARY | dict(cls_token_id=1, sep_token_id=2)),
    hf_model("t5_encoder", "encoder", "T5EncoderModel", "T5Config", T5_SMALL),
    hf_model("hf_vit", "vit", "ViTModel", "ViTConfig", VISION_HF, inputs="image"),
    hf_model("clip_vision", "vit", "CLIPVisionModel", "CLIPVisionConfig", VISION_HF, inputs="image"),
    hf_model("dinov2", "vit", "Dinov2Model", "Dinov2Config", VISION_HF, inputs="image"),
    hf_model("segformer", "hybrid", "SegformerModel", "SegformerConfig", {}, inputs="image"),
    # decoders
    hf_model("gpt2", "decoder", "GPT2Model", "GPT2Config",
             dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, use_cache=False)),
    hf_model("gptj", "decoder", "GPTJModel", "GPTJConfig",
             dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, rotary_dim=32, vocab_size=VOCAB, use_cache=False)),
    hf_model("gpt_neox", "decoder", "GPTNeoXModel", "GPTNeoXConfig", BERT_LIKE | NO_CACHE),
    hf_model("llama", "decoder", "LlamaModel", "LlamaConfig", _llama_like()),
    hf_model("mistral", "decoder", "MistralModel", "MistralConfig", _llama_like()),
    hf_model("qwen2", "decoder", "Qwen2Model", "Qwen2Config", _llama_like()),
    hf_model("qwen3", "decoder", "Qwen3Model", "Qwen3Config", _llama_like(head_dim=64)),
    hf_model("gemma2", "decoder", "Gemma2Model", "Gemma2Config", _llama_like(head_dim=64)),
    hf_model("phi3", "decoder", "Phi3Model", "Phi3Config", _llama_like(**TOKENS_IN_VOCABULARY)),
    hf_model("falcon", "decoder", "FalconModel", "FalconConfig",
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, vocab_size=VOCAB,
                  use_cache=False)),
    hf_model("opt", "decoder", "OPTModel", "OPTConfig",
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=FFN,
                  word_embed_proj_dim=HIDDEN, vocab_size=VOCAB, use_cache=False)),
    hf_model("bloom", "decoder", "BloomModel", "BloomConfig",
             dict(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, use_cache=False)),
    # encoder-decoder
    hf_model("mbart", "encoder-decoder", "MBartModel", "MBartConfig",               # counts its real tokens
             SEQ2SEQ),
    hf_model("pegasus", "encoder-decoder", "PegasusModel", "PegasusConfig", SEQ2SEQ,    # decoder ids given
             argument=("input_ids", "decoder_input_ids")),
    hf_model("marian", "encoder-decoder", "MarianModel", "MarianConfig",
             SEQ2SEQ | dict(decoder_vocab_size=VOCAB, pad_token_id=0), argument=("input_ids", "decoder_input_ids")),
    hf_model("m2m100", "encoder-decoder", "M2M100Model", "M2M100Config", SEQ2SEQ,       # sinusoidal positions
             argument=("input_ids", "decoder_input_ids")),
    hf_model("blenderbot", "encoder-decoder", "BlenderbotModel", "BlenderbotConfig", SEQ2SEQ,
             argument=("input_ids", "decoder_input_ids")),
    hf_model("t5", "encoder-decoder", "T5Model", "T5Config", T5_SMALL, argument=("input_ids", "decoder_input_ids")),
    hf_model("bart", "encoder-decoder", "BartModel", "BartConfig",
             SEQ2SEQ),
    # audio
    hf_model("whisper_encoder", "audio", "WhisperModel", "WhisperConfig",
             dict(d_model=HIDDEN, encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                  decoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_ffn_dim=FFN, vocab_size=VOCAB,
                  num_mel_bins=80, max_source_positions=100, decoder_start_token_id=1, **TOKENS_IN_VOCABULARY),
             inputs="features", seq=200, part="encoder"),
    hf_model("speech2text", "audio", "Speech2TextModel", "Speech2TextConfig",           # conv subsampler + GLU
             SEQ2SEQ | dict(num_mel_bins=80, input_feat_per_channel=80, max_source_positions=200), inputs="frames",
             seq=200, part="encoder"),
    hf_model("wav2vec2", "audio", "Wav2Vec2Model", "Wav2Vec2Config", VISION_HF, inputs="wave", seq=16000),
    hf_model("hubert", "audio", "HubertModel", "HubertConfig", VISION_HF, inputs="wave", seq=16000),
    hf_model("ast", "audio", "ASTModel", "ASTConfig", VISION_HF | dict(max_length=128, num_mel_bins=128),
             inputs="features", seq=128, argument="input_values"),
    # MoE
    hf_model("mixtral", "moe", "MixtralModel", "MixtralConfig",
             _llama_like(num_local_experts=4, num_experts_per_tok=2)),
    hf_model("qwen2_moe", "moe", "Qwen2MoeModel", "Qwen2MoeConfig",
             _llama_like(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=FFN,
                         shared_expert_intermediate_size=FFN)),
    hf_model("olmoe", "moe", "OlmoeModel", "OlmoeConfig", _llama_like(num_experts=4, num_experts_per_tok=2)),
    hf_model("jamba", "moe", "JambaModel", "JambaConfig",                          # experts and Mamba layers
             _llama_like(num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1,
                         expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16, use_mamba_kernels=False),
             seq=32),
    # state-space
    hf_model("mamba", "ssm", "MambaModel", "MambaConfig",
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, state_size=16, vocab_size=VOCAB, use_cache=False),
             seq=32),
    hf_model("mamba2", "ssm", "Mamba2Model", "Mamba2Config",
             dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_heads=8, head_dim=64, state_size=16,
                  n_groups=1, vocab_size=VOCAB, chunk_size=32, use_cache=False), seq=32),
]


# ---- analysing one model -------------------------------------------------------------------------------------

def library_problem(library: str) -> str | None:
    """None when `library` imports, else why it does not (its models are skipped)."""
    try:
        importlib.import_module(library)
    except ImportError as error:
        return f"{library} is not installed ({error})"
    return None


def at_batch(inputs: Inputs, batch: int) -> Inputs:
    """A suite model's example inputs (batch 1) at `batch`: each input's first row repeated."""
    if batch == 1:
        return inputs
    return tuple(x.expand(batch, *x.shape[1:]).contiguous() for x in inputs)


def analyze_model(entry: SuiteModel, batch: int = 1) -> ModelResult:
    """Build `entry`, take it to float16 (channels-last images) and analyse it at `batch` as `opfuse analyze --dtype
    fp16` does on the CPU; the result says what runs through PyTorch."""
    from opfuse.api import analyze
    from opfuse.bench.harness import protocol_form
    from opfuse.config import FusionConfig

    result = ModelResult(entry.name, entry.family, entry.library, "failed")
    problem = library_problem(entry.library)
    if problem is not None:
        result.status, result.error = "skipped", problem
        return result
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(SEED)
            model, inputs = entry.build()
            model, inputs = protocol_form(model, at_batch(inputs, batch), torch.float16, "cpu")
            analysis = analyze(model, inputs, config=FusionConfig(dtype="float16"), name=entry.name)
    except Exception as error:     # a model the analysis cannot take is a result, not a crash of the suite
        result.error = _first_line(error)
        result.seconds = time.perf_counter() - start
        return result
    result.seconds = time.perf_counter() - start
    record_pytorch(result, analysis)
    return result


def record_pytorch(result: ModelResult, analysis) -> None:
    """Fill `result` from `analysis`: launches, and what runs through PyTorch by opaque op and by group kind."""
    from opfuse.fusion.reasons import Code
    from opfuse.ir.ops import get_op, launches_kernel

    graph = analysis.prepared
    groups = {g.name: g for g in analysis.plan.groups}
    result.launches = analysis.fused.kernel_launches
    opaque: Counter = Counter()
    no_kernel: Counter = Counter()
    for name, reason in analysis.pytorch_groups.items():
        nodes = [graph[n] for n in groups[name].nodes]
        result.pytorch_launches += sum(launches_kernel(graph, node) for node in nodes)
        opaque.update(node.attrs.get("target", "?") for node in nodes if node.op == "opaque")
        if reason.code is Code.OPAQUE and all(node.op == "opaque" for node in nodes):
            continue
        ops = "+".join(dict.fromkeys(node.op for node in nodes if node.op != "opaque"))
        key = f"{reason.code.value}: {ops}"
        no_kernel[key] += 1
        result.examples.setdefault(key, reason.text[:300])
    result.opaque, result.no_kernel = dict(opaque.most_common()), dict(no_kernel.most_common())
    calls = Counter("+".join(dict.fromkeys(graph[n].op for n in groups[name].nodes if not get_op(graph[n].op).alias))
                    for name in analysis.library_calls)
    result.library_calls = dict(calls.most_common())
    result.status = "pytorch" if analysis.pytorch_groups else "clean"


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:400]


# ---- running many ---------------------------------------------------------------------------------------------

def _child(entry: SuiteModel, batch: int, threads: int, connection) -> None:
    torch.set_num_threads(threads)
    try:
        result = analyze_model(entry, batch)
    except BaseException as error:     # analyze_model catches the model's errors; this is opfuse's or the suite's
        result = ModelResult(entry.name, entry.family, entry.library, "failed",
                             error=_first_line(error) + " | " + traceback.format_exc(limit=3)[-300:])
    connection.send(asdict(result))
    connection.close()


def run_suite(models: Sequence[SuiteModel], workers: int = 1, timeout: float = 900.0,
              on_result: Callable[[ModelResult], None] | None = None, batch: int = 1) -> list[ModelResult]:
    """Analyse every model at `batch`, `workers` at a time, each in a process forked from this one (0: all in this
    process, no timeout); results in `models` order. A model past `timeout` seconds is stopped and counted as failed."""
    if workers <= 0:
        results = []
        for entry in models:
            results.append(analyze_model(entry, batch))
            if on_result:
                on_result(results[-1])
        return results
    for library in {entry.library for entry in models}:    # imported before forking: children start warm
        if library_problem(library) is None:
            importlib.import_module(library)
    import opfuse.api  # noqa: F401
    context = multiprocessing.get_context("fork")
    threads = max(1, (os.cpu_count() or 1) // workers)
    pending = list(enumerate(models))
    running: dict[int, tuple] = {}
    results: dict[int, ModelResult] = {}
    while pending or running:
        while pending and len(running) < workers:
            index, entry = pending.pop(0)
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(entry, batch, threads, send), daemon=True)
            process.start()
            send.close()
            running[index] = (entry, process, receive, time.monotonic())
        ready = multiprocessing.connection.wait([r[2] for r in running.values()], timeout=1.0)
        for index, (entry, process, receive, started) in list(running.items()):
            result = None
            if receive in ready:
                try:
                    result = ModelResult(**receive.recv())
                except EOFError:    # the process died without a word: a crash (out of memory, a segfault)
                    process.join()
                    result = ModelResult(entry.name, entry.family, entry.library, "failed",
                                         error=f"the analysis process died (exit code {process.exitcode})")
            elif time.monotonic() - started > timeout:
                process.kill()
                result = ModelResult(entry.name, entry.family, entry.library, "failed",
                                     error=f"timed out after {timeout:.0f} s", seconds=timeout)
            if result is not None:
                process.join()
                receive.close()
                del running[index]
                results[index] = result
                if on_result:
                    on_result(result)
    return [results[i] for i in range(len(models))]


# ---- reporting ------------------------------------------------------------------------------------------------

def summarize(results: Sequence[ModelResult]) -> dict:
    """Suite-wide numbers: models tried (skipped ones aside), analysed, clean (nothing through PyTorch) and its
    share of those tried, and what runs through PyTorch over the suite: per opaque op and per no-kernel kind, the
    models it appears in and its count."""
    tried = [r for r in results if r.status != "skipped"]
    clean = [r for r in tried if r.status == "clean"]
    opaque: dict[str, list[int]] = {}
    no_kernel: dict[str, list[int]] = {}
    for r in tried:
        for table, found in ((opaque, r.opaque), (no_kernel, r.no_kernel)):
            for key, count in found.items():
                entry = table.setdefault(key, [0, 0])
                entry[0] += 1
                entry[1] += count
    order = lambda table: dict(sorted(table.items(), key=lambda item: (-item[1][0], -item[1][1], item[0])))  # noqa
    return {"models": len(results), "skipped": len(results) - len(tried), "tried": len(tried),
            "analysed": sum(r.analysed for r in tried), "clean": len(clean),
            "clean_percent": round(100.0 * len(clean) / len(tried), 1) if tried else 0.0,
            "failed": [f"{r.name}: {r.error}" for r in tried if r.status == "failed"],
            "opaque": order(opaque), "no_kernel": order(no_kernel)}


def _through_pytorch(r: ModelResult) -> str:
    """What runs through PyTorch, then the library calls (which are kernels of the plan: torch's attention)."""
    parts = [f"{_short(target)} x{count}" for target, count in r.opaque.items()]
    parts += [f"{key} x{count}" for key, count in r.no_kernel.items()]
    parts += [f"library call: {ops} x{count}" for ops, count in r.library_calls.items()]
    return "; ".join(parts)


def _short(target: str) -> str:
    """'leaky_relu' for 'aten.leaky_relu.default' (the overload kept when it is not the default one)."""
    match = re.fullmatch(r"aten\.(\w+)\.(\w+)(\[\d+\])?", target)
    if not match:
        return target
    name, overload, item = match.groups()
    return name + ("" if overload == "default" else f".{overload}") + (item or "")


def markdown(results: Sequence[ModelResult]) -> str:
    """The per-model table and the suite-wide lists, as markdown."""
    summary = summarize(results)
    lines = [f"{summary['clean']} of {summary['tried']} models ({summary['clean_percent']}%) run nothing through "
             f"PyTorch; {summary['analysed']} analysed" + (f", {summary['skipped']} skipped" if summary["skipped"]
                                                           else "") + ".", "",
             "| model | family | status | launches | through PyTorch (launches) | what |",
             "| --- | --- | --- | ---: | ---: | --- |"]
    for r in results:
        what = r.error if r.status in ("failed", "skipped") else _through_pytorch(r)
        lines.append(f"| {r.name} | {r.family} | {r.status} | {r.launches or ''} | {r.pytorch_launches or ''} | "
                     f"{what.replace('|', '/')} |")
    lines += ["", "| opaque op | models | nodes |", "| --- | ---: | ---: |"]
    lines += [f"| {_short(k)} | {m} | {n} |" for k, (m, n) in summary["opaque"].items()]
    lines += ["", "| group without a kernel | models | groups |", "| --- | ---: | ---: |"]
    lines += [f"| {k} | {m} | {n} |" for k, (m, n) in summary["no_kernel"].items()]
    return "\n".join(lines) + "\n"


def select(models: Sequence[SuiteModel], only: str | None = None, family: str | None = None
           ) -> list[SuiteModel]:
    pattern = re.compile(only) if only else None
    return [m for m in models if (pattern is None or pattern.search(m.name)) and (family is None or
                                                                                  m.family == family)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opfuse.bench.suite", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="analyse the models whose name matches this regular expression")
    parser.add_argument("--family", help="analyse the models of this family (cnn, vit, hybrid, mlp, encoder, "
                                         "decoder, encoder-decoder, audio, moe, ssm)")
    parser.add_argument("--batch", type=int, default=1, help="the example inputs' batch (default 1)")
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="models analysed at once, each in its own process (0: in this process)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a model may take")
    parser.add_argument("--json", metavar="FILE", help="write every result and the summary as JSON")
    parser.add_argument("--markdown", metavar="FILE", help="write the tables as markdown")
    parser.add_argument("--list", action="store_true", help="list the models and exit")
    args = parser.parse_args(argv)
    models = select(SUITE, args.only, args.family)
    if args.list:
        for m in models:
            print(f"{m.name:32} {m.family:16} {m.library}")
        return 0
    if not models:
        print("no model matches", file=sys.stderr)
        return 2

    def progress(r: ModelResult) -> None:
        detail = r.error if r.status in ("failed", "skipped") else _through_pytorch(r)
        print(f"{r.name:28} {r.status:8} {r.launches:5d} launches {r.seconds:6.1f} s  {detail[:160]}", flush=True)

    results = run_suite(models, args.workers, args.timeout, progress, args.batch)
    summary = summarize(results)
    print(f"\n{summary['clean']} of {summary['tried']} models ({summary['clean_percent']}%) run nothing through "
          f"PyTorch; {summary['analysed']} analysed, {summary['skipped']} skipped")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "models": [asdict(r) for r in results]}, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
