"""What every lowered fusion group looks like to the runtime: `GroupKernel`, and the source loader.

A `GroupKernel` is one fusion group turned into one Triton kernel. It is built once per compile from the graph and
the group (weights are packed then: transposed, concatenated, cast to the compute dtype, moved to the device) and
run many times. Its `run` takes the group's non-constant inputs (in `group.inputs` order, constants skipped) and
returns the group's outputs (in `group.outputs` order).

Layout convention shared by all kernels: 4-D activations are produced in channels-last (NHWC) memory format, and
every kernel reads its activation inputs through their strides, so a channel slice of a horizontally merged output
(a strided view) is a valid input.

Generated kernel source is written to a file and imported (`load_source`) because `triton.jit` needs real source.
The files live in a private folder (`kernel_source_dir`: mode 0700, this user's), each named by the hash of its
source, and a file is imported only when it holds exactly the source its name says: one found there with other
contents is written again first (`load_source`), or refused (`import_kernel`, how compile workers and the binary
collector import a kernel by its path).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import sys
import tempfile
import warnings
from abc import ABC, abstractmethod
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Sequence

import torch

from opfuse.environment import kernel_dir
from opfuse.files import UnsafeFolder, check_private, private_dir, write_atomically
from opfuse.fusion.plan import FusionGroup
from opfuse.ir.graph import Graph
from opfuse.ir.ops import FusionKind, kind_of


# the forms a group runs in (`KernelConfig.form`): its Triton kernel, the anchor through cuBLAS/cuDNN and the
# epilogue as a kernel, or its ops one by one through PyTorch (`opfuse.codegen.forms`); a squeeze group also runs
# as the separate kernels its parts would be without that fusion (`opfuse.codegen.squeeze`)
FORM_TRITON, FORM_LIBRARY, FORM_UNFUSED, FORM_SEPARATE = "triton", "library", "unfused", "separate"


@dataclass(frozen=True)
class KernelConfig:
    """One point of a kernel's tuning space: the form it runs in (its Triton kernel, or another form of the
    group: `opfuse.codegen.forms`), constexpr block sizes and launch options."""

    # e.g. (("BLOCK_M", 128), ("BLOCK_N", 64), ("BLOCK_K", 32)), with a split kernel's K slices (SPLIT_K), the
    # conv groups one program of a grouped conv computes (BLOCK_G) or a depthwise run's outputs (COLS) where a
    # config has them
    params: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2
    form: str = FORM_TRITON

    @classmethod
    def of(cls, num_warps: int = 4, num_stages: int = 2, form: str = FORM_TRITON, **params: int) -> "KernelConfig":
        return cls(tuple(sorted(params.items())), num_warps, num_stages, form)

    def __getitem__(self, key: str) -> int:
        return dict(self.params)[key]

    def as_dict(self) -> dict[str, int | str]:
        return dict(self.params) | {"num_warps": self.num_warps, "num_stages": self.num_stages, "form": self.form}


def find_anchor(graph: Graph, group: FusionGroup) -> str | None:
    """The group's anchor node: the one the planner named, else its first anchor-kind node."""
    if group.anchor is not None:
        return group.anchor
    return next((name for name in group.nodes if kind_of(graph[name]) is FusionKind.ANCHOR), None)


def tuned_configs(configs: Sequence[KernelConfig], top: int | None) -> list[KernelConfig]:
    """The configs of its own a kernel's tuning times: its first `top` (all where None or 0)."""
    return list(configs[:top] if top else configs)


@dataclass
class CompiledInfo:
    """Resource use of one compiled kernel, read from Triton's compiled metadata (None where unknown)."""

    registers: int | None = None
    spills: int | None = None
    shared_bytes: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# per group output, where a kernel may store it (`GroupKernel.run`)
Outputs = Sequence[torch.Tensor | None] | None


