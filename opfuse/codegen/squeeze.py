"""Squeeze-and-excitation's squeeze in one Triton kernel: `lower_squeeze_group(graph, group, device, hw)`.

The group (kind SQUEEZE, recognised by `opfuse.fusion.squeeze.squeeze_chain`): global average pool of x [N, C, H, W]
-> GEMM C -> R (a 1x1 conv or a linear) + elementwise epilogue -> GEMM R -> C + elementwise epilogue. The kernel
(`SQUEEZE_TEMPLATE`, its epilogues generated from `opfuse.codegen.expr`) runs in two Triton forms:

- split (SPLIT >= 1): programs over (sample, BLOCK_C channels, SPLIT spatial slices) sum their slice of x in float32
  and add it atomically into a workspace of N x C float32 sums, then take a ticket from a counter per sample
  (acq_rel, after a barrier: the program's sums are visible before its ticket). The program with the last ticket
  of its sample reads the completed sums (exchanging them for zeros), runs both GEMMs with their epilogues for that
  sample, streaming the weights in chunks of BLOCK_K channels (the R hidden values stay in registers), writes the C
  outputs and resets the counter. Every call therefore leaves the workspace zero, as a CUDA graph replay needs;
  the workspace belongs to this kernel instance alone (allocated zeroed on its device when it is built), so two
  groups never share one. The pool stays parallel over H x W at batch 1.
- plain (SPLIT = 0): one program per sample pools each chunk of BLOCK_K channels and folds it into the first GEMM
  at once; no workspace, no atomics. Good for small H x W or large batches.

Other forms the autotuner measures beside them (`alternatives`): `FORM_SEPARATE`, the three kernels the group would
be without this fusion (the pool, each GEMM with its epilogue; each at its first config), and with `library` the
group's ops unfused through PyTorch: a fused kernel measured slower than either is not kept.

Traffic (the Triton forms): x read once, both weights read once per sample (L2 after the first), N x C outputs
written; the workspace adds 2 x N x C float32 atomics. Everything accumulates in float32.
"""

from __future__ import annotations

from typing import Sequence

import torch

from opfuse.codegen.base import (FORM_SEPARATE, FORM_UNFUSED, GroupKernel, KernelConfig, Outputs, compiled_info,
                                 load_kernel)
from opfuse.codegen.expr import DISCRETE_OPS, SUPPORTED_OPS, Unsupported, emit, literal, refusal
from opfuse.codegen.template_kernel import INT32_LIMIT, extent
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.fusion.squeeze import SqueezeChain, squeeze_chain, squeeze_tile
from opfuse.hardware import HardwareProfile, kernel_profile
from opfuse.ir.graph import Graph, GraphError, torch_dtype
from opfuse.ir.interpret import run_nodes
from opfuse.ir.ops import launches_kernel

SEPARATE = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_SEPARATE)
UNFUSED = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_UNFUSED)

