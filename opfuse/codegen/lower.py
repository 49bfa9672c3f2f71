"""Pick the kernel template for each fusion group: `lower_group(graph, group, device)` and `lower_plan(plan, device)`.

Dispatch reads the group's kind and anchor op: CONV_CONV groups -> `lower_conv_conv_group`, SQUEEZE groups (a
global average pool and two small GEMMs) -> `lower_squeeze_group`, conv2d -> `lower_conv_group`, linear/matmul ->
`lower_gemm_group`, sdpa -> `lower_attention` (its forms: torch's attention and a Triton flash kernel), elementwise
groups -> `lower_pointwise_group`, reductions -> `lower_reduction_group`, an op that runs alone (`OpDef.kernel`: a
grouped GEMM, MoE routing's library calls) -> `opfuse.codegen.grouped_gemm`. A group that gets no kernel (a view, an
opaque op, a gather, or a template that raised `Unsupported`) runs through PyTorch at run time; the reason (a stable
code and the words, `opfuse.fusion.reasons.Reason`) is recorded so the report can say why. The templates are in
`TEMPLATES`, by name, each its `supports` (whether it takes a group: its checks, no source generated, a reason of its
own code where not) and its lowering, which makes the same checks first: `choose_lowering` names one,
`template_refusal` asks its `supports` (the planner does before each merge), `lower_group` lowers.
"""

from __future__ import annotations

from typing import Callable, Mapping, MutableMapping, NamedTuple

import torch

from opfuse.codegen import attention, conv, conv_conv, gemm, grouped_gemm, pointwise, reduction, squeeze
from opfuse.codegen.base import FORM_LIBRARY, GroupKernel, dependent_launches, find_anchor, folding_rows
from opfuse.codegen.expr import Unsupported
from opfuse.codegen.template_kernel import INT32_LIMIT
from opfuse.fusion.concat_in_place import planned_slots
from opfuse.fusion.legality_views import MAPPED_COPIES, maps_on_load
from opfuse.fusion.plan import FusionGroup, FusionPlan, GroupKind
from opfuse.fusion.reasons import Code, Reason
from opfuse.hardware import HardwareProfile, get_hardware, kernel_profile
from opfuse.ir.graph import Graph, GraphError
from opfuse.ir.ops import FusionKind, get_op, kind_of, view_copies

class Template(NamedTuple):
    """A kernel template: `supports(graph, group, users=None)` -> None where it takes the group, else the Reason
    (generating nothing); `lower(graph, group, device, hw=profile)` -> its kernel, `Unsupported` (with the same
    code) where `supports` refuses or a refusal shows only as the source is generated."""

    supports: Callable[..., Reason | None]
    lower: Callable[..., GroupKernel | None]


TEMPLATES: dict[str, Template] = {
    "conv": Template(conv.supports, conv.lower_conv_group),
    "gemm": Template(gemm.supports, gemm.lower_gemm_group),
    "attention": Template(attention.supports, attention.lower_attention),
    "conv-conv": Template(conv_conv.supports, conv_conv.lower_conv_conv_group),
    "squeeze": Template(squeeze.supports, squeeze.lower_squeeze_group),
    "pointwise": Template(pointwise.supports, pointwise.lower_pointwise_group),
    "reduction": Template(reduction.supports, reduction.lower_reduction_group),
    "grouped_gemm": Template(grouped_gemm.supports_grouped_gemm, grouped_gemm.lower_grouped_gemm),
    "library": Template(grouped_gemm.supports_library, grouped_gemm.lower_library),
}
ANCHOR_TEMPLATES = {"conv2d": "conv", "linear": "gemm", "matmul": "gemm", "sdpa": "attention"}   # anchor op ->

# kinds that never get a kernel of ours, and why
NO_KERNEL_KINDS = {
    GroupKind.VIEW: Reason(Code.VIEW, "view: metadata only, no kernel needed"),
    GroupKind.IN_PLACE: Reason(Code.IN_PLACE, "cat written in place by its parts' kernels: no kernel needed"),
    GroupKind.INJECTIVE: Reason(Code.COPYING_OP,
                                "injective (gather/pad/copy): no Triton template, runs through PyTorch"),
}