class GroupKernel(ABC):
    """A fusion group lowered to one Triton kernel."""

    def __init__(self, graph: Graph, group: FusionGroup, name: str, source: str):
        self.graph = graph
        self.group = group
        self.name = name            # e.g. fused_conv2d_add_relu_1a2b3c4d
        self.source = source        # the Triton source, for the report and debug dumps
        self.last_compiled: CompiledInfo | None = None
        # an output of it is a part of a cat written in place (`opfuse.fusion.concat_in_place`, set by lowering): it
        # offers the autotuner only forms that store into a slice given to `run`, a copy each call costing more
        self.stores_in_place = False

    @property
    def runtime_inputs(self) -> list[str]:
        """The group inputs the caller passes to `run` (constants are held by the kernel)."""
        return [i for i in self.group.inputs if not self.graph.is_constant(i)]

    def launches(self, config: KernelConfig | None = None) -> int:
        """Kernel launches of one `run` with `config` (default: the first config)."""
        return 1

    def alternatives(self, library: bool = True) -> list[KernelConfig]:
        """Configs the autotuner times besides the first N of `configs()`: other forms of the kernel (anchor
        kernels: the unsplit form of a split-K kernel, and with `library` the anchor through cuBLAS/cuDNN and the
        group's ops unfused through PyTorch)."""
        return []

    def describe_library_form(self, config: KernelConfig | None = None) -> str:
        """What the library form (FORM_LIBRARY) `config` runs, in words, for `CompiledModel.library_anchors`."""
        return f"anchor {self.group.anchor or '?'} through PyTorch's library"

    def keep_form(self, config: KernelConfig) -> None:
        """Called once `config` is the config that runs: free what only other forms of the kernel need."""

    def streamed_weight(self, config: KernelConfig | None) -> torch.Tensor | None:
        """The constant tensor that `config` reads whole from device memory, the kernel's cost (a GEMM's packed
        weight), or None: what the kernel may prefetch before it waits (`opfuse.runtime.prefetch`)."""
        return None

    def keep_default(self) -> None:
        """`keep_form` of the default config, after runs of several configs that chose none (the compile workers'
        recording, the spill check before tuning): what those made goes, and is made again where it runs."""
        configs = self.configs()
        if configs:
            self.keep_form(configs[0])

    @abstractmethod
    def configs(self) -> list[KernelConfig]:
        """Candidate configs for autotuning; the first is the default when tuning is off."""

    @abstractmethod
    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """Compute the group's outputs from its runtime inputs. `outputs`: per group output, a tensor of its shape
        and dtype (any strides: a slice of a cat written in place) it may be stored into, or None; a kernel stores
        there where its form can, else returns a tensor of its own, which the caller copies."""


def kernel_name(prefix: str, ops: Sequence[str], source: str) -> str:
    """fused_<op>_<op>_<hash>: readable and unique per generated source."""
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]
    body = "_".join(dict.fromkeys(ops))[:60]
    return f"{prefix}_{body}_{digest}"


def load_kernel(prefix: str, ops: Sequence[str], source: str, units: Sequence[str] = (), rows: Sequence[str] = (),
                row_strides: Sequence[str] = (), row_count: int | None = None) -> tuple[str, str, "Launcher"]:
    """(name, source, launcher of the jitted function) of generated `source` whose function is called KERNEL_NAME:
    the name is `kernel_name` of the source as given, then written into it, so profiles show
    fused_conv2d_relu_1a2b3c4d. `units`: the integer parameters the kernel rebinds as multiples of its UNIT
    (`unit_code`); the launcher passes UNIT (`unit_of` their values). `rows`: its row counts (`rows_jit`), and
    `row_strides` the strides along the rows of every tensor it addresses by row; the launcher passes ROW_UNIT
    (`row_unit_of` their values). `row_count`: the rows of the group it is built for (`RowFolding`)."""
    source = with_dependent_launch(source)
    name = kernel_name(prefix, ops, source)
    source = source.replace("KERNEL_NAME", name)
    module = load_source(source, name)
    return name, source, Launcher(getattr(module, name), module.__file__, name, units, rows, row_strides, row_count)


