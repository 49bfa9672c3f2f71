"""Text generation (`opfuse.compile_generator`, `opfuse.generate`) through Triton's interpreter, on tiny decoders
from transformers' Config classes: a prefill and token-by-token decode steps over opfuse's static KV cache give the
tokens transformers' own generate gives, and leave the cache eager leaves."""

import pytest
import torch
import transformers as T

import opfuse
from opfuse.generate import KVCacheDecoder, compile_generator
from opfuse.ir.graph import GraphError

CONFIG = opfuse.FusionConfig(dtype="float32")


def tiny_llama():
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return T.LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    return model, compile_generator(model, max_batch=3, max_seq_len=32, config=CONFIG)


def reference(model, prompt, new):
    """transformers' greedy generate, never stopping early (the Configs' default eos id is a token like any other
    to these random weights)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return model.generate(prompt, max_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(prompt),
                              min_new_tokens=new)


def test_greedy_tokens_equal_transformers_generate_and_the_cache_equals_eagers(llama):
    model, generator = llama
    prompt = torch.tensor([[1, 5, 7, 9, 11]])
    out = generator.generate(prompt, 16)
    assert torch.equal(out, reference(model, prompt, 16))
    eager = KVCacheDecoder(model, 3, 32)          # the same steps eagerly: the same cache, row for row
    rows = torch.cat([out[:, :-1]] * 3)
    with torch.no_grad():
        eager(rows[:, :5], torch.arange(5))
        for position in range(5, 20):
            eager(rows[:, position:position + 1], torch.tensor([position]))
    for name, tensor in generator.cache.items():
        torch.testing.assert_close(tensor[:, :, :20], getattr(eager, name)[:, :, :20], rtol=1e-4, atol=1e-5)


def test_a_batch_under_max_batch_runs_each_prompt_as_alone(llama):
    model, generator = llama
    prompts = torch.tensor([[3, 4, 2, 8], [9, 1, 1, 5]])
    out = generator.generate(prompts, 6)
    assert out.shape == (2, 10)
    for row in range(2):
        assert torch.equal(out[row:row + 1], reference(model, prompts[row:row + 1], 6))


def test_prompts_of_lengths_in_one_bucket_share_one_prefill_and_give_transformers_tokens(llama):
    """Prompts of 5, 6 and 7 tokens run padded to 8 through one compiled prefill; the padding changes no token."""
    model, generator = llama
    for length in (5, 6, 7):
        prompt = torch.arange(1, length + 1)[None] * 3 % 128
        assert torch.equal(generator.generate(prompt, 4), reference(model, prompt, 4)), length
    assert generator.prefill_length(5) == generator.prefill_length(7) == 8 and generator.prefill_length(31) == 32
    assert not {5, 6, 7} & set(generator.prefills) and 8 in generator.prefills


def test_stream_yields_the_tokens_generate_returns_one_step_at_a_time(llama):
    _, generator = llama
    prompt = torch.tensor([[2, 3, 4]])
    steps = list(generator.stream(prompt, 5))
    assert len(steps) == 5 and all(step.shape == (1,) for step in steps)
    assert torch.equal(torch.stack(steps, 1), generator.generate(prompt, 5)[:, 3:])


def test_sampling_is_seeded_and_top_k_one_is_greedy(llama):
    _, generator = llama
    prompt = torch.tensor([[1, 2, 3]])
    greedy = generator.generate(prompt, 6)
    assert torch.equal(generator.generate(prompt, 6, temperature=0.7, top_k=1), greedy)
    draws = [generator.generate(prompt, 6, temperature=1.5, generator=torch.Generator().manual_seed(seed))
             for seed in (1, 1, 2)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_a_sequence_that_drew_eos_keeps_drawing_it(llama):
    _, generator = llama
    prompt = torch.tensor([[1, 5, 7, 9, 11]])
    first = int(generator.generate(prompt, 1)[0, -1])
    out = generator.generate(prompt, 8, eos_token_id=first)
    assert out.shape == (1, 6) and int(out[0, -1]) == first      # the stream ended once every row drew it


@pytest.mark.parametrize("prompt, new, match", [
    (torch.tensor([[1] * 30]), 3, "do not fit max_seq_len 32"),
    (torch.ones(4, 2, dtype=torch.long), 2, "over max_batch 3"),
    (torch.ones(1, 2), 2, "int64 token ids"),
])
def test_a_call_over_the_limits_is_refused_naming_them(llama, prompt, new, match):
    _, generator = llama
    with pytest.raises(GraphError, match=match):
        generator.generate(prompt, new)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "mistral", "gpt2", "mixtral"])
def test_other_decoder_families_generate_as_transformers_does(family):
    configs = {
        "qwen2": lambda: T.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "mistral": lambda: T.MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                                           max_position_embeddings=64, sliding_window=None),
        "gpt2": lambda: T.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                                     initializer_range=0.5),
        "mixtral": lambda: T.MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                           num_local_experts=4, num_experts_per_tok=2,
                                           experts_implementation="grouped_mm"),
    }
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(configs[family]()).eval()
    prompts = torch.tensor([[1, 5, 7, 9, 11], [3, 4, 2, 8, 6]])
    generator = compile_generator(model, max_batch=2, max_seq_len=24, config=CONFIG)
    assert torch.equal(generator.generate(prompts, 8), reference(model, prompts, 8))


def test_the_decode_report_counts_weights_and_cache_per_step(llama):
    model, generator = llama
    report = generator.decode_report(position=7)
    weights = sum(p.numel() * 4 for p in model.parameters())        # float32; the tied head counted once
    assert weights <= report["weight_bytes"] < weights + 1024        # and small constants: rope's, the mask's range
    per_position = 2 * 2 * 3 * 2 * 16 * 4         # k and v, 2 layers, 3 rows, 2 kv heads, head dim 16, float32
    assert report["cache_bytes_read"] == per_position * 32 and report["cache_bytes_needed"] == per_position * 8
    assert report["launches"] >= 1 and report["predicted_s"] > 0
    bandwidth = generator.step.analysis.hardware.memory_bandwidth
    assert report["bandwidth_floor_s"] == pytest.approx((report["weight_bytes"] + per_position * 8) / bandwidth)
    assert report["measured_s"] is None and report["share_of_bandwidth_floor"] is None     # no GPU timed it


def test_opfuse_bench_generate_times_each_contender_and_counts_the_tokens_equal_to_eagers(tmp_path, monkeypatch,
                                                                                           capsys):
    """`opfuse bench llama-tiny --generate` end to end, its GPU parts on the CPU (the model built there, the
    interpreter running the kernels, the environment faked; torch.compile's contender needs a GPU, so opfuse and
    eager alone)."""
    import json

    from opfuse.bench import cli_bench, generation, harness
    from opfuse.cli import main

    build = generation.llama
    monkeypatch.setattr(cli_bench, "gpu_problem", lambda: None)
    monkeypatch.setattr(harness, "environment", lambda: {"gpu": "none: the CPU"})
    monkeypatch.setattr(generation, "llama", lambda name, device, dtype: build(name, "cpu", torch.float32))
    out = tmp_path / "generate.json"
    assert main(["bench", "llama-tiny", "--generate", "--prompt", "5", "--new", "3", "--dtype", "fp32",
                 "--tune-top", "0", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["results"][0]
    assert (result["batch"], result["prompt"], result["new"]) == (1, 5, 3)
    assert set(result["contenders"]) == {"opfuse", "eager"}
    for row in result["contenders"].values():
        assert row["ttft_ms"] > 0 and row["step_ms"] > 0 and row["greedy_equal_eager_tokens"] == 3
        assert row["tokens_per_s"] == pytest.approx(1e3 / row["step_ms"])
    report = result["decode_report"]
    assert report["launches"] > 0 and report["weight_bytes"] > 0 and report["position"] == 5 + 3 // 2
    printed = " ".join(capsys.readouterr().out.split())
    assert "llama-tiny: batch 1, prompt 5, 3 new tokens" in printed and "launches" in printed


@pytest.mark.parametrize("prologue", [False, True])
def test_analysis_lowers_on_the_meta_device_as_the_cpu_lowers(prologue):
    """`lowered_outcome` lowers on the meta device (no weight is copied or packed): every group gets the kernel of
    the same class, or the same reason, as lowering on the CPU gives it; with the norm prologues, whose gated pairs
    fold the norm's weight on the CPU."""
    from opfuse.codegen.lower import lower_plan, lowered_outcome

    decoder = KVCacheDecoder(tiny_llama(), 1, 16).eval()
    inputs = (torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, dtype=torch.long))
    config = opfuse.FusionConfig(dtype="float16", norm_prologue=prologue, rms_norm_prologue=prologue)
    plan = opfuse.analyze(decoder, inputs, config).plan
    on_meta, why_meta = lower_plan(plan, "meta")
    on_cpu, why_cpu = lower_plan(plan, "cpu")
    assert {n: type(k) for n, k in on_meta.items()} == {n: type(k) for n, k in on_cpu.items()}
    assert {n: r.code for n, r in why_meta.items()} == {n: r.code for n, r in why_cpu.items()}
    assert lowered_outcome(plan)[0] == {}
    if prologue:
        assert sum(getattr(k, "prologue", None) is not None for k in on_meta.values()) >= 2
