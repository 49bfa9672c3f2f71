"""Text generation with a KV cache: `compile_generator(model, max_batch, max_seq_len, config)`, then
`.generate(input_ids, max_new_tokens)` (greedy, or sampled with a temperature and top-k) or `.stream(...)`.

A decoder language model whose attention keeps its keys and values in a transformers `Cache` (LlamaForCausalLM,
Qwen2, Mistral, GPT-2, ...) is wrapped with a static KV cache of opfuse's own (`KVCacheDecoder`): per layer a key
and a value buffer, [max_batch, kv_heads, max_seq_len, head_dim], marked as the model's state
(`opfuse.frontend.torch_export.mark_state`) and written at the call's `cache_position` by `index_copy_`, which the
compiled model runs in place (`opfuse.runtime.compiled`); the positions and the causal mask over the cache come
from `cache_position` too. That module is compiled twice over one cache (`CompiledModel.bind_state`): the decode
step, one token per sequence (on a GPU one CUDA graph, replayed per token), and the prefill, compiled per bucket of
prompt lengths (the powers of two, capped at max_seq_len; each compiled at its first prompt). A prompt runs padded
at its end to its bucket (`prefill_length`): the causal mask over the cache keeps the padding out of every prompt
token's logits, and the padding's keys and values land at positions after the prompt, which each decode step
overwrites before it reads them (a step at position p writes p and attends to positions up to p). Every compile is
verified against eager as `opfuse.compile` verifies.

A batch of b <= max_batch prompts runs as max_batch rows (the last row repeated; each row's cache is its own, so the
others are untouched), and the prompts of a batch share their length (one cache position for all): pad them to one
length beforehand. A prompt and its new tokens fit in max_seq_len, or the call is refused naming the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import torch

from opfuse.config import FusionConfig
from opfuse.ir.graph import GraphError


class _PositionedLayer:
    """One layer of the cache, as transformers' cache layers look to a model: `update` writes the new keys and
    values at the decoder's current positions into the decoder's buffers, and returns the whole cache."""

    is_sliding = False
    is_compileable = True

    def __init__(self, owner: "KVCacheDecoder", index: int):
        self.owner, self.index = owner, index
        self.is_initialized = True
        self.max_cache_len = owner.max_seq_len

    @property
    def keys(self) -> torch.Tensor:
        return getattr(self.owner, f"key_cache_{self.index}")

    @property
    def values(self) -> torch.Tensor:
        return getattr(self.owner, f"value_cache_{self.index}")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        position = self.owner.position
        self.keys.index_copy_(2, position, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, position, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_mask_sizes(self, *args: Any) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int:
        return 0

    def get_max_cache_shape(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()


def cache_shape(config: Any, max_batch: int, max_seq_len: int) -> tuple[int, tuple[int, int, int, int]]:
    """(layers, the shape of one layer's key or value cache) of a transformers decoder's config."""
    layers = config.num_hidden_layers
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return layers, (max_batch, kv_heads, max_seq_len, head_dim)


class KVCacheDecoder(torch.nn.Module):
    """A transformers decoder LM with a static KV cache of its own: forward(input_ids [B, T], cache_position [T])
    writes the tokens' keys and values at those positions and returns the logits [B, T, vocab]."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int):
        super().__init__()
        from transformers.cache_utils import Cache

        from opfuse.frontend.torch_export import mark_state

        self.model = model
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        layers, shape = cache_shape(model.config, max_batch, max_seq_len)
        weight = next(model.parameters())
        names = []
        for index in range(layers):
            for kind in ("key", "value"):
                names.append(f"{kind}_cache_{index}")
                self.register_buffer(names[-1], torch.zeros(shape, dtype=weight.dtype, device=weight.device))
        mark_state(self, *names)
        self.__dict__["cache"] = Cache(layers=[_PositionedLayer(self, index) for index in range(layers)])
        self.position = torch.zeros(1, dtype=torch.long)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        self.position = cache_position
        batch, length = input_ids.shape
        keys = torch.arange(self.max_seq_len, device=input_ids.device)
        mask = (keys[None, :] <= cache_position[:, None])[None, None].expand(batch, 1, length, self.max_seq_len)
        positions = cache_position[None].expand(batch, length)
        out = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=self.cache,
                         use_cache=True)
        return out.logits

    def reset(self) -> None:
        for name, buffer in self.named_buffers(recurse=False):
            buffer.zero_()