# Programmatic dependent launch (Hopper and later): a kernel launched with it may start while the kernel before it
# in the stream drains, and waits inside (griddepcontrol.wait) until that kernel's writes are visible. Every
# generated kernel opens with `DEPENDENT_LAUNCH_CODE` under its PDL constexpr (0 unless a launcher passes 1): it
# waits for the kernel before it to finish, then lets the next one start. So nothing it does overlaps the kernel
# before it (no read before that one's writes, no write before its reads: the same order as without), while the
# next kernel's launch, its blocks' scheduling and setup overlap this one's run and tail. A kernel not launched
# dependently (PyTorch's, cuBLAS's) is waited for whole, as always. In a CUDA graph the launch attribute becomes a
# programmatic edge: the gaps between a decode step's 180 small kernels are the launches this hides.
DEPENDENT_LAUNCH_PARAM = "PDL: tl.constexpr = 0"
DEPENDENT_LAUNCH_CODE = """\
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
"""

# Weight prefetch (Hopper and later; `opfuse.runtime.prefetch` decides which kernel prefetches): before anything
# else, a kernel launched with PREFETCH=1 asks L2 for pf_bytes of device memory from address pf_addr, its own
# weight, in bulk prefetches of PREFETCH_CHUNK bytes spread over its programs' lanes (cp.async.bulk.prefetch.L2:
# no register receives the data and nothing waits for it). A weight is no kernel's output, so this reads nothing a
# kernel before may still write.
PREFETCH_CHUNK = 4096
PREFETCH_PARAMS = "pf_addr=0, pf_bytes=0, PREFETCH: tl.constexpr = 0"
PREFETCH_CODE = f"""\
    if PREFETCH:
        pf_program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
        pf_lane = pf_program * 128 + tl.arange(0, 128)
        for pf_first in range(0, tl.cdiv(pf_bytes, {PREFETCH_CHUNK}), tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2) * 128):
            pf_offset = (pf_first + pf_lane).to(tl.int64) * {PREFETCH_CHUNK}
            pf_size = tl.minimum(tl.maximum(pf_bytes - pf_offset, 0), {PREFETCH_CHUNK}).to(tl.int32)
            tl.inline_asm_elementwise(
                "{{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }}",
                "=r,l,r", [pf_addr + pf_offset, pf_size], dtype=tl.int32, is_pure=False, pack=1)
"""


def with_dependent_launch(source: str) -> str:
    """Generated `source` whose KERNEL_NAME function takes the prefetch parameters and the PDL constexpr last and
    opens with PREFETCH_CODE, then DEPENDENT_LAUNCH_CODE (the signature's parentheses matched, its body on the
    lines after it)."""
    start = source.index("def KERNEL_NAME(") + len("def KERNEL_NAME(")
    depth, close = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(source[close], 0)
        close += 1
    params = source[start:close - 1].rstrip()
    separator = "" if not params else " " if params.endswith(",") else ", "
    body = source.index("\n", close) + 1
    return (f"{source[:start]}{params}{separator}{PREFETCH_PARAMS}, {DEPENDENT_LAUNCH_PARAM}{source[close - 1:body]}"
            f"{PREFETCH_CODE}{DEPENDENT_LAUNCH_CODE}{source[body:]}")


_DEPENDENT: ContextVar[bool] = ContextVar("opfuse_dependent_launch", default=False)
_DEPENDENT_DEVICES: dict[int, bool] = {}     # CUDA device index -> whether it launches dependently (sm_90+)


@contextmanager
def dependent_launches(enabled: bool) -> Iterator[None]:
    """Inside, every Launcher built launches its kernel dependently (`DEPENDENT_LAUNCH_CODE`) where `enabled` and
    the launch's GPU can (compute capability 9.0 or later: Triton's interpreter and older GPUs never do). The plan's
    kernels are built so (`opfuse.codegen.lower.lower_plan`, FusionConfig.dependent_launch)."""
    token = _DEPENDENT.set(enabled)
    try:
        yield
    finally:
        _DEPENDENT.reset(token)