SQUEEZE_TEMPLATE = '''
import triton
import triton.language as tl


@triton.jit
def KERNEL_NAME(
    x_ptr, s_xn, s_xc, s_xh, s_xw, w1_ptr, w2_ptr, sums_ptr, tickets_ptr,
    {params}
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr,
    SPLIT: tl.constexpr, PROGRAMS: tl.constexpr, INT64: tl.constexpr,
):
    # C={channels} R={hidden} H={height} W={width}
    n = tl.program_id(0)
    if INT64:
        n = n.to(tl.int64)
    x_sample = x_ptr + n * s_xn
    lanes = tl.arange(0, BLOCK_HW)
    hidden = tl.arange(0, BLOCK_R)
    hidden_mask = hidden < {hidden}
    if SPLIT == 0:
        # plain: this program pools every chunk of channels and folds it into the first GEMM at once
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, {channels}, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < {channels}
            acc = tl.zeros([BLOCK_HW, BLOCK_K], dtype=tl.float32)
            for p0 in range(0, {spatial}, BLOCK_HW):
                hw = p0 + lanes
                offsets = (hw // {width}) * s_xh + (hw % {width}) * s_xw
                mask = (hw < {spatial})[:, None] & k_mask[None, :]
                acc += tl.load(x_sample + offsets[:, None] + ks[None, :] * s_xc, mask=mask, other=0.0).to(tl.float32)
            pooled = tl.sum(acc, axis=0) / {spatial}
            w = tl.load(w1_ptr + hidden[:, None] * {channels} + ks[None, :],
                        mask=hidden_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
            h += tl.sum(w * pooled[None, :], axis=1)
{plain_tail}
    else:
        # split: reduce this program's slice of the spatial positions, add it into the sample's sums
        cs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        c_mask = cs < {channels}
        acc = tl.zeros([BLOCK_HW, BLOCK_C], dtype=tl.float32)
        for step in range(tl.program_id(2), {steps_of}, SPLIT):
            hw = step * BLOCK_HW + lanes
            offsets = (hw // {width}) * s_xh + (hw % {width}) * s_xw
            mask = (hw < {spatial})[:, None] & c_mask[None, :]
            acc += tl.load(x_sample + offsets[:, None] + cs[None, :] * s_xc, mask=mask, other=0.0).to(tl.float32)
        tl.atomic_add(sums_ptr + n * {channels} + cs, tl.sum(acc, axis=0), mask=c_mask, sem="acq_rel")
        tl.debug_barrier()      # every thread's sums are in before the program takes its ticket
        ticket = tl.atomic_add(tickets_ptr + n, 1, sem="acq_rel")
        if ticket == PROGRAMS - 1:
            # the sample's last program: its sums are complete. Each thread reads them by an atomic (coherent
            # in L2, whatever this SM's L1 holds), then leaves zeros for the next call
            h = tl.zeros([BLOCK_R], dtype=tl.float32)
            for k0 in range(0, {channels}, BLOCK_K):
                ks = k0 + tl.arange(0, BLOCK_K)
                k_mask = ks < {channels}
                sums = tl.atomic_add(sums_ptr + n * {channels} + ks, tl.zeros([BLOCK_K], dtype=tl.float32),
                                     mask=k_mask, sem="acq_rel")
                tl.store(sums_ptr + n * {channels} + ks, tl.zeros([BLOCK_K], dtype=tl.float32), mask=k_mask)
                pooled = tl.where(k_mask, sums, 0.0) / {spatial}
                w = tl.load(w1_ptr + hidden[:, None] * {channels} + ks[None, :],
                            mask=hidden_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
                h += tl.sum(w * pooled[None, :], axis=1)
{split_tail}
            tl.store(tickets_ptr + n, 0)      # every program of the sample has taken its ticket
'''


def lower_squeeze_group(graph: Graph, group: FusionGroup, device, hw: HardwareProfile | None = None
                        ) -> "SqueezeKernel":
    """The group's squeeze kernel (see the module docstring)."""
    return SqueezeKernel(graph, group, torch.device(device), kernel_profile(hw))


