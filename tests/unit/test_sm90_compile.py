"""benchmarks/sm90_compile.py: kernels compiled for sm_90 without a GPU (Triton's front end, LLVM and ptxas on the
CPU), and what it reads from the PTX and the cubin."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from opfuse.codegen.base import import_file

ROOT = Path(__file__).resolve().parents[2]
sm90_compile = import_file(ROOT / "benchmarks" / "sm90_compile.py", "sm90_compile")

PTX = """
    @%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
    @%p2 ld.global.b16 { %rs1 }, [ %rd2 + 0 ];
    ld.global.nc.v2.f32 { %f1, %f2 }, [ %rd3 ];
    @%p3 st.global.b16 [ %rd4 + 0 ], { %rs2 };
    ld.shared.v4.b32 { %r5, %r6, %r7, %r8 }, [ %r9 ];
    cp.async.cg.shared.global [ %r54 + 0 ], [ %rd13 + 0 ], 0x10, %r55;
    cp.async.ca.shared.global [ %r56 + 0 ], [ %rd14 + 0 ], 4, %r57;
    cp.async.commit_group;
"""


def test_access_widths_average_the_bytes_of_global_loads_async_copies_and_stores():
    assert sm90_compile.access_widths(PTX) == {"ld": (16 + 2 + 8 + 16 + 4) / 5, "st": 2.0}
    assert sm90_compile.access_widths("") == {"ld": 0.0, "st": 0.0}


LOOPS = """
    mov.u32 %r1, 0;
$L__BB0_1:
    // a comment
    add.s32 %r1, %r1, 1;
    setp.lt.s32 %p1, %r1, %r2;
    @%p1 bra $L__BB0_1;
$L__BB0_2:
    st.global.b32 [ %rd1 + 0 ], { %r1 };
    @%p2 bra.uni $L__BB0_3;
$L__BB0_3:
    ret;
