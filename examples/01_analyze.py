"""Analyze a model without running it: which ops waste memory traffic, what opfuse fuses, and what that saves.

    python examples/01_analyze.py                       # resnet18, batch 1
    python examples/01_analyze.py resnet50 --batch 64
    python examples/01_analyze.py bert-base

No GPU needed. `opfuse.analyze` captures the model (torch.export), prepares the graph (casts it to fp16, folds
batch norms) and plans the fusion; FLOPs and bytes come from the op registry, times from the cost model of the
hardware profile (an H200 here). `opfuse analyze MODEL` prints the same with every table.
"""

import argparse
from collections import Counter

import opfuse
from opfuse.bench.zoo import BUILTIN_MODELS, load_builtin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="resnet18", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--batch", type=int, default=1)
    args = parser.parse_args()

    model, inputs = load_builtin(args.model, batch=args.batch)
    analysis = opfuse.analyze(model, inputs, opfuse.FusionConfig(dtype="float16", hardware="h200"), name=args.model)

    # 1. Per op, as PyTorch runs it: one kernel each. The seed's rule: under 10 FLOPs/Byte, fuse it.
    ops = analysis.op_rows
    candidates = [r for r in ops if r.candidate]
    print(f"{args.model}, batch {args.batch}: {len(ops)} ops, each its own kernel; {len(candidates)} of them do "
          f"under {analysis.config.density_threshold:g} FLOPs per byte they move (fusion candidates)")
    print("the ten that move the most bytes:")
    print(f"  {'op':<28}{'kind':<11}{'moves':>10}{'FLOPs/B':>9}  candidate")
    for r in sorted(ops, key=lambda r: -r.bytes_moved)[:10]:
        print(f"  {r.name:<28}{r.kind:<11}{r.bytes_moved / 1e6:>7.2f} MB{r.density:>9.1f}  "
              f"{'yes' if r.candidate else ''}")

    # 2. What opfuse fuses: one kernel per group (two where a row reduction's rows are split: a second kernel
    # merges the slices).
    kinds = Counter(g.kind.value for g in analysis.plan.groups if g.launches)
    split = sum(1 for g in analysis.plan.groups if g.launches > 1)
    print(f"\nopfuse runs {analysis.plan.kernel_launches} kernels for {sum(kinds.values())} groups: "
          + ", ".join(f"{count} {kind}" for kind, count in kinds.most_common())
          + (f" ({split} of them split rows: two kernels each)" if split else ""))

    # 3. The seed's table: the whole model, unfused vs fused.
    unfused, fused = analysis.unfused, analysis.fused
    print(f"\n{'':<28}{'unfused':>12}{'fused':>12}")
    for label, field, fmt in [("bytes read (MB)", "bytes_read", lambda v: f"{v / 1e6:.2f}"),
                              ("bytes written (MB)", "bytes_written", lambda v: f"{v / 1e6:.2f}"),
                              ("total traffic (MB)", "total_bytes", lambda v: f"{v / 1e6:.2f}"),
                              ("kernel launches", "kernel_launches", str),
                              ("peak intermediates (MB)", "peak_intermediate_bytes", lambda v: f"{v / 1e6:.2f}"),
                              ("FLOPs per byte", "density", lambda v: f"{v:.1f}"),
                              ("predicted time (µs)", "predicted_time", lambda v: f"{v * 1e6:.1f}")]:
        print(f"{label:<28}{fmt(getattr(unfused, field)):>12}{fmt(getattr(fused, field)):>12}")


if __name__ == "__main__":
    main()
