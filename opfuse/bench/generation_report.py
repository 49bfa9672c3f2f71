"""ZOO.md's text-generation table (issue 52), from the JSON `benchmarks/generate.py` writes (`generation_lines`).

One row per contender of each (batch, prompt) run: time to first token, decode step, tokens/s, the bytes a step must
read (weights and the cache up to the middle of the new tokens) over the step and their share of the GPU's
datasheet bandwidth, opfuse's tokens/s over torch.compile's, and how many greedy tokens equal eager's from the first
on; under each run, opfuse's launches per decode step and the bytes it must read per token.
"""

from __future__ import annotations

from typing import Any

CONTENDER_NAMES = {"opfuse": "opfuse", "inductor": "torch.compile reduce-overhead", "eager": "eager"}


def generation_lines(results: dict[str, Any]) -> list[str]:
    """The section's Markdown lines for one `generate.json` (its "device", "torch", "dtype" and "runs")."""
    processes = results.get("processes", 1)
    where = ("in one process" if processes == 1 else
             f"in {processes} processes of their own (joined by `--merge`), each beside eager")
    lines = ["## Text generation", "",
             f"`benchmarks/generate.py` on {results.get('device', '?')} (torch {results.get('torch', '?')}, "
             f"{results.get('dtype', '?')}): the ~1.1B Llama of `opfuse.bench.generation`, greedy, each contender on "
             f"the same KV-cache decoder {where}, decode steps timed in interleaved rounds (CUDA events, "
             "median). GB/s: the bytes a step must read (weights, and the cache up to the middle of the new tokens) "
             "over the step.", "",
             "| batch | prompt | new | contender | time to first token | decode step | tokens/s | GB/s | share of "
             "bandwidth | vs torch.compile | greedy tokens equal eager's |",
             "|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    notes = []
    for run in results.get("runs", []):
        contenders = run.get("contenders", {})
        baseline = (contenders.get("inductor") or {}).get("tokens_per_s")
        for name, figures in contenders.items():
            ratio = (figures["tokens_per_s"] / baseline if baseline and figures.get("tokens_per_s")
                     and name != "inductor" else None)
            lines.append(
                f"| {run['batch']} | {run['prompt']} | {run['new']} | {CONTENDER_NAMES.get(name, name)} | "
                f"{_number(figures.get('ttft_ms'), '.2f', ' ms')} | {_number(figures.get('step_ms'), '.3f', ' ms')} | "
                f"{_number(figures.get('tokens_per_s'), '.0f')} | {_number(figures.get('gb_per_s'), '.0f')} | "
                f"{_number(_percent(figures.get('share_of_bandwidth')), '.1f', '%')} | "
                f"{_number(ratio, '.2f', 'x')} | {figures.get('greedy_equal_eager_tokens', '-')} of {run['new']} |")
        report = run.get("decode_report") or {}
        if "opfuse" not in contenders:
            notes.append(f"- batch {run['batch']}, prompt {run['prompt']}: no opfuse figures in this run.")
        elif report:
            per_token = (report["weight_bytes"] + report["cache_bytes_needed"]) / max(report["tokens_per_step"], 1)
            notes.append(f"- batch {run['batch']}, prompt {run['prompt']}: opfuse's decode step plans "
                         f"{report['launches']} launches and must read {per_token / 1e9:.3f} GB a token "
                         f"({report['tokens_per_step']} token(s) a step).")
    return lines + ([""] + notes if notes else [])


def merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One result of several `generate.json`s: runs keyed by (batch, prompt, new), contenders joined, the first
    file's figures kept where two have the same contender; `processes` counts those of a merged one too."""
    merged = {key: results[0][key] for key in ("device", "torch", "dtype")}
    merged["processes"] = sum(result.get("processes", 1) for result in results)
    runs: dict[tuple[int, int, int], dict[str, Any]] = {}
    for result in results:
        if result["device"] != merged["device"]:
            raise ValueError(f"generate runs on {result['device']!r} and {merged['device']!r} cannot be joined")
        for run in result["runs"]:
            key = (run["batch"], run["prompt"], run["new"])
            into = runs.setdefault(key, {**run, "contenders": {}})
            into["decode_report"] = into.get("decode_report") or run.get("decode_report")
            for name, figures in run["contenders"].items():
                into["contenders"].setdefault(name, figures)
    merged["runs"] = list(runs.values())
    return merged


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _number(value: float | None, spec: str, unit: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{unit}"
