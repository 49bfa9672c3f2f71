"""Why a fusion was taken or refused, and why a group runs through PyTorch: `Reason(code, text)`.

The text is for people and may change; the code is stable, for tests and tools (inductor's `WhyNoFuse` keeps a
reason beside each refusal in the same spirit). A `FusionDecision` carries both (`code`, `reason`), so does every
value of `Analysis.pytorch_groups` and of a compiled model's `fallbacks`; `opfuse analyze --json` and the report
write them as `"code"` next to `"reason"`. The codes, and what each means:

Fusions taken (verdict fused):
  fused                 the pair is legal, fits the hardware and the cost model predicts it faster (or is off)
  whole-block           a depthwise + pointwise pair that does not pay alone, taken as a step to the whole inverted
                        residual, which the cost model predicts faster than the three convolutions apart

Fusions refused as illegal (`opfuse.fusion.legality.can_fuse`, and the planner's views and siblings):
  opaque                an opaque op would be in the kernel: it runs through PyTorch
  alone                 an op that runs alone in a kernel of its own would be in the kernel (a grouped GEMM, a
                        topk or sort: `opfuse.ir.ops.OpDef.kernel`)
  copying-op            an injective op that copies (gather, pad, ...) stays its own kernel
  cat-with-hub          a cat joins elementwise chains only, not the kernel of an anchor or a reduction
  view-in-anchor        a view would join an anchor's kernel, whose template maps no views
  view-drops-elements   a view that drops or repeats elements (slice, expand) would join a kernel
  view-after-reduction  a view would map a reduction's result in its epilogue, which the template writes at the
                        reduction's own coordinates or a reshape of them only (no permute, slice or expand)
  view-shared           a view between the pair is read outside it too (or is a graph output)
  several-users         a value passed from producer to consumer is read outside the pair too
  no-shared-value       the consumer reads no value of the producer
  cycle                 a node outside the pair reads one side and feeds the other
  disabled              a FusionConfig switch turns this fusion off (residual, conv_conv, conv_conv_expand,
                        squeeze; the text names it)
  anchor-prologue       an op would run before an anchor in its kernel that takes no such prologue (a linear or a
                        1x1 conv takes elementwise ops that read nothing else of full size)
  anchor-and-reduction  an anchor and a reduction in one kernel
  two-reductions        two reductions in one kernel
  not-elementwise       an op beside the group's anchor or reduction is not elementwise
  side-branch           an op would reach the hub's epilogue from a branch neither before nor after the hub
  broadcast-growth      an op of the kernel has more elements than the value it reads (it would recompute)
  output-size           the values the kernel writes differ in size (it iterates over the largest)
  two-anchors           anchors that form no conv-conv chain: not all convolutions, more than three, or one does
                        not feed the next
  conv-shape            convolutions that chain but are not [1x1 ->] depthwise -> 1x1 (stride 1, no padding)
  expand-alone          a 1x1 expansion conv joins a depthwise conv only together with its pointwise conv
  inner-read            a value inside a conv-conv chain (which stays in registers) is read outside its stage
  inner-operand         a conv-conv chain reads a weight that is no constant, or an inner stage an operand that
                        is no per-channel constant
  not-squeeze           a global average pool and the two small GEMMs after it are no squeeze-and-excitation
                        chain (`opfuse.fusion.squeeze`: the text says which part is not)
  different-epilogues   sibling anchors whose epilogues differ (horizontal fusion)
  sibling-operand       a sibling's epilogue reads an activation: concatenated siblings take constants only
  dependent             groups fused side by side (horizontal) depend on one another
  library-anchor        an anchor no template tiles runs as a library call alone (an sdpa of head dims over the
                        attention template's: torch's attention), so it takes no epilogue

Fusions refused for the hardware (verdict over budget) or the cost (verdict unprofitable):
  over-budget           the resource model says the fused kernel needs more registers or shared memory than
                        the hardware has
  split-back            the compiled kernel of these nodes failed the resource check on the GPU (every config
                        spilled), so the plan keeps them apart
  unprofitable          the cost model predicts the fused kernel no faster than the two apart

A group's code (`FusionGroup.code`): fused for a merged group, the code of the first refusal a lone node met, or
  no-candidate          a lone node no fusion was ever considered for
  in-place              a cat whose parts their producers' kernels store into its slices: no kernel
                        (`opfuse.fusion.concat_in_place`)
  view-copy             views PyTorch would copy (a reshape of a permuted tensor) that no neighbour reads through:
                        one copy kernel of the elementwise template, reading through their index map

Groups that run through PyTorch (`opfuse.codegen.lower.choose_lowering`, `lower_group`, `opfuse.compile`):
  opaque, copying-op    as above: the op has no kernel of opfuse's
  view                  a view: metadata only, nothing to launch
  no-template           no Triton template covers the group's anchor op or its mix of ops
  Refused by the group's template (`opfuse.codegen.lower.template_refusal`: its `supports`, before any source is
  generated; the planner asks it before each merge, so a plan holds such a group only where a node alone is one):
  several-anchors       anchors the template does not put in one kernel (siblings of other inputs, ops or
                        geometries; several attention anchors)
  not-constant          a weight, bias or per-channel parameter the template needs as a constant is computed
  operand-dtype         a dtype the template does not compute in (operands of different dtypes, wide integers)
  operand-shape         operands the template does not tile (a 1-D matmul operand, a pooling of other rank,
                        head dims that differ)
  epilogue-form         ops around the anchor or reduction that the template cannot place (an op that does not
                        follow the anchor, sibling epilogues that differ, a norm without whole rows)
  unsupported           the template refused the group while generating it (`Unsupported`; the text says why)
  no-kernel             no kernel was built for the group
  failed-verification   its kernel failed the check against the group's reference values, so it was dropped
  eager-call            a call the compiled model could not run was run eagerly (fallback="eager")
  not-compiled          compiling failed, so the whole model runs eagerly (fallback="eager")
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Code(str, Enum):
    """The stable codes of `Reason` (their meanings: the module docstring)."""

    FUSED = "fused"
    WHOLE_BLOCK = "whole-block"

    OPAQUE = "opaque"
    ALONE = "alone"
    COPYING_OP = "copying-op"
    CAT_WITH_HUB = "cat-with-hub"
    VIEW_IN_ANCHOR = "view-in-anchor"
    VIEW_DROPS_ELEMENTS = "view-drops-elements"
    VIEW_AFTER_REDUCTION = "view-after-reduction"
    VIEW_SHARED = "view-shared"
    SEVERAL_USERS = "several-users"
    NO_SHARED_VALUE = "no-shared-value"
    CYCLE = "cycle"
    DISABLED = "disabled"
    ANCHOR_PROLOGUE = "anchor-prologue"
    ANCHOR_AND_REDUCTION = "anchor-and-reduction"
    TWO_REDUCTIONS = "two-reductions"
    NOT_ELEMENTWISE = "not-elementwise"
    SIDE_BRANCH = "side-branch"
    BROADCAST_GROWTH = "broadcast-growth"
    OUTPUT_SIZE = "output-size"
    TWO_ANCHORS = "two-anchors"
    CONV_SHAPE = "conv-shape"
    EXPAND_ALONE = "expand-alone"
    INNER_READ = "inner-read"
    INNER_OPERAND = "inner-operand"
    NOT_SQUEEZE = "not-squeeze"
    DIFFERENT_EPILOGUES = "different-epilogues"
    SIBLING_OPERAND = "sibling-operand"
    DEPENDENT = "dependent"
    LIBRARY_ANCHOR = "library-anchor"

    OVER_BUDGET = "over-budget"
    SPLIT_BACK = "split-back"
    UNPROFITABLE = "unprofitable"

    VIEW = "view"
    VIEW_COPY = "view-copy"
    IN_PLACE = "in-place"
    NO_TEMPLATE = "no-template"
    SEVERAL_ANCHORS = "several-anchors"
    NOT_CONSTANT = "not-constant"
    OPERAND_DTYPE = "operand-dtype"
    OPERAND_SHAPE = "operand-shape"
    EPILOGUE_FORM = "epilogue-form"
    UNSUPPORTED = "unsupported"
    NO_CANDIDATE = "no-candidate"
    NO_KERNEL = "no-kernel"
    FAILED_VERIFICATION = "failed-verification"
    EAGER_CALL = "eager-call"
    NOT_COMPILED = "not-compiled"


@dataclass(frozen=True)
class Reason:
    """A code from `Code` (a member or its value: "several-users") and the words that explain it."""

    code: Code
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "code", Code(self.code))    # an unknown code fails here, naming itself

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Reason({self.code.value!r}, {self.text!r})"

    def to_dict(self) -> dict[str, Any]:
        """As the JSON outputs write it: {"code": ..., "reason": ...}."""
        return {"code": self.code.value, "reason": self.text}