"""


def test_loop_instructions_count_the_blocks_that_branch_back_to_themselves():
    assert sm90_compile.loop_instructions(LOOPS) == 3      # BB0_1; BB0_2 branches forward
    assert sm90_compile.loop_instructions("") == 0


# every offline script starts so: the script's module loaded from its file, its stand-in driver active
PREAMBLE = '''
import json, sys
sys.path.insert(0, {root!r})
import importlib.util
spec = importlib.util.spec_from_file_location("sm90_compile", {script!r})
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
from triton.runtime.driver import driver
driver.set_active(module.OfflineDriver())
'''


def run_offline(tmp_path: Path, body: str, timeout: float) -> object:
    """Run PREAMBLE + `body` as a script without TRITON_INTERPRET (Triton reads a jitted function's source from
    its file), its Triton cache in `tmp_path`; the JSON its last line printed."""
    script = tmp_path / "offline.py"
    script.write_text(PREAMBLE.format(root=str(ROOT), script=str(ROOT / "benchmarks" / "sm90_compile.py")) + body)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


KERNEL = '''
import triton, triton.language as tl
from triton.runtime.jit import MockTensor
import torch

@triton.jit
def add_one(x_ptr, y_ptr, n, STRIDED: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    value = tl.load(x_ptr + (offs * 3 if STRIDED else offs), mask=mask)
    tl.store(y_ptr + offs, value + 1, mask=mask)

report = {}
for strided in (False, True):
    kernel = add_one.warmup(MockTensor(torch.float16), MockTensor(torch.float16), 4096, strided, BLOCK=1024,
                            grid=(1,))
    report[str(strided)] = module.resources(kernel.asm["cubin"]) | module.access_widths(kernel.asm["ptx"])
print(json.dumps(report))
'''


def test_a_kernel_compiles_for_sm90_on_the_cpu_and_its_widths_follow_its_indexing(tmp_path):
    report = run_offline(tmp_path, KERNEL, timeout=300)
    dense, strided = report["False"], report["True"]
    assert dense["ld"] == 16.0 and dense["st"] == 16.0          # 8 halves per instruction
    assert strided["ld"] == 2.0 and strided["st"] == 16.0       # a gather: one half per instruction
    assert 0 < dense["registers"] <= 255 and dense["local"] == 0 == strided["local"]


def test_example_values_are_channels_last_where_the_compiled_model_holds_them_so():
    """Images, convolutions, [N, H, W, C] rows permuted back to [N, C, H, W] and what elementwise ops make of them:
    channels-last; attention's 4-D heads (a permute of a 3-D activation) and their matmul: contiguous."""
    from tests.kernels.builders import KernelGraph

    b = KernelGraph()
    image = b.input("image", (1, 3, 8, 8))
    conv = b.op("conv2d", image, b.const("w", b.random(4, 3, 3, 3)), stride=(1, 1), padding=(1, 1),
                dilation=(1, 1), groups=1)
    relu = b.op("relu", conv)
    tokens = b.input("tokens", (1, 8, 8))              # attention's heads: a 3-D activation viewed as 4-D
    heads = b.op("permute", b.op("reshape", tokens, shape=(1, 8, 2, 4)), dims=(0, 2, 1, 3))
    scores = b.op("relu", b.op("matmul", heads, b.op("permute", heads, dims=(0, 1, 3, 2))))
    # ConvNeXt's block end: a linear over [N, H, W, C] rows permuted back to [N, C, H, W], then the residual add
    rows = b.op("linear", b.op("permute", conv, dims=(0, 2, 3, 1)), b.const("w2", b.random(4, 4)))
    back = b.op("permute", rows, dims=(0, 3, 1, 2))
    residual = b.op("add", back, conv)
    # ShuffleNet's channel shuffle: [N, 2, C/2, H, W], swapped, and back to [N, C, H, W]
    split = b.op("reshape", relu, shape=(1, 2, 2, 8, 8))
    shuffled = b.op("reshape", b.op("permute", split, dims=(0, 2, 1, 3, 4)), shape=(1, 4, 8, 8))
    memo = {}
    names = (image, conv, relu, heads, scores, back, residual, shuffled)
    found = {name: sm90_compile.channels_last(b.graph, name, memo) for name in names}
    assert found == {image: True, conv: True, relu: True, heads: False, scores: False, back: True, residual: True,
                     shuffled: True}


MODEL = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import opfuse


class Tiny(nn.Module):
    """One of each template: conv (implicit GEMM), depthwise, 1x1 as a GEMM with a residual, grouped conv, a
    squeeze-excitation, max pool, a linear + GELU, a layer norm and attention."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU())
        self.depthwise = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.pointwise = nn.Conv2d(16, 16, 1)
        self.grouped = nn.Conv2d(16, 32, 3, padding=1, groups=4)
        self.squeeze = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(32, 8, 1), nn.SiLU(), nn.Conv2d(8, 32, 1),
                                     nn.Sigmoid())
        self.qkv = nn.Linear(32, 3 * 64)
        self.norm = nn.LayerNorm(64)
        self.head = nn.Linear(64, 16)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.pointwise(self.depthwise(x)) + x)
        x = self.grouped(x)
        x = F.max_pool2d(x * self.squeeze(x), 2)                     # [2, 32, 4, 4]
        tokens = x.flatten(2).transpose(1, 2)                         # [2, 16, 32]
        q, k, v = self.qkv(tokens).view(2, 16, 3, 1, 64).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(2, 16, 64)
        return self.head(F.gelu(self.norm(attended)))


torch.manual_seed(0)
model, x = Tiny().eval(), torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last)
plan = opfuse.analyze(model, (x,), opfuse.FusionConfig(dtype="float16")).plan
rows = module.compile_plan(plan, "all", top=2)        # an attention kernel lists torch's attention first
print(json.dumps(rows))
'''


@pytest.mark.slow
def test_every_template_and_form_compiles_for_sm90(tmp_path):
    """The interpreter runs Triton code as Python: a kernel real Triton cannot compile passes every interpreter
    test. Here one tiny model's kernels (every template, the first two configs of each and every library form) are
    compiled for sm_90 by Triton itself, and the flat library epilogue's stores are 16 bytes wide."""
    rows = run_offline(tmp_path, MODEL, timeout=1200)
    assert [row for row in rows if "error" in row] == []
    kernels = {row["kernel"].split("_")[1] for row in rows}
    assert {"conv2d", "dw", "linear", "layer", "sdpa"} <= kernels, kernels
    flat = [row for row in rows if row["config"].get("BLOCK") == 1024 and row["config"]["form"] == "library"]
    assert flat and all(row["st_bytes"] == 16.0 for row in flat), flat


