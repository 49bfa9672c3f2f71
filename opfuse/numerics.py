"""Numerical checks against eager: per-group (which kernel is wrong?) and end to end (is the model right?).

Errors are relative: ||out - ref|| / ||ref||, the reference computed in float32 (float64 for float32 models).
Thresholds (METHOD.md): 1e-4 for float32, 1e-3 where tf32 is used, 1e-2 for float16/bfloat16.
A result over the threshold still passes when PyTorch at the same precision is as far off (within
EAGER_ERROR_MARGIN): the computation is ill-conditioned there, and no kernel can do better than the precision it
computes in. Where PyTorch is over the threshold too, a result also passes within the threshold of its operands'
scale (`operand_scale`): an output that cancellation leaves far smaller than the values it is computed from (the
mean of a normalised row is rounding noise around zero) carries rounding errors of their size, which differ with
the order of the arithmetic by more than any margin on PyTorch's own (`acceptable`: the one rule of every check).

An explicit cast to a floating type inside the model (ONNX Cast, torch's `.float()` or `.half()`) is a statement of
precision, not of meaning: the compiled model computes it in the compute dtype (`cast_precision` retypes it), so every
reference and every run of PyTorch at the compute dtype computes it in its own precision too (`float_casts_to`), a
cast to float16 in a float32 model included: rounding there would hold the compiled model to a rounding it does not
do. Casts to integer or bool types keep their meaning everywhere, and so does a narrow model's cast to float32 of
values a choice ranks (`opfuse.passes.cast_precision.widening_casts`: a router's softmax before its topk); PyTorch at
the compute dtype still narrows that one, so its figure is the rougher of the two there.
Entry points: `check_groups`, `relative_error`, `acceptable`, `scaled_errors`, `tolerance`, `random_inputs_like`,
`reference_convolutions` and `float_casts_to` (for reference runs), `without_cudnn_search`.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode

from opfuse.ir.graph import Graph, GraphError, Node, torch_dtype
from opfuse.ir.ops import get_op, view_chain, view_source

# a result may differ from the high-precision reference by this much more than PyTorch at the same precision
# does, when both are over the tolerance (an ill-conditioned computation, not a wrong kernel)
EAGER_ERROR_MARGIN = 1.25

TOLERANCE = {"float32": 1e-4, "tf32": 1e-3, "float16": 1e-2, "bfloat16": 1e-2, "float64": 1e-10}


def tolerance(dtype: str, device: torch.device | str | None = None) -> float:
    """The relative-error bound for a model computed in `dtype`; float32 on a GPU may use tf32 (as PyTorch does:
    cuDNN convolutions by default, matmuls when the float32 matmul precision allows it)."""
    if dtype == "float32" and device is not None and torch.device(device).type == "cuda" and (
            torch.backends.cudnn.allow_tf32 or torch.get_float32_matmul_precision() != "highest"):
        return TOLERANCE["tf32"]
    return TOLERANCE[dtype]


# tl.dot's precision for float32 operands where PyTorch's settings allow tf32 (`dot_precision`): three tf32
# products (hi*hi + hi*lo + lo*hi), since Triton's single tf32 product left whole convnets 7-75x further from
# float64 than cuDNN's tf32 (RESULTS.md, run 79)
TF32_DOT = "tf32x3"


def dot_precision(conv: bool) -> str:
    """tl.dot's `input_precision` for float32 operands of a product: TF32_DOT where PyTorch's own kernel may use
    tf32 (cuDNN's switch for a convolution, the float32 matmul precision for any other product), else full float32
    ("ieee")."""
    allowed = torch.backends.cudnn.allow_tf32 if conv else torch.get_float32_matmul_precision() != "highest"
    return TF32_DOT if allowed else "ieee"


def matrix_dtype(dtype: str, conv: bool) -> str:
    """The key of `HardwareProfile.matrix_peak` for a matrix product computed in `dtype`: a float32 one runs as
    `dot_precision` says ("float32" for one tf32 product, "tf32x3", or "ieee" on the CUDA cores)."""
    if dtype != "float32":
        return dtype
    precision = dot_precision(conv)
    return "float32" if precision == "tf32" else precision


def reference_dtype(dtype: str) -> torch.dtype:
    return torch.float64 if dtype in ("float32", "float64") else torch.float32


def relative_error(out: torch.Tensor, ref: torch.Tensor, scale: float = 0.0) -> float:
    """||out - ref|| / max(||ref||, scale) in float64; NaN or Inf where the reference is finite never passes."""
    out64, ref64 = out.detach().to(torch.float64), ref.detach().to(torch.float64)
    if out64.shape != ref64.shape:
        return float("inf")
    finite = torch.isfinite(ref64)
    if not torch.equal(torch.isfinite(out64), finite):
        return float("inf")
    # NaN/Inf positions agree (same result as eager there); compare the finite part
    diff = torch.linalg.vector_norm(torch.where(finite, out64 - ref64, 0.0))
    norm = max(float(torch.linalg.vector_norm(torch.where(finite, ref64, 0.0))), scale)
    if norm == 0:
        return float(diff)
    return float(diff) / norm


def acceptable(error: float, tolerance: float, eager_error: float | None = None,
               scaled_error: float | None = None) -> bool:
    """Whether a result `error` away from the reference passes (the module docstring's rule): within `tolerance`;
    else within EAGER_ERROR_MARGIN of PyTorch's own error at the compute dtype (`eager_error`); else, where PyTorch
    is over the tolerance too, within it measured against the operands' scale (`scaled_error`). An error that is
    not finite never passes, whatever PyTorch's: infinity is within any margin of PyTorch's own infinity, so where
    both overflow the result is judged against PyTorch at the compute dtype instead (`verification`)."""
    if error <= tolerance:
        return True
    if eager_error is None or not math.isfinite(error):
        return False
    return error <= EAGER_ERROR_MARGIN * eager_error or (
        eager_error > tolerance and scaled_error is not None and scaled_error <= tolerance)


def operand_scale(graph: Graph, values: Mapping[str, torch.Tensor], name: str) -> float:
    """The norm value `name` would have at the root mean square of the floating operands of the node that computes
    it (through views), all in `values`: the size of the rounding errors it carries, where cancellation makes it
    far smaller than them. 0 for an input or a constant, and where no operand is floating."""
    node = view_source(graph, name)
    if node.op in ("input", "constant", "state"):
        return 0.0
    operands = [values[i] for i in node.inputs if values[i].is_floating_point() and values[i].numel()]
    if not operands:
        return 0.0
    rms = max(float(torch.linalg.vector_norm(v.to(torch.float64))) / math.sqrt(v.numel()) for v in operands)
    return rms * math.sqrt(values[name].numel())


def scaled_errors(graph: Graph, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor], dtype: str
                  ) -> list[float]:
    """The relative error of each of `outputs` (the graph's outputs, in order, computed from `inputs` in `dtype`)
    against the reference, measured against its operands' scale where that is the larger (`operand_scale`)."""
    values = interpret_all(graph, inputs, reference_dtype(dtype))
    return [relative_error(out, values[name], operand_scale(graph, values, name))
            for out, name in zip(outputs, graph.outputs)]


def random_inputs_like(examples: Sequence[torch.Tensor], seed: int = 1234) -> list[torch.Tensor]:
    """Fresh random inputs shaped like the examples (never zeros): floats ~N(0,1), and integers drawn from the
    example's own values, each element as likely: an index stays in range, a sentinel (an ignore index of -100, a
    label past the classes that a loss masks) stays one, and a divisor the example holds no 0 in gets none."""
    generator = torch.Generator().manual_seed(seed)
    fresh = []
    for x in examples:
        if x.is_floating_point():
            value = torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.dtype)
        elif x.dtype == torch.bool:
            value = torch.rand(x.shape, generator=generator) < 0.5
        elif not x.numel():
            value = torch.zeros(x.shape, dtype=x.dtype)
        else:
            flat = x.detach().reshape(-1).cpu()
            value = flat[torch.randint(0, flat.numel(), x.shape, generator=generator)]
        fresh.append(value.to(x.device))
    return fresh


@contextlib.contextmanager
def cudnn_setting(name: str, value: bool) -> Iterator[None]:
    """Inside, `torch.backends.cudnn.<name>` is `value`; the setting before is restored after."""
    saved = getattr(torch.backends.cudnn, name)
    setattr(torch.backends.cudnn, name, value)
    try:
        yield
    finally:
        setattr(torch.backends.cudnn, name, saved)


def without_cudnn_search() -> contextlib.AbstractContextManager:
    """Inside, cuDNN picks convolution algorithms by its heuristics, not by timing them (`cudnn.benchmark`, the
    benchmarks' setting, restored after): a run that meets each convolution shape once would spend longer timing
    algorithms than running them."""
    return cudnn_setting("benchmark", False)


CONVOLUTIONS = frozenset({torch.conv1d, torch.conv2d, torch.conv3d})


def library_grouped(args: Sequence, kwargs: Mapping) -> bool:
    """Whether a convolution call (`torch.conv2d`'s arguments) is grouped but not depthwise: PyTorch's own kernels
    would run it group by group and, on a GPU, image by image."""
    x = args[0] if args else kwargs["input"]
    weight = args[1] if len(args) > 1 else kwargs["weight"]    # by keyword too (transformers' conv1d fallback)
    groups = kwargs.get("groups", args[6] if len(args) > 6 else 1)
    return groups > 1 and groups != x.shape[-weight.dim() + 1]


class _ReferenceConvolutions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in CONVOLUTIONS or library_grouped(args, kwargs):
            return func(*args, **kwargs)
        with cudnn_setting("enabled", False):
            return func(*args, **kwargs)


@contextlib.contextmanager
def reference_convolutions() -> Iterator[None]:
    """Inside, convolutions run through PyTorch's own kernels, not cuDNN, but those grouped and not depthwise
    (`library_grouped`), which cuDNN runs by its heuristics (`without_cudnn_search`). For reference runs: each
    meets every convolution shape once, in a precision nothing else runs, where cuDNN's first call of a shape costs
    far more than the run itself (a depthwise shape in float32: seconds, RESULTS.md run 95), and cuDNN computes
    float32 convolutions in TF32 by default, a coarser reference than PyTorch's float32 GEMMs."""
    with without_cudnn_search(), _ReferenceConvolutions():
        yield


class _FloatCastsTo(TorchFunctionMode):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FLOAT_CONVERSIONS:
            return args[0].to(self.dtype)
        if func not in DTYPE_VIEWS:     # a view as another dtype reinterprets bits: no precision to change
            args = tuple(self._in_own_precision(a) for a in args)
            kwargs = {key: self._in_own_precision(value) for key, value in kwargs.items()}
        return func(*args, **kwargs)

    def _in_own_precision(self, value):
        return self.dtype if isinstance(value, torch.dtype) and value.is_floating_point else value


FLOAT_CONVERSIONS = frozenset({torch.Tensor.half, torch.Tensor.float, torch.Tensor.double, torch.Tensor.bfloat16})
DTYPE_VIEWS = frozenset({torch.Tensor.view, torch.ops.aten.view.dtype})


@contextlib.contextmanager
def float_casts_to(dtype: torch.dtype) -> Iterator[None]:
    """Inside, every floating dtype a PyTorch call names (`x.to(torch.float16)`, `x.float()`, `dtype=` of a factory
    or a softmax, ONNX Cast through the op registry) is `dtype`: a model run in `dtype` stays in it (the module
    docstring's rule on casts), where a cast as written would hand a float64 reference's MatMul a float32 operand."""
    with _FloatCastsTo(dtype):
        yield


def interpret_all(graph: Graph, inputs: Sequence[torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every node's value, computed through the op references with floating values in `dtype` (convolutions
    without cuDNN: `reference_convolutions`)."""
    with reference_convolutions():
        return _interpret_all(graph, inputs, dtype)


def _interpret_all(graph: Graph, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
                   after_node: Callable[[Node], None] | None = None) -> dict[str, torch.Tensor]:
    """`interpret_all` under whatever convolution settings are in force; `after_node` is called with each node
    (but the inputs) once its value is computed (benchmarks/reference_time.py times the ops so)."""
    values: dict[str, torch.Tensor] = {}
    for node in _reference_values(graph, inputs, dtype, values):
        if after_node is not None and node.op != "input":
            after_node(node)
    return values


def _reference_values(graph: Graph, inputs: Sequence[torch.Tensor], dtype: torch.dtype,
                      values: dict[str, torch.Tensor]) -> Iterator[Node]:
    """Compute every node's reference value into `values` in graph order, yielding each node once its value is
    there (the caller may drop values it no longer needs)."""
    device = inputs[0].device if inputs else torch.device("cpu")
    for node, x in zip(graph.input_nodes, inputs):
        values[node.name] = x.to(dtype) if x.is_floating_point() else x
    for node in graph:
        if node.op in ("constant", "state"):
            tensor = graph.constants[node.name].to(device)
            values[node.name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
        elif node.op != "input":
            attrs = dict(node.attrs)
            if node.op == "cast" and torch_dtype(attrs["dtype"]).is_floating_point:
                attrs["dtype"] = str(dtype).removeprefix("torch.")   # keep the reference in its own precision
            try:
                values[node.name] = get_op(node.op).run([values[i] for i in node.inputs], attrs)
            except Exception as error:
                raise GraphError(f"reference run of node {node.describe()} failed: {error}") from error
        yield node


CHOOSING = ("topk",)     # ops whose output depends on which of their input's values is larger


def near_ties(graph: Graph, inputs: Sequence[torch.Tensor], dtype: str) -> list[str]:
    """The choices (`CHOOSING`) whose reference input holds a near-tie at their cut: along the dim, the k-th and the
    (k+1)-th largest (smallest) values closer than `dtype`'s resolution (its eps) times the row's largest magnitude,
    where any run in `dtype` may choose the other element. Each as "node (a gap of ... of its row's scale)"."""
    resolution = torch.finfo(torch_dtype(dtype)).eps
    found = []
    values: dict[str, torch.Tensor] = {}
    for node in _reference_values(graph, inputs, reference_dtype(dtype), values):
        if node.op not in CHOOSING or not values[node.inputs[0]].is_floating_point():
            continue
        x, k, dim = values[node.inputs[0]], node.attrs["k"], node.attrs["dim"]
        if k >= x.shape[dim]:
            continue
        ranked = torch.topk(x, k + 1, dim, node.attrs["largest"]).values
        gap = (ranked.narrow(dim, k - 1, 1) - ranked.narrow(dim, k, 1)).abs()
        scale = x.abs().amax(dim, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
        worst = float((gap / scale).min())
        if worst < resolution:
            found.append(f"{node.describe()} (a gap of {worst:.1e} of its row's scale)")
    return found


def check_needs(graph: Graph, group) -> set[str]:
    """The reference values a group's check reads: its nodes and outputs, every operand of its nodes (its inputs;
    PyTorch at the compute dtype recomputes the nodes from them for an error over the tolerance), and what
    `operand_scale` reads behind each output's views."""
    names = set(group.nodes) | set(group.outputs)
    for name in group.nodes:
        names.update(graph[name].inputs)
    for name in group.outputs:
        source = view_source(graph, name)
        names.update(view_chain(graph, name), [source.name], source.inputs)
    return names


@dataclass(frozen=True)
class ReferenceSchedule:
    """When, walking the graph in order, each check can run and each reference value can go: `ready[i]`, the checks
    whose values are all computed once node i is; `free[i]`, the values nothing reads after node i (neither a later
    node, a later check, nor a view of them that is still needed)."""

    ready: dict[int, list[str]]
    free: dict[int, list[str]]


def reference_schedule(graph: Graph, needs: Mapping[str, set[str]]) -> ReferenceSchedule:
    """The schedule of checks that read `needs` (check name -> value names) over `graph`'s reference run."""
    position = {node.name: i for i, node in enumerate(graph)}
    last = dict(position)
    for node in graph:
        for name in node.inputs:
            last[name] = max(last[name], position[node.name])
    ready: dict[int, list[str]] = {}
    for check, names in needs.items():
        at = max((position[n] for n in names if n in position), default=0)
        ready.setdefault(at, []).append(check)
        for name in names:
            if name in last:
                last[name] = max(last[name], at)
    for node in reversed(list(graph)):      # a view keeps its source's memory alive
        if get_op(node.op).alias and node.inputs:
            last[node.inputs[0]] = max(last[node.inputs[0]], last[node.name])
    free: dict[int, list[str]] = {}
    for name, at in last.items():
        free.setdefault(at, []).append(name)
    return ReferenceSchedule(ready, free)


def reference_peak(graph: Graph, needs: Mapping[str, set[str]], size: Callable[[Node], int]) -> int:
    """The most the reference values live at once take when the checks reading `needs` run as soon as they can and
    each value goes once nothing reads it (`reference_schedule`); `size(node)` is what its value holds."""
    schedule = reference_schedule(graph, needs)
    live = peak = 0
    for i, node in enumerate(graph):
        live += size(node)
        peak = max(peak, live)
        live -= sum(size(graph[name]) for name in schedule.free.get(i, ()))
    return peak


@dataclass(frozen=True)
class Layout:
    """Where a tensor's elements sit in its storage, and their dtype: what a Triton kernel is specialised on besides
    its sizes (strides divisible by 16, pointers aligned to 16 bytes), so that a kernel checked on values laid out
    otherwise than the model hands them would be compiled again, and another specialisation checked."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    storage: int            # elements of the storage the tensor views
    dtype: torch.dtype

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Layout":
        return cls(tuple(tensor.shape), tuple(tensor.stride()), tensor.storage_offset(),
                   tensor.untyped_storage().nbytes() // tensor.element_size(), tensor.dtype)

    def overlaps(self) -> bool:
        """Whether two of its indices address one element (a broadcast view, overlapping windows)."""
        span = 0        # the last element offset reachable through the dims of smaller strides
        for stride, size in sorted((st, sz) for st, sz in zip(self.stride, self.shape) if sz > 1):
            if stride <= span:
                return True
            span += stride * (size - 1)
        return False

    def holding(self, value: torch.Tensor) -> torch.Tensor:
        """`value`'s elements in a fresh tensor of this layout (one that does not overlap)."""
        base = torch.empty(self.storage, dtype=self.dtype, device=value.device)
        return base.as_strided(self.shape, self.stride, self.offset).copy_(value)


def laid_out(value: torch.Tensor, layout: Layout | None) -> torch.Tensor:
    """`value` as a kernel argument: in `layout` (the compiled model's, where known and it does not overlap), else
    4-D values channels-last (the kernels' layout for images)."""
    if layout is not None and layout.shape == tuple(value.shape) and not layout.overlaps():
        return layout.holding(value)
    return value.contiguous(memory_format=torch.channels_last) if value.dim() == 4 else value


@dataclass
class GroupCheck:
    group: str
    kernel: str
    error: float
    tolerance: float
    detail: str = ""          # the exception, where the kernel crashed
    eager_error: float | None = None   # the group's ops run by PyTorch at the compute dtype, when error > tolerance
    scaled_error: float | None = None  # the error against the operands' scale, when PyTorch is over it too

    @property
    def passed(self) -> bool:
        return acceptable(self.error, self.tolerance, self.eager_error, self.scaled_error)


def check_groups(graph: Graph, kernels: Mapping[str, object], inputs: Sequence[torch.Tensor],
                 dtype: str, configs: Mapping[str, object] | None = None,
                 on_kernel: Callable[[str], None] | None = None,
                 layouts: Mapping[str, Layout] | None = None) -> list[GroupCheck]:
    """Run each kernel on reference inputs, each laid out as `layouts` says (the compiled model's values, by name:
    `laid_out`), and compare its outputs with the reference values of the same nodes; `on_kernel(name)` is called
    before each kernel runs (progress). The reference run keeps a value only while a later node or check reads it:
    each kernel is checked as soon as the values it needs are computed (`reference_schedule`), so the reference holds
    about what an eager run at the reference dtype holds, not every value of the graph at once."""
    compute = torch_dtype(dtype)
    bound = tolerance(dtype, inputs[0].device if inputs else None)
    schedule = reference_schedule(graph, {name: check_needs(graph, kernel.group) | set(kernel.runtime_inputs)
                                          for name, kernel in kernels.items()})
    checks: dict[str, GroupCheck] = {}
    reference: dict[str, torch.Tensor] = {}
    values = _reference_values(graph, inputs, reference_dtype(dtype), reference)
    for i in range(len(graph)):
        with reference_convolutions():      # the reference's convolutions only: the kernels run as compiled
            next(values)
        for name in schedule.ready.get(i, ()):
            kernel = kernels[name]
            if on_kernel is not None:
                on_kernel(kernel.name)
            checks[name] = _check_kernel(graph, name, kernel, reference, compute, dtype, bound,
                                         (configs or {}).get(name), layouts)
        for value in schedule.free.get(i, ()):
            reference.pop(value, None)
    return [checks[name] for name in kernels]


def _check_kernel(graph: Graph, name: str, kernel, reference: Mapping[str, torch.Tensor], compute: torch.dtype,
                  dtype: str, bound: float, config, layouts: Mapping[str, Layout] | None) -> GroupCheck:
    """One kernel's check against the reference values (`check_groups`)."""
    args = []
    for value_name in kernel.runtime_inputs:
        value = reference[value_name]
        value = value.to(compute) if value.is_floating_point() else value
        args.append(laid_out(value, (layouts or {}).get(value_name)))
    detail, outputs = "", []
    try:
        outputs = kernel.run(args, config)
        if len(outputs) != len(kernel.group.outputs):   # zip would check only some of them
            raise GraphError(f"returned {len(outputs)} outputs, the group has {len(kernel.group.outputs)}")
        error = max(relative_error(out, reference[o]) for out, o in zip(outputs, kernel.group.outputs))
    except Exception as crash:  # a kernel that crashes is as wrong as one that miscomputes: record why
        error, detail = float("inf"), f"{type(crash).__name__}: {crash}"
    check = GroupCheck(name, kernel.name, error, bound, detail)
    if bound < error < float("inf"):
        try:
            check.eager_error = _eager_group_error(graph, kernel.group, reference, compute)
        except Exception:   # no PyTorch figure to compare with: the check stands as measured
            pass
        if check.eager_error is not None and check.eager_error > bound:
            check.scaled_error = max(relative_error(out, reference[o], operand_scale(graph, reference, o))
                                     for out, o in zip(outputs, kernel.group.outputs))
        if check.passed:
            check.detail = (f"ill-conditioned: PyTorch in {dtype} differs from the reference by "
                            f"{check.eager_error:.2e} too")
    return check


def _eager_group_error(graph: Graph, group, reference: Mapping[str, torch.Tensor], compute: torch.dtype) -> float:
    """Relative error of the group's outputs when PyTorch computes its nodes at the compute dtype from the same
    (rounded) inputs the kernel got: what the kernel's error is to be compared with."""
    values: dict[str, torch.Tensor] = {}

    def value(name: str) -> torch.Tensor:
        if name not in values:
            tensor = reference[name]
            values[name] = tensor.to(compute) if tensor.is_floating_point() else tensor
        return values[name]

    for name in group.nodes:
        node = graph[name]
        if node.op in ("input", "constant", "state"):
            continue
        attrs = dict(node.attrs)
        if node.op == "cast" and torch_dtype(attrs["dtype"]).is_floating_point:
            attrs["dtype"] = str(compute).removeprefix("torch.")
        values[name] = get_op(node.op).run([value(i) for i in node.inputs], attrs)
    return max(relative_error(values[o], reference[o]) for o in group.outputs)
