"""Resource-checked autotuning: `tune(kernels, example_values, config, cache)` -> {group name: KernelConfig}.

For each kernel and each of its candidate configs: compile and run it once, read what the compiler reports
(registers, spills, shared memory; `GroupKernel.last_compiled`), reject configs that spill or exceed the hardware
profile (`screen_configs`, a pure function; where every one of the first `tune_top` is rejected, the kernel's next
configs are compiled too, `more_configs`, until one fits), time the rest in a CUDA graph (`cuda_median_time`,
median; `opfuse.runtime.clock`) and keep the fastest. Besides its own configs a kernel offers other forms
(`GroupKernel.alternatives`): an anchor kernel's unsplit form, its anchor through cuBLAS/cuDNN with a generated
epilogue, and its group unfused (the ops through PyTorch): a fusion that measures slower than the ops it merges is
not kept. A group whose every config is rejected is reported in `TuningResult.over_budget` ("over budget: every
config spills") so the caller can split it; it still gets the least bad config, so the model runs either way. An
anchor group whose unfused form wins is reported in `TuningResult.slower_fused`, for the caller to plan again
without that fusion (`compiler.split_back`).
Results are kept in the on-disk `TuningCache`. On a GPU the candidates of every kernel not in the cache are
compiled in parallel by worker processes (`opfuse.runtime.precompile`, `Compiling`) while the tuner times the
kernels before, so that its own runs load them from Triton's cache. Without a GPU (Triton's interpreter) nothing
is timed and each kernel gets its first config.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch

from opfuse.codegen.base import FORM_TRITON, FORM_UNFUSED, CompiledInfo, GroupKernel, KernelConfig, tuned_configs
from opfuse.codegen.forms import runs_epilogue_apart
from opfuse.codegen.library_fused import LibraryUnavailable
from opfuse.config import FusionConfig
from opfuse.hardware import KIB, HardwareProfile, get_hardware
from opfuse.ir.graph import GraphError
from opfuse.ir.ops import FusionKind, kind_of
from opfuse.runtime.cache import TuningCache, tuning_key
from opfuse.runtime.clock import ColdClock, cold_set, cuda_median_time, timing_available
from opfuse.runtime.launch_records import distinct_compiles, launches_by_config, record_launches
from opfuse.runtime.precompile import Precompiled, active_pool, gpu_index, pool_of_its_own, workers_of
from opfuse.runtime.worker_pool import TIMEOUT_S, CompilePool

SPILLS = "register spills"
EVERY_CONFIG_SPILLS = "over budget: every config spills"

Benchmark = Callable[[Callable[[], Any]], float]   # runs fn repeatedly, returns seconds per call


@dataclass
class TuningRecord:
    """What `tune` writes while it tunes, kernel by kernel; `freeze` makes the `TuningResult` it returns."""
    configs: dict[str, KernelConfig] = field(default_factory=dict)            # group name -> chosen config
    over_budget: dict[str, str] = field(default_factory=dict)                 # group name -> why no config fits
    slower_fused: dict[str, str] = field(default_factory=dict)                # anchor group -> why its unfused form won
    epilogue_apart: dict[str, str] = field(default_factory=dict)              # group of one anchor -> why its fastest
                                                                              # form runs the anchor apart from its ops
    seconds: dict[str, float] = field(default_factory=dict)                   # group -> measured time of its choice
    rejected: dict[str, dict[KernelConfig, str]] = field(default_factory=dict)    # group -> {config: reason}
    timings: dict[str, dict[KernelConfig, float]] = field(default_factory=dict)   # group -> {config: median seconds}
    from_cache: set[str] = field(default_factory=set)                         # groups whose choice the cache gave
    precompiled: Precompiled | None = None                                    # what the compile workers did

    def freeze(self) -> "TuningResult":
        return TuningResult(configs=self.configs, over_budget=self.over_budget, slower_fused=self.slower_fused,
                            epilogue_apart=self.epilogue_apart, seconds=self.seconds,
                            rejected={name: MappingProxyType(dict(r)) for name, r in self.rejected.items()},
                            timings={name: MappingProxyType(dict(t)) for name, t in self.timings.items()},
                            from_cache=frozenset(self.from_cache), precompiled=self.precompiled)


@dataclass(frozen=True, eq=False)
class TuningResult(Mapping[str, KernelConfig]):
    """What autotuning chose, read-only: a mapping of group name -> chosen KernelConfig, and what the tuner saw on
    the way (the fields of `TuningRecord`, which `tune` fills and freezes into this). The replanning
    (`opfuse.replan`) reads `over_budget`, `slower_fused`, `epilogue_apart` and `seconds`; the report reads
    `timings` and `from_cache`."""
    configs: Mapping[str, KernelConfig] = field(default_factory=dict)
    over_budget: Mapping[str, str] = field(default_factory=dict)
    slower_fused: Mapping[str, str] = field(default_factory=dict)
    epilogue_apart: Mapping[str, str] = field(default_factory=dict)
    seconds: Mapping[str, float] = field(default_factory=dict)
    rejected: Mapping[str, Mapping[KernelConfig, str]] = field(default_factory=dict)
    timings: Mapping[str, Mapping[KernelConfig, float]] = field(default_factory=dict)
    from_cache: frozenset[str] = frozenset()
    precompiled: Precompiled | None = None

    def __post_init__(self) -> None:
        for name in ("configs", "over_budget", "slower_fused", "epilogue_apart", "seconds", "rejected", "timings"):
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))
        object.__setattr__(self, "from_cache", frozenset(self.from_cache))

    def __getitem__(self, group: str) -> KernelConfig:
        return self.configs[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self.configs)

    def __len__(self) -> int:
        return len(self.configs)


def format_config(config: KernelConfig) -> str:
    params = " ".join(f"{k}={v}" for k, v in config.params)
    form = f"{config.form}: " if config.form != FORM_TRITON else ""
    return f"{form}{params} warps={config.num_warps} stages={config.num_stages}".strip()


# ---- the resource check (pure) ---------------------------------------------------------------------------

def resource_violation(info: CompiledInfo | None, hardware: HardwareProfile, config: KernelConfig) -> str | None:
    """Why a compiled config does not fit the hardware (spills, registers, shared memory), or None if it fits.

    Unknown values (None, e.g. under the interpreter) are not held against the config.
    """
    if info is None:
        return None
    if info.spills:
        return f"{SPILLS}: {info.spills}"
    if info.registers is not None:
        if info.registers > hardware.max_registers_per_thread:
            return f"{info.registers} registers/thread > {hardware.max_registers_per_thread}"
        per_block = info.registers * config.num_warps * 32
        if per_block > hardware.registers_per_sm:
            return (f"{info.registers} registers x {config.num_warps * 32} threads = {per_block} "
                    f"> {hardware.registers_per_sm} per SM")
    if info.shared_bytes is not None and info.shared_bytes > hardware.shared_memory_per_block:
        return (f"{info.shared_bytes / KIB:.1f} KiB shared memory > "
                f"{hardware.shared_memory_per_block / KIB:.0f} KiB per block")
    return None


@dataclass
class Screening:
    accepted: list[KernelConfig]                                 # in candidate order
    rejected: dict[KernelConfig, str] = field(default_factory=dict)
    over_budget: str | None = None                               # set when nothing was accepted
    fallback: KernelConfig | None = None                         # least bad config when nothing was accepted


def screen_configs(candidates: Mapping[KernelConfig, CompiledInfo | str | None],
                   hardware: HardwareProfile) -> Screening:
    """Split configs into those that fit and those rejected (a str value is an error raised while compiling)."""
    if not candidates:
        raise ValueError("screen_configs needs at least one config")
    screening = Screening(accepted=[])
    for config, info in candidates.items():
        reason = info if isinstance(info, str) else resource_violation(info, hardware, config)
        if reason is None:
            screening.accepted.append(config)
        else:
            screening.rejected[config] = reason
    if not screening.accepted:
        reasons = screening.rejected
        if all(r.startswith(SPILLS) for r in reasons.values()):
            screening.over_budget = EVERY_CONFIG_SPILLS
        else:
            screening.over_budget = "over budget: every config rejected (" + "; ".join(
                f"{format_config(c)}: {r}" for c, r in reasons.items()) + ")"

        def badness(config: KernelConfig) -> tuple[int, int]:   # fewest spills; then candidate order
            info = candidates[config]
            spills = info.spills if isinstance(info, CompiledInfo) and info.spills is not None else 1 << 30
            return spills, list(candidates).index(config)

        screening.fallback = min(candidates, key=badness)
    return screening


# ---- measuring -------------------------------------------------------------------------------------------

def tunes(config: FusionConfig, device: torch.device | str) -> bool:
    """Whether a build of `config` on `device` autotunes its kernels: asked to, on a GPU that can time them."""
    return bool(config.autotune) and timing_available(device)


def out_of_resources() -> tuple[type[BaseException], ...]:
    """The exceptions of a Triton launch the GPU refuses for want of shared memory or registers."""
    try:
        from triton.runtime.errors import OutOfResources
        return (OutOfResources,)
    except ImportError:
        return ()


def _restore(entry: dict[str, Any] | None, configs: list[KernelConfig]) -> KernelConfig | None:
    """The cached config if it is still one of the kernel's candidates."""
    if not entry or not isinstance(entry.get("config"), dict):
        return None
    for config in configs:
        if config.as_dict() == entry["config"]:
            return config
    return None


