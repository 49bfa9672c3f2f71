"""Shapes that vary: one compile serving a range of sizes per dynamic dim (`opfuse.compile(..., dynamic_shapes=)`).

`dynamic_shapes` is spelled as torch.export spells it: per input (a tuple in the inputs' order, or a dict by the
forward's argument names), None for an input of fixed shape, or {dim: torch.export.Dim("seq", min=1, max=512)};
inputs that share a Dim object share its size. A Dim without a max is unbounded.

Each dynamic dim's range is cut into buckets: the powers of two inside it, and its max (`bucket_sizes`: 1..64 gives
1, 2, 4, 8, 16, 32, 64); `FusionConfig.bucket_steps` puts more between each two (2: 1, 2, 3, 4, 6, 8, 16, 24, ...), a
compile each, for less padding. A call's size along each dim picks the smallest bucket that holds it, and the bucket's
model, compiled and tuned at the bucket's sizes (its kernels, tiles and CUDA graph its own), runs the call:
- at exactly the bucket's sizes, as is;
- at smaller sizes, padded up to the bucket's (the inputs' last slice repeated along each padded dim) and the outputs
  cut back, only where padding cannot change a result: the plan's graph computes every output row along that dim
  from the same row of the inputs, and each output holds that dim whole (`opfuse.ir.rows.value_rows`; a softmax
  over the batch, attention over a padded key sequence or a reshape merging the dim with another refuse it); or,
  where rows interact, the positions a padded sequence adds at its end are never read by the real ones
  (`opfuse.ir.seq_padding`, checked against the model traced one position shorter): a causal model, or attention
  under a mask that an input padded with zeros masks (an attention mask: `Bucket.zero_filled` names it);
- otherwise at its exact sizes, compiled once per distinct sizes (`DynamicModel.buckets` lists them, and why).
A bucket's model is compiled at its first call (`compile_buckets` compiles them up front). Sizes outside a dim's
range, inputs that disagree on a shared dim, and a fixed dim that differs from the example's are one-line errors
naming the input and the range; nothing is ever computed at other sizes silently.

The kernels of one bucket are specialised to its sizes: a size between buckets costs the padding of its bucket, and
each bucket its own compile (run-time sizes in the kernels would let one compile serve every bucket: not done).
"""

from __future__ import annotations

import inspect
import math
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import torch

from opfuse.config import FusionConfig
from opfuse.ir.graph import Graph, GraphError


@dataclass(frozen=True)
class DynamicDim:
    """One dynamic dimension: its name, its range (`max` None: unbounded), and where it lies among the inputs
    ((input index, dim) pairs)."""

    name: str
    min: int
    max: int | None
    uses: tuple[tuple[int, int], ...]

    def describe(self) -> str:
        return f"{self.name} in [{self.min}, {'inf' if self.max is None else self.max}]"


def bucket_sizes(dim: DynamicDim, up_to: int | None = None, steps: int = 1) -> list[int]:
    """The bucket sizes of `dim`, smallest first: its powers of two, with `steps` - 1 more between each two (evenly on
    a log scale, rounded up, past BUCKET_ALIGNMENT to a multiple of it: 2 steps give 1, 2, 3, 4, 6, 8, 16, 24, 32,
    48, ...), inside its range, and its max (an unbounded dim's up to the first at or past `up_to`)."""
    limit = dim.max if dim.max is not None else max(up_to or dim.min, dim.min)
    sizes: list[int] = []
    for size in _ladder(steps):
        if size >= limit:
            sizes.append(limit if dim.max is not None else size)
            return sizes
        if size >= dim.min:
            sizes.append(size)
    raise AssertionError("the ladder of bucket sizes is endless")


BUCKET_ALIGNMENT = 8   # bucket sizes past it are multiples of it (`_ladder`)


