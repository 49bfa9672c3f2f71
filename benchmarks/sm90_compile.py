"""Compile a built-in model's Triton kernels for sm_90 (H100/H200) on a machine without a GPU, and report what
ptxas made of each: registers, local memory (spills), how wide its global loads and stores are, how many PTX
instructions its loops issue a step, and how long it took to compile (with an empty Triton cache:
TRITON_CACHE_DIR), then which kernels spill and which access memory narrowly (`summary`); or what changed between
two trees' compiles of one model (`compare`).

Triton's front end, LLVM and ptxas all run on the CPU; only loading and launching a kernel needs a GPU. A stand-in
driver (`OfflineDriver`) answers Triton's questions about the device, each kernel runs once per config with its
launches recorded (as for the compile workers, `opfuse.runtime.precompile`), and each recorded launch is compiled
by `JITFunction.warmup`. The values a kernel reads are random tensors of their graph types (4-D activations
channels-last as opfuse's kernels write them, `channels_last`), so a kernel is specialised as in a real compile
except where a real value's strides or alignment differ (a slice of a larger tensor, say). What this cannot say is the time: it finds spills and unvectorised
memory access before a GPU session, it does not replace measuring.

    python -m benchmarks.sm90_compile shufflenet_v2_x1_0 --batch 64 [--forms library] [--json out.json]
    python -m benchmarks.sm90_compile convnext_tiny --batch 64 --with-ops linear,gelu --tune-top 99 --forms triton
    python -m benchmarks.sm90_compile convnext_tiny --enable norm_epilogue --with-ops conv2d,layer_norm
    python -m benchmarks.sm90_compile --compare before.json after.json    # two trees' --json of one model

Must run without TRITON_INTERPRET (the interpreter compiles nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path


VECTOR = re.compile(r"\b(ld|st)\.global(?:\.[a-z]+)*?(?:\.v(\d))?\.(?:b|f|u|s)(\d+)\b")
ASYNC_COPY = re.compile(r"\bcp\.async\.c[ag]\.shared\.global(?:\.[a-z0-9]+)*\s+\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)")
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
LABEL = re.compile(r"^(\$L__BB\d+_\d+):")


class OfflineDriver:
    """Triton's active driver without a GPU: an sm_90 target on device 0; anything that needs the device fails."""

    def __init__(self, arch: int = 90):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def __getattr__(self, name: str):
        raise AttributeError(f"no GPU here: Triton asked the offline driver for {name}")


