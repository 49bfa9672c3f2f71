"""Compile a model with opfuse and compare it with eager PyTorch: same outputs, fewer kernels, and (on a GPU) time.

    python examples/02_compile.py                      # a small residual CNN defined below
    python examples/02_compile.py --model resnet50     # a built-in model (on a GPU: the interpreter takes minutes)

`opfuse.compile(model, example_inputs, config)` runs the whole pipeline (capture, passes, fusion plan, Triton
kernels, autotuning, CUDA graph) and checks the result against eager before returning it; the model you pass is
never changed. On a GPU the script runs in fp16 at batch 32 and times both; without one, Triton runs the kernels
in its CPU interpreter, so the script uses a tiny float32 input and only compares outputs.
"""

import argparse
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")    # must be set before triton is imported

import torch.nn as nn  # noqa: E402

import opfuse  # noqa: E402


class SmallResNet(nn.Module):
    """A stem (conv + BN + ReLU), one residual block, global pooling and a classifier."""

    def __init__(self, width: int = 32, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        y = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(y)) + x)           # the residual add fuses into conv2's kernel
        return self.head(x.mean(dim=(2, 3)))


def small_resnet(batch: int = 1, size: int = 224):
    """(model, example inputs), seeded; BN statistics made non-trivial so that folding them matters."""
    torch.manual_seed(0)
    model = SmallResNet()
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.normal_(0, 0.1)
            module.running_var.uniform_(0.5, 1.5)
    return model.eval(), (torch.randn(batch, 3, size, size),)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="small", help="'small' (the CNN above) or a built-in model name")
    parser.add_argument("--batch", type=int, default=32 if torch.cuda.is_available() else 2)
    args = parser.parse_args()
    on_gpu = torch.cuda.is_available()

    if args.model == "small":
        model, inputs = small_resnet(args.batch, size=224 if on_gpu else 12)
    else:
        from opfuse.bench.zoo import load_builtin
        model, inputs = load_builtin(args.model, batch=args.batch)
    dtype = torch.float16 if on_gpu else torch.float32
    if on_gpu:
        model = model.cuda().to(dtype)
        inputs = tuple(x.cuda().to(dtype) if x.is_floating_point() else x.cuda() for x in inputs)

    compiled = opfuse.compile(model, inputs, opfuse.FusionConfig(dtype=str(dtype).removeprefix("torch.")),
                              quiet=False)
    with torch.no_grad():
        eager_out, opfuse_out = model(*inputs), compiled(*inputs)
    analysis = compiled.analysis
    print(f"{args.model}, input {tuple(inputs[0].shape)} {str(dtype).removeprefix('torch.')}")
    print(f"eager PyTorch: {analysis.unfused.kernel_launches} kernels; opfuse: {compiled.launches}")
    through_pytorch = {g: why for g, why in compiled.fallbacks.items() if why.code != "view"}   # views launch nothing
    for group, why in through_pytorch.items():
        print(f"  {group} runs through PyTorch: {why}")
    print(f"relative error, opfuse vs eager: {relative_error(opfuse_out, eager_out):.1e}")
    print("compile stages: " + ", ".join(f"{stage} {seconds:.1f} s" for stage, seconds in compiled.seconds.items()))

    if on_gpu:
        from opfuse.bench.harness import median_ms
        with torch.inference_mode():
            eager_ms, opfuse_ms = median_ms(model, inputs), median_ms(compiled, inputs)
        print(f"median per forward: eager {eager_ms:.3f} ms, opfuse {opfuse_ms:.3f} ms "
              f"({eager_ms / opfuse_ms:.2f}x)")
    else:
        print("times need a GPU: run this script on one")


if __name__ == "__main__":
    main()