@dataclass
class Ahead:
    """What the next generated kernel launched prefetches into L2 (`PREFETCH_CODE`): the first `nbytes` of
    `weight`'s memory; `issued` once a launch took it."""

    weight: torch.Tensor
    nbytes: int
    issued: bool = False


_AHEAD: ContextVar[Ahead | None] = ContextVar("opfuse_prefetch_ahead", default=None)


@contextmanager
def prefetching(target: tuple[torch.Tensor, int] | None) -> Iterator[None]:
    """Inside, the first generated kernel launched on a GPU that can (`launches_dependently`: compute capability 9.0
    or later) prefetches the first bytes of a weight, `target` = (weight, bytes) (`PREFETCH_CODE`); nothing where
    `target` is None."""
    if target is None:
        yield
        return
    token = _AHEAD.set(Ahead(*target))
    try:
        yield
    finally:
        _AHEAD.reset(token)


def launches_dependently(args: Sequence[Any]) -> bool:
    """Whether a launch with these arguments runs on a GPU that launches dependently (the first tensor's)."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if device is None or device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEPENDENT_DEVICES:
        _DEPENDENT_DEVICES[index] = torch.cuda.get_device_capability(index)[0] >= 9
    return _DEPENDENT_DEVICES[index]


# Triton specialises an integer argument on one fact about its factors: whether 16 divides it. A kernel over 24
# channels (a row stride of 24 elements, a mask `offs_n < 24`) is compiled as if its rows could start anywhere, so
# it loads and stores 2 bytes an instruction. A kernel with a UNIT constexpr rebinds the integers that address its
# vectorised dim as `x // UNIT * UNIT` (the same value: the launcher passes a UNIT that divides them all), which
# tells Triton they are multiples of UNIT: 24 channels then move 16 bytes an instruction.
UNIT_MAX = 16


def unit_of(values: Sequence[int]) -> int:
    """The UNIT of a launch whose unit parameters are `values`: the largest power of two dividing all of them, or 1
    (no rebinding) where that is 1 or at least UNIT_MAX (Triton knows those multiples of 16 already; zeros divide
    by anything)."""
    common = math.gcd(*values)
    unit = common & -common
    return unit if 1 < unit < UNIT_MAX else 1


# Triton also specialises the row count of a [rows, channels] tile kernel (M: output pixels, GEMM rows) on 16
# dividing it, and one model's layers take both kinds of value (3136 and 196 pixels): each config of a template would
# compile twice. Only where some tensor is contiguous along the rows (a row stride of 1: an NCHW input, a transposed
# GEMM operand, a one-channel output) does the row mask `offs_m < M` set an access width; elsewhere the two compiles
# load and store alike, the aligned one with a few registers fewer (RESULTS.md, 2026-12-04 offline). So the
# templates declare their row counts `@triton.jit(do_not_specialize_on_alignment=[...])` (`rows_jit`), take a
# ROW_UNIT constexpr and rebind the row counts as multiples of it. That is for a kernel a plan launches at both
# kinds of row count (ROW_UNIT 1 unless a tensor runs along the rows: `row_unit_of`); any other is compiled from a
# copy of its source without `rows_jit`, as Triton specialises it (`RowFolding`: the aligned compile has fewer
# registers, and rebinding M as a multiple of 16 does not give them back).
def rows_jit(rows: Sequence[str]) -> str:
    """The decorator of a template whose row counts are `rows`: Triton does not specialise them on alignment."""
    return f"@triton.jit(do_not_specialize_on_alignment={list(rows)!r})"


def unaligned_params(function: Any) -> set[str]:
    """The parameters a jitted function's decorator keeps from alignment specialisation (`rows_jit`); none under
    the interpreter, which keeps no flags."""
    return {p.name for p in getattr(function, "params", ()) if p.do_not_specialize_on_alignment}


def row_unit_of(rows: Sequence[int], strides: Sequence[int]) -> int:
    """The ROW_UNIT of a launch with row counts `rows` and row strides `strides`: 16 where some stride is 1 and 16
    divides every row count, else 1. Nothing is vectorised along rows without a stride of 1, nor where 16 does not
    divide the rows: Triton knows the sizes of a row's parts (R2, AR3) only as multiples of 16, so a run along the
    rows is never known longer than that (a smaller unit would only add compiles)."""
    return UNIT_MAX if 1 in strides and all(row % UNIT_MAX == 0 for row in rows) else 1


class RowFolding:
    """Which of one plan's generated kernels fold the alignment of their row counts (`rows_jit`): a jitted function
    the plan's groups launch at row counts 16 divides and at others, where folding saves a compile. Every other
    Launcher switches to a copy of its kernel that Triton specialises on its row counts (`Launcher.specialise_rows`),
    which compiles as before folding. Collected while the plan's kernels are built (`folding_rows`), each Launcher
    with the rows of the group it serves, then decided."""

    def __init__(self) -> None:
        self._kinds: dict[tuple[str, str], set[bool]] = {}
        self._launchers: list[Launcher] = []

    def add(self, launcher: "Launcher", rows: int | None) -> None:
        kinds = self._kinds.setdefault((launcher.path, launcher.name), set())
        kinds.update({True, False} if rows is None else {rows % UNIT_MAX == 0})
        self._launchers.append(launcher)

    def decide(self) -> None:
        # chosen before any switches: switching changes a Launcher's path, which keys `_kinds`
        single = [launcher for launcher in self._launchers if len(self._kinds[launcher.path, launcher.name]) < 2]
        for launcher in single:
            launcher.specialise_rows()


_FOLDING: ContextVar[RowFolding | None] = ContextVar("opfuse_row_folding", default=None)


@contextmanager
def folding_rows() -> Iterator[RowFolding]:
    """Inside, every Launcher built joins one `RowFolding`, decided on leaving: how a plan's kernels are built.
    A Launcher built outside folds its row counts."""
    folding = RowFolding()
    token = _FOLDING.set(folding)
    try:
        yield folding
    finally:
        _FOLDING.reset(token)
    folding.decide()


def unit_code(names: Sequence[str], rows: Sequence[str] = (), indent: str = "    ") -> str:
    """The kernel lines that rebind `names` as multiples of UNIT and the row counts `rows` as multiples of ROW_UNIT
    (nothing where the unit is 1, a constexpr branch), for a template's `{units}` line."""
    lines = []
    for unit, rebound, rule in (("UNIT", names, "unit_of"), ("ROW_UNIT", rows, "row_unit_of")):
        if rebound:
            lines.append(f"{indent}if {unit} > 1:   # the launcher's {unit} divides each of these "
                         f"(opfuse.codegen.base.{rule})")
            lines += [f"{indent}    {name} = {name} // {unit} * {unit}" for name in rebound]
    return "\n".join(lines)


