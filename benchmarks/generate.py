"""Text generation: opfuse's generator against torch.compile on the same KV-cache decoder (issue 52).

A Llama-class model from transformers' LlamaConfig with random weights (scaled so fp16 stays finite): by default the
~1.1B config of the issue (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632, vocab 32000). For each
batch and prompt length, one process and one `torch.inference_mode()`:

  opfuse      opfuse.compile_generator: the prefill, then decode steps (one CUDA graph each)
  inductor    torch.compile(mode="reduce-overhead", fullgraph=True) of the same `KVCacheDecoder` (the static cache
              gpt-fast uses: one CUDA graph per decode step), prefill and decode compiled apart
  eager       the same decoder, eagerly

Per contender: time to first token (the prefill plus one sampled token), decode tokens per second (the median of
CUDA-event times of NEW decode steps, rounds interleaved across contenders), and achieved GB/s: the bytes a decode
step must move (`Generator.decode_report`: weights plus the cache up to the position) over its time, with the share
of the GPU's datasheet bandwidth. Greedy tokens of every contender are compared with eager's.

    python -m benchmarks.generate --out DIR [--batches 1,8,32] [--prompts 128,1024] [--new 256] [--tiny]

--tiny runs a 2-layer model of hidden 64 (a dry run of the script; on the CPU through TRITON_INTERPRET=1).
Writes DIR/generate.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

BILLION = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
           "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 4096}
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def llama(config: dict, device: str, dtype: torch.dtype):
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**config, initializer_range=0.02)).eval()
    model.generation_config.eos_token_id = None
    return model.to(device, dtype)


def cuda_ms(fn, device: str) -> float:
    """Milliseconds of one call: CUDA events on a GPU, the wall clock elsewhere."""
    if device != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end)


class Decoding:
    """One contender's prefill and decode step over its own cache, greedy."""

    def __init__(self, name: str, prefill, step, reset):
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


def contenders(model, batch: int, max_len: int, device: str, tiny: bool, names: set[str]
               ) -> tuple[list[Decoding], object]:
    import opfuse
    from opfuse.generate import KVCacheDecoder, compile_generator

    dtype = next(model.parameters()).dtype
    config = opfuse.FusionConfig(dtype=str(dtype).removeprefix("torch."), tune_top=2)
    generator, found = None, []
    if "opfuse" in names:
        generator = compile_generator(model, batch, max_len, config)
        found.append(Decoding("opfuse", lambda ids, pos: generator.prefill(ids), generator.step, generator.reset))
    eager = KVCacheDecoder(model, batch, max_len).eval()
    found.append(Decoding("eager", eager, eager, eager.reset))      # the reference of the greedy tokens
    if device == "cuda" and not tiny and "inductor" in names:
        compiled = KVCacheDecoder(model, batch, max_len).eval()
        step = torch.compile(compiled, mode="reduce-overhead", fullgraph=True)
        found.append(Decoding("inductor", compiled, step, compiled.reset))
    return found, generator


def run(model, batch: int, prompt: int, new: int, device: str, tiny: bool, names: set[str]) -> dict:
    found, generator = contenders(model, batch, prompt + new, device, tiny, names)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    result = {"batch": batch, "prompt": prompt, "new": new, "contenders": {}}
    step_ms: dict[str, list[float]] = {c.name: [] for c in found}
    first_ms: dict[str, float] = {}
    with torch.inference_mode():
        for contender in found:             # warm-up: compiles, captures
            contender.first(ids)
            for position in range(prompt, prompt + 3):
                contender.next(position)
        for contender in found:
            first_ms[contender.name] = cuda_ms(lambda: contender.first(ids), device)
        for position in range(prompt, prompt + new - 1):    # rounds interleaved: a step of each in turn
            for contender in found:
                step_ms[contender.name].append(cuda_ms(lambda: contender.next(position), device))
    from opfuse.analysis.roofline import hardware_of_gpu

    # the datasheet bandwidth of the GPU this runs on (the plan's profile is FusionConfig.hardware, H200 by default)
    gpu = hardware_of_gpu(torch.cuda.get_device_name()) if device == "cuda" else None
    if generator is not None:
        report = generator.decode_report(position=prompt + new // 2)
        must_move = report["weight_bytes"] + report["cache_bytes_needed"]
        bandwidth = (gpu or generator.step.analysis.hardware).memory_bandwidth
    else:           # no analysis without opfuse: the weights alone
        report, bandwidth = {}, gpu.memory_bandwidth
        must_move = sum(p.numel() * p.element_size() for p in model.parameters())
    reference = torch.stack(next(c for c in found if c.name == "eager").tokens, 1)
    for contender in found:
        median = statistics.median(step_ms[contender.name])
        tokens = torch.stack(contender.tokens, 1)
        result["contenders"][contender.name] = {
            "ttft_ms": first_ms[contender.name], "step_ms": median, "tokens_per_s": batch * 1e3 / median,
            "gb_per_s": must_move / median / 1e6, "share_of_bandwidth": must_move / (median / 1e3) / bandwidth,
            "greedy_equal_eager_tokens": int((tokens == reference).all(0).long().cumprod(0).sum())}
    result["decode_report"] = report
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompts", default="128,1024")
    parser.add_argument("--new", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model of hidden 64: a dry run")
    parser.add_argument("--contenders", default="opfuse,inductor", help="beside eager, which always runs")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = llama(TINY if args.tiny else BILLION, device, dtype)
    results = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
               "dtype": str(dtype), "runs": []}
    for batch in map(int, args.batches.split(",")):
        for prompt in map(int, args.prompts.split(",")):
            results["runs"].append(run(model, batch, prompt, args.new, device, args.tiny,
                                       set(args.contenders.split(","))))
            print(json.dumps(results["runs"][-1]["contenders"]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "generate.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