def access_widths(ptx: str) -> dict[str, float]:
    """Mean bytes per global load and per global store instruction of a kernel's PTX (16: fully vectorised); the
    loads count the asynchronous copies to shared memory (`cp.async`) that pipelined dot operands go through."""
    sizes: dict[str, list[int]] = {"ld": [], "st": []}
    for kind, lanes, bits in VECTOR.findall(ptx):
        sizes[kind].append(int(lanes or 1) * int(bits) // 8)
    sizes["ld"] += [int(size, 0) for size in ASYNC_COPY.findall(ptx)]
    return {kind: (sum(v) / len(v) if v else 0.0) for kind, v in sizes.items()}


def loop_instructions(ptx: str) -> int:
    """PTX instructions in a kernel's loop bodies (the basic blocks that branch back to themselves): what a K step
    or a filter row costs to issue, beside the setup and epilogue run once."""
    blocks: dict[str, list[str]] = {"entry": []}
    current = "entry"
    for line in ptx.splitlines():
        text = line.strip()
        label = LABEL.match(text)
        if label:
            current = label.group(1)
            blocks[current] = []
        elif text and not text.startswith(("//", ".", "{", "}")):
            blocks[current].append(text)
    return sum(len(body) for name, body in blocks.items()
               if any(re.search(rf"\bbra(?:\.uni)?\s+{re.escape(name)};", text) for text in body))


def resources(cubin: bytes) -> dict[str, int]:
    """Registers and local memory bytes per thread (its stack frame, where spills go, and local arrays: what
    Triton reports as `n_spills`), from cuobjdump's resource usage of the cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        out = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True).stdout
    match = RESOURCES.search(out)
    if match is None:
        return {}
    registers, stack, _, local = map(int, match.groups())
    return {"registers": registers, "local": stack + local}


def compile_record(record, modules: dict) -> dict:
    """Compile one recorded launch for the offline target: its resources, access widths and compile time."""
    from opfuse.codegen.base import import_file
    from opfuse.runtime.compile_worker import warmup

    module = modules.get(record.path)
    if module is None:
        module = modules[record.path] = import_file(record.path, Path(record.path).stem)
    start = time.perf_counter()
    kernel = warmup(getattr(module, record.function), record)
    seconds = time.perf_counter() - start      # Triton's on-disk cache makes a second run fast
    widths = {f"{k}_bytes": round(v, 1) for k, v in access_widths(kernel.asm["ptx"]).items()}
    return (resources(kernel.asm["cubin"]) | widths | {"loop": loop_instructions(kernel.asm["ptx"]),
                                                        "compile_s": round(seconds, 3)})


IMAGE_OPS = ("conv2d", "conv_transpose2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "batch_norm")


VIEW_OPS = ("reshape", "permute")


def channels_last(graph, name: str, memo: dict) -> bool:
    """Whether opfuse's compiled model holds a 4-D value channels-last: a 4-D image input, a convolution's or a
    pooling's result, an [N, H, W, C] value permuted to [N, C, H, W], and what elementwise ops, concatenations,
    slices and views of a 4-D value make of those (a pointwise kernel writes its outputs in its largest input's
    layout: a channel shuffle's reshape, permute, reshape of a channels-last image stays so; attention's 4-D heads,
    views of a 3-D activation, are contiguous)."""
    from opfuse.ir.ops import kind_of

    if name not in memo:
        node = graph[name]
        if len(node.type.shape) != 4:
            memo[name] = False
        elif node.op == "input":
            memo[name] = node.type.dtype.startswith(("float", "bfloat"))
        elif node.op in IMAGE_OPS:
            memo[name] = True
        elif node.op == "permute" and list(node.attrs["dims"]) == [0, 3, 1, 2]:
            memo[name] = True     # [N, H, W, C] seen as [N, C, H, W] (ConvNeXt's blocks end so): channels-last memory
        elif node.op in ("cat", "slice") or kind_of(node).elementwise:
            memo[name] = any(channels_last(graph, i, memo) for i in node.inputs if graph[i].op != "constant")
        elif node.op in VIEW_OPS:
            source = node
            while source.op in VIEW_OPS:          # back through the views to what they view
                source = graph[source.inputs[0]]
            memo[name] = channels_last(graph, source.name, memo)
        else:
            memo[name] = False
    return memo[name]


def example_values(plan, kernels) -> dict:
    """A random tensor of its graph type for every value a kernel reads, laid out as the compiled model holds it
    (`channels_last`; a real value may still be a strided view where this one is dense)."""
    import torch

    from opfuse.runtime.binaries import example_inputs

    names = sorted({name for kernel in kernels.values() for name in kernel.runtime_inputs})
    tensors = example_inputs([plan.graph[name].type for name in names], torch.device("cpu"))
    values, memo = {}, {}
    for name, tensor in zip(names, tensors):
        if channels_last(plan.graph, name, memo):
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        values[name] = tensor
    return values


COMPARED = ("registers", "local", "ld_bytes", "st_bytes", "loop", "error")


def compare(before: list[dict], after: list[dict]) -> str:
    """What changed between two compiles of one model's launches (`--json` of two trees, launch by launch in the
    same order): each distinct launch and config whose registers, local memory, access widths, loop instructions
    or error differ, then the counts and the compile seconds of each."""
    if [(r["group"], r["config"]) for r in before] != [(r["group"], r["config"]) for r in after]:
        raise ValueError("the two files hold different launches: compile one model and batch with both trees")
    lines, seen = [], set()
    for old, new in zip(before, after):
        old_facts, new_facts = ({k: row.get(k) for k in COMPARED} for row in (old, new))
        key = (old["launch"], json.dumps(old["config"], sort_keys=True))
        if old_facts != new_facts and key not in seen:
            seen.add(key)
            changed = {k: (old_facts[k], new_facts[k]) for k in COMPARED if old_facts[k] != new_facts[k]}
            lines.append(f"{old['launch'][:40]:40} {key[1][:70]:70} {changed}")
    seconds = [sum(row.get("compile_s", 0.0) for row in rows) for rows in (before, after)]
    lines.append(f"{len(seen)} distinct launches differ of {len(before)} launches; compile "
                 f"{seconds[0]:.1f} s -> {seconds[1]:.1f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["--compare"]:
        if len(argv) != 3:
            parser.error("--compare takes two --json files")
        print(compare(*(json.loads(Path(path).read_text()) for path in argv[1:])))
        return 0
    parser.add_argument("model")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--forms", choices=("all", "library", "triton"), default="all",
                        help="which configs to compile: all (the tuner's candidates), the library forms, or the "
                             "kernels' own Triton configs")
    parser.add_argument("--tune-top", type=int, default=None, help="the kernels' first configs (FusionConfig's "
                        "tune_top by default)")
    parser.add_argument("--with-ops", default="", metavar="OPS",
                        help="only the groups holding every one of these ops (comma-separated, e.g. linear,gelu)")
    parser.add_argument("--enable", action="append", default=[], metavar="SWITCH",
                        help="a FusionConfig switch that is off by default, on (e.g. norm_epilogue; repeatable)")
    parser.add_argument("--json", help="write every compiled launch here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        parser.error("run without TRITON_INTERPRET: the interpreter compiles nothing")

    import torch
    from triton.runtime.driver import driver

    import opfuse
    from opfuse.bench.harness import protocol_form
    from opfuse.bench.zoo import load_builtin

    driver.set_active(OfflineDriver())
    model, inputs = load_builtin(args.model, args.batch)
    model, inputs = protocol_form(model, inputs, torch.float32, device="cpu")
    from opfuse.bench.zoo_bench import enable_switches

    config = opfuse.FusionConfig(dtype="float16", **dict.fromkeys(enable_switches(args.enable), True))
    plan = opfuse.analyze(model, inputs, config).plan
    top = args.tune_top if args.tune_top is not None else config.tune_top
    ops = {op for op in args.with_ops.split(",") if op}
    groups = {g.name for g in plan.groups if ops <= {plan.graph[n].op for n in g.nodes}} if ops else None
    rows = compile_plan(plan, args.forms, top, on_row=print_row, groups=groups)
    failed = Counter(row["error"].split(":")[0] for row in rows if "error" in row)
    seconds = sum(row.get("compile_s", 0.0) for row in rows)
    print(f"{len(rows)} launches compiled for sm_90 in {seconds:.1f} s, {sum(failed.values())} failed {dict(failed)}")
    print(summary(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


def compile_plan(plan, forms: str = "all", top: int | None = None, on_row=None,
                 groups: set[str] | None = None) -> list[dict]:
    """Every launch of every candidate config (`forms`: all, library or triton; the first `top` of each kernel's
    own) of the plan's kernels (those of `groups` only, where given), compiled for the active driver's target: one
    row each, with an "error" where the compile failed (the tuner would reject that config); `on_row(row)` as each
    is done."""
    from opfuse.codegen.base import recording_launches
    from opfuse.codegen.forms import is_library, is_unfused
    from opfuse.codegen.lower import lower_plan
    from opfuse.runtime.autotune import candidates, kernel_inputs

    kernels, _ = lower_plan(plan, "cpu")
    if groups is not None:
        kernels = {name: kernel for name, kernel in kernels.items() if name in groups}
    values = example_values(plan, kernels)
    wanted = {"all": lambda c: True, "library": is_library, "triton": lambda c: not is_library(c)}[forms]
    rows, modules = [], {}
    for name, kernel in kernels.items():
        feeds = kernel_inputs(kernel, values)
        for kernel_config in candidates(kernel, top, True)[1]:
            if is_unfused(kernel_config) or not wanted(kernel_config):   # the unfused form compiles nothing
                continue
            with recording_launches() as launches:
                kernel.run(feeds, kernel_config)
            for record in launches:
                row = {"group": name, "kernel": kernel.name, "config": kernel_config.as_dict(),
                       "launch": record.function}
                try:
                    row |= compile_record(record, modules)
                except Exception as error:       # reported, not fatal: the tuner would reject this config
                    row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows


NARROW_BYTES = 8    # a mean global access under this many bytes: mostly scalar or 2-wide fp16 accesses


def summary(rows: list[dict]) -> str:
    """What to look at first: the launches that spill (local memory) and those whose mean global load or store is
    under NARROW_BYTES, each as the kernels they are in (with the launch count), widest problem first."""
    def kernels(selected: list[dict], key) -> str:
        counts = Counter(row["launch"] for row in sorted(selected, key=key))
        return ", ".join(f"{name} ({n})" for name, n in counts.items()) or "none"

    compiled = [row for row in rows if "error" not in row]
    spilling = [row for row in compiled if row.get("local", 0) > 0]
    narrow = [row for row in compiled
              if 0 < min(row.get("ld_bytes") or NARROW_BYTES, row.get("st_bytes") or NARROW_BYTES) < NARROW_BYTES]
    return (f"spilling: {len(spilling)} launches: {kernels(spilling, lambda r: -r['local'])}\n"
            f"global access under {NARROW_BYTES} B: {len(narrow)} launches: "
            f"{kernels(narrow, lambda r: min(r.get('ld_bytes') or 99, r.get('st_bytes') or 99))}")


def print_row(row: dict) -> None:
    print(f"{row['group']:5} {row['launch'][:40]:40} {json.dumps(row['config'])[:70]:70} "
          f"regs {row.get('registers', '-'):>3} local {row.get('local', '-'):>4} "
          f"ld {row.get('ld_bytes', '-'):>4} st {row.get('st_bytes', '-'):>4} {row.get('error', '')}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
