"""A hand-written back-to-back MLP kernel against the GEMMs apart, on ConvNeXt's MLP shapes (issue 16).

ConvNeXt's block ends in linear (C -> 4C) + GELU + linear (4C -> C): opfuse runs it as cuBLAS, a bias + GELU pass
and cuBLAS again (run 97: 57.5 + 114.0 + 49.5 us per stage-1 block at batch 64), storing and reading back the
4C-wide hidden tensor (308 MB there). Here one Triton program owns BLOCK_M rows: it loads its [BLOCK_M, C] input
once, and for each BLOCK_H slice of the hidden features computes x @ W1 + b1, GELU (opfuse's exact form,
`opfuse.codegen.expr`), and accumulates that slice times W2 into a [BLOCK_M, C] float32 accumulator, which it
stores with b2 added: the hidden tensor never reaches device memory. Its output width C must fit one accumulator
(C <= MAX_OUT); wider MLPs (ConvNeXt's last stages, the transformers') are reported as not run.

Contenders, each in a CUDA graph of REPEAT calls, median of CUDA events, fp16, in one process:
  fused      the kernel above, each tile of TILES (BLOCK_M x BLOCK_H / warps / stages)
  apart      F.linear + F.gelu + F.linear (cuBLAS, ATen's GELU, cuBLAS: what the library forms run)
  inductor   torch.compile of the same three ops (default mode)
Each output is compared with the float32 reference by relative error.

    python -m benchmarks.mlp_pair --out DIR [--batches 64,1]

Writes DIR/mlp_pair.json and DIR/mlp_pair.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from opfuse.codegen.base import load_source
from opfuse.codegen.expr import emit
from opfuse.fusion.tiles import next_power_of_2
from opfuse.numerics import relative_error

REPEAT = 20
MAX_OUT = 256          # output features one program's float32 accumulator holds
# ConvNeXt-tiny's stages: (pixels per image, channels)
STAGES = [(56 * 56, 96), (28 * 28, 192), (14 * 14, 384), (7 * 7, 768)]
# (BLOCK_M, BLOCK_H, num_warps, num_stages)
TILES = [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (32, 64, 4, 2)]

FUSED_MLP = '''
import triton
import triton.language as tl


@triton.jit
def fused_mlp(x_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, y_ptr, M, K, H, N,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    mask_m, mask_k, mask_n = offs_m < M, offs_k < K, offs_n < N
    x = tl.load(x_ptr + offs_m[:, None] * K + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        w1 = tl.load(w1_ptr + offs_k[:, None] * H + offs_h[None, :], mask=mask_k[:, None] & mask_h[None, :],
                     other=0.0)
        hid = tl.dot(x, w1) + tl.load(b1_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)[None, :]
        hid = {gelu}
        w2 = tl.load(w2_ptr + offs_h[:, None] * N + offs_n[None, :], mask=mask_h[:, None] & mask_n[None, :],
                     other=0.0)
        acc = tl.dot(hid.to(w2.dtype), w2, acc)
    acc += tl.load(b2_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * N + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])
'''


def kernel():
    """The jitted fused MLP, exact GELU as opfuse's epilogues compute it."""
    return load_source(FUSED_MLP.format(gelu=emit("gelu", {}, ["hid"])), "mlp_pair").fused_mlp


def dot_block(n: int) -> int:
    """A block covering `n` along a `tl.dot` dim: a power of two, at least 16."""
    return max(16, next_power_of_2(n))