def candidates(kernel: GroupKernel, top: int | None, library: bool) -> tuple[list[KernelConfig], list[KernelConfig]]:
    """(the kernel's own first `top` configs, those and its other forms): what `tune_kernel` times."""
    own = tuned_configs(kernel.configs(), top)
    configs = own + [c for c in kernel.alternatives(library) if c not in own]
    if not configs:
        raise GraphError(f"kernel {kernel.name} (group {kernel.group.name}) offers no configs")
    return own, configs


def compile_configs(kernel: GroupKernel, inputs: list[torch.Tensor], configs: Iterable[KernelConfig]
                    ) -> dict[KernelConfig, CompiledInfo | str | None]:
    """Run `kernel` once with each config: {config: what its compile reports (None: nothing to report, e.g. a
    library form), or why it could not run (out of resources, a fused library call the library refused)}; any other
    failure is an error naming the config."""
    compiled: dict[KernelConfig, CompiledInfo | str | None] = {}
    for config in configs:
        kernel.last_compiled = None
        try:
            kernel.run(inputs, config)
        except out_of_resources() as error:
            compiled[config] = f"out of resources: {error}"
            continue
        except LibraryUnavailable as error:
            compiled[config] = f"library refused: {error}"
            continue
        except Exception as error:
            raise GraphError(f"kernel {kernel.name} (group {kernel.group.name}) failed with config "
                             f"{format_config(config)}: {error}") from error
        compiled[config] = kernel.last_compiled
    return compiled