def _within_int32(graph: Graph, group: FusionGroup) -> Reason | None:
    """None, or why an anchor group runs through PyTorch: the anchor templates index with int32 offsets (the
    pointwise and reduction templates switch to int64), so no tensor they read or write may have more elements,
    nor the one buffer a horizontal group's siblings write their outputs into (its outputs together), nor split-K's
    workspace (the anchor's output once per slice, for the tile that slices it most)."""
    values = list(dict.fromkeys(group.inputs + group.nodes))
    largest = max(values, key=lambda name: graph[name].type.numel)
    if graph[largest].type.numel > INT32_LIMIT:
        return Reason(Code.UNSUPPORTED, f"{graph[largest].describe()} has {graph[largest].type.numel} elements, "
                      f"more than the anchor templates' int32 offsets reach ({INT32_LIMIT})")
    together = sum(graph[name].type.numel for name in group.outputs)
    if group.kind is GroupKind.HORIZONTAL and together > INT32_LIMIT:
        return Reason(Code.UNSUPPORTED, f"the outputs of horizontal group {group.name} ({', '.join(group.outputs)}) "
                      f"share one buffer of {together} elements, more than the anchor templates' int32 offsets "
                      f"reach ({INT32_LIMIT})")
    anchor = graph[find_anchor(graph, group) or group.nodes[0]]
    workspace = max(group.split_k.values(), default=1) * anchor.type.numel     # split-K's partial tiles
    if workspace > INT32_LIMIT:
        return Reason(Code.UNSUPPORTED, f"the K slices of {anchor.describe()} need a workspace of {workspace} "
                      f"elements, more than the anchor templates' int32 offsets reach ({INT32_LIMIT})")
    return None


def choose_lowering(graph: Graph, group: FusionGroup) -> str | Reason:
    """The name of the template for `group` (a key of TEMPLATES), or the reason it has none."""
    if group.kind is GroupKind.OPAQUE:      # name the op: "opaque" alone does not say what runs through PyTorch
        kernels = {get_op(graph[n].op).kernel for n in group.nodes if kind_of(graph[n]) is FusionKind.OPAQUE}
        if len(kernels) == 1 and None not in kernels:   # an op that runs alone in a kernel of its own (`OpDef.kernel`),
            return kernels.pop()            # the outputs of one such call, or a grouped GEMM with its gated product
        ops = ", ".join(graph[n].describe() for n in group.nodes)
        return Reason(Code.OPAQUE, f"opaque op {ops}: runs through PyTorch")
    if group.kind in NO_KERNEL_KINDS:
        return NO_KERNEL_KINDS[group.kind]
    kinds = {name: kind_of(graph[name]) for name in group.nodes}
    in_place = {name for name in group.nodes if graph.writes_state_in_place(name)}   # stored by the pointwise template
    for name, kind in kinds.items():
        if kind is FusionKind.OPAQUE and name not in in_place:
            return Reason(Code.OPAQUE, f"opaque op {graph[name].describe()}: runs through PyTorch")
    if group.kind is GroupKind.CONV_CONV:
        return _within_int32(graph, group) or "conv-conv"
    if group.kind is GroupKind.SQUEEZE:
        return "squeeze"
    anchor = find_anchor(graph, group)
    if anchor is not None:
        op = graph[anchor].op
        if op not in ANCHOR_TEMPLATES:
            return Reason(Code.NO_TEMPLATE, f"no Triton template for anchor op {op!r}")
        return _within_int32(graph, group) or ANCHOR_TEMPLATES[op]
    if group.kind is GroupKind.REDUCTION or any(k is FusionKind.REDUCTION for k in kinds.values()):
        return "reduction"
    # a slice the group stores as a tensor of its own (`planner.store_slices`) is evaluated through coordinates too
    if all(k.elementwise or maps_on_load(graph[name]) or graph[name].op == "slice" and name in group.outputs
           or name in in_place for name, k in kinds.items()):
        computes = any(k.elementwise or view_copies(graph, graph[name]) or graph[name].op in MAPPED_COPIES
                       or name in in_place for name, k in kinds.items())
        if computes and group.kind in (GroupKind.POINTWISE, GroupKind.HORIZONTAL_POINTWISE, GroupKind.SINGLE):
            return "pointwise"   # (free views alone are no kernel)
    if all(graph[name].op == "identity" or kind is FusionKind.INJECTIVE for name, kind in kinds.items()):
        return NO_KERNEL_KINDS[GroupKind.INJECTIVE]
    return Reason(Code.NO_TEMPLATE, f"no Triton template for a {group.kind.value} group of ops "
                  f"{', '.join(dict.fromkeys(graph[n].op for n in group.nodes))}")


