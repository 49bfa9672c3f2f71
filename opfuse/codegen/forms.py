"""The execution forms of an anchor kernel, and their base class `EpilogueKernel`.

Beside its Triton configs (tiles, split-K slices), an anchor kernel runs in two other forms the autotuner measures:
the library form (`LIBRARY_CONFIGS`: the anchor through cuBLAS/cuDNN, then the epilogue as a generated kernel), the
fused library form where the library runs the epilogue itself (`LIBRARY_FUSED`: `opfuse.codegen.library_fused`)
and the unfused form (`UNFUSED`: the group's ops one by one through PyTorch). A config names its form; `is_library`,
`is_library_fused` and `is_unfused` read it.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import triton

from opfuse.codegen.base import FORM_LIBRARY, FORM_UNFUSED, GroupKernel, KernelConfig, Outputs
from opfuse.codegen.epilogue import generate_kernel
from opfuse.codegen.split_k import REDUCE_BLOCK_M, REDUCE_BLOCK_N, SplitK, unsplit
from opfuse.ir.graph import Node
from opfuse.ir.interpret import device_constants, run_nodes
from opfuse.ir.ops import launches_kernel

if TYPE_CHECKING:
    from opfuse.codegen.epilogue import Epilogue, TileLayout

# The library form of an anchor kernel: the anchor alone through PyTorch (cuBLAS / cuDNN) into a buffer, then one
# generated kernel reads it and runs the group's epilogue. Two launches and one round trip of the anchor's result
# instead of one fused kernel: the autotuner measures it beside the Triton configs and keeps it only where it is
# faster (the shapes where the library's GEMM or convolution beats the template's). Three forms of its epilogue
# kernel, which streams the anchor's whole output: 2-D tiles (REDUCE_TEMPLATE over a single slice), the split-K
# reduce's small one and a wider one for large outputs (bert-base's 8192 x 3072 FFN activations at batch 64), and
# a flat block of elements in memory order (FLAT_TEMPLATE, BLOCK), whose loads and stores are vectorised whatever the
# channel count, as a pointwise kernel's are
LIBRARY_CONFIGS = (
    KernelConfig.of(num_warps=4, num_stages=1, form=FORM_LIBRARY, BLOCK_M=REDUCE_BLOCK_M, BLOCK_N=REDUCE_BLOCK_N),
    KernelConfig.of(num_warps=8, num_stages=1, form=FORM_LIBRARY, BLOCK_M=64, BLOCK_N=128),
    KernelConfig.of(num_warps=4, num_stages=1, form=FORM_LIBRARY, BLOCK=1024))
LIBRARY = LIBRARY_CONFIGS[0]
LibraryAnchor = Callable[[dict[str, torch.Tensor]], torch.Tensor]   # values by name -> [batch, rows, columns]
# the whole library form of a group that is its anchors alone (the bias inside the library call): values by name ->
# the group's outputs, with no epilogue kernel
LibraryOutputs = Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]
# The fused library form: the group as one cuDNN/cuBLASLt call that runs its epilogue too (`library_fused`)
LIBRARY_FUSED = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_LIBRARY, FUSED=1)
# The unfused form: the group's ops one by one through PyTorch, as eager runs them (cuBLAS with its bias epilogue,
# then PyTorch's own elementwise kernels). The autotuner times it too, so a fusion that measures slower than the
# ops it merges is refused at run time (bert-base's K=768 linears, where cuBLAS's main loop beats the template's).
UNFUSED = KernelConfig.of(num_warps=1, num_stages=1, form=FORM_UNFUSED)


# The library form's flat epilogue kernel: BLOCK consecutive elements of the library's result src[batch, rows,
# columns] (dense) per program, batch pid_b, under the flat contract of `opfuse.codegen.epilogue`. TOTAL (rows x
# columns) is an argument of its own so that Triton specialises on its divisibility: the mask's, which decides
# whether loads and stores are vectorised
FLAT_TEMPLATE = '''
import triton
import triton.language as tl


@triton.jit
def KERNEL_NAME(
    src_ptr, TOTAL, N, R1, R2, B1,
    {params}
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_b = tl.program_id(1)
    flat = pid * BLOCK + tl.arange(0, BLOCK)
    mask = flat < TOTAL
    offs_dense = pid_b * TOTAL + flat
    offs_m = flat // N
    offs_n = flat % N
    b0 = pid_b // B1
    b1 = pid_b % B1
    r2 = offs_m % R2
    r1 = (offs_m // R2) % R1
    r0 = offs_m // (R2 * R1)
    acc = tl.load(src_ptr + offs_dense, mask=mask, other=0.0).to(tl.float32)

{epilogue}
'''


class FlatEpilogue:
    """The library form's flat epilogue kernel: FLAT_TEMPLATE with an epilogue's flat form (whose `launch_args`
    bind each run)."""

    def __init__(self, epilogue: "Epilogue"):
        # named flat_<ops>_<hash>: a profile tells it from the fused kernel of the same ops
        self.name, self.source, self.kernel = generate_kernel(FLAT_TEMPLATE, epilogue.flat_form(), "flat")

    def run(self, result: torch.Tensor, layout: "TileLayout", args: list, block: int, num_warps: int) -> None:
        """The epilogue over `result` [batch, rows, columns] (contiguous) into the outputs `args` holds."""
        batch, rows, columns = result.shape
        _, r1, r2 = layout.row_sizes()
        b1 = layout.batch_sizes()[1] if layout.batch_dims else 1
        grid = (triton.cdiv(rows * columns, block), batch)
        self.kernel[grid](result, rows * columns, columns, r1, r2, b1, *args, BLOCK=block, num_warps=num_warps)


def is_flat(config: KernelConfig) -> bool:
    """Whether a library config runs the flat epilogue kernel."""
    return "BLOCK" in dict(config.params)


def is_library(config: KernelConfig | None) -> bool:
    return config is not None and config.form == FORM_LIBRARY


def is_library_fused(config: KernelConfig | None) -> bool:
    """Whether a config is the fused library form (`LIBRARY_FUSED`)."""
    return is_library(config) and "FUSED" in dict(config.params)


def is_unfused(config: KernelConfig | None) -> bool:
    return config is not None and config.form == FORM_UNFUSED


def runs_epilogue_apart(kernel: GroupKernel, config: KernelConfig | None) -> bool:
    """Whether `config` runs the kernel's anchor through the library and its epilogue as a generated kernel of its
    own (the library form of a group with an epilogue): a kernel the epilogue's ops could as well join elsewhere."""
    return (is_library(config) and not is_library_fused(config) and isinstance(kernel, EpilogueKernel)
            and kernel.library_outputs is None and kernel.library_anchor is not None)