def next_configs(kernel: GroupKernel, inputs: list[torch.Tensor], hardware: HardwareProfile, top: int | None
                 ) -> list[KernelConfig]:
    """The configs `more_configs` will compile first for this kernel (its next `top`) where every one of its first
    `top` is rejected, else none; the first are run to see (`compile_configs`), from Triton's cache once the
    compile workers have built them."""
    own = tuned_configs(kernel.configs(), top)
    over_budget = screen_configs(compile_configs(kernel, inputs, own), hardware).over_budget
    kernel.keep_default()       # those runs' packings go before the next kernel's, as after recording
    if not over_budget:
        return []
    rest = [c for c in kernel.configs() if c not in own]
    return rest[:top or len(rest)]


def more_configs(kernel: GroupKernel, own: list[KernelConfig], compiled: dict[KernelConfig, CompiledInfo | str | None],
                 hardware: HardwareProfile, top: int | None,
                 compile_all: Callable[[list[KernelConfig]], None]) -> list[KernelConfig]:
    """The kernel's own configs past its first `top` that tuning compiles because every one before them was
    rejected (spills, registers, shared memory), `top` at a time until one fits: tiles are listed for aligned,
    wide outputs first, and a kernel whose loads cannot be vectorized (ShuffleNet's 58 channels) spills in all of
    those while a smaller tile fits. Each batch is compiled with `compile_all` (into `compiled`); returns those
    tried."""
    tried: list[KernelConfig] = []
    rest = [c for c in kernel.configs() if c not in own]
    step = top or len(rest)
    while rest and screen_configs({c: compiled[c] for c in own + tried if c in compiled}, hardware).over_budget:
        batch, rest = rest[:step], rest[step:]
        compile_all(batch)
        tried += batch
    return tried