DEPTHWISE = '''
import torch
from opfuse.codegen.base import KernelConfig, import_file, recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.fusion.tiles import unrolled_tap_registers
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.compile_worker import warmup
from tests.kernels.test_conv_kernels import Builder

b = Builder(dtype="float16")
x = b.input("x", (2, 16, 14, 14))
y = b.conv(x, 16, 7, padding=3, groups=16)
kernel = lower_conv_group(b.graph, b.group([y], GroupKind.ANCHOR_EPILOGUE), "cpu")
feeds = [b.feeds[n].contiguous(memory_format=torch.channels_last) for n in kernel.runtime_inputs]
report = {}
for loop in (0, 1):
    config = KernelConfig.of(num_warps=4, num_stages=1, BLOCK_M=64, BLOCK_N=32, ROW_LOOP=loop)
    with recording_launches() as launches:
        kernel.run(feeds, config)
    (record,) = launches
    compiled = warmup(getattr(import_file(record.path, "dw_offline"), record.function), record)
    report[str(loop)] = module.resources(compiled.asm["cubin"])
report["estimate"] = unrolled_tap_registers(dict(config.params, num_warps=config.num_warps), 49, 2)
print(json.dumps(report))
'''


def test_depthwise_taps_the_register_rule_unrolls_spill_and_the_row_loop_does_not(tmp_path):
    """A 7x7 depthwise tile of 16 fp16 elements a thread: `unrolled_tap_registers` puts it over 255 registers, and
    ptxas spills it unrolled; in the row loop (what `depthwise_configs` gives it) it fits."""
    report = run_offline(tmp_path, DEPTHWISE, timeout=600)
    assert report["estimate"] > 255
    assert report["0"]["local"] > 0
    assert report["1"]["local"] == 0 and report["1"]["registers"] <= 255


def test_summary_names_the_spilling_and_the_narrow_launches():
    rows = [{"launch": "gemm_a", "local": 0, "ld_bytes": 16.0, "st_bytes": 16.0},
            {"launch": "gemm_b", "local": 96, "ld_bytes": 16.0, "st_bytes": 2.0},
            {"launch": "dw", "local": 0, "ld_bytes": 3.8, "st_bytes": 16.0},
            {"launch": "dw", "local": 0, "ld_bytes": 4.9, "st_bytes": 16.0},
            {"launch": "reduce", "local": 0, "ld_bytes": 16.0, "st_bytes": 0.0},   # stores nothing: not narrow
            {"launch": "broken", "error": "CompilationError: x"}]
    spilling, narrow = sm90_compile.summary(rows).splitlines()
    assert spilling == "spilling: 1 launches: gemm_b (1)"
    assert narrow == "global access under 8 B: 3 launches: gemm_b (1), dw (2)"