def supports(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """None where the squeeze template takes `group`, else why not (`_taken`'s checks; no source generated)."""
    return refusal("squeeze", lambda: _taken(graph, group, graph.users() if users is None else users))


def _taken(graph: Graph, group: FusionGroup, users) -> SqueezeChain:
    """The group's squeeze chain; `Unsupported` where it is none, or reads a dtype the kernel does not take."""
    chain = squeeze_chain(graph, group.nodes, users)
    if not isinstance(chain, SqueezeChain):
        raise Unsupported(f"group {group.name} is no squeeze chain" + (f": {chain}" if chain else ""),
                          Code.EPILOGUE_FORM)
    x = graph[chain.pool].inputs[0]
    if graph[x].type.dtype not in ("float16", "bfloat16", "float32"):
        raise Unsupported(f"the squeeze kernel takes float16/bfloat16/float32 inputs, not {graph[x].type.dtype}",
                          Code.OPERAND_DTYPE)
    return chain


def _indent(lines: list[str], depth: int) -> str:
    return "\n".join("    " * depth + line for line in lines)


class SqueezeKernel(GroupKernel):
    """A SQUEEZE group as one Triton kernel (split or plain form), or its separate kernels, or its ops unfused."""

    def __init__(self, graph: Graph, group: FusionGroup, device: torch.device, hw: HardwareProfile):
        chain = _taken(graph, group, graph.users())
        self.chain, self.device, self.hw = chain, device, hw
        x = graph[chain.pool].inputs[0]
        for name in group.outputs:
            if name not in (chain.second, *chain.second_epilogue):
                raise GraphError(f"group {group.name} outputs {name}, which is no value of its second GEMM")
        self.x = x
        self.vectors: list[torch.Tensor] = []      # per-channel constants (biases, epilogue operands), in order
        self._var: dict[str, str] = {}             # group value -> the kernel variable holding it
        first, hidden = self._stage(graph, chain.first, chain.first_epilogue, "hidden", "hidden_mask", "h")
        second, _ = self._stage(graph, chain.second, chain.second_epilogue, "ks", "k_mask", "o")
        stores = []
        for i, name in enumerate(group.outputs):
            dtype = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32"}.get(
                graph[name].type.dtype)
            if dtype is None:
                raise Unsupported(f"output {name} is {graph[name].type.dtype}")
            stores.append(f"tl.store(out{i}_ptr + n * s_out{i}_n + ks * s_out{i}_c, {self._var[name]}.to({dtype}), "
                          "mask=k_mask)")
        # padded hidden lanes are zeroed: an epilogue may make them non-zero, and 0 * NaN is no zero
        second_gemm = ["ks = k0 + tl.arange(0, BLOCK_K)", f"k_mask = ks < {chain.channels}",
                       f"w = tl.load(w2_ptr + ks[:, None] * {chain.hidden} + hidden[None, :],",
                       "            mask=k_mask[:, None] & hidden_mask[None, :], other=0.0).to(tl.float32)",
                       "o = tl.sum(w * h[None, :], axis=1)"] + second + stores
        tail = first + [f"h = tl.where(hidden_mask, {hidden}, 0.0)",
                        f"for k0 in range(0, {chain.channels}, BLOCK_K):"] + ["    " + line for line in second_gemm]
        params = "".join(f"v{i}_ptr, " for i in range(len(self.vectors)))
        params += "".join(f"out{i}_ptr, s_out{i}_n, s_out{i}_c, " for i in range(len(group.outputs)))
        source = SQUEEZE_TEMPLATE.format(
            params=params, channels=chain.channels, hidden=chain.hidden, height=chain.height, width=chain.width,
            spatial=chain.spatial, steps_of=f"tl.cdiv({chain.spatial}, BLOCK_HW)",
            plain_tail=_indent(tail, 2), split_tail=_indent(tail, 3))
        ops = [graph[n].op for n in group.nodes]
        header = f'"""Generated by opfuse (squeeze): {", ".join(ops)}."""\n'    # no names: `build_kernel`
        name, source, self.function = load_kernel("fused", ops, header + source)
        super().__init__(graph, group, name, source)
        self.w1 = self._weight(graph, chain.first, chain.hidden, chain.channels)
        self.w2 = self._weight(graph, chain.second, chain.channels, chain.hidden)
        self.vectors = [v.to(device) for v in self.vectors]
        # the split form's workspace: this kernel's own, zero between calls (each call leaves it so)
        self.sums = torch.zeros(chain.batch * chain.channels, dtype=torch.float32, device=device)
        self.tickets = torch.zeros(chain.batch, dtype=torch.int32, device=device)
        self.output_fill: float | None = None     # tests set NaN so an element the kernel misses shows
        self._separate: list[GroupKernel] | None = None
        self._unfused_constants: dict[str, torch.Tensor] | None = None

    # ---- code generation ----------------------------------------------------------------------------
    def _stage(self, graph: Graph, anchor: str, epilogue: Sequence[str], index: str, mask: str,
               result: str) -> tuple[list[str], str]:
        """(lines computing a GEMM's bias and elementwise epilogue on its float32 result `result` over channel
        index `index`, the variable of the stage's last value); fills `self._var` and `self.vectors`."""
        lines = []
        node = graph[anchor]
        value = result
        if len(node.inputs) > 2:
            value = f"a{len(self._var)}"
            lines.append(f"{value} = {result} + {self._vector(graph, node.inputs[2], index, mask)}")
        self._var[anchor] = value
        for name in epilogue:
            step = graph[name]
            if step.op not in SUPPORTED_OPS or step.op in DISCRETE_OPS:
                raise Unsupported(f"{step.describe()}: the squeeze kernel's epilogues take arithmetic ops only")
            args = [self._var[v] if v in self._var else self._vector(graph, v, index, mask) for v in step.inputs]
            variable = f"e{len(self._var)}"
            lines.append(f"{variable} = {emit(step.op, step.attrs, args)}")
            self._var[name] = variable
        return lines, self._var[epilogue[-1]] if epilogue else value

    def _vector(self, graph: Graph, value: str, index: str, mask: str) -> str:
        """A constant operand: a literal for one element, else a per-channel vector loaded at `index`."""
        tensor = graph.constants[value]
        if tensor.numel() == 1:
            return literal(float(tensor.reshape(-1)[0]))
        position = len(self.vectors)
        self.vectors.append(tensor.reshape(-1).contiguous().to(torch_dtype(graph[value].type.dtype)))
        return f"tl.load(v{position}_ptr + {index}, mask={mask}, other=0.0).to(tl.float32)"

    def _weight(self, graph: Graph, anchor: str, rows: int, columns: int) -> torch.Tensor:
        weight = graph.constants[graph[anchor].inputs[1]]
        return weight.reshape(rows, columns).contiguous().to(device=self.device,
                                                             dtype=torch_dtype(graph[self.x].type.dtype))

    # ---- configs and forms --------------------------------------------------------------------------
    def configs(self) -> list[KernelConfig]:
        """The split form (the planner's tile: about two programs per SM), fewer and more slices, then plain."""
        chain, sms = self.chain, self.hw.sm_count
        if self.hw.interpreted:    # tiny tiles, so that the interpreter walks several channel blocks and slices
            small = {"BLOCK_C": 4, "BLOCK_HW": 4, "BLOCK_K": 4}
            tiles = [squeeze_tile(chain, sms, 1, split=2) | small, squeeze_tile(chain, sms, 1, split=0) | small]
            tiles[0]["SPLIT"] = min(3, -(-chain.spatial // 4))
        else:
            first = squeeze_tile(chain, sms)
            tiles = [first, squeeze_tile(chain, sms, split=max(1, first["SPLIT"] // 4)),
                     squeeze_tile(chain, sms, split=first["SPLIT"] * 4), squeeze_tile(chain, sms, 8, split=0)]
        configs = []
        for tile in tiles:
            warps = tile.pop("num_warps")
            config = KernelConfig.of(num_warps=warps, num_stages=1, **tile)
            if config not in configs:
                configs.append(config)
        return configs

    def alternatives(self, library: bool = True) -> list[KernelConfig]:
        """The group as its three separate kernels; with `library`, its ops unfused through PyTorch."""
        return [SEPARATE] + ([UNFUSED] if library else [])

    def launches(self, config: KernelConfig | None = None) -> int:
        if config is not None and config.form == FORM_UNFUSED:
            return sum(launches_kernel(self.graph, self.graph[n]) for n in self.group.nodes)
        if config is not None and config.form == FORM_SEPARATE:
            return sum(k.launches() for k in self.separate_kernels())
        return 1

    def keep_form(self, config: KernelConfig) -> None:
        if config.form != FORM_SEPARATE:
            self._separate = None
        if config.form != FORM_UNFUSED:
            self._unfused_constants = None

    # ---- running ------------------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """(Stores its own outputs: `outputs` is not used.)"""
        config = config or self.configs()[0]
        if config.form == FORM_UNFUSED:
            return self.run_unfused(inputs)
        if config.form == FORM_SEPARATE:
            return self.run_separate(inputs)
        if len(inputs) != 1 or tuple(inputs[0].shape) != self.graph[self.x].type.shape:
            raise GraphError(f"kernel {self.name} takes {self.x} {self.graph[self.x].type}, got "
                             f"{[list(t.shape) for t in inputs]}")
        x = inputs[0]
        outputs = [self._allocate(name) for name in self.group.outputs]
        chain, split = self.chain, config["SPLIT"]
        programs = -(-chain.channels // config["BLOCK_C"]) * split
        grid = (chain.batch, 1, 1) if split == 0 else (chain.batch, -(-chain.channels // config["BLOCK_C"]), split)
        widest = max(extent(x), x.shape[0] * x.stride(0))
        args = [x, *x.stride(), self.w1, self.w2, self.sums, self.tickets, *self.vectors]
        for out in outputs:
            args += [out, out.stride(0), out.stride(1)]
        handle = self.function[grid](*args, **dict(config.params), PROGRAMS=max(programs, 1),
                                     INT64=widest > INT32_LIMIT, num_warps=config.num_warps,
                                     num_stages=config.num_stages)
        self.last_compiled = compiled_info(handle)
        return outputs

    def _allocate(self, name: str) -> torch.Tensor:
        type = self.graph[name].type
        tensor = torch.empty(type.shape, dtype=torch_dtype(type.dtype), device=self.device)
        return tensor if self.output_fill is None else tensor.fill_(self.output_fill)

    def separate_kernels(self) -> list[GroupKernel]:
        """The pool, and each GEMM with its epilogue, as the kernels they are without this fusion (built on first
        use)."""
        if self._separate is None:
            from opfuse.codegen.lower import lower_group   # (lower imports this module lazily too)

            chain, kernels = self.chain, []
            parts = [[chain.pool], [chain.first, *chain.first_epilogue], [chain.second, *chain.second_epilogue]]
            for i, nodes in enumerate(parts):
                inputs = list(dict.fromkeys(v for n in nodes for v in self.graph[n].inputs if v not in nodes))
                outputs = list(self.group.outputs) if i == 2 else [nodes[-1]]
                part = FusionGroup(self.group.id, GroupKind.SINGLE if len(nodes) == 1 else GroupKind.ANCHOR_EPILOGUE,
                                   nodes, anchor=None if i == 0 else nodes[0], inputs=inputs, outputs=outputs)
                reasons: dict = {}
                kernel = lower_group(self.graph, part, self.device, reasons, self.hw)
                if kernel is None:
                    raise GraphError(f"group {self.group.name}: its part {', '.join(nodes)} has no kernel "
                                     f"({reasons.get(part.name)})")
                kernels.append(kernel)
            self._separate = kernels
        return self._separate

    def run_separate(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The three kernels one after the other, each at its first config."""
        values = dict(zip(self.runtime_inputs, inputs))
        for kernel in self.separate_kernels():
            results = kernel.run([values[name] for name in kernel.runtime_inputs])
            values.update(zip(kernel.group.outputs, results))
        self.last_compiled = None
        return [values[name] for name in self.group.outputs]

    def run_unfused(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's ops one by one through their PyTorch references."""
        nodes = [self.graph[n] for n in self.group.nodes]
        if self._unfused_constants is None:
            self._unfused_constants = {v: self.graph.constants[v].to(self.device) for node in nodes
                                       for v in node.inputs if self.graph.is_constant(v)}
        values = run_nodes(nodes, dict(zip(self.runtime_inputs, inputs)) | self._unfused_constants)
        self.last_compiled = None
        return [values[name] for name in self.group.outputs]
