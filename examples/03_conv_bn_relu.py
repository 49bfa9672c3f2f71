"""The classic fusion example: Conv + BN + ReLU run three ways, with the traffic each moves and the time each takes.

1. PyTorch eager: three kernels (conv, batch norm, ReLU), each reading its input from and writing its output to
   GPU memory.
2. opfuse: the compiler folds BN into the conv's weights and fuses the ReLU into the conv's epilogue, so one kernel
   runs (`opfuse.compile`).
3. A hand-written Triton kernel doing the same: a direct NHWC convolution with bias and ReLU, BN folded by hand.

    python examples/03_conv_bn_relu.py            # on a GPU: batch 32, 64 -> 64 channels, 56x56, fp16, timed
    python examples/03_conv_bn_relu.py --batch 8  # another batch size
    opfuse analyze examples/03_conv_bn_relu.py:conv_bn_relu --batch 32    # the same block through the CLI

The traffic table is computed, not measured, so it prints on any machine. On a GPU each variant is then timed
(CUDA-event medians of CUDA-graph replays after warm-up). Without a GPU, Triton runs kernels in its CPU
interpreter: the script checks all three agree on a tiny shape instead, and says the times need a GPU.
"""

import argparse
import copy
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")    # must be set before triton is imported

import torch.nn as nn  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import opfuse  # noqa: E402


def conv_bn_relu(batch: int = 32, channels: int = 64, size: int = 56):
    """(model, example inputs): a 3x3 conv, BN with non-trivial statistics, ReLU, as in a ResNet stem stage."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                          nn.ReLU())
    with torch.no_grad():
        conv, bn = model[0], model[1]
        conv.weight.normal_(0, (2 / (9 * channels)) ** 0.5, generator=generator)
        bn.weight.uniform_(0.5, 1.5, generator=generator)
        bn.bias.normal_(0, 0.1, generator=generator)
        bn.running_mean.normal_(0, 0.1, generator=generator)
        bn.running_var.uniform_(0.5, 1.5, generator=generator)
    return model.eval(), (torch.randn(batch, channels, size, size, generator=generator),)


# ---- the hand-written kernel ---------------------------------------------------------------------------

def fold_batch_norm(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """BN(conv(x)) = conv'(x) + b': scale the conv's output channels, shift by the BN's offset.
    Returns the weight laid out [KH, KW, C_in, C_out] (so a tap's weights are contiguous per channel) and b'."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.bias)
    weight = conv.weight * scale[:, None, None, None]
    return weight.permute(2, 3, 1, 0).contiguous(), (bias - bn.running_mean) * scale + bn.bias


@triton.jit
def conv_bias_relu_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, H, W, C_IN, C_OUT,
                          KH: tl.constexpr, KW: tl.constexpr, PAD: tl.constexpr,
                          BLOCK_P: tl.constexpr, BLOCK_CO: tl.constexpr, BLOCK_CI: tl.constexpr):
    # y[p, co] = relu(b[co] + sum over taps (kh, kw) and input channels ci of x[pixel p moved by the tap, ci] *
    # w[kh, kw, ci, co]); stride 1, 'same' padding; x and y NHWC. One program: BLOCK_P pixels x BLOCK_CO channels.
    p = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    co = tl.program_id(1) * BLOCK_CO + tl.arange(0, BLOCK_CO)
    n, oh, ow = p // (H * W), (p // W) % H, p % W
    acc = tl.zeros((BLOCK_P, BLOCK_CO), dtype=tl.float32)
    for kh in range(KH):
        for kw in range(KW):
            ih, iw = oh - PAD + kh, ow - PAD + kw
            inside = (p < N * H * W) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)   # padding reads zeros
            pixel = ((n * H + ih) * W + iw) * C_IN
            for ci0 in range(0, C_IN, BLOCK_CI):
                ci = ci0 + tl.arange(0, BLOCK_CI)
                x = tl.load(x_ptr + pixel[:, None] + ci[None, :], mask=inside[:, None] & (ci[None, :] < C_IN),
                            other=0.0)
                w = tl.load(w_ptr + ((kh * KW + kw) * C_IN + ci[:, None]) * C_OUT + co[None, :],
                            mask=(ci[:, None] < C_IN) & (co[None, :] < C_OUT), other=0.0)
                acc += tl.dot(x, w)
    bias = tl.load(b_ptr + co, mask=co < C_OUT, other=0.0).to(tl.float32)
    y = tl.maximum(acc + bias[None, :], 0.0)                   # the epilogue: bias (BN folded in), then ReLU
    tl.store(y_ptr + p[:, None] * C_OUT + co[None, :], y.to(y_ptr.dtype.element_ty),
             mask=(p[:, None] < N * H * W) & (co[None, :] < C_OUT))