UNITS = '''
import torch
from opfuse.codegen.base import import_file, recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.compile_worker import stand_in
from tests.kernels.test_conv_kernels import Builder

report = {}
for cin, cout in ((144, 24), (24, 144)):
    b = Builder(dtype="float16")
    x = b.input("x", (2, cin, 8, 8))
    y = b.conv(x, cout, 1)
    kernel = lower_conv_group(b.graph, b.group([y], GroupKind.ANCHOR_EPILOGUE), "cpu")
    feeds = [b.feeds[n].contiguous(memory_format=torch.channels_last) for n in kernel.runtime_inputs]
    with recording_launches() as launches:
        kernel.run(feeds, kernel.configs()[0])
    (record,) = launches
    function = getattr(import_file(record.path, f"units_{cin}"), record.function)
    for unit in (1, dict(record.kwargs)["UNIT"]):
        kwargs = {n: stand_in(v) for n, v in record.kwargs} | {"UNIT": unit}
        compiled = function.warmup(*map(stand_in, record.args), grid=(1,), **kwargs)
        report[f"{cin}->{cout} unit {unit}"] = module.access_widths(compiled.asm["ptx"])
print(json.dumps(report))
'''


def test_channels_in_units_of_8_load_and_store_16_bytes_wide(tmp_path):
    """A 1x1 conv (a GEMM) to and from 24 fp16 channels, compiled for sm_90 as launched (UNIT 8) and as it would be
    without the unit (1): with it, its 24-channel stores and loads are 16 bytes wide; without, 2 to 4."""
    report = run_offline(tmp_path, UNITS, timeout=600)
    assert set(report) == {"144->24 unit 1", "144->24 unit 8", "24->144 unit 1", "24->144 unit 8"}
    assert report["144->24 unit 8"]["st"] == 16.0 and report["144->24 unit 1"]["st"] <= 4.0
    assert report["24->144 unit 8"]["ld"] >= 8.0 and report["24->144 unit 1"]["ld"] <= 4.0


ROWS = '''
import torch
from opfuse.codegen.base import import_file, recording_launches
from opfuse.codegen.conv import lower_conv_group
from opfuse.fusion.plan import GroupKind
from opfuse.runtime.compile_worker import stand_in
from tests.kernels.test_conv_kernels import Builder

report = {}
for layout in ("nhwc", "nchw"):
    b = Builder(dtype="float16")
    x = b.input("x", (1, 32, 4, 16))
    skip = b.random(1, 32, 4, 16)
    if layout == "nhwc":
        skip = skip.to(memory_format=torch.channels_last)
    y = b.op("add", b.conv(x, 32, 1), b.input("skip", (1, 32, 4, 16), skip))
    kernel = lower_conv_group(b.graph, b.group([y], GroupKind.RESIDUAL), "cpu")
    with recording_launches() as launches:
        kernel.run([b.feeds[n] for n in kernel.runtime_inputs], kernel.configs()[0])
    (record,) = launches
    function = getattr(import_file(record.path, f"rows_{layout}"), record.function)
    launched = dict(record.kwargs)["ROW_UNIT"]
    for rows in (64, 49):
        for row_unit in sorted({1, launched}):
            args = [stand_in(rows if name == "M" else value) for name, value in zip(function.arg_names, record.args)]
            kwargs = {n: stand_in(v) for n, v in record.kwargs} | {"ROW_UNIT": row_unit}
            compiled = function.warmup(*args, grid=(1,), **kwargs)
            report[f"{layout} {rows} {row_unit}"] = module.access_widths(compiled.asm["ptx"]) | {"hash": compiled.hash}
    report[layout] = launched
print(json.dumps(report))
'''


def test_a_row_count_compiles_once_unless_a_tensor_runs_along_the_rows(tmp_path):
    """A 1x1 conv (a GEMM) with a residual, compiled for sm_90 at 64 and 49 rows. With a channels-last residual
    the launch's ROW_UNIT is 1 and both row counts are one compile (`rows_jit`). With an NCHW residual (16 pixels
    a row, stride 1 along them) the launch passes ROW_UNIT 16, and only with it is the residual loaded wider than
    one half an instruction."""
    report = run_offline(tmp_path, ROWS, timeout=600)
    assert report["nhwc"] == 1 and report["nhwc 64 1"] == report["nhwc 49 1"]
    assert report["nchw"] == 16 and report["nchw 64 16"]["ld"] > report["nchw 64 1"]["ld"]

GROUPS = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
import opfuse


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return torch.tanh(self.fc2(F.gelu(self.fc1(x))))