def cached_choice(kernel: GroupKernel, inputs: list[torch.Tensor], configs: list[KernelConfig],
                  cache: TuningCache | None, gpu_name: str,
                  cold: bool = False) -> tuple[str | None, dict | None, KernelConfig | None]:
    """(tuning key, cache entry, the cached config if it is still a candidate) of a kernel: one of `configs`, or
    of the kernel's configs past them that the tuning went on to (`more_configs`); timed `cold` or not."""
    if cache is None:
        return None, None, None
    key = tuning_key(kernel.source, inputs, gpu_name, candidates=[c.as_dict() for c in configs], cold=cold)
    entry = cache.load(key)
    return key, entry, _restore(entry, configs + [c for c in kernel.configs() if c not in configs])


def note_choice(kernel: GroupKernel, chosen: KernelConfig, timings: Mapping[str, float],
                result: TuningRecord) -> None:
    """Report the group's measured time (`TuningResult.seconds`, where `timings`, seconds by `format_config`, has
    the chosen config's), and a group with an anchor whose fastest form runs it apart from the group's other ops:
    the unfused form (`TuningResult.slower_fused`, with its fastest other form and the unfused time) or, for a group
    of one anchor, the library form with an epilogue kernel of its own (`TuningResult.epilogue_apart`)."""
    name = kernel.group.name
    time_s = timings.get(format_config(chosen))
    if time_s is not None:
        result.seconds[name] = time_s
    anchors = [n for n in kernel.group.nodes if kind_of(kernel.graph[n]) is FusionKind.ANCHOR]
    if not anchors:
        return
    others = [(t, c) for c, t in timings.items() if c != format_config(chosen)]
    if chosen.form == FORM_UNFUSED:
        measured = (f": {min(others)[0] * 1e6:.1f} us fused ({min(others)[1]}) against {time_s * 1e6:.1f} us"
                    if others and time_s is not None else "")
        result.slower_fused[name] = f"slower than its ops through PyTorch{measured}"
    elif len(anchors) == 1 and runs_epilogue_apart(kernel, chosen):
        measured = f": {time_s * 1e6:.1f} us" if time_s is not None else ""
        result.epilogue_apart[name] = f"fastest with its anchor through the library, its epilogue apart{measured}"