@dataclass(frozen=True)
class LaunchRecord:
    """A launch as a compile worker needs it (`opfuse.runtime.precompile`): the kernel's module file and function,
    its arguments with every tensor replaced by a `TensorArg`, and its keyword options."""

    path: str
    function: str
    args: tuple
    kwargs: tuple[tuple[str, Any], ...]


_RECORDING: ContextVar[list[LaunchRecord] | None] = ContextVar("opfuse_recording_launches", default=None)


@contextmanager
def recording_launches() -> Iterator[list[LaunchRecord]]:
    """Inside, generated kernels are not launched: each launch is appended to the list yielded (and returns None)."""
    records: list[LaunchRecord] = []
    token = _RECORDING.set(records)
    try:
        yield records
    finally:
        _RECORDING.reset(token)


class Launcher:
    """A generated Triton kernel, launched as `launcher[grid](*args, **options)` like the jitted function it holds;
    inside `recording_launches()` a launch is recorded instead."""

    def __init__(self, function: Any, path: str, name: str, units: Sequence[str] = (), rows: Sequence[str] = (),
                 row_strides: Sequence[str] = (), row_count: int | None = None):
        self.function, self.path, self.name = function, path, name
        self.units = tuple(units)
        # where each unit parameter is among the positional arguments (a launch may also pass one by name)
        self._unit_positions = self._positions(self.units)
        # the row counts and the strides that decide the kernel's ROW_UNIT (`row_unit_of`); the row counts are
        # those its decorator keeps from alignment specialisation (`rows_jit`; the interpreter keeps no flags)
        unaligned = unaligned_params(function)
        if hasattr(function, "params") and unaligned != set(rows):
            raise ValueError(f"{name}: row counts {sorted(rows)}, but the decorator leaves {sorted(unaligned)} "
                             "unspecialised on alignment")
        if rows and not row_strides:
            raise ValueError(f"{name}: row counts {list(rows)} need the row strides that set ROW_UNIT")
        self._rows = tuple(rows)
        self._row_positions = self._positions(rows)
        self._row_stride_positions = self._positions(row_strides)
        folding = _FOLDING.get()
        if rows and folding is not None:
            folding.add(self, row_count)
        self.dependent = _DEPENDENT.get()     # launched dependently where the GPU can (`dependent_launches`)

    def specialise_rows(self) -> None:
        """Launch a copy of this kernel whose decorator is plain `triton.jit` (written beside it, same function
        name): Triton specialises its row counts itself, and ROW_UNIT stays 1."""
        if not self._rows:
            return
        source = read_kernel_source(self.path)
        plain = source.replace(rows_jit(self._rows), "@triton.jit", 1)
        if plain == source:
            raise ValueError(f"{self.name}: no {rows_jit(self._rows)} in its source")
        module = load_source(plain, self.name)
        self.function, self.path = getattr(module, self.name), module.__file__
        self._row_positions = []

    def _positions(self, names: Sequence[str]) -> list[tuple[int, str]]:
        return [(self.function.arg_names.index(name), name) for name in names]

    @staticmethod
    def _values(positions: list[tuple[int, str]], args: Sequence[Any], kwargs: dict[str, Any]) -> list[Any]:
        return [args[i] if i < len(args) else kwargs[name] for i, name in positions]

    def unit(self, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
        """The UNIT of a launch with these arguments (`unit_of` its unit parameters' values)."""
        return unit_of(self._values(self._unit_positions, args, kwargs))

    def row_unit(self, args: Sequence[Any], kwargs: dict[str, Any]) -> int:
        """The ROW_UNIT of a launch with these arguments (`row_unit_of` its row counts and row strides)."""
        return row_unit_of(self._values(self._row_positions, args, kwargs),
                           self._values(self._row_stride_positions, args, kwargs))

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            if self.units:
                kwargs["UNIT"] = self.unit(args, kwargs)
            if self._rows:
                kwargs["ROW_UNIT"] = self.row_unit(args, kwargs) if self._row_positions else 1
            if self.dependent and launches_dependently(args):
                kwargs["PDL"], kwargs["launch_pdl"] = 1, True
            ahead = _AHEAD.get()
            if ahead is not None and not ahead.issued and launches_dependently(args):
                kwargs.update(pf_addr=ahead.weight.data_ptr(), pf_bytes=ahead.nbytes, PREFETCH=1)
                ahead.issued = True
            records = _RECORDING.get()
            if records is None:
                return self.function[grid](*args, **kwargs)
            records.append(LaunchRecord(self.path, self.name, tuple(_describe(a) for a in args),
                                        tuple(sorted((k, _describe(v)) for k, v in kwargs.items()))))
            return None
        return launch

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") or attribute == "function":   # copy and pickle look these up before __init__
            raise AttributeError(attribute)
        return getattr(self.function, attribute)


@dataclass(frozen=True)
class TensorArg:
    """A tensor argument of a recorded launch: what Triton specialises a kernel on (dtype, alignment)."""

    dtype: str              # torch's name, e.g. "float16"
    offset: int             # data pointer modulo 16


def _describe(arg: Any) -> Any:
    if isinstance(arg, torch.Tensor):
        return TensorArg(str(arg.dtype).removeprefix("torch."), arg.data_ptr() % 16)
    return arg


def compiled_info(compiled: Any) -> CompiledInfo:
    """Registers, spills and shared memory of a Triton compiled kernel (None under the interpreter)."""
    if compiled is None:
        return CompiledInfo()
    metadata = getattr(compiled, "metadata", None)
    shared = getattr(metadata, "shared", None) if metadata is not None else None
    return CompiledInfo(getattr(compiled, "n_regs", None), getattr(compiled, "n_spills", None), shared)


_KERNEL_DIRS: dict[str, Path] = {}     # the folder chosen for each configured root, once per process
GENERATED_PREFIX = "opfuse_generated_"


def kernel_source_dir() -> Path:
    """The private folder generated kernels are written to (`opfuse.files.private_dir`): OPFUSE_KERNEL_DIR, else
    `<temp dir>/opfuse-kernels-<uid>`; where another user holds that default (created it first), a fresh private
    folder of the temp dir, with a warning. A configured folder that is not private is an error."""
    root = kernel_dir()
    key = root or ""
    if key not in _KERNEL_DIRS:
        if root:
            _KERNEL_DIRS[key] = private_dir(root)
        else:
            default = Path(tempfile.gettempdir()) / f"opfuse-kernels-{os.getuid()}"
            try:
                _KERNEL_DIRS[key] = private_dir(default)
            except UnsafeFolder as error:
                warnings.warn(f"opfuse: not using {default} for generated kernels ({error}); using a new private "
                              "folder instead", stacklevel=2)
                _KERNEL_DIRS[key] = Path(tempfile.mkdtemp(prefix=f"opfuse-kernels-{os.getuid()}-"))
    return _KERNEL_DIRS[key]


def source_digest(source: str | bytes) -> str:
    """The hash a generated module's file name carries: the first 16 hex digits of its source's sha256."""
    return hashlib.sha256(source.encode() if isinstance(source, str) else source).hexdigest()[:16]


def load_source(source: str, module_name: str) -> ModuleType:
    """Import generated Triton source as a module: from the file of the kernel folder named by its hash, written
    (atomically) first unless that file holds exactly `source`."""
    unique = f"{GENERATED_PREFIX}{module_name}_{source_digest(source)}"
    if unique in sys.modules:
        return sys.modules[unique]
    path = kernel_source_dir() / f"{unique}.py"
    data = source.encode()
    if not (path.is_file() and not path.is_symlink() and path.read_bytes() == data):
        write_atomically(path, data)
    module = import_file(path, unique)
    sys.modules[unique] = module
    return module


def read_kernel_source(path: str | os.PathLike) -> str:
    """The source of a generated kernel file (a Launcher's or a LaunchRecord's path), read only where the file lies
    in a private folder and holds the source its name's hash says (`load_source` named it); else ValueError."""
    path = Path(path)
    stem = path.stem
    if not stem.startswith(GENERATED_PREFIX) or path.suffix != ".py" or path.is_symlink():
        raise ValueError(f"{path} is not a generated kernel module")
    try:
        check_private(path.parent)
    except UnsafeFolder as error:
        raise ValueError(str(error)) from None
    data = path.read_bytes()
    if source_digest(data) != stem.rpartition("_")[2]:
        raise ValueError(f"{path} does not hold the source its name says (its contents changed): not imported")
    return data.decode()


def import_kernel(path: str | os.PathLike) -> ModuleType:
    """The module of a generated kernel file, checked as `read_kernel_source` checks it."""
    read_kernel_source(path)
    return import_file(path, Path(path).stem)


def import_file(path: str | os.PathLike, name: str) -> ModuleType:
    """The module of a Python file, executed under `name` (not registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
