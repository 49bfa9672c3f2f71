"""Text generation timed: opfuse's generator against torch.compile and eager on one KV-cache decoder (issue 52).

Entry point: `run_generation(model, batch, prompt, new, names) -> dict`, used by `opfuse bench MODEL --generate` and
benchmarks/generate.py. The models are transformers' LlamaForCausalLM from `GENERATION_MODELS` configs with seeded
random weights (`llama(name, device, dtype)`): "llama-1.1b" is the issue's (hidden 2048, 22 layers, 32 heads, 4 KV
heads, intermediate 5632, vocab 32000), "llama-tiny" a 2-layer dry run. Per contender, under one
`torch.inference_mode()`:

  opfuse      opfuse.compile_generator: the prefill (`Generator.prefill`), then decode steps (a CUDA graph each)
  inductor    torch.compile(mode="reduce-overhead", fullgraph=True) of the same `KVCacheDecoder` (the static cache
              gpt-fast uses: one CUDA graph per decode step), its prefill eager; on a GPU only
  eager       the same decoder, eagerly (always: the reference of the greedy tokens)

Each reports the time to first token (the cache reset, the prefill and one greedy token; the median of
TIMED_PREFILLS after WARM_PREFILLS), the median decode step (CUDA events, rounds
interleaved across contenders, each step a new position), tokens per second, and the bytes a step must move (the
weights and the cache up to the middle position: `Generator.decode_report`; the weights alone without opfuse) over
its time, with the share of the datasheet bandwidth of the GPU measured on. `greedy_equal_eager_tokens` counts the
leading tokens equal to eager's.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable

import torch

from opfuse.bench.timing import time_once

GENERATION_MODELS = {
    "llama-1.1b": {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                   "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 4096},
    "llama-tiny": {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256},
}
CONTENDERS = ("opfuse", "inductor", "eager")
# prefills before any is timed (the first compiles, the second captures the CUDA graph), then the timed ones: a time
# to first token once measured at the capture read 71.5 ms for a prefill that replays in 1.63 ms (RESULTS.md)
WARM_PREFILLS, TIMED_PREFILLS = 3, 5


def llama(name: str, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A LlamaForCausalLM of `GENERATION_MODELS[name]`, seeded random weights (std 0.02), on `device` in `dtype`."""
    import transformers as T

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = T.LlamaForCausalLM(T.LlamaConfig(**GENERATION_MODELS[name], initializer_range=0.02)).eval()
    model.generation_config.eos_token_id = None
    return model.to(device, dtype)


class Decoding:
    """One contender's prefill and decode step over its own cache, greedy."""

    def __init__(self, name: str, prefill: Callable, step: Callable, reset: Callable[[], None]):
        self.name, self.prefill, self.step, self.reset = name, prefill, step, reset
        self.tokens: list[torch.Tensor] = []

    def first(self, ids: torch.Tensor) -> torch.Tensor:
        self.reset()
        logits = self.prefill(ids, torch.arange(ids.shape[1], device=ids.device))
        self.tokens = [logits[:, -1].argmax(-1)]
        return self.tokens[-1]

    def next(self, position: int) -> torch.Tensor:
        position_tensor = torch.tensor([position], device=self.tokens[-1].device)
        self.tokens.append(self.step(self.tokens[-1][:, None], position_tensor)[:, -1].argmax(-1))
        return self.tokens[-1]


