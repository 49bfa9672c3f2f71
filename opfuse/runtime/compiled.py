"""The compiled model: `CompiledModel(plan, kernels, device)` runs a fusion plan's groups in order.

A group with a kernel calls `kernel.run(runtime inputs, config)`; a group without one (view, opaque, attention,
unsupported) runs its nodes through their PyTorch references, and is listed in `compiled.fallbacks` with the
reason (`opfuse.fusion.reasons.Reason`: a stable code and the words). A kernel whose autotuning kept another form
names it: `library_anchors` (anchor through cuBLAS/cuDNN, generated epilogue) and `unfused` (the fusion measured
slower than its ops run one by one through PyTorch).
The schedule (which values each step reads, and after which step each value is dead) is worked out once
at build time, so a forward pass is a plain loop that frees every intermediate right after its last reader.

Inputs are checked against the signature the model was compiled for. A mismatch is an error naming the input,
unless a `recompile` callback was given: it then builds a model for the new signature, cached per signature.
On CUDA (config.cuda_graph) the first call after the warm-up captures the whole forward into a CUDA graph over
static input buffers; later calls copy their inputs in (the copy casts and lays them out as compiled, and an input
that is its static buffer is not copied), replay it, and return a copy of each static output. An input the capturing
call passed already in the compiled dtype and layout is its own static buffer (borrowed, kept alive): the graph reads
it in place, so a caller that passes that very tensor again (whatever it wrote into it) pays no copy, as
torch.compile's CUDA graphs skip inputs whose address they captured. The first call with any other tensor there (or
with that tensor's storage moved or its strides changed in place) captures the graph again over private buffers,
copied into from then on (`opfuse.runtime.cuda_graph`). A captured graph's kernel nodes are counted
(`opfuse.runtime.graph_nodes`): from then on they are `launches`, library helper kernels included.

Calls are thread-safe: they serialise on the model's lock (`opfuse.runtime.gate.call_lock`), which covers a whole
run (the eager path, the warm-up, the capture, and a replay with its copies in and out), so two calls never share
the static buffers; a capture also waits for every other compiled model's calls and holds them back
(`opfuse.runtime.gate.CAPTURE_GATE`). Through Triton's CPU interpreter every model shares one lock. For parallel
throughput, use one compiled model per stream, device or process.

`build_compiled_model(plan, device, example_inputs)` is the whole runtime stage: lower, build, autotune.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import torch

from opfuse.codegen.base import GroupKernel, KernelConfig, prefetching, recording_launches
from opfuse.codegen.lower import choose_lowering, lower_plan, plan_hardware
from opfuse.config import FusionConfig
from opfuse.fusion.concat_in_place import planned_slots
from opfuse.fusion.plan import FusionGroup, FusionPlan
from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import Graph, GraphError, Node, TensorType, dtype_name, torch_dtype
from opfuse.ir.interpret import device_constants, launches_of
from opfuse.ir.ops import get_op, launches_kernel, view_source
from opfuse.runtime.autotune import (Compiling, TuningResult, every_choice_cached, kernel_inputs, out_of_resources,
                                     tune, tunes)
from opfuse.runtime.cache import TuningCache
from opfuse.runtime.cuda_graph import CudaGraphReplay
from opfuse.runtime.gate import CAPTURE_GATE, call_lock
from opfuse.runtime.precompile import active_pool, compile_pool, workers_of
from opfuse.runtime.prefetch import prefetch_targets


@dataclass(frozen=True)
class InputSpec:
    """What the model was compiled for, per input."""

    name: str
    type: TensorType
    device: str

    def __str__(self) -> str:
        return f"{self.name}: {self.type} on {self.device}"


Signature = tuple[InputSpec, ...]


def format_signature(signature: Signature) -> str:
    return "(" + ", ".join(map(str, signature)) + ")"


def device_key(device: torch.device | str) -> str:
    """'cpu', 'cuda:0': a CUDA device without an index means the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return f"cuda:{index}"
    return str(device)