def conv_bias_relu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """relu(conv(x, weight) + bias) for a stride-1 'same' conv; `weight` as fold_batch_norm lays it out."""
    n, c_in, h, w = x.shape
    kh, kw, _, c_out = weight.shape
    x = x.contiguous(memory_format=torch.channels_last)       # NHWC in memory
    y = torch.empty((n, c_out, h, w), device=x.device, dtype=x.dtype, memory_format=torch.channels_last)
    grid = (triton.cdiv(n * h * w, 64), triton.cdiv(c_out, 64))
    conv_bias_relu_kernel[grid](x, weight, bias, y, n, h, w, c_in, c_out, KH=kh, KW=kw, PAD=kh // 2,
                                BLOCK_P=64, BLOCK_CO=64, BLOCK_CI=32)
    return y


# ---- the comparison ------------------------------------------------------------------------------------

def traffic_table(analysis, read_by_hand: int, written_by_hand: int) -> None:
    """The seed's table: what each variant reads and writes, and how many kernels it launches."""
    unfused, fused = analysis.unfused, analysis.fused
    rows = [("bytes read", unfused.bytes_read, fused.bytes_read, read_by_hand),
            ("bytes written", unfused.bytes_written, fused.bytes_written, written_by_hand),
            ("total traffic", unfused.total_bytes, fused.total_bytes, read_by_hand + written_by_hand)]
    print(f"{'':<18}{'PyTorch eager':>16}{'opfuse':>16}{'hand-written':>16}")
    for label, *values in rows:
        print(f"{label:<18}" + "".join(f"{v / 1e6:>13.2f} MB" for v in values))
    print(f"{'kernel launches':<18}{unfused.kernel_launches:>16}{fused.kernel_launches:>16}{1:>16}")
    hand_density = fused.flops / (read_by_hand + written_by_hand)
    print(f"{'FLOPs/Byte':<18}{unfused.density:>16.1f}{fused.density:>16.1f}{hand_density:>16.1f}")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()

    model, (x,) = conv_bn_relu(batch=args.batch)
    analysis = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float16"))   # counts only: runs nothing
    weight, bias = fold_batch_norm(model[0], model[1])
    y_bytes = x.numel() * 2                  # fp16 output, as large as the input here
    print(f"Conv 3x3 + BN + ReLU, input {tuple(x.shape)}, float16")
    traffic_table(analysis, (x.numel() + weight.numel() + bias.numel()) * 2, y_bytes)

    if not on_gpu:   # check the three variants agree, on a tiny shape in float32 through Triton's interpreter
        model, (x,) = conv_bn_relu(batch=2, channels=8, size=6)
        compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float32"))
        with torch.no_grad():
            weight, bias = fold_batch_norm(model[0], model[1])
            eager, fused, by_hand = model(x), compiled(x), conv_bias_relu(x, weight, bias)
        print(f"\nno GPU: numerics on a tiny shape {tuple(x.shape)} in float32 (Triton interpreter)")
        print(f"opfuse ({compiled.launches} kernel) vs eager: relative error {relative_error(fused, eager):.1e}")
        print(f"hand-written kernel vs eager: relative error {relative_error(by_hand, eager):.1e}")
        if max(relative_error(fused, eager), relative_error(by_hand, eager)) > 1e-4:
            raise SystemExit("the variants disagree: please report this")
        print("the times of the three variants need a GPU: run this script on one")
        return

    from opfuse.bench.harness import cuda_graphed, kernel_profile, median_ms

    torch.backends.cudnn.benchmark = True
    reference_model, reference_x = copy.deepcopy(model).cuda(), x.cuda()          # float32, for the errors
    model = model.cuda().half().to(memory_format=torch.channels_last)
    x = x.cuda().half().contiguous(memory_format=torch.channels_last)
    compiled = opfuse.compile(model, (x,), opfuse.FusionConfig(dtype="float16", cuda_graph=False))
    weight, bias = (t.detach().half().cuda() for t in fold_batch_norm(reference_model[0], reference_model[1]))
    variants = {"PyTorch eager": model, "opfuse": compiled,
                "hand-written": lambda x: conv_bias_relu(x, weight, bias)}
    traffic = {"PyTorch eager": analysis.unfused.total_bytes, "opfuse": analysis.fused.total_bytes,
               "hand-written": (x.numel() + weight.numel() + bias.numel()) * 2 + y_bytes}
    with torch.inference_mode():
        reference = reference_model(reference_x)
        print(f"\n{'':<16}{'median':>12}{'kernels':>9}{'GB/s':>8}{'rel. error':>12}   (CUDA graphs, events)")
        for name, fn in variants.items():
            milliseconds = median_ms(cuda_graphed(fn, (x,)), (x,))
            kernels, _ = kernel_profile(fn, (x,))
            gbps = traffic[name] / (milliseconds / 1e3) / 1e9
            print(f"{name:<16}{milliseconds * 1e3:>9.1f} µs{kernels:>9}{gbps:>8.0f}"
                  f"{relative_error(fn(x), reference):>12.1e}")


if __name__ == "__main__":
    main()