def template_refusal(graph: Graph, group: FusionGroup, users=None) -> Reason | None:
    """Why the template `choose_lowering` names for `group` refuses it (its `supports`), or None: also None where no
    template is named (the group runs through PyTorch for a reason of another kind, or launches nothing)."""
    choice = choose_lowering(graph, group)
    return None if isinstance(choice, Reason) else TEMPLATES[choice].supports(graph, group, users)


def lower_group(graph: Graph, group: FusionGroup, device: torch.device | str,
                reasons: MutableMapping[str, Reason] | None = None, hw: HardwareProfile | None = None
                ) -> GroupKernel | None:
    """The group's kernel for GPU `hw` (default: the default profile; every template takes its tiles from it, as
    `kernel_profile` gives it), or None (reason stored in `reasons[group.name]`) when it runs through PyTorch."""
    choice = choose_lowering(graph, group)
    if isinstance(choice, Reason):
        reason = choice
    else:
        try:
            kernel = TEMPLATES[choice].lower(graph, group, torch.device(device), hw=kernel_profile(hw))
        except Unsupported as error:
            reason = Reason(error.code, f"unsupported by the {choice} template: {error}")
        except ImportError as error:
            raise GraphError(f"group {group.name}: the {choice} template needs what this install lacks "
                             f"({error})") from error
        else:
            if kernel is not None:
                return kernel
            reason = Reason(Code.NO_KERNEL, f"the {choice} template made no kernel for it")
    if reasons is not None:
        reasons[group.name] = reason
    return None


def groups_through_pytorch(plan: FusionPlan) -> dict[str, Reason]:
    """{group name: why} for every group that launches work but gets no opfuse kernel, found by lowering the plan
    (`lowered_outcome`): the compiled model runs those groups' nodes one by one through PyTorch."""
    return lowered_outcome(plan)[0]


def lowered_outcome(plan: FusionPlan) -> tuple[dict[str, Reason], dict[str, str]]:
    """The plan lowered on PyTorch's meta device (nothing runs, compiles or copies weights: the templates make the
    same choices there as on the GPU): (`groups_through_pytorch`, `library_calls` of its kernels)."""
    kernels, reasons = lower_plan(plan, "meta")
    through = {group.name: reasons[group.name] for group in plan.groups if group.launches and group.name in reasons}
    return through, library_calls(kernels)


def library_calls(kernels: Mapping[str, GroupKernel]) -> dict[str, str]:
    """{group name: what it runs, in words} for the kernels whose every form is a library call (an sdpa the attention
    template cannot tile runs torch's attention): a kernel of the plan, not of opfuse's making."""
    return {name: kernel.describe_library_form(kernel.configs()[0]) for name, kernel in kernels.items()
            if kernel.configs() and all(config.form == FORM_LIBRARY for config in kernel.configs())}


def plan_hardware(plan: FusionPlan) -> HardwareProfile:
    """The GPU profile a plan's kernels pick their tiles for: the one it was planned for (`kernel_profile`: under
    Triton's interpreter, its one tiny tile a template)."""
    return kernel_profile(plan.profile or get_hardware(plan.hardware))


def lower_plan(plan: FusionPlan, device: torch.device | str
               ) -> tuple[dict[str, GroupKernel], dict[str, Reason]]:
    """Lower every group for the plan's GPU: ({group name: kernel}, {group name: why it runs through PyTorch})."""
    kernels: dict[str, GroupKernel] = {}
    reasons: dict[str, Reason] = {}
    hw = plan_hardware(plan)
    config = plan.config
    # which kernels fold their row counts' alignment: those launched at both kinds (`folding_rows`)
    with folding_rows(), dependent_launches(config is not None and config.dependent_launch):
        for group in plan.groups:
            kernel = lower_group(plan.graph, group, device, reasons, hw)
            if kernel is not None:
                kernels[group.name] = kernel
    for part in planned_slots(plan):      # (`GroupKernel.stores_in_place`)
        kernel = kernels.get(plan.group_of(part).name)
        if kernel is not None:
            kernel.stores_in_place = True
    return kernels, reasons