def _ladder(steps: int):
    """1, then ceil(2 ** (k + i / steps)) for k = 0, 1, ... and i < steps, each once, increasing; past
    BUCKET_ALIGNMENT rounded up to a multiple of it: a sequence of 431 keys (16-byte rows of fp16 broken) sends
    PyTorch's attention to a path 1.7x slower than at 432 (RESULTS.md, session 32)."""
    if steps < 1:
        raise ValueError(f"bucket steps must be at least 1, got {steps}")
    last, octave = 0, 0
    while True:
        for i in range(steps):
            size = math.ceil(2 ** (octave + i / steps) - 1e-9)
            if size > BUCKET_ALIGNMENT:
                size = -(-size // BUCKET_ALIGNMENT) * BUCKET_ALIGNMENT
            if size > last:
                last = size
                yield size
        octave += 1


def bucket_of(dim: DynamicDim, size: int, steps: int = 1) -> int:
    """The smallest bucket size of `dim` that holds `size`."""
    return next(b for b in bucket_sizes(dim, size, steps) if b >= size)


def parse_dynamic_shapes(dynamic_shapes: Any, example_inputs: Sequence[torch.Tensor],
                         forward: Callable[..., Any] | None = None, names: Sequence[str] | None = None
                         ) -> list[DynamicDim]:
    """The dynamic dims `dynamic_shapes` declares (module docstring) for these example inputs (a list of DynamicDims
    as is: the dynamo backend's); GraphError naming the input where it is not something this reads, or where an
    example lies outside a range."""
    if isinstance(dynamic_shapes, list) and all(isinstance(d, DynamicDim) for d in dynamic_shapes):
        return dynamic_shapes
    per_input = _per_input(dynamic_shapes, len(example_inputs), forward, names)
    found: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for index, spec in enumerate(per_input):
        if spec is None:
            continue
        if isinstance(spec, (list, tuple)):
            spec = dict(enumerate(spec))
        if not isinstance(spec, Mapping):
            raise GraphError(f"dynamic_shapes of input {index}: expected None or {{dim: Dim}}, got "
                             f"{type(spec).__name__}")
        rank = example_inputs[index].dim()
        for dim, declared in spec.items():
            if declared is None:
                continue
            if not isinstance(dim, int) or not -rank <= dim < rank:
                raise GraphError(f"dynamic_shapes of input {index}: no dim {dim!r} in a {rank}-d input")
            if not hasattr(declared, "__name__") or not hasattr(declared, "min"):
                raise GraphError(f"dynamic_shapes of input {index}, dim {dim}: expected a torch.export.Dim with a "
                                 f"name and a range, got {declared!r}")
            found.setdefault(id(declared), (declared, []))[1].append((index, dim % rank))
    dims = []
    for declared, uses in found.values():
        low = max(1, int(declared.min))
        high = None if declared.max is None or declared.max >= sys.maxsize or \
            type(declared.max).__name__ != "int" else int(declared.max)
        if high is not None and high < low:
            raise GraphError(f"dynamic dim {declared.__name__}: max {high} is below min {low}")
        dim = DynamicDim(declared.__name__, low, high, tuple(uses))
        for index, axis in uses:
            size = example_inputs[index].shape[axis]
            if size < dim.min or (dim.max is not None and size > dim.max):
                raise GraphError(f"example input {index} has {size} along dim {axis}, outside {dim.describe()}")
        dims.append(dim)
    return dims


def _per_input(dynamic_shapes: Any, count: int, forward: Callable[..., Any] | None,
               names: Sequence[str] | None = None) -> list[Any]:
    """One spec per input: `dynamic_shapes` as a sequence, or a dict by the inputs' `names` (by default the
    forward's arguments)."""
    if isinstance(dynamic_shapes, Mapping):
        what = "the model's inputs" if names is not None else f"the forward's first {count} arguments"
        names = list(names) if names is not None else \
            list(inspect.signature(forward).parameters) if forward is not None else []
        unknown = [key for key in dynamic_shapes if key not in names[:count]]
        if unknown:
            raise GraphError(f"dynamic_shapes names {unknown[0]!r}, which is not one of {what} "
                             f"({', '.join(names[:count])})")
        return [dynamic_shapes.get(name) for name in names[:count]]
    if isinstance(dynamic_shapes, (list, tuple)) and len(dynamic_shapes) == count:
        return list(dynamic_shapes)
    raise GraphError(f"dynamic_shapes must give one entry per input ({count}), as a tuple or a dict by argument "
                     f"name, got {type(dynamic_shapes).__name__}")


# ---- a call's sizes, padding and cutting ---------------------------------------------------------------------------

@dataclass(frozen=True)
class InputKind:
    """What an input of a dynamic model must be: its dtype, device and rank, and its size along each fixed dim (an
    example's shape: the dynamic dims' sizes in it are not checked)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, x: torch.Tensor) -> "InputKind":
        return cls(tuple(x.shape), x.dtype, x.device)

    def describe(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{','.join(map(str, self.shape))}] on {self.device}"


def call_sizes(dims: Sequence[DynamicDim], inputs: Sequence[Any], expected: Sequence[torch.Tensor | InputKind],
               names: Sequence[str] = ()) -> tuple[int, ...]:
    """Each dynamic dim's size in this call, after checking the call: as many tensor inputs as `expected` (example
    tensors, or InputKinds), of their dtypes, devices, ranks and fixed sizes, sharing each dim's size, inside each
    range (GraphError naming the input: its position, and its name where `names` has it)."""
    def label(index: int) -> str:
        return f"input {index} ({names[index]})" if index < len(names) else f"input {index}"

    kinds = [e if isinstance(e, InputKind) else InputKind.of(e) for e in expected]
    if len(inputs) != len(kinds):
        raise GraphError(f"the model takes {len(kinds)} inputs, got {len(inputs)}")
    dynamic = {use: dim for dim in dims for use in dim.uses}
    sizes = []
    for index, (x, kind) in enumerate(zip(inputs, kinds)):
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"{label(index)} must be a tensor, got {type(x).__name__}")
        if x.dim() != len(kind.shape) or x.dtype != kind.dtype or x.device != kind.device:
            raise GraphError(f"{label(index)} is {_describe(x)}, the model takes {kind.describe()}-like inputs")
        for axis, (got, want) in enumerate(zip(x.shape, kind.shape)):
            if (index, axis) not in dynamic and got != want:
                varying = ", ".join(f"{dim.name} ({label(i)} dim {a})" for dim in dims for i, a in dim.uses)
                raise GraphError(f"{label(index)} has {got} along dim {axis}, which is fixed at {want}: only "
                                 f"{varying or 'nothing'} may vary")
    for dim in dims:
        seen = {(index, axis): inputs[index].shape[axis] for index, axis in dim.uses}
        size = next(iter(seen.values()))
        if len(set(seen.values())) > 1:
            raise GraphError(f"inputs disagree on dynamic dim {dim.name}: "
                             + ", ".join(f"{label(i)} dim {a} is {s}" for (i, a), s in seen.items()))
        if size < dim.min or (dim.max is not None and size > dim.max):
            index, axis = dim.uses[0]
            raise GraphError(f"{label(index)} has {size} along dim {axis}, outside {dim.describe()}")
        sizes.append(size)
    return tuple(sizes)


def _describe(x: torch.Tensor) -> str:
    return f"{str(x.dtype).removeprefix('torch.')}[{','.join(map(str, x.shape))}] on {x.device}"


def _input_names(model: Any, count: int) -> list[str]:
    """The names of a module's `count` call inputs: its forward's parameters (none where its signature does not list
    them one by one, nor for an ONNX model, whose names its caller gives)."""
    if not isinstance(model, torch.nn.Module):
        return []
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return []
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in parameters[:count]):
        return []
    return [p.name for p in parameters[:count]]


def pad_inputs(inputs: Sequence[torch.Tensor], dims: Sequence[DynamicDim], sizes: Sequence[int],
               targets: Sequence[int], zero_filled: Mapping[str, Sequence[int]] | None = None) -> list[torch.Tensor]:
    """The inputs grown along each dynamic dim from its size to its target, repeating their last slice (real values:
    a padded row is never degenerate, as zeros would be for a mask or a normalisation), or with zeros for the inputs
    `zero_filled` names by dim (an attention mask, whose zeros mask the padded keys)."""
    padded = list(inputs)
    for dim, size, target in zip(dims, sizes, targets):
        if target == size:
            continue
        for index, axis in dim.uses:
            x = padded[index]
            shape = list(x.shape)
            shape[axis] = target - size
            tail = x.new_zeros(shape) if index in (zero_filled or {}).get(dim.name, ()) else \
                x.narrow(axis, size - 1, 1).expand(shape)
            padded[index] = torch.cat([x, tail], axis)
    return padded


def padding_problem(graph: Graph, dim: DynamicDim) -> tuple[dict[str, int | None], str | None]:
    """For padding `dim`: the output dim each of `graph`'s outputs holds it in (None: an output without it, which
    is the same for every row), or why padding it could change a result (the node, and how)."""
    from opfuse.ir.rows import row_dependence, value_rows

    inputs = graph.input_nodes
    input_dims: dict[str, int | None] = {node.name: None for node in inputs}
    for index, axis in dim.uses:
        input_dims[inputs[index].name] = axis
    rows = value_rows(graph, input_dims)
    if not isinstance(rows, dict):
        return {}, _named(str(rows), dim)
    cuts = {name: (rows[name].dim if rows[name] is not None else None) for name in graph.outputs}
    problem = row_dependence(graph, input_dims, {name: (0 if cut is None else cut) for name, cut in cuts.items()})
    return cuts, None if problem is None else _named(str(problem), dim)


def _named(why: str, dim: DynamicDim) -> str:
    """The rows analysis's words (it calls the padded dim "the batch") with the dim's own name."""
    return why if dim.name == "batch" else why.replace("the batch", dim.name)


def cut_outputs(outputs: Sequence[torch.Tensor], names: Sequence[str], dims: Sequence[DynamicDim],
                sizes: Sequence[int], targets: Sequence[int], cuts: Mapping[str, Mapping[str, int | None]]
                ) -> list[torch.Tensor]:
    """The outputs (graph outputs `names`) of a run padded from `sizes` up to `targets`, cut back along the dim each
    holds each padded dynamic dim in (`cuts`: dim name -> output -> its dim, or its dims, None or () for an output
    without it)."""
    flat = list(outputs)
    for dim, size, target in zip(dims, sizes, targets):
        if size != target:
            held = cuts[dim.name]
            for position, name in enumerate(names):
                along = held.get(name)
                for axis in (() if along is None else (along,) if isinstance(along, int) else along):
                    flat[position] = flat[position].narrow(axis, 0, size)
    return flat


# ---- the model -------------------------------------------------------------------------------------------------------

@dataclass
class Padding:
    """How a call may be padded up to one compiled size (a bucket's, or a package's profile): per dynamic dim, the
    output dims a padded run is cut back along, or why it may not be padded; the inputs padded with zeros and the
    smallest size served, where the sequence pads at its end (`opfuse.ir.seq_padding`)."""

    cuts: dict[str, dict[str, Any]] = field(default_factory=dict)   # dim -> output -> the dim(s) it is cut along
    refused: dict[str, str] = field(default_factory=dict)            # dim -> why padding it is refused
    zero_filled: dict[str, tuple[int, ...]] = field(default_factory=dict)   # dim -> inputs padded with zeros
    least: dict[str, int] = field(default_factory=dict)     # dim -> the smallest size padding serves (default 1)

    def pads(self, name: str, size: int) -> bool:
        """Whether a call of `size` along dim `name` may run padded up to these sizes."""
        return name not in self.refused and size >= self.least.get(name, 1)


def padding_of(dims: Sequence[DynamicDim], sizes: Sequence[int], graph: Graph,
               end_padding: Callable[[Padding, int, str], str | None]) -> Padding:
    """How a call pads up to `sizes` on a model whose plan graph is `graph`, per dynamic dim over 1: its rows held
    apart (`padding_problem`), else its end padded where `end_padding(padding, position, how rows interact)` fills
    `padding` in (returning None) rather than saying why not. A size of 1 pads nothing."""
    padding = Padding()
    for position, (dim, size) in enumerate(zip(dims, sizes)):
        if size == 1:
            continue
        cuts, problem = padding_problem(graph, dim)
        if problem is not None:     # rows interact: perhaps not the real positions with those padded
            problem = end_padding(padding, position, problem)
        if problem is None:
            padding.cuts.setdefault(dim.name, cuts)
        else:
            padding.refused[dim.name] = problem
    return padding


@dataclass(kw_only=True)
class Bucket(Padding):
    """One compiled model of a DynamicModel: its sizes (a bucket's, or a call's exact ones), the model, how it pads
    (`Padding`), and its compile time."""

    sizes: tuple[int, ...]
    model: Any                                  # an OpfuseModule
    exact: bool                                 # compiled for a call's exact sizes (its bucket may not pad them)
    seconds: float = 0.0

    def describe(self) -> str:
        pads = "pads " + (", ".join(n + zeros_note(self.zero_filled.get(n, ())) for n in sorted(self.cuts))
                          or "nothing") if not self.exact \
            else "exact sizes"
        refusals = "".join(f"; {dim} not padded: {why}" for dim, why in self.refused.items())
        return f"{self.sizes}: {pads}{refusals} (compiled in {self.seconds:.1f} s)"


class DynamicModel(torch.nn.Module):
    """A model compiled for ranges of sizes (see the module docstring); called like the model."""

    def __init__(self, model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], config: FusionConfig,
                 dims: Sequence[DynamicDim], quiet: bool = True, names: Sequence[str] | None = None):
        super().__init__()
        from opfuse.module import eager_copy

        if not dims:
            raise GraphError("dynamic_shapes declares no dynamic dim: compile without it")
        # a plain attribute: .to()/.half() never reach it; an ONNX model (path, bytes, ModelProto) is imported at each
        # bucket's sizes
        self.__dict__["_eager"] = eager_copy(model) if isinstance(model, torch.nn.Module) else model
        self.examples = [x.detach() for x in example_inputs]
        self.config = replace(config, recompile=False)
        self.dims = list(dims)
        self.quiet = quiet
        self.buckets: dict[tuple[int, ...], Bucket] = {}     # compiled models by their sizes
        # what errors name inputs by: an ONNX model's, given by the caller, which read the model
        self.input_names = list(names) if names is not None else _input_names(model, len(self.examples))
        self._lock = threading.Lock()
        sizes = call_sizes(self.dims, self.examples, self.examples)
        key = self.bucket_sizes_of(sizes)
        self.compiled = self._bucket(key, pad_inputs(self.examples, self.dims, sizes, key)).model   # the example's

    @property
    def analysis(self) -> Any:
        return self.compiled.analysis

    @property
    def fallbacks(self) -> Any:
        return self.compiled.fallbacks

    def bucket_sizes_of(self, sizes: Sequence[int]) -> tuple[int, ...]:
        return tuple(bucket_of(dim, size, self.config.bucket_steps) for dim, size in zip(self.dims, sizes))

    def compile_buckets(self, sizes: Mapping[str, Sequence[int]] | None = None) -> None:
        """Compile the buckets now (all of each bounded dim's, or those of `sizes`: dim name -> sizes), so that no
        call compiles."""
        choices = []
        for dim in self.dims:
            wanted = (sizes or {}).get(dim.name)
            if wanted is None and dim.max is None:
                raise GraphError(f"dynamic dim {dim.name} is unbounded: name the sizes to compile")
            steps = self.config.bucket_steps
            choices.append(sorted({bucket_of(dim, s, steps) for s in wanted}) if wanted
                           else bucket_sizes(dim, None, steps))
        import itertools

        for key in itertools.product(*choices):
            if key not in self.buckets:
                base = call_sizes(self.dims, self.examples, self.examples)
                self._bucket(key, pad_or_cut(self.examples, self.dims, base, key))

    def forward(self, *inputs: torch.Tensor) -> Any:
        sizes = call_sizes(self.dims, inputs, self.examples, self.input_names)
        key = self.bucket_sizes_of(sizes)
        bucket = self.buckets.get(key)
        if bucket is None:
            with self._lock:
                bucket = self.buckets.get(key) or self._bucket(key, pad_inputs(inputs, self.dims, sizes, key))
        if key == sizes:
            return bucket.model(*inputs)
        if not all(bucket.pads(dim.name, size) for dim, size, target in zip(self.dims, sizes, key) if size != target):
            exact = self.buckets.get(sizes)
            if exact is None:
                with self._lock:
                    exact = self.buckets.get(sizes) or self._bucket(sizes, inputs, exact=True)
            return exact.model(*inputs)
        outputs = bucket.model(*pad_inputs(inputs, self.dims, sizes, key, bucket.zero_filled))
        return self._cut(bucket, outputs, sizes, key)

    def _bucket(self, key: tuple[int, ...], inputs: Sequence[torch.Tensor], exact: bool = False) -> Bucket:
        """Compile the model at sizes `key` on these inputs (of those sizes) and decide how it pads."""
        from opfuse.compiler import compile as opfuse_compile

        assert call_sizes(self.dims, inputs, self.examples) == key, "a bucket is compiled at its own sizes"

        start = time.perf_counter()
        pinned = {} if not isinstance(self._eager, torch.nn.Module) else None   # an ONNX model at these sizes
        model = opfuse_compile(self._eager, tuple(inputs), replace(self.config, fallback="error"), self.quiet,
                               dynamic_shapes=pinned)
        seconds = time.perf_counter() - start

        def end_padding(padding: Padding, position: int, rows: str) -> str | None:
            """Where rows along the dim interact (`rows` says how): `end_padding_of` the model's graph, traced
            again one position shorter."""
            dim = self.dims[position]
            found = end_padding_of(self._eager, model.analysis.prepared, model.analysis.config.dtype, self.dims, dim,
                                   key, inputs, rows)
            if isinstance(found, str):
                return found
            end, zeros = found
            padding.cuts[dim.name], padding.zero_filled[dim.name], padding.least[dim.name] = end.cuts, zeros, end.least
            return None

        padding = Padding() if exact else padding_of(self.dims, key, model.compiled.plan.graph, end_padding)
        bucket = Bucket(sizes=key, model=model, exact=exact, seconds=seconds, **vars(padding))
        self.buckets[key] = bucket
        return bucket

    def _cut(self, bucket: Bucket, outputs: Any, sizes: Sequence[int], key: Sequence[int]) -> Any:
        from torch.utils._pytree import tree_flatten, tree_unflatten

        flat, spec = tree_flatten(outputs)
        flat = cut_outputs(flat, bucket.model.compiled.plan.graph.outputs, self.dims, sizes, key, bucket.cuts)
        return tree_unflatten(flat, spec)

    def extra_repr(self) -> str:
        dims = ", ".join(dim.describe() for dim in self.dims)
        return f"dims=[{dims}], buckets={len(self.buckets)}"


def zeros_note(inputs: Sequence[int]) -> str:
    """' (input 1 padded with zeros)', or nothing for no input."""
    if not inputs:
        return ""
    return f" ({'inputs' if len(inputs) > 1 else 'input'} {', '.join(map(str, inputs))} padded with zeros)"


def end_padding_of(model: Any, graph: Graph, dtype: str, dims: Sequence[DynamicDim], dim: DynamicDim,
                   sizes: Sequence[int], inputs: Sequence[torch.Tensor], rows: str
                   ) -> tuple[Any, tuple[int, ...]] | str:
    """Whether `graph` (`model` prepared in `dtype` at `sizes`, from `inputs`), whose rows along `dim` interact as
    `rows` says, may be padded at the end of `dim` for some choice of inputs padded with zeros
    (`opfuse.ir.seq_padding`, against the model traced one position shorter, or an ONNX model imported at those
    sizes): (its EndPadding, those inputs), or why not."""
    from opfuse.api import capture
    from opfuse.ir.seq_padding import end_padding_with_zeros
    from opfuse.passes.manager import prepare_graph

    size = sizes[list(dims).index(dim)]
    if size - 1 < max(dim.min, 1):
        return rows
    shorter = pad_or_cut(inputs, dims, sizes, [s - (d is dim) for d, s in zip(dims, sizes)])
    try:
        if not isinstance(model, torch.nn.Module):      # an ONNX model, imported at the shorter sizes
            from opfuse.frontend.onnx_compile import constant_inputs
            from opfuse.frontend.onnx_import import _read_model
            from opfuse.frontend.onnx_module import onnx_module

            if constant_inputs(_read_model(model)):     # its shape inputs read as constants: not compared
                return rows
            model = onnx_module(model, shorter).eval()
        reference, _ = prepare_graph(capture(model, shorter), dtype)
    except GraphError as error:
        return f"{rows}; the model traced at {size - 1} positions failed: {error}"
    return end_padding_with_zeros(graph, reference, dim.uses, rows)


def pad_or_cut(inputs: Sequence[torch.Tensor], dims: Sequence[DynamicDim], sizes: Sequence[int],
               targets: Sequence[int]) -> list[torch.Tensor]:
    """The inputs at the target sizes: grown as `pad_inputs` grows them, or cut to their first rows."""
    grown = pad_inputs(inputs, dims, sizes, [max(s, t) for s, t in zip(sizes, targets)])
    result = list(grown)
    for dim, target in zip(dims, targets):
        for index, axis in dim.uses:
            result[index] = result[index].narrow(axis, 0, target)
    return result


def bucket_analyses(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], config: FusionConfig,
                    dims: Sequence[DynamicDim]) -> list[dict[str, Any]]:
    """What `opfuse.analyze` predicts at every bucket of bounded `dims` (the inputs grown or cut from the example
    to each bucket's sizes): per bucket, its sizes, fused launches, traffic and predicted time, and per dim whether
    a call below it is padded or why not (as a DynamicModel would decide on that bucket's plan)."""
    import itertools

    from opfuse.api import analyze

    base = [example_inputs[dim.uses[0][0]].shape[dim.uses[0][1]] for dim in dims]   # the example may lie outside
    records = []
    for key in itertools.product(*(bucket_sizes(dim, None, config.bucket_steps) for dim in dims)):
        analysis = analyze(model, pad_or_cut(example_inputs, dims, base, key), config)
        padding = {}
        for dim, size in zip(dims, key):
            if size > 1:
                padding[dim.name] = padding_problem(analysis.prepared, dim)[1] or "pads"
                if padding[dim.name] != "pads":     # as a DynamicModel decides: perhaps its end pads
                    found = end_padding_of(model, analysis.prepared, analysis.config.dtype, dims, dim, key,
                                           pad_or_cut(example_inputs, dims, base, key), padding[dim.name])
                    padding[dim.name] = found if isinstance(found, str) else "pads" + zeros_note(found[1])
        fused = analysis.fused
        records.append({"sizes": list(key), "launches": fused.kernel_launches, "bytes": fused.total_bytes,
                        "flops": fused.flops, "predicted_s": fused.predicted_time, "padding": padding})
    return records