@dataclass
class Sampling:
    """How a token is drawn from a step's logits: greedy (temperature 0), else from the softmax of logits /
    temperature over the `top_k` most likely (all: None), with `generator` for reproducible draws."""

    temperature: float = 0.0
    top_k: int | None = None
    generator: torch.Generator | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.temperature <= 0:
            return logits.argmax(-1)
        logits = logits.float() / self.temperature
        if self.top_k is not None:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probabilities = torch.softmax(logits, -1)
        return torch.multinomial(probabilities.cpu(), 1, generator=self.generator).squeeze(-1).to(logits.device)


class Generator:
    """A decoder LM compiled for generation (module docstring): `generate`, `stream`, and the compiled models."""

    def __init__(self, model: torch.nn.Module, max_batch: int, max_seq_len: int, config: FusionConfig,
                 quiet: bool = True):
        from opfuse.compiler import compile as opfuse_compile

        if max_batch < 1 or max_seq_len < 2:
            raise GraphError(f"compile_generator needs max_batch >= 1 and max_seq_len >= 2, got {max_batch}, "
                             f"{max_seq_len}")
        self.decoder = KVCacheDecoder(model, max_batch, max_seq_len).eval()
        self.config, self.quiet = config, quiet
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        self.device = next(model.parameters()).device
        ids = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
        self.step = opfuse_compile(self.decoder, (ids, torch.zeros(1, dtype=torch.long, device=self.device)), config,
                                   quiet)
        self.cache = self.step.compiled.state        # shared by every prefill
        self.prefills: dict[int, Any] = {}           # prompt length -> its compiled prefill
        self._compile = opfuse_compile

    def prefill_model(self, length: int) -> Any:
        """The compiled prefill of prompts of `length` tokens (compiled at the first one), on the shared cache."""
        if length not in self.prefills:
            ids = torch.zeros(self.max_batch, length, dtype=torch.long, device=self.device)
            positions = torch.arange(length, device=self.device)
            compiled = self._compile(self.decoder, (ids, positions), self.config, self.quiet)
            compiled.compiled.bind_state(self.cache)
            self.prefills[length] = compiled
        return self.prefills[length]

    def prefill_length(self, length: int) -> int:
        """The length the prefill of a prompt of `length` tokens runs at: the smallest power of two that holds it,
        at most max_seq_len (see the module docstring)."""
        return min(1 << (length - 1).bit_length(), self.max_seq_len)

    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """The logits [max_batch, T, vocab] of prompts `ids` ([max_batch, T], on the device), written into the
        cache at positions 0..T-1: run at `prefill_length(T)`, the prompts padded at their end with their last
        token."""
        length = ids.shape[1]
        padded = self.prefill_length(length)
        if padded > length:
            ids = torch.cat([ids, ids[:, -1:].expand(ids.shape[0], padded - length)], 1)
        logits = self.prefill_model(padded)(ids, torch.arange(padded, device=self.device))
        return logits[:, :length]

    def reset(self) -> None:
        """An empty cache (generation starts from it anyway: a prompt overwrites its positions)."""
        self.step.compiled.reset_state()

    def stream(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 0.0, top_k: int | None = None,
               eos_token_id: int | None = None, generator: torch.Generator | None = None) -> Iterator[torch.Tensor]:
        """The new tokens of a batch of prompts ([b, T] token ids), one [b] tensor per step as each is drawn; a
        sequence that drew `eos_token_id` draws it again until every one has (then the stream ends)."""
        ids = self._rows(input_ids, max_new_tokens)
        rows, length = input_ids.shape
        sample = Sampling(temperature, top_k, generator)
        with torch.no_grad():
            token = sample(self.prefill(ids)[:, -1])
            done = torch.zeros_like(token, dtype=torch.bool)
            for step in range(max_new_tokens):
                if eos_token_id is not None:
                    token = torch.where(done, torch.full_like(token, eos_token_id), token)
                    done |= token == eos_token_id
                yield token[:rows]
                if step + 1 == max_new_tokens or (eos_token_id is not None and bool(done[:rows].all())):
                    return
                position = torch.tensor([length + step], device=self.device)
                token = sample(self.step(token[:, None], position)[:, -1])

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, **sampling: Any) -> torch.Tensor:
        """The prompts followed by their new tokens ([b, T + new]); `sampling` as `stream` takes it."""
        new = list(self.stream(input_ids, max_new_tokens, **sampling))
        return torch.cat([input_ids, torch.stack(new, 1).to(input_ids.device)], 1) if new else input_ids

    def decode_report(self, position: int | None = None) -> dict[str, Any]:
        """`decode_report` of this generator's decode step at cache `position` (default the last), with the
        measured time once a GPU has timed the step (`CompiledModel.forward_ms`)."""
        return decode_report(self.step.analysis, self.max_batch, self.max_seq_len, position,
                             self.step.compiled.forward_ms)

    def _rows(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """The prompts as the compiled models take them: max_batch rows on the device (the last repeated)."""
        if input_ids.dim() != 2 or input_ids.dtype != torch.long:
            raise GraphError(f"input_ids must be [batch, length] int64 token ids, got {input_ids.dtype} "
                             f"{list(input_ids.shape)}")
        rows, length = input_ids.shape
        if rows > self.max_batch:
            raise GraphError(f"a batch of {rows} prompts is over max_batch {self.max_batch}")
        if length < 1 or max_new_tokens < 1 or length + max_new_tokens > self.max_seq_len:
            raise GraphError(f"a prompt of {length} tokens and {max_new_tokens} new ones do not fit max_seq_len "
                             f"{self.max_seq_len}")
        ids = input_ids.to(self.device)
        return torch.cat([ids, ids[-1:].expand(self.max_batch - rows, length)]) if rows < self.max_batch else ids


def compile_generator(model: torch.nn.Module, max_batch: int, max_seq_len: int,
                      config: FusionConfig = FusionConfig(), quiet: bool = True) -> Generator:
    """A Generator of `model` (a transformers decoder LM, in eval mode, on its device and dtype) for batches of up to
    `max_batch` prompts and sequences of up to `max_seq_len` tokens; see the module docstring."""
    return Generator(model, max_batch, max_seq_len, config, quiet)


def decode_report(analysis: Any, max_batch: int, max_seq_len: int, position: int | None = None,
                  measured_ms: float | None = None) -> dict[str, Any]:
    """What one decode step (`analysis`: opfuse.analyze of a `KVCacheDecoder` at one token a sequence) moves and how
    near the memory-bandwidth limit it is, at cache `position` (default the last): the weight bytes, the cache bytes
    a step must read there (the keys and values up to it, every row) and the cache bytes this decode step reads
    (its attention reads the whole static cache), the bytes per step of opfuse's plan, its launches, its predicted
    time, the bandwidth floor of the bytes it must move (`opfuse.analysis.roofline.floor`: weights + the cache up to
    `position`, on the plan's hardware profile), and, given a measured step, its time and its share of that floor.
    Per step; a step makes `max_batch` tokens."""
    from opfuse.analysis.roofline import datasheet_ceilings, floor, share_of_floor

    graph = analysis.prepared
    position = max_seq_len - 1 if position is None else position
    weights = sum(graph[name].type.nbytes for name in graph.constants if graph[name].op == "constant")
    cache = sum(graph[name].type.nbytes for name in graph.state)
    needed = cache * (position + 1) // max_seq_len
    minimum = floor(analysis.fused.flops, weights + needed, datasheet_ceilings(analysis.hardware,
                                                                               analysis.config.dtype))
    measured_s = None if measured_ms is None else measured_ms / 1e3
    return {"tokens_per_step": max_batch, "position": position, "weight_bytes": weights,
            "cache_bytes_needed": needed, "cache_bytes_read": cache, "plan_bytes": analysis.fused.total_bytes,
            "launches": analysis.fused.kernel_launches, "predicted_s": analysis.fused.predicted_time,
            "bandwidth_floor_s": minimum.memory, "measured_s": measured_s, "hardware": analysis.hardware.name,
            "share_of_bandwidth_floor": share_of_floor(minimum.memory, measured_s)}