@dataclass
class Step:
    """One launch of the forward pass: a group's kernel, or one node of a group run through PyTorch."""

    group: FusionGroup
    reads: list[str]
    writes: list[str]
    kernel: GroupKernel | None = None
    node: Node | None = None
    free: list[str] = field(default_factory=list)     # values dead after this step
    ahead: tuple[torch.Tensor, int] | None = None     # its weight, prefetched before it waits (`runtime.prefetch`)


def default_reason(graph: Graph, group: FusionGroup) -> Reason:
    """Why a group given no kernel runs through PyTorch, when the caller did not say."""
    choice = choose_lowering(graph, group)
    if isinstance(choice, Reason):
        return choice
    return Reason(Code.NO_KERNEL, "no kernel was built for it: runs through PyTorch")


def to_channels_last(x: torch.Tensor) -> torch.Tensor:
    if x.dim() == 4 and x.is_floating_point():
        return x.contiguous(memory_format=torch.channels_last)
    return x


def input_form(spec: InputSpec) -> tuple[torch.dtype | None, torch.memory_format]:
    """How an input is brought to what the kernels read: (the float dtype a floating input is cast to, or None
    for an integer or bool input; the memory format, channels-last for a 4-D float image)."""
    dtype = torch_dtype(spec.type.dtype)
    if not dtype.is_floating_point:
        return None, torch.preserve_format
    return dtype, torch.channels_last if len(spec.type.shape) == 4 else torch.preserve_format