def tune_kernel(kernel: GroupKernel, inputs: list[torch.Tensor], hardware: HardwareProfile, benchmark: Benchmark,
                result: TuningRecord, cache: TuningCache | None = None, gpu_name: str = "",
                top: int | None = None, library: bool = False, cold: bool = False) -> KernelConfig:
    """Choose the config of one kernel among its first `top` configs (and further ones while all of those are
    rejected: `more_configs`) and its other forms (`alternatives`: unsplit, and with `library` the anchor through
    cuBLAS/cuDNN and the group unfused; see module docstring), timed by `benchmark` (`cold`: a `ColdClock`, which
    the cache keys apart); record it."""
    name = kernel.group.name
    own, configs = candidates(kernel, top, library)
    key, entry, cached = cached_choice(kernel, inputs, configs, cache, gpu_name, cold)
    if cached is not None:
        result.configs[name] = cached
        result.from_cache.add(name)
        if entry.get("over_budget"):
            result.over_budget[name] = entry["over_budget"]
        note_choice(kernel, cached, entry.get("timings") or {}, result)
        return cached

    compiled: dict[KernelConfig, CompiledInfo | str | None] = {}

    def compile_all(batch: list[KernelConfig]) -> None:
        compiled.update(compile_configs(kernel, inputs, batch))

    compile_all(configs)
    own = own + more_configs(kernel, own, compiled, hardware, top, compile_all)
    screening = screen_configs(compiled, hardware)
    result.rejected[name] = screening.rejected
    timings = {config: benchmark(lambda config=config: kernel.run(inputs, config)) for config in screening.accepted}
    result.timings[name] = timings
    # the fused kernel's own configs all over budget: reported (the caller splits the group into smaller fused
    # kernels) even where another form, the unfused ops say, was accepted and runs meanwhile
    over_budget = screen_configs({c: compiled[c] for c in own if c in compiled}, hardware).over_budget \
        if any(c in compiled for c in own) else None
    if timings:
        chosen = min(timings, key=timings.__getitem__)
    else:
        chosen = screening.fallback
        over_budget = screening.over_budget
    if over_budget:
        result.over_budget[name] = over_budget
    result.configs[name] = chosen
    note_choice(kernel, chosen, {format_config(c): t for c, t in timings.items()}, result)
    # the other forms' weights and constants go now, not after every kernel is tuned: one kernel's extra copies
    # at a time (a form run again later makes them again)
    kernel.keep_form(chosen)
    if cache is not None:
        cache.store(key, {
            "kernel": kernel.name, "group": name, "config": chosen.as_dict(),
            "time_s": timings.get(chosen), "over_budget": over_budget,
            "timings": {format_config(c): t for c, t in timings.items()},
            "rejected": {format_config(c): r for c, r in screening.rejected.items()},
        })
    return chosen