plan = opfuse.analyze(MLP().eval(), (torch.randn(4, 32),), opfuse.FusionConfig(dtype="float16")).plan
chosen = {g.name for g in plan.groups if {"linear", "gelu"} <= {plan.graph[n].op for n in g.nodes}}
rows = module.compile_plan(plan, "triton", top=1, groups=chosen)
print(json.dumps({"chosen": sorted(chosen), "groups": sorted({row["group"] for row in rows}),
                  "errors": [row for row in rows if "error" in row]}))
'''


@pytest.mark.slow
def test_only_the_groups_asked_for_are_compiled(tmp_path):
    """`compile_plan(..., groups=...)` (the script's --with-ops) compiles those groups' kernels and no other."""
    result = run_offline(tmp_path, GROUPS, timeout=600)
    assert len(result["chosen"]) == 1 and result["groups"] == result["chosen"] and not result["errors"]


def test_compare_names_each_launch_whose_compile_changed_once():
    config = {"BLOCK_M": 64, "num_warps": 4}
    before = [{"group": "g0", "launch": "conv_a", "config": config, "registers": 192, "local": 0, "ld_bytes": 16.0,
               "st_bytes": 16.0, "compile_s": 1.5},
              {"group": "g1", "launch": "conv_a", "config": config, "registers": 192, "local": 0, "ld_bytes": 16.0,
               "st_bytes": 16.0, "compile_s": 0.5},
              {"group": "g2", "launch": "dw", "config": config, "registers": 40, "local": 0, "ld_bytes": 16.0,
               "st_bytes": 16.0, "compile_s": 1.0}]
    after = [dict(before[0], registers=241, compile_s=1.0), dict(before[1], registers=241, compile_s=0.0),
             dict(before[2], compile_s=0.5)]
    lines = sm90_compile.compare(before, after).splitlines()
    assert len(lines) == 2 and lines[0].startswith("conv_a") and "'registers': (192, 241)" in lines[0]
    assert lines[1] == "1 distinct launches differ of 3 launches; compile 3.0 s -> 1.5 s"
    with pytest.raises(ValueError, match="different launches"):
        sm90_compile.compare(before, after[:2])


DEPENDENT = '''
from triton.runtime.jit import MockTensor
import torch
from opfuse.codegen.base import load_kernel

SOURCE = """
import triton
import triton.language as tl


@triton.jit
def KERNEL_NAME(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)
"""
_, source, launcher = load_kernel("dependent", ["add"], SOURCE)
report = {}
for pdl, prefetch in ((0, 0), (1, 0), (1, 1)):
    kernel = launcher.function.warmup(MockTensor(torch.float16), MockTensor(torch.float16), 4096, BLOCK=1024, PDL=pdl,
                                      launch_pdl=bool(pdl), pf_addr=1 << 40, pf_bytes=12582912, PREFETCH=prefetch,
                                      grid=(1,))
    ptx = kernel.asm["ptx"]
    bulk, wait = ptx.find("cp.async.bulk.prefetch.L2.global"), ptx.find("griddepcontrol.wait")
    report[f"{pdl}/{prefetch}"] = [wait >= 0, "griddepcontrol.launch_dependents" in ptx,
                                   bool(kernel.metadata.launch_pdl), bulk >= 0, 0 <= bulk < wait]
print(json.dumps(report))
'''


def test_a_kernel_launched_dependently_waits_for_the_one_before_then_lets_the_next_start(tmp_path):
    """Every generated kernel takes the PDL constexpr and the prefetch parameters (`with_dependent_launch`):
    compiled for sm_90 with PDL=1 and launch_pdl its PTX waits on the prerequisite grid and then triggers its
    dependents; with PDL=0 neither. With PREFETCH=1 it first issues bulk L2 prefetches (before it waits)."""
    report = run_offline(tmp_path, DEPENDENT, timeout=300)
    assert report == {"0/0": [False, False, False, False, False], "1/0": [True, True, True, False, False],
                      "1/1": [True, True, True, True, True]}