class CompiledModel(CudaGraphReplay, torch.nn.Module):
    """A fusion plan's kernels, run in plan order (see module docstring)."""

    def __init__(self, plan: FusionPlan, kernels: Mapping[str, GroupKernel | None], device: torch.device | str,
                 *, configs: Mapping[str, KernelConfig] | None = None, fallbacks: Mapping[str, Reason] | None = None,
                 config: FusionConfig | None = None,
                 recompile: Callable[[Sequence[torch.Tensor]], Callable[..., Any]] | None = None,
                 unflatten: Callable[[list[torch.Tensor]], Any] | None = None, cuda_graph_warmup: int = 1):
        super().__init__()
        self.plan = plan
        self.graph = plan.graph
        self.device = torch.device(device)
        self.config = config or plan.config or FusionConfig()
        unknown = set(k for k, v in kernels.items() if v is not None) - {g.name for g in plan.groups}
        if unknown:
            raise GraphError(f"kernels given for groups not in the plan: {sorted(unknown)}")
        self.kernels: dict[str, GroupKernel] = {k: v for k, v in kernels.items() if v is not None}
        self.configs: dict[str, KernelConfig] = {name: k.configs()[0] for name, k in self.kernels.items()}
        self.configs.update(configs or {})
        self.fallbacks: dict[str, Reason] = {}
        for group in plan.groups:
            if group.name not in self.kernels:
                self.fallbacks[group.name] = (fallbacks or {}).get(group.name) or default_reason(plan.graph, group)
        self.recompile = recompile
        self.unflatten = unflatten
        self.tuning: TuningResult | None = None      # when autotuned
        # seconds of build_compiled_model's stages: lower; where it tunes, precompile (recording every candidate's
        # launches for the compile workers) and tune (the example values, each kernel's run once the workers
        # built its default config, then the timing of each kernel once they built its candidates)
        self.build_seconds: dict[str, float] = {}
        self.replan_note: str | None = None     # what a compile planned again after a split back did (compiler)
        self.forward_ms: float | None = None     # a replay of the forward as timed at the compile (`measure_forward`)
        self._variants: dict[Signature, Callable[..., Any]] = {}

        self.input_names = [n.name for n in self.graph.input_nodes]
        self.signature: Signature = tuple(InputSpec(n.name, n.type, device_key(self.device))
                                          for n in self.graph.input_nodes)
        self._input_forms = [input_form(spec) for spec in self.signature]
        self._steps = self._schedule()
        self._plan_prefetch()
        users = self.graph.users()
        # the state updates written in place (`Graph.writes_state_in_place`) that run through PyTorch
        self._in_place = {update for update in self.graph.state.values()
                          if self.graph.writes_state_in_place(update, users)}
        # cats written in place (`opfuse.fusion.concat_in_place`): part -> (cat, dim, start, length) of the slice its
        # producer stores it into
        self._slots = planned_slots(self.plan)
        self._in_place_cats = {cat for cat, *_ in self._slots.values()}
        # PyTorch-run node -> the kernels it launched as it last ran (a cat in place: none)
        self._launched: dict[str, int] = {cat: 0 for cat in self._in_place_cats}
        self._zero_state: dict[str, bool] = {}   # state node -> whether it starts as zeros (`reset_state`)
        # constants read by PyTorch-run nodes: on the device once, as private copies (never the user's tensors,
        # and never registered as parameters, so .to()/.half() on this module cannot reach the user's model)
        needed = {r for s in self._steps for r in s.reads} | set(self.graph.outputs) | set(self.graph.state)
        self._constants = device_constants(self.graph, [s.node for s in self._steps if s.node is not None],
                                           self.device, private=True)
        self._constants.update({name: self.graph.constants[name].detach().to(self.device, copy=True)
                                for name in self.graph.constants if name in needed and name not in self._constants})
        self._constant_outputs = {name for name in self.graph.outputs if self._aliases_constant(name)}

        self.use_cuda_graph = bool(self.config.cuda_graph) and self.device.type == "cuda"
        self.cuda_graph_warmup = cuda_graph_warmup
        self.cuda_graph_error: str | None = None     # why capture failed (the model then runs eagerly)
        self._failed_captures: list[Any] = []
        self._reset_cuda_graph()
        self._lock = call_lock()      # held by a whole run: see the module docstring

    # ---- build time ---------------------------------------------------------------------------------------
    def _aliases_constant(self, name: str) -> bool:
        """Whether value `name` is a constant or a view of one (through alias ops run by PyTorch)."""
        return view_source(self.graph, name).op == "constant"

    def _schedule(self) -> list[Step]:
        graph = self.graph
        available = {n.name for n in graph if n.op in ("input", "constant", "state")}
        steps: list[Step] = []

        def check(step: Step, what: str) -> None:
            for name in step.reads:
                if name not in available:
                    raise GraphError(f"{what} in group {step.group.name} reads {name!r}, which no earlier group "
                                     "produces (the plan's group order or outputs are wrong)")
            steps.append(step)
            available.update(step.writes)

        for group in self.plan.groups:
            kernel = self.kernels.get(group.name)
            if kernel is not None:
                check(Step(group, list(kernel.runtime_inputs), list(group.outputs), kernel=kernel),
                      f"kernel {kernel.name}")
                continue
            for name in group.nodes:
                node = graph[name]
                if node.op not in ("input", "constant", "state"):
                    check(Step(group, list(node.inputs), [name], node=node), f"node {node.describe()}")
        for name in graph.outputs:
            if name not in available:
                raise GraphError(f"graph output {name!r} is produced by no group of the plan")

        outputs = set(graph.observed)       # the state's updates live to the end of a call, written back there
        last_use = {}
        for index, step in enumerate(steps):
            for name in step.writes:
                last_use.setdefault(name, index)     # written and never read: dead at once
            for name in step.reads:
                last_use[name] = index
        for name, index in last_use.items():
            if name not in outputs:
                steps[index].free.append(name)
        return steps

    def _plan_prefetch(self) -> None:
        """Each step's `ahead` for the configs that run, with FusionConfig.weight_prefetch on CUDA."""
        targets = {}
        if self.config.weight_prefetch and self.device.type == "cuda":
            targets = prefetch_targets(self._steps, self.configs, plan_hardware(self.plan))
        for index, step in enumerate(self._steps):
            step.ahead = targets.get(index)

    # ---- introspection ------------------------------------------------------------------------------------
    @property
    def launches(self) -> int:
        """Kernel launches per forward: on a captured (or measured: `measure_forward`) CUDA graph, its kernel nodes,
        every library helper kernel among them (`opfuse.runtime.graph_nodes`); else each kernel's, and one per
        PyTorch-run node that computes or (a view) copied as it last ran (`launches_of`; before any run, as the
        graph says)."""
        if self._graph_launches is not None:
            return self._graph_launches
        return sum(s.kernel.launches(self.configs.get(s.group.name)) if s.kernel is not None
                   else self._launched.get(s.node.name, int(launches_kernel(self.graph, s.node)))
                   for s in self._steps)

    @property
    def library_anchors(self) -> dict[str, str]:
        """Groups whose anchor runs through PyTorch's library (cuBLAS/cuDNN) with the epilogue as a generated
        kernel, or with its bias and no epilogue kernel for a group of bare linears, or with its epilogue inside
        the library call (the fused library form): the autotuner measured that faster than every Triton config it
        tried. And the timings."""
        from opfuse.codegen.forms import is_library

        return {name: self.kernels[name].describe_library_form(config) + self._measured_against_triton(name)
                for name, config in self.configs.items() if is_library(config)}

    @property
    def unfused(self) -> dict[str, str]:
        """Groups that run unfused, their ops one by one through PyTorch, because the autotuner measured that
        faster than the fused kernel, and the timings."""
        from opfuse.codegen.forms import is_unfused

        return {name: f"{self.kernels[name].launches(config)} PyTorch ops unfused (fusion refused: "
                      f"measured slower){self._measured_against_triton(name)}"
                for name, config in self.configs.items() if is_unfused(config)}

    def _measured_against_triton(self, name: str) -> str:
        """': X us measured against Y us for the best Triton config (...)' for group `name`'s chosen form."""
        from opfuse.codegen.forms import is_library, is_unfused
        from opfuse.runtime.autotune import format_config

        if self.tuning is None:
            return ""
        if name in self.tuning.from_cache:
            return ": the tuning cache's choice (measured when this kernel was first tuned)"
        timings = dict(self.tuning.timings.get(name, {}))
        chosen = timings.pop(self.configs[name], None)
        timings = {c: t for c, t in timings.items() if not (is_library(c) or is_unfused(c))}   # the Triton forms
        if chosen is None or not timings:
            return ""
        best = min(timings, key=timings.__getitem__)
        return (f": {chosen * 1e6:.1f} us measured against {timings[best] * 1e6:.1f} us for the best Triton config "
                f"({format_config(best)})")

    def set_configs(self, configs: Mapping[str, KernelConfig]) -> None:
        """Use these kernel configs from now on (drops a captured CUDA graph, which baked the old ones in)."""
        unknown = set(configs) - set(self.kernels)
        if unknown:
            raise GraphError(f"configs given for groups without a kernel: {sorted(unknown)}")
        with self._lock:      # not under a call running the old configs or replaying the graph about to be dropped
            self.configs.update(configs)
            for name, config in configs.items():
                self.kernels[name].keep_form(config)
            self._plan_prefetch()
            self.forward_ms = None
            self._reset_cuda_graph()

    def set_cuda_graph(self, enabled: bool) -> None:
        """Switch CUDA graph capture on or off (only has an effect on CUDA)."""
        with self._lock:
            self.use_cuda_graph = enabled and self.device.type == "cuda"
            self.cuda_graph_error = None
            self._reset_cuda_graph()

    # ---- run time -----------------------------------------------------------------------------------------
    def input_signature(self, inputs: Sequence[Any]) -> Signature:
        if len(inputs) != len(self.signature):
            raise GraphError(f"compiled model of {self.graph.name} takes {len(self.signature)} inputs "
                             f"{format_signature(self.signature)}, got {len(inputs)}")
        specs = []
        for spec, x in zip(self.signature, inputs):
            if not isinstance(x, torch.Tensor):
                raise GraphError(f"input {spec.name!r} must be a tensor, got {type(x).__name__}")
            specs.append(InputSpec(spec.name, TensorType(tuple(x.shape), dtype_name(x.dtype)), str(x.device)))
        return tuple(specs)

    def forward(self, *inputs: torch.Tensor) -> Any:
        signature = self.input_signature(inputs)
        if signature != self.signature:
            return self._other_signature(signature, inputs)
        return self.run_matching(inputs)

    def run_matching(self, inputs: Sequence[torch.Tensor]) -> Any:
        """The forward pass for inputs the caller has already checked against `signature` in shape and device
        (OpfuseModule does, so a call pays for one check: on a CUDA graph at batch 1, host time before the replay
        is latency). A floating input may come in another float dtype: it is cast to the compiled one, in the same
        step that lays it out channels-last (the copy into the static buffer, on a captured CUDA graph)."""
        if torch.is_grad_enabled():      # entering no_grad costs host time: only when grad mode is on
            with torch.no_grad():
                outputs = self._run(inputs)
        else:
            outputs = self._run(inputs)
        if self.unflatten is not None:
            return self.unflatten(outputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def _run(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One forward, the whole of it under the call lock: a replay's copies in and out share the static buffers
        with every other call, and the warm-up and capture change what later calls run."""
        with self._lock:
            if self._cuda_graph is not None and self._replays(inputs):
                with CAPTURE_GATE.shared():
                    return self._replay_as_captured(inputs)
            if self.use_cuda_graph and self.cuda_graph_error is None:     # warm-up or (re)capture: alone
                with CAPTURE_GATE.exclusive():
                    if self._cuda_graph is not None:
                        return self._replay(inputs)
                    prepared = [self._prepare(x, form) for x, form in zip(inputs, self._input_forms)]
                    return self._run_cuda_graph(prepared, [p is x for p, x in zip(prepared, inputs)])
            with CAPTURE_GATE.shared():
                return self._execute([self._prepare(x, form) for x, form in zip(inputs, self._input_forms)])

    @staticmethod
    def _prepare(x: torch.Tensor, form: tuple[torch.dtype | None, torch.memory_format]) -> torch.Tensor:
        """`x` in the compiled dtype and layout: itself when it already is (one `to` call, no copy)."""
        dtype, memory_format = form
        if dtype is None or not x.is_floating_point():
            return x
        return x.to(dtype=dtype, memory_format=memory_format)

    def _other_signature(self, signature: Signature, inputs: Sequence[torch.Tensor]) -> Any:
        if self.recompile is None:
            wrong = next(f"{got} (compiled for {want.type} on {want.device})"
                         for got, want in zip(signature, self.signature) if got != want)
            raise GraphError(f"input {wrong}: the model was compiled for {format_signature(self.signature)} "
                             f"but called with {format_signature(signature)}; compile it again for these "
                             "inputs (or pass a recompile callback)")
        with self._lock:      # threads calling with a new signature at once compile it once
            variant = self._variants.get(signature)
            if variant is None:
                variant = self.recompile(inputs)
                self._variants[signature] = variant
        return variant(*inputs)

    def _run_steps(self, inputs: Sequence[torch.Tensor], keep_all: bool = False,
                   before_kernel: Callable[[str], None] | None = None) -> dict[str, torch.Tensor]:
        values: dict[str, torch.Tensor] = dict(self._constants)
        values.update(zip(self.input_names, inputs))
        for step in self._steps:
            if before_kernel is not None and step.kernel is not None:
                before_kernel(step.group.name)
            self._run_step(step, values)     # a call of its own, so no local keeps a dead value alive
            if not keep_all:
                for name in step.free:
                    values.pop(name, None)
        for holder, update in self.graph.state.items():      # what an update computed elsewhere leaves in it
            if values[update] is not self._constants[holder]:
                self._constants[holder].copy_(values[update])
        return values

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The model's state (a KV cache) by state node: the tensors each call reads and writes, kept between calls."""
        return {holder: self._constants[holder] for holder in self.graph.state}

    def reset_state(self) -> None:
        """Every state tensor back to what it held before the first call (zeros, for a fresh KV cache): zeroed on
        its device where it started as zeros (the first reset looks), else copied from the host, one tensor at a
        time (a KV cache's 2 x layers copies from pageable memory took about 30 ms on an H100 for a ~1.1B Llama)."""
        with torch.no_grad():
            for holder in self.graph.state:
                initial = self.graph.constants[holder]
                if holder not in self._zero_state:
                    self._zero_state[holder] = not bool(initial.any())
                if self._zero_state[holder]:
                    self._constants[holder].zero_()
                else:
                    self._constants[holder].copy_(initial)

    def bind_state(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Read and write these tensors as the model's state from now on (another compiled model's, so that two
        compiled models of one decoder, a prefill and a decode step, share one KV cache); each of the state node's
        type, on this model's device. Drops a captured CUDA graph, which baked the old ones in."""
        for holder, tensor in tensors.items():
            mine = self._constants.get(holder)
            if holder not in self.graph.state or tensor.shape != mine.shape or tensor.dtype != mine.dtype \
                    or tensor.device != mine.device:
                raise GraphError(f"bind_state: {holder!r} is no state of {self.graph.name} of shape "
                                 f"{list(tensor.shape)} and dtype {tensor.dtype} on {tensor.device}")
        self._constants.update(tensors)
        self._reset_cuda_graph()

    def _run_step(self, step: Step, values: dict[str, torch.Tensor]) -> None:
        args = [values[name] for name in step.reads]
        node = step.node
        if node is not None and node.name in self._in_place:
            # the state's update: written into the state's own tensor, in place (only the rows of the call move)
            values[node.name] = args[0].index_copy_(node.attrs["dim"], args[1], args[2])
            self._launched[node.name] = 1
            return
        if node is not None and node.name in self._in_place_cats:     # its parts' steps stored it
            self._cat_buffer(node.name, values)
            return
        if step.kernel is not None:
            slices = [self._slice(name, values) for name in step.writes]
            with prefetching(step.ahead):
                outputs = self._run_kernel(step, args, slices if any(s is not None for s in slices) else None)
            if len(outputs) != len(step.writes):
                raise GraphError(f"kernel {step.kernel.name} of group {step.group.name} returned "
                                 f"{len(outputs)} outputs, the group has {len(step.writes)} {step.writes}")
            values.update(zip(step.writes, map(_stored, slices, outputs)))
            return
        try:
            out = get_op(step.node.op).run(args, step.node.attrs)
            self._launched[step.node.name] = launches_of(step.node, args, out)
        except GraphError:
            raise
        except Exception as error:
            raise GraphError(f"running node {step.node.describe()} (group {step.group.name}, through "
                             f"PyTorch) failed: {error}") from error
        slice_ = self._slice(step.node.name, values)
        if slice_ is not None:
            self._launched[step.node.name] += 1
        values[step.node.name] = _stored(slice_, out)

    def _slice(self, name: str, values: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """Where value `name` is stored: its slice of the cat it is written into in place (the cat's buffer made
        when its first part is stored), or None (anywhere)."""
        if name not in self._slots:
            return None
        cat, dim, start, length = self._slots[name]
        return self._cat_buffer(cat, values).narrow(dim, start, length)

    def _cat_buffer(self, cat: str, values: dict[str, torch.Tensor]) -> torch.Tensor:
        """The buffer of cat `cat` written in place: channels-last where 4-D floating (the kernels' image layout)."""
        if cat not in values:
            type = self.graph[cat].type
            dtype = torch_dtype(type.dtype)
            image = len(type.shape) == 4 and dtype.is_floating_point
            values[cat] = torch.empty(type.shape, dtype=dtype, device=self.device,
                                      memory_format=torch.channels_last if image else torch.contiguous_format)
        return values[cat]

    def _run_kernel(self, step: Step, args: list[torch.Tensor],
                    slices: list[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Run the step's kernel with its config (`slices`: where it may store its outputs, `GroupKernel.run`); one
        the GPU refuses at launch (out of shared memory or registers: the resource model's estimate fell short)
        gives way to the kernel's next config that runs, which becomes its config."""
        name, kernel = step.group.name, step.kernel
        config = self.configs.get(name)
        where = (slices,) if slices is not None else ()     # passed only where there are slices
        try:
            return kernel.run(args, config, *where)
        except out_of_resources() as error:
            refused = error
        configs = kernel.configs()
        for candidate in configs[configs.index(config) + 1 if config in configs else 0:]:
            try:
                outputs = kernel.run(args, candidate, *where)
            except out_of_resources():
                continue
            self.configs[name] = candidate
            return outputs
        raise GraphError(f"kernel {kernel.name} of group {name}: no config fits the GPU ({refused})") from refused

    def _execute(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        values = self._run_steps(inputs)
        # an output that is a constant or a view of one (a model returning x.new_zeros(..)) is the model's own
        # tensor: each caller gets a copy, as eager gives each call a new tensor
        return [values[name].clone() if name in self._constant_outputs else values[name]
                for name in self.graph.outputs]

    def collect_values(self, *inputs: torch.Tensor, before_kernel: Callable[[str], None] | None = None
                       ) -> dict[str, torch.Tensor]:
        """Every value of one eager forward, by name: example inputs for the autotuner. `before_kernel(group)` is
        called before each kernel runs (`Compiling.ready_default`: until the compile workers built it)."""
        signature = self.input_signature(inputs)
        if signature != self.signature:
            raise GraphError(f"collect_values needs inputs matching {format_signature(self.signature)}, "
                             f"got {format_signature(signature)}")
        with torch.no_grad():
            return self._run_steps([to_channels_last(x) for x in inputs], keep_all=True, before_kernel=before_kernel)

    def stand_ins_are_safe(self) -> bool:
        """Whether `stand_in_values` can run: every op PyTorch runs on what a kernel made (its zeros) is elementwise
        or a view, never one that could index out of range with computed values (a gather, an opaque call), which
        on a GPU would be a device-side assert no later step survives."""
        from opfuse.codegen.operands import VIEW_OPS
        from opfuse.ir.ops import kind_of

        made = {name for step in self._steps if step.kernel is not None for name in step.writes}
        for step in self._steps:
            if step.kernel is not None or step.node.name in self._in_place_cats:   # (a cat in place runs nothing)
                continue
            if any(name in made for name in step.reads):
                if not (kind_of(step.node).elementwise or step.node.op in VIEW_OPS):
                    return False
                made.update(step.writes)
        return True

    def stand_in_values(self, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
        """`collect_values`' tensors, their shapes, strides and dtypes, with no generated kernel run (each launch
        recorded instead: `recording_launches`) and so none compiled: what the compile workers need to build
        every kernel's candidates before the first of them runs. A kernel's outputs are zeros, so that what
        PyTorch runs between kernels reads values in range (indices too)."""
        signature = self.input_signature(inputs)
        if signature != self.signature:
            raise GraphError(f"stand_in_values needs inputs matching {format_signature(self.signature)}, "
                             f"got {format_signature(signature)}")
        values: dict[str, torch.Tensor] = dict(self._constants)
        values.update(zip(self.input_names, [to_channels_last(x) for x in inputs]))
        given = {t.untyped_storage().data_ptr() for t in values.values() if isinstance(t, torch.Tensor)}
        with torch.no_grad(), recording_launches():
            for step in self._steps:
                self._run_step(step, values)
                if step.kernel is not None:       # what it made, never an input's or a constant's memory
                    for name in step.writes:
                        if values[name].untyped_storage().data_ptr() not in given:
                            values[name].zero_()
        return values

    def extra_repr(self) -> str:
        return (f"graph={self.graph.name}, device={self.device}, kernels={len(self.kernels)}, "
                f"pytorch_groups={len(self.fallbacks)}, cuda_graph={self.use_cuda_graph}")


def _stored(slice_: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """A step's output `out` where it belongs: in `slice_` where one is given (copied there unless the kernel stored it
    there itself), else as it is."""
    if slice_ is None:
        return out
    if out.data_ptr() != slice_.data_ptr() or out.stride() != slice_.stride():
        slice_.copy_(out)
    return slice_


def build_compiled_model(plan: FusionPlan, device: torch.device | str,
                         example_inputs: Sequence[torch.Tensor] | None = None, *,
                         config: FusionConfig | None = None, cache: Any = None, quiet: bool = False,
                         recompile: Callable[[Sequence[torch.Tensor]], Callable[..., Any]] | None = None,
                         unflatten: Callable[[list[torch.Tensor]], Any] | None = None) -> CompiledModel:
    """Lower every group, build the model, and autotune it on `example_inputs` when a GPU can time it.

    Groups whose every config is over budget are listed in `model.tuning.over_budget` (the caller may split them
    and build again). `cache` defaults to the TuningCache of config.cache_dir.
    """
    config = config or plan.config or FusionConfig()
    start = time.perf_counter()
    kernels, reasons = lower_plan(plan, device)
    model = CompiledModel(plan, kernels, device, fallbacks=reasons, config=config, recompile=recompile,
                          unflatten=unflatten)
    model.build_seconds["lower"] = time.perf_counter() - start
    if kernels and example_inputs is not None and tunes(config, device):
        cache = cache if cache is not None else TuningCache.for_config(config)
        with compile_pool(workers_of(config), device):
            start = time.perf_counter()
            stand_ins = stand_ins_of(model, example_inputs)
            inputs = None if stand_ins is None else {k.group.name: kernel_inputs(k, stand_ins)
                                                     for k in kernels.values()}
            compiling = None
            if inputs is not None and every_choice_cached(kernels.values(), inputs, config, cache, model.device):
                values = stand_ins       # nothing to time: the cached choices need only shapes and strides
            else:
                if inputs is not None and active_pool(model.device) is not None:
                    compiling = Compiling.start(list(kernels.values()), inputs, config, cache, model.device)
                del stand_ins, inputs
                model.build_seconds["precompile"] = time.perf_counter() - start
                start = time.perf_counter()
                values = _values_once_built(model, example_inputs, compiling, quiet)
            model.tuning = tune(kernels, values, config, cache, quiet=quiet, compiling=compiling)
            del values
            model.build_seconds["tune"] = time.perf_counter() - start
        model.set_configs(dict(model.tuning.configs))
    model.reset_state()          # the tuning's runs wrote it
    return model


def _values_once_built(model: CompiledModel, example_inputs: Sequence[torch.Tensor], compiling: Compiling | None,
                       quiet: bool) -> dict[str, torch.Tensor]:
    """`model.collect_values` of the example inputs, each kernel run once the workers built its default config."""
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    if compiling is None:
        return model.collect_values(*example_inputs)
    with Progress(TextColumn("[bold]compiling[/] {task.description}"), TimeElapsedColumn(), disable=quiet,
                  transient=True) as progress:
        progress.add_task(f"the candidates of {len(compiling.kernels)} kernels in {compiling.pool.workers} processes",
                          total=None)
        return model.collect_values(*example_inputs, before_kernel=compiling.ready_default)


def stand_ins_of(model: CompiledModel, example_inputs: Sequence[torch.Tensor]
                 ) -> dict[str, torch.Tensor] | None:
    """`model.stand_in_values` of the example inputs, or None where they cannot be made. A tuning needs only their
    shapes, strides and dtypes where every choice is cached; otherwise the compile workers build every kernel's
    candidates (its default config among them) from them before `collect_values` runs the kernels, which would
    compile the default configs here, one at a time. Verification reads from them how the model lays out the
    values its kernels get (`verification.layouts_of`)."""
    if not model.stand_ins_are_safe():
        return None
    try:
        return model.stand_in_values(*example_inputs)
    except Exception:
        return None