def fused_mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
              tile: tuple[int, int, int, int], out: torch.Tensor | None = None) -> torch.Tensor:
    """gelu(x @ w1 + b1) @ w2 + b2 for x [M, K], w1 [K, H], w2 [H, N] (row-major), in one launch."""
    block_m, block_h, warps, stages = tile
    m, k = x.shape
    h, n = w2.shape
    if n > MAX_OUT:
        raise ValueError(f"{n} output features do not fit one accumulator (at most {MAX_OUT})")
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    kernel()[(-(-m // block_m),)](x, w1, b1, w2, b2, y, m, k, h, n, BLOCK_M=block_m, BLOCK_K=dot_block(k),
                                  BLOCK_H=block_h, BLOCK_N=dot_block(n), num_warps=warps, num_stages=stages)
    return y


def apart(x, w1, b1, w2, b2):
    """The same MLP as PyTorch runs it: two GEMMs (weights as nn.Linear holds them, [out, in]) and ATen's GELU."""
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def run_shape(batch: int, pixels: int, channels: int) -> dict:
    from opfuse.bench.timing import graphed_call_us

    m, hidden = batch * pixels, 4 * channels
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(m, channels, generator=generator).half().cuda()
    w1 = (torch.randn(hidden, channels, generator=generator) / channels ** 0.5).half().cuda()
    b1 = (0.1 * torch.randn(hidden, generator=generator)).half().cuda()
    w2 = (torch.randn(channels, hidden, generator=generator) / hidden ** 0.5).half().cuda()
    b2 = (0.1 * torch.randn(channels, generator=generator)).half().cuda()
    row: dict = {"batch": batch, "m": m, "channels": channels, "hidden": hidden}
    with torch.inference_mode():
        reference = apart(x.float(), w1.float(), b1.float(), w2.float(), b2.float())
        row["apart_us"] = graphed_call_us(lambda: apart(x, w1, b1, w2, b2), REPEAT)
        row["apart_err"] = relative_error(apart(x, w1, b1, w2, b2), reference)
        start = time.perf_counter()
        compiled = torch.compile(apart)
        row["inductor_err"] = relative_error(compiled(x, w1, b1, w2, b2), reference)
        row["inductor_compile_s"] = round(time.perf_counter() - start, 1)
        row["inductor_us"] = graphed_call_us(lambda: compiled(x, w1, b1, w2, b2), REPEAT)
        if channels > MAX_OUT:
            row["fused"] = f"not run: {channels} output features > {MAX_OUT}"
            return row
        w1_t, w2_t = w1.t().contiguous(), w2.t().contiguous()      # [K, H] and [H, N], row-major
        out = torch.empty((m, channels), dtype=x.dtype, device=x.device)
        row["fused"] = []
        for tile in TILES:
            entry: dict = {"tile": "{}x{}/w{}/s{}".format(*tile)}
            try:
                start = time.perf_counter()
                fused_mlp(x, w1_t, b1, w2_t, b2, tile, out)
                torch.cuda.synchronize()
                entry["first_call_s"] = round(time.perf_counter() - start, 2)
                entry["err"] = relative_error(out, reference)
                entry["us"] = graphed_call_us(lambda: fused_mlp(x, w1_t, b1, w2_t, b2, tile, out), REPEAT)
            except Exception as error:
                entry["error"] = f"{type(error).__name__}: {str(error)[:200]}"
            row["fused"].append(entry)
    return row


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [f"### back-to-back MLP, fp16: {env.get('date')}, {env.get('gpu')}, torch {env.get('torch')}, "
             f"triton {env.get('triton')}", "",
             f"us per call ({REPEAT} calls per CUDA graph); relative error against float32.", "",
             "| batch | M x C -> 4C -> C | apart (cuBLAS + GELU + cuBLAS) | torch.compile | fused: best tile | "
             "fused / apart | errors apart / compile / fused |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        shape = f"{r['m']} x {r['channels']}"
        timed = [f for f in r.get("fused", []) if isinstance(f, dict) and "us" in f] \
            if isinstance(r.get("fused"), list) else []
        if timed:
            best = min(timed, key=lambda f: f["us"])
            fused, ratio, err = f"{best['us']:.1f} ({best['tile']})", f"{r['apart_us'] / best['us']:.2f}x", \
                f"{best['err']:.1e}"
        else:
            fused, ratio, err = str(r.get("fused", "-"))[:60], "-", "-"
        lines.append(f"| {r['batch']} | {shape} | {r['apart_us']:.1f} | {r['inductor_us']:.1f} | {fused} | {ratio} "
                     f"| {r['apart_err']:.1e} / {r['inductor_err']:.1e} / {err} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    from opfuse.bench import harness

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="bench-out")
    parser.add_argument("--batches", default="64,1")
    args = parser.parse_args()
    out = harness.start_gpu_run("mlp_pair.py", args.out)
    if out is None:
        return 3
    env = harness.environment()
    rows = []
    for batch in [int(b) for b in args.batches.split(",") if b]:
        for pixels, channels in STAGES:
            try:
                row = run_shape(batch, pixels, channels)
            except Exception as error:
                row = {"batch": batch, "m": batch * pixels, "channels": channels,
                       "error": f"{type(error).__name__}: {str(error)[:300]}"}
            print(json.dumps(row, default=str), flush=True)
            rows.append(row)
            (out / "mlp_pair.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1, default=str))
            (out / "mlp_pair.md").write_text(markdown(env, [r for r in rows if "error" not in r]))
    print(markdown(env, [r for r in rows if "error" not in r]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