def contenders(model: torch.nn.Module, batch: int, max_len: int, names: set[str], tune_top: int = 2
               ) -> tuple[list[Decoding], Any]:
    """The contenders of `names` (eager always) over caches of `batch` x `max_len`, and opfuse's generator (None
    when opfuse is not among them)."""
    import opfuse
    from opfuse.generate import KVCacheDecoder, compile_generator

    from opfuse.analysis.roofline import hardware_of_gpu

    dtype = next(model.parameters()).dtype
    cuda = next(model.parameters()).is_cuda
    gpu = hardware_of_gpu(torch.cuda.get_device_name()) if cuda else None     # the plan's profile: the GPU's own
    config = opfuse.FusionConfig(dtype=str(dtype).removeprefix("torch."), tune_top=tune_top,
                                 **({"hardware": gpu.name} if gpu is not None else {}))
    generator, found = None, []
    if "opfuse" in names:
        generator = compile_generator(model, batch, max_len, config)
        found.append(Decoding("opfuse", lambda ids, pos: generator.prefill(ids), generator.step, generator.reset))
    eager = KVCacheDecoder(model, batch, max_len).eval()
    found.append(Decoding("eager", eager, eager, eager.reset))
    if cuda and "inductor" in names:
        compiled = KVCacheDecoder(model, batch, max_len).eval()
        step = torch.compile(compiled, mode="reduce-overhead", fullgraph=True)
        found.append(Decoding("inductor", compiled, step, compiled.reset))
    return found, generator


def run_generation(model: torch.nn.Module, batch: int, prompt: int, new: int,
                   names: set[str] | frozenset[str] = frozenset(CONTENDERS), tune_top: int = 2) -> dict[str, Any]:
    """Prompts of `batch` x `prompt` seeded token ids, `new` tokens each, every contender of `names` timed (module
    docstring): {"batch", "prompt", "new", "contenders": {name: figures}, "decode_report": opfuse's}."""
    device = next(model.parameters()).device.type
    found, generator = contenders(model, batch, prompt + new, names, tune_top)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    step_ms: dict[str, list[float]] = {c.name: [] for c in found}
    first_ms: dict[str, list[float]] = {c.name: [] for c in found}
    with torch.inference_mode():
        for contender in found:             # warm-up: compiles, captures (a CUDA graph at a model's second call)
            for _ in range(WARM_PREFILLS):
                contender.first(ids)
            for position in range(prompt, prompt + min(3, new - 1)):
                contender.next(position)
        for _ in range(TIMED_PREFILLS):     # rounds interleaved, as the steps are
            for contender in found:
                first_ms[contender.name].append(time_once(lambda: contender.first(ids), device == "cuda"))
        for position in range(prompt, prompt + new - 1):    # rounds interleaved: a step of each in turn
            for contender in found:
                step_ms[contender.name].append(time_once(lambda: contender.next(position), device == "cuda"))
    must_move, bandwidth, report = _bytes_and_bandwidth(model, generator, prompt + new // 2, device)
    reference = torch.stack(next(c for c in found if c.name == "eager").tokens, 1)
    result: dict[str, Any] = {"batch": batch, "prompt": prompt, "new": new, "contenders": {},
                              "decode_report": report}
    for contender in found:
        median = statistics.median(step_ms[contender.name]) if step_ms[contender.name] else None
        tokens = torch.stack(contender.tokens, 1)
        result["contenders"][contender.name] = {
            "ttft_ms": statistics.median(first_ms[contender.name]), "step_ms": median,
            "tokens_per_s": None if median is None else batch * 1e3 / median,
            "gb_per_s": None if median is None else must_move / median / 1e6,
            "share_of_bandwidth": None if median is None or bandwidth is None else
            must_move / (median / 1e3) / bandwidth,
            "greedy_equal_eager_tokens": int((tokens == reference).all(0).long().cumprod(0).sum())}
    return result


def _bytes_and_bandwidth(model: torch.nn.Module, generator: Any, position: int, device: str
                         ) -> tuple[int, float | None, dict[str, Any]]:
    """(bytes a decode step must move, the datasheet bandwidth of the GPU measured on or None, opfuse's report)."""
    from opfuse.analysis.roofline import hardware_of_gpu

    gpu = hardware_of_gpu(torch.cuda.get_device_name()) if device == "cuda" else None
    bandwidth = gpu.memory_bandwidth if gpu is not None else None
    if generator is None:
        return sum(p.numel() * p.element_size() for p in model.parameters()), bandwidth, {}
    report = generator.decode_report(position=position)
    return report["weight_bytes"] + report["cache_bytes_needed"], bandwidth, report