def tune(kernels: Mapping[str, GroupKernel] | Iterable[GroupKernel], example_values: Mapping[str, torch.Tensor],
         config: FusionConfig, cache: TuningCache | None = None, *, quiet: bool = False,
         benchmark: Benchmark | None = None, hardware: HardwareProfile | None = None,
         compiling: Compiling | None = None) -> TuningResult:
    """{group name: config} for every kernel; `example_values` maps value names to tensors of a real run.

    `benchmark` replaces do_bench (tests use a fake clock); without it, timing needs a CUDA device. On a GPU the
    compile workers build the candidates meanwhile: `compiling` where the caller queued them already
    (`Compiling.start`), else queued here.
    """
    kernels = list(kernels.values()) if isinstance(kernels, Mapping) else list(kernels)
    result = TuningRecord()
    gpu = next((v.device for v in example_values.values()
                if isinstance(v, torch.Tensor) and timing_available(v.device)), None)
    on_gpu = gpu is not None
    if benchmark is None and on_gpu:
        benchmark = cuda_median_time
    if benchmark is None or not config.autotune:
        for kernel in kernels:
            result.configs[kernel.group.name] = kernel.configs()[0]
        return result.freeze()

    hardware = hardware or get_hardware(config.hardware)
    gpu_name = torch.cuda.get_device_name(gpu) if on_gpu else "cpu"
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("[bold]autotuning[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    inputs = {kernel.group.name: kernel_inputs(kernel, example_values) for kernel in kernels}
    cold = cold_set(kernels, config, gpu) if benchmark is cuda_median_time else set()
    cold_clock = ColdClock(gpu) if cold else None
    own = compiling is None and on_gpu
    if own:
        compiling = Compiling.start(kernels, inputs, config, cache, gpu)
    try:
        with Progress(*columns, disable=quiet, transient=True) as progress:
            task = progress.add_task("", total=len(kernels))
            for kernel in kernels:
                progress.update(task, description=kernel.name)
                if compiling is not None:
                    compiling.ready(kernel.group.name, inputs[kernel.group.name])
                timed_cold = kernel.group.name in cold
                tune_kernel(kernel, inputs[kernel.group.name], hardware, cold_clock if timed_cold else benchmark,
                            result, cache, gpu_name, config.tune_top, config.library_anchors, timed_cold)
                progress.advance(task)
    finally:
        if compiling is not None:
            result.precompiled = compiling.close() if own else compiling.counts()
    return result.freeze()


Job = tuple[GroupKernel, list[torch.Tensor], list[KernelConfig]]     # a kernel, its inputs, its candidates


class Compiling:
    """The compile workers building the candidates `tune_kernel` will time of each kernel whose choice is not cached
    (`start`), queued all at once: every kernel's default config first (`CompiledModel.collect_values` runs those:
    `ready_default`), then each kernel's other candidates, kernel by kernel. `tune` times a kernel as soon as its
    own are built (`ready`) while the workers go on with the next kernels', so a cold compile takes about as long as
    the longer of the two, not their sum; what it waits for that no worker has taken yet it builds itself
    (`CompilePool.wait`). Whatever the workers did not build by `TIMEOUT_S` after the start is
    given up on and left to the tuner, which compiles it itself."""

    def __init__(self, pool: CompilePool, owned: bool, jobs: list[Job], hardware: HardwareProfile,
                 top: int | None, recorded: Mapping[str, dict[KernelConfig, list]] | None = None):
        self.pool, self.owned, self.hardware, self.top = pool, owned, hardware, top
        self.deadline = time.monotonic() + TIMEOUT_S
        # the kernels only: the inputs they were recorded on (stand-ins as large as the model's activations) go
        self.kernels = {kernel.group.name: kernel for kernel, _, _ in jobs}
        self.defaults: dict[str, list[tuple]] = {}
        rest: dict[str, list] = {}
        for kernel, args, configs in jobs:                          # each default queued as soon as recorded
            name = kernel.group.name
            launches = dict(recorded[name]) if recorded else launches_by_config(kernel, args, configs)
            self.defaults[name] = pool.submit(launches.pop(kernel.configs()[0], []))
            rest[name] = [record for records in launches.values() for record in records]
        self.keys = {name: self.defaults[name] + pool.submit(rest[name]) for name in self.kernels}
        self.checked: set[str] = set()      # kernels whose next configs (`next_configs`) were looked for
        self.expired = False                # past the deadline: the tuner builds what is left itself

    @classmethod
    def start(cls, kernels: Sequence[GroupKernel], inputs: Mapping[str, list[torch.Tensor]], config: FusionConfig,
              cache: TuningCache | None, gpu: torch.device) -> "Compiling | None":
        """Queue the candidates of `kernels` (`inputs`: each one's runtime inputs by group; stand-ins of the right
        shapes, strides and dtypes will do, nothing is computed) in the running `compile_pool`, else in a pool of
        its own where there are at least `MIN_LAUNCHES`; None where no workers are to run (`compile_workers` under 2,
        nothing to build)."""
        workers = workers_of(config)
        if workers < 2:
            return None
        jobs = uncached(kernels, inputs, config, cache, torch.cuda.get_device_name(gpu),
                        cold_set(kernels, config, gpu))
        if not jobs:
            return None
        hardware = get_hardware(config.hardware)
        pool = active_pool(gpu)
        if pool is not None:
            return cls(pool, False, jobs, hardware, config.tune_top)
        recorded = {kernel.group.name: launches_by_config(kernel, args, configs) for kernel, args, configs in jobs}
        launches = len(distinct_compiles([r for by_config in recorded.values() for records in by_config.values()
                                          for r in records]))
        pool = pool_of_its_own(workers, launches, gpu_index(gpu))
        if pool is None:
            return None
        try:
            return cls(pool, True, jobs, hardware, config.tune_top, recorded)
        except BaseException:
            pool.close()
            raise

    def _wait(self, keys: list[tuple]) -> None:
        """Until `keys` are built, or the deadline: then every launch of this build is given up on at once (one
        round of killed workers, not one a kernel: their replacements serve the compile's next build)."""
        if self.expired:
            return
        if not self.pool.wait(keys, max(0.0, self.deadline - time.monotonic())):
            self.expired = True
            self.pool.give_up([key for keys in self.keys.values() for key in keys])

    def ready_default(self, group: str) -> None:
        """Return once the default config of `group`'s kernel is built (or given up on)."""
        if group in self.defaults:
            self._wait(self.defaults[group])

    def ready(self, group: str, args: list[torch.Tensor]) -> None:
        """Return once every candidate of `group`'s kernel is built (or given up on); where every one of its first
        configs spills (run on `args`, its runtime inputs, to see), its next ones (`next_configs`) are built too,
        ahead of the other kernels'."""
        if group not in self.kernels:
            return
        self._wait(self.keys[group])
        if group in self.checked:
            return
        self.checked.add(group)
        kernel = self.kernels[group]
        more = next_configs(kernel, args, self.hardware, self.top)
        if more and not self.expired:
            keys = self.pool.submit(record_launches([(kernel, args, more)]), first=True)
            self.keys[group] = self.keys[group] + keys
            self._wait(keys)

    def counts(self) -> Precompiled:
        """What the workers did so far: distinct launches queued, compiled (of them built here while waiting), not
        compiled."""
        keys = {key for keys in self.keys.values() for key in keys}
        compiled = sum(key in self.pool.done for key in keys)
        return Precompiled(launches=len(keys), compiled=compiled, failed=len(keys) - compiled,
                           here=sum(key in self.pool.built_here for key in keys))

    def close(self) -> Precompiled:
        """`counts`; a pool of its own ends here."""
        counts = self.counts()
        if self.owned:
            self.pool.close()
        return counts


def uncached(kernels: Iterable[GroupKernel], inputs: Mapping[str, list[torch.Tensor]], config: FusionConfig,
             cache: TuningCache | None, gpu_name: str, cold: set[str] = frozenset()) -> list[Job]:
    """(kernel, its inputs, the candidates `tune_kernel` would time) of each kernel the cache holds no choice of
    (`inputs`: each kernel's runtime inputs by group; a key reads only their shapes, strides and dtypes, so
    stand-ins will do; `cold`: the groups timed cold, `cold_set`)."""
    jobs = []
    for kernel in kernels:
        _, configs = candidates(kernel, config.tune_top, config.library_anchors)
        if cached_choice(kernel, inputs[kernel.group.name], configs, cache, gpu_name,
                         kernel.group.name in cold)[2] is None:
            jobs.append((kernel, inputs[kernel.group.name], configs))
    return jobs


def every_choice_cached(kernels: Iterable[GroupKernel], inputs: Mapping[str, list[torch.Tensor]],
                        config: FusionConfig, cache: TuningCache | None, gpu: torch.device) -> bool:
    """Whether `tune` would time nothing: the cache holds a choice of every kernel (`uncached`)."""
    gpu_name = torch.cuda.get_device_name(gpu) if timing_available(gpu) else "cpu"     # as `tune` names it
    kernels = list(kernels)
    return cache is not None and not uncached(kernels, inputs, config, cache, gpu_name,
                                              cold_set(kernels, config, gpu))


def kernel_inputs(kernel: GroupKernel, example_values: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """The example values a kernel runs on, in its `runtime_inputs` order."""
    missing = [n for n in kernel.runtime_inputs if n not in example_values]
    if missing:
        raise GraphError(f"autotuning kernel {kernel.name} (group {kernel.group.name}) needs values "
                         f"{missing}, which the example values lack")
    return [example_values[n] for n in kernel.runtime_inputs]