class EpilogueKernel(GroupKernel):
    """Base of the anchor kernels (conv, depthwise, conv-conv, GEMM): the config list fixed at build time, the
    binding of one call's runtime inputs and the held constants to the epilogue's arguments and outputs, the
    library form (`LIBRARY`) where the subclass gives its anchor through PyTorch (`library_anchor`, or
    `library_outputs` for a group of bare anchors), and the unfused form (`UNFUSED`) of every group."""

    _configs: list[KernelConfig]
    constants: dict[str, torch.Tensor]
    epilogue: "Epilogue"

    split: "SplitK | None" = None
    library_anchor: LibraryAnchor | None = None
    library_outputs: LibraryOutputs | None = None   # set where the library form needs no epilogue kernel
    library_fused: LibraryOutputs | None = None     # the fused library form, where the library runs the epilogue
    # the group's nodes the anchor's input is computed through (a linear's operand views, a GEMM's prologue), which
    # the Triton forms fold into their operand loads, and the constants they read: the library forms run them
    # through PyTorch first (`_library_values`)
    operand_nodes: Sequence[Node] = ()
    operand_constants: dict[str, torch.Tensor] | None = None
    # the operand nodes as one generated elementwise kernel (`operand_kernel`), made on first use; False where
    # they are views alone (PyTorch copies only what must be) or not elementwise
    _operand_kernel: GroupKernel | bool | None = None
    _library_epilogue: object = None     # the epilogue kernel of the library form, generated on first use
    _flat_epilogue: FlatEpilogue | None = None    # its flat form, likewise
    _unfused_constants: dict[str, torch.Tensor] | None = None   # the unfused form's weights, on first use
    # kernel launches of the PyTorch-run nodes as their last run launched them ("operand": `operand_nodes`,
    # "unfused": the unfused form's): a view copies or not by the strides its input came with, which the graph
    # does not say; `launches` counts these once a form has run
    _launched: dict[str, int] | None = None

    def configs(self) -> list[KernelConfig]:
        return list(self._configs)

    def alternatives(self, library: bool = True) -> list[KernelConfig]:
        """The unsplit form of a split-K kernel's first config that takes the plan's slices (a conv's
        group-blocked configs run unsplit anyway); with `library`, the library forms where there are (the fused one
        last) and the unfused form; only those with an epilogue kernel where it `stores_in_place` (the others
        return tensors of their own, which would be copied), the flat one not where the siblings of a horizontal
        group store apart (`Epilogue.separate`: the tile form only)."""
        forms = []
        if self.split is not None:
            first = next(c for c in self._configs if "SPLIT_K" in dict(c.params))
            forms.append(unsplit(first))
        if library and self.stores_in_place:
            if self.library_outputs is None and self.library_anchor is not None:
                forms.extend(c for c in LIBRARY_CONFIGS if not (is_flat(c) and self.epilogue.separate))
        elif library:
            if self.library_outputs is not None:
                forms.append(LIBRARY)              # no epilogue kernel, so no epilogue tile to choose
            elif self.library_anchor is not None:
                forms.extend(LIBRARY_CONFIGS)
            if self.library_fused is not None:
                forms.append(LIBRARY_FUSED)
            forms.append(UNFUSED)
        return forms

    def describe_library_form(self, config: KernelConfig | None = None) -> str:
        """What the library form `config` runs, in words (`CompiledModel.library_anchors`)."""
        if is_library_fused(config):
            return f"{self.group.anchor or '?'} with its epilogue in one cuDNN/cuBLASLt call, no epilogue kernel"
        if self.library_outputs is not None:
            return f"{self.group.anchor or '?'} through PyTorch (cuBLAS) with its bias, no epilogue kernel"
        prologue = "its prologue as a generated kernel, then " if self.operand_kernel is not None else ""
        return (f"{prologue}anchor {self.group.anchor or '?'} through PyTorch (cuBLAS/cuDNN), then its epilogue as "
                "a generated kernel")

    def launches(self, config: KernelConfig | None = None) -> int:
        """Two in the library form (the library's kernel, then the epilogue, which a group of bare anchors and the
        fused library form do without; cuBLAS/cuDNN may add helper kernels of their own), plus what computing the
        anchor's input first launches (`operand_nodes`: one `operand_kernel` for a prologue's ops, else what PyTorch
        launches, a view it must copy); one per launching op in the unfused form; else one (K slices too: the last
        slice of a tile runs the epilogue, `opfuse.codegen.split_k.last_slice`). What PyTorch launches is what the form's last run launched (`run_nodes`' count), or before
        any run what the graph says."""
        launched = self._launched or {}
        if is_unfused(config):
            if "unfused" in launched:
                return launched["unfused"]
            return sum(launches_kernel(self.graph, node) for node in self._unfused_nodes)
        if is_library(config):
            operand = launched.get("operand")
            if operand is None:
                operand = 1 if self.operand_kernel is not None else sum(launches_kernel(self.graph, node)
                                                                        for node in self.operand_nodes)
            return (1 if self.library_outputs is not None or is_library_fused(config) else 2) + operand
        return 1

    def run(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
            outputs: Outputs = None) -> list[torch.Tensor]:
        """The group's outputs in `config`'s form: the Triton kernel's and the library form's epilogue kernel store
        into `outputs` where given; the fused library form, bare anchors through the library and the unfused form
        return their own (`GroupKernel.run`)."""
        if is_unfused(config):
            return self.run_unfused(inputs)
        if is_library(config):
            return self.run_library(inputs, config, outputs)
        return self.run_triton(inputs, config, outputs)

    def run_triton(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None = None,
                   outputs: Outputs = None) -> list[torch.Tensor]:
        raise NotImplementedError

    def keep_form(self, config: KernelConfig) -> None:
        """Free what only the other forms need once `config` is the one that runs (the library form's own weight,
        the epilogue kernel of each library form but the one kept (none for the fused library form), with the flat
        one's copies of the constants;
        the library forms' operand kernel; the unfused form's constants)."""
        if not is_library(config) and hasattr(self.library_anchor, "release"):
            self.library_anchor.release()
        if not (is_library(config) and is_flat(config)):
            self._flat_epilogue = None
            self.epilogue.drop_flat_form()
        if not is_library(config) or is_flat(config) or is_library_fused(config):
            self._library_epilogue = None        # a split kernel keeps its reduce kernel in `split`
        if not is_unfused(config):
            self._unfused_constants = None
        if not is_library(config):
            self._operand_kernel = None

    @cached_property
    def _unfused_nodes(self) -> list[Node]:
        return [self.graph[n] for n in self.group.nodes if self.graph[n].op not in ("input", "constant")]

    @cached_property
    def _unfused_frees(self) -> list[list[str]]:
        """Per node of the unfused form, the group's intermediates dead after it (read by no later node, not an
        output): freed there, as the runtime frees values between groups. Worked out once, not every call."""
        nodes = self._unfused_nodes
        produced, outputs = {node.name for node in nodes}, set(self.group.outputs)
        last_reader = {name: i for i, node in enumerate(nodes) for name in node.inputs if name in produced}
        frees: list[list[str]] = [[] for _ in nodes]
        for name, i in last_reader.items():
            if name not in outputs:
                frees[i].append(name)
        return frees

    def run_unfused(self, inputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The group's ops one by one through their PyTorch references, as the runtime runs a group it has no kernel
        for (each intermediate freed after its last reader); the constants they read (the graph's, BN already
        folded) go to the device on first use (`device_constants`)."""
        nodes = self._unfused_nodes
        if self._unfused_constants is None:
            self._unfused_constants = device_constants(self.graph, nodes, self.epilogue.device)
        values = dict(zip(self.runtime_inputs, inputs)) | self._unfused_constants
        launched: list[int] = []
        run_nodes(nodes, values, self._unfused_frees, launched)
        self._launched = (self._launched or {}) | {"unfused": sum(launched)}
        self.last_compiled = None
        return [values[name] for name in self.group.outputs]

    def run_library(self, inputs: Sequence[torch.Tensor], config: KernelConfig = LIBRARY,
                    outputs: Outputs = None) -> list[torch.Tensor]:
        """The anchor through PyTorch, then the generated epilogue kernel (with `config`'s tile) over its result; or
        the whole group through the library (bare anchors, the fused library form)."""
        if is_library_fused(config):
            if self.library_fused is None:
                raise ValueError(f"kernel {self.name} has no fused library form")
            self.last_compiled = None
            return self.library_fused(self._library_values(dict(zip(self.runtime_inputs, inputs)) | self.constants))
        if self.library_outputs is not None:
            self.last_compiled = None
            return self.library_outputs(self._library_values(dict(zip(self.runtime_inputs, inputs)) | self.constants))
        if self.library_anchor is None:
            raise ValueError(f"kernel {self.name} has no library form")
        self.last_compiled = None
        flat = is_flat(config)
        _, values, args, outputs = self.bind(inputs, None, self.epilogue.flat_form() if flat else None, outputs)
        result = self.library_anchor(self._library_values(values)).contiguous()
        if flat:
            if self._flat_epilogue is None:
                self._flat_epilogue = FlatEpilogue(self.epilogue)
            self._flat_epilogue.run(result, self.layout, args, config["BLOCK"], config.num_warps)
            return outputs
        if self._library_epilogue is None:   # a split kernel's reduce kernel is that same kernel
            self._library_epilogue = self.split or SplitK.reduce_only(self.epilogue)
        self._library_epilogue.run_reduce(result.reshape(1, *result.shape), self.layout, args, config["BLOCK_M"],
                                          config["BLOCK_N"], config.num_warps)
        return outputs

    @property
    def operand_kernel(self) -> GroupKernel | None:
        """The library forms' prologue as one generated kernel: the operand nodes where they compute (an SE scale,
        a scaled input) and are all elementwise or views, whose result the library reads (one launch, its loads
        and stores vectorised, where PyTorch would run each op with its own strided kernel); else None. Like every
        pointwise kernel it keeps float32 between the chain's ops, rounding once at the end (eager rounds each)."""
        if self._operand_kernel is None:
            self._operand_kernel = self._make_operand_kernel() or False
        return self._operand_kernel or None

    def _make_operand_kernel(self) -> GroupKernel | None:
        from opfuse.codegen.expr import Unsupported
        from opfuse.codegen.operands import VIEW_OPS
        from opfuse.codegen.pointwise import lower_pointwise_group
        from opfuse.fusion.plan import FusionGroup, GroupKind

        nodes = list(self.operand_nodes)
        if all(node.op in VIEW_OPS for node in nodes):
            return None
        names = {node.name for node in nodes}
        inputs = list(dict.fromkeys(i for node in nodes for i in node.inputs if i not in names))
        group = FusionGroup(self.group.id, GroupKind.POINTWISE, [node.name for node in nodes], inputs=inputs,
                            outputs=[nodes[-1].name])
        try:
            return lower_pointwise_group(self.graph, group, self.epilogue.device)
        except Unsupported:
            return None

    def _library_values(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`values` with the anchor's input computed first (`operand_nodes`): what the library reads. Through
        `operand_kernel` where there is one, else through PyTorch."""
        if not self.operand_nodes:
            return values
        prologue = self.operand_kernel
        if prologue is not None:
            (result,) = prologue.run([values[name] for name in prologue.runtime_inputs])
            self._launched = (self._launched or {}) | {"operand": 1}
            return values | {self.operand_nodes[-1].name: result}
        launched: list[int] = []
        values = run_nodes(self.operand_nodes, dict(values) | (self.operand_constants or {}), launched=launched)
        self._launched = (self._launched or {}) | {"operand": sum(launched)}
        return values

    def bind(self, inputs: Sequence[torch.Tensor], config: KernelConfig | None, epilogue: "Epilogue | None" = None,
             outputs: Outputs = None) -> tuple[KernelConfig, dict[str, torch.Tensor], list, list[torch.Tensor]]:
        """(the config to launch, every value by name, the launch arguments of `epilogue` (default: the kernel's),
        the outputs it stores: `outputs` where the epilogue can store there, else allocated)."""
        values = dict(zip(self.runtime_inputs, inputs)) | self.constants
        args, outputs = (epilogue or self.epilogue).launch_args(values, outputs)
        return config or self._configs[0], values, args, outputs
