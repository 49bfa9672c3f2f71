"""A loaded package (`opfuse.load`): `PackagedModel`, one compiled model per held sizes of its dynamic dims, called
like the model it was saved from (`opfuse.runtime.package` writes and reads the file).

A package's dynamic dims (`opfuse.runtime.dynamic.DynamicDim`) come from what was saved: a `DynamicModel`
(`opfuse.compile(..., dynamic_shapes=)`) keeps its dims and every bucket it compiled; a list of compiled models at
several batch sizes (`opfuse.save([compiled_b1, compiled_b8, compiled_b64], path)`, as TensorRT's optimisation
profiles) has one dim, "batch": dim 0 of every input; one compiled model has none and takes exactly its shapes
(nobody declared a batch there: dim 0 may be tokens).

A call at sizes a compiled model holds runs on it unpadded, bit for bit as the model it was saved from. A call at
other sizes runs on the smallest model whose sizes hold them, its inputs padded along each dim it grows (their last
slice repeated: real data, so no padded row is degenerate, as a row of zeros would be for an attention mask) and its
outputs cut back, only where padding cannot change a result: each model's plan graph a call may be padded up to is
checked at load (`padding_refusals`, by `opfuse.runtime.dynamic.padding_problem` and `opfuse.ir.rows`, or for a
sequence whose positions interact by `opfuse.ir.seq_padding` against the next smaller size held: attention under an
attention mask, padded with zeros, or causal). Where some node may mix rows along that dim (a softmax over the
batch, `x - x.mean(0)`, attention over a padded sequence without a mask), the package runs only the sizes it holds,
and a call at others is an error naming that node and the sizes held
(`PackagedModel.padding_refused_because` says why; `warn_if_exact_sizes` says it at save). A call larger than every
size held is an error naming the sizes the package holds.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from opfuse.ir.graph import Graph, GraphError, dtype_name, torch_dtype
from opfuse.runtime.dynamic import (DynamicDim, InputKind, Padding, call_sizes, cut_outputs, pad_inputs,
                                    padding_of)


def batch_of(profile: dict[str, Any]) -> int | None:
    """A profile's batch size: dim 0 shared by every input and every output, or None (no batch dimension)."""
    shapes = [i["shape"] for i in profile["inputs"]] + profile["output_shapes"]
    if not profile["inputs"] or any(len(shape) == 0 for shape in shapes):
        return None
    batch = shapes[0][0]
    return batch if all(shape[0] == batch for shape in shapes) else None


def check_profiles(profiles: Sequence[dict[str, Any]], where: str) -> list[int | None]:
    """Each profile's batch size; for several profiles, that they are one model at distinct batch sizes."""
    from opfuse.runtime.package import PackageError

    batches = [batch_of(p) for p in profiles]
    if len(profiles) < 2:
        return batches
    if None in batches:
        index = batches.index(None)
        raise PackageError(f"cannot save {where}: model {index} has no batch dimension (dim 0 of every input and "
                           "output the same size), so it cannot be one of several batch sizes")
    if len(set(batches)) != len(batches):
        raise PackageError(f"cannot save {where}: two of its models have the same batch size ({batches})")

    def without_batch(profile: dict[str, Any]) -> Any:
        return ([(i["shape"][1:], i["dtype"]) for i in profile["inputs"]], profile["output_spec"],
                profile["output_dtypes"], [shape[1:] for shape in profile["output_shapes"]])

    first = without_batch(profiles[0])
    for index, profile in enumerate(profiles[1:], 1):
        if without_batch(profile) != first:
            raise PackageError(f"cannot save {where}: model {index} (batch {batches[index]}) is not model 0 at "
                               "another batch size: their inputs or outputs differ beyond dim 0")
    return batches


def batch_dim(batches: Sequence[int], input_count: int) -> DynamicDim:
    """The dynamic dim of a package of one model at several batch sizes: dim 0 of every input, from 1 up (a call
    larger than every size held is refused naming the sizes held)."""
    return DynamicDim("batch", 1, None, tuple((index, 0) for index in range(input_count)))


def padding_refusals(dims: Sequence[DynamicDim], profiles: Sequence[tuple[tuple[int, ...], bool, Graph]]
                     ) -> dict[tuple[int, ...], Padding]:
    """For each profile (its sizes, whether it holds exact sizes only, its plan graph) a call may be padded up to:
    per dynamic dim, whether and how a padded call runs on it (`Padding`): every output row from its own input row
    (`opfuse.runtime.dynamic.padding_problem`); or else no real position reading the padded end of the sequence
    (`opfuse.ir.seq_padding.end_padding`), checked against the profile the package holds at the next smaller size
    along that dim (the others alike), whose positions the constants are compared on: fewer than the compile's
    trace one position shorter compares, so at least half the size (or one less). A size of 1 pads nothing, and a trace
    at size 1 cannot tell that dim from any other of size 1: it is not asked."""
    found = {}
    for sizes, exact, graph in profiles:
        found[sizes] = Padding() if exact else padding_of(
            dims, sizes, graph, lambda padding, position, rows: _end_padding(padding, dims, position, sizes, graph,
                                                                           profiles, rows))
    return found


def _end_padding(padding: Padding, dims: Sequence[DynamicDim], position: int, sizes: tuple[int, ...], graph: Graph,
                 profiles: Sequence[tuple[tuple[int, ...], bool, Graph]], rows: str) -> str | None:
    """`padding_refusals`' second way: None where the end of dim `position` pads (`padding` filled in), else why
    not."""
    from opfuse.ir.seq_padding import end_padding_with_zeros

    dim = dims[position]
    smaller = [(other[position], reference) for other, _, reference in profiles
               if other[position] < sizes[position] and all(o == s for i, (o, s) in enumerate(zip(other, sizes))
                                                            if i != position)]
    nearest, reference = max(smaller, key=lambda pair: pair[0]) if smaller else (0, None)
    if nearest < max(2, sizes[position] // 2) and nearest != sizes[position] - 1:
        return rows     # constants compared on fewer than half the positions prove too little
    found = end_padding_with_zeros(graph, reference, dim.uses, rows)
    if isinstance(found, str):
        return found
    end, zeros = found
    padding.cuts[dim.name], padding.zero_filled[dim.name], padding.least[dim.name] = end.cuts, zeros, end.least
    return None


def exact_sizes_message(where: str, dims: Sequence[DynamicDim], held: Sequence[tuple[int, ...]], problem: str
                        ) -> str:
    if len(dims) == 1:
        sizes = ", ".join(str(s[0]) for s in sorted(held))
        return f"{where} runs only its {dims[0].name} sizes {sizes}, never a {dims[0].name} padded up to one of them: " \
               f"{problem}"
    return f"{where} runs only the sizes it holds ({', '.join(map(str, sorted(held)))}), never padded: {problem}"


def warn_if_exact_sizes(dims: Sequence[DynamicDim], profiles: Sequence[tuple[tuple[int, ...], bool, Graph]],
                        where: str) -> str | None:
    """At save: a one-line warning where a package of several sizes cannot pad a call up to one of them (see
    `padding_refusals`); returns the reason, or None."""
    if len(profiles) < 2:
        return None
    problem = next((why for padding in padding_refusals(dims, profiles).values() for why in padding.refused.values()),
                   None)
    if problem is not None:
        warnings.warn(exact_sizes_message(where, dims, [sizes for sizes, _, _ in profiles], problem), stacklevel=3)
    return problem


@dataclass
class Profile:
    """One compiled model of a package, the sizes of its dynamic dims, and what a call must match."""

    sizes: tuple[int, ...]
    exact: bool                                 # held for calls at exactly its sizes (its rows interact)
    compiled: Any                               # CompiledModel
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    output_spec: TreeSpec
    output_dtypes: list[torch.dtype]
    name: str

    @classmethod
    def of(cls, saved: Any, sizes: Sequence[int], exact: bool, compiled: Any) -> "Profile":
        """The profile of a checked `opfuse.runtime.package.SavedProfile` and the model built from it."""
        return cls(tuple(sizes), exact, compiled, [(shape, torch_dtype(dtype)) for shape, dtype in saved.inputs],
                   saved.output_spec, [torch_dtype(d) for d in saved.output_dtypes], saved.name)


def _format(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


class PackagedModel(torch.nn.Module):
    """A package's compiled models, one per held sizes of its dynamic dims (see the module docstring)."""

    def __init__(self, profiles: Sequence[Profile], path: str, dims: Sequence[DynamicDim] = (),
                 rebuilt_because: str | None = None):
        super().__init__()
        self.path = path
        self.dims = list(dims)
        self._profiles = sorted(profiles, key=lambda p: (math.prod(p.sizes), p.sizes))
        self.models = torch.nn.ModuleList(p.compiled for p in self._profiles)
        self.device = self._profiles[0].compiled.device
        self.rebuilt_because = rebuilt_because     # why the saved plan was built again here (recompile=True)
        self._kinds = [InputKind(shape, dtype, self.device) for shape, dtype in self._profiles[0].inputs]
        self._padding = padding_refusals(self.dims, [(p.sizes, p.exact, p.compiled.plan.graph)
                                                     for p in self._profiles])
        # why a call between the sizes held is refused instead of padded (None: it is padded, or nothing varies)
        self.padding_refused_because = next((why for padding in self._padding.values()
                                             for why in padding.refused.values()), None)

    @property
    def name(self) -> str:
        return self._profiles[0].name

    @property
    def sizes_held(self) -> list[tuple[int, ...]]:
        """The sizes of the dynamic dims each compiled model holds, smallest first (one empty tuple: fixed shapes)."""
        return [p.sizes for p in self._profiles]

    @property
    def batch_sizes(self) -> list[int]:
        """For a package of one dynamic dim, the sizes it holds, smallest first; else empty."""
        return [p.sizes[0] for p in self._profiles] if len(self.dims) == 1 else []

    @property
    def input_dtypes(self) -> list[torch.dtype]:
        """The dtype each input is passed in (as the model saved took it)."""
        return [dtype for _, dtype in self._profiles[0].inputs]

    def compiled_for(self, *sizes: int) -> Any:
        """The CompiledModel a call at these sizes of the dynamic dims runs on (none given: the first one held)."""
        return self._choose(tuple(sizes))[0].compiled if sizes else self._profiles[0].compiled

    def example_inputs(self, *sizes: int) -> list[torch.Tensor]:
        """Inputs this model takes, at these sizes of its dynamic dims (default: the smallest held): seeded normal
        floats, zeros for integers (token ids, masks); for benchmarks and smoke tests."""
        from opfuse.ir.graph import TensorType
        from opfuse.runtime.binaries import example_inputs

        profile = self._profiles[0] if not sizes else self._choose(tuple(sizes))[0]
        shapes = [list(shape) for shape, _ in profile.inputs]
        for dim, size in zip(self.dims, sizes or profile.sizes):
            for index, axis in dim.uses:
                shapes[index][axis] = size
        return example_inputs([TensorType(tuple(shape), dtype_name(dtype))
                               for shape, (_, dtype) in zip(shapes, profile.inputs)], self.device)

    def forward(self, *inputs: torch.Tensor) -> Any:
        if not self.dims:
            self._check_fixed(inputs)
            profile, sizes = self._profiles[0], ()
        else:
            sizes = call_sizes(self.dims, inputs, self._kinds)
            profile, sizes = self._choose(sizes)
        padded = sizes != profile.sizes
        if padded:
            inputs = tuple(pad_inputs(inputs, self.dims, sizes, profile.sizes,
                                      self._padding[profile.sizes].zero_filled))
        outputs = profile.compiled.run_matching(inputs)
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        flat = [out if out.dtype == dtype else out.to(dtype) for out, dtype in zip(flat, profile.output_dtypes)]
        if padded:
            flat = cut_outputs(flat, profile.compiled.plan.graph.outputs, self.dims, sizes, profile.sizes,
                               self._padding[profile.sizes].cuts)
        return flat[0] if profile.output_spec.is_leaf() else tree_unflatten(flat, profile.output_spec)

    def _check_fixed(self, inputs: Sequence[Any]) -> None:
        expected = self._profiles[0].inputs
        if len(inputs) != len(expected):
            raise GraphError(f"{self.path} takes {len(expected)} inputs, got {len(inputs)}")
        for index, (x, (shape, dtype)) in enumerate(zip(inputs, expected)):
            if not isinstance(x, torch.Tensor):
                raise GraphError(f"input {index} must be a tensor, got {type(x).__name__}")
            if x.dtype != dtype or x.device != self.device or tuple(x.shape) != shape:
                raise GraphError(f"input {index} is {_format(x.shape, x.dtype)} on {x.device}, {self.path} was "
                                 f"compiled for {_format(shape, dtype)} on {self.device}")

    def _choose(self, sizes: tuple[int, ...]) -> tuple[Profile, tuple[int, ...]]:
        """The profile a call at these sizes runs on: the one holding them exactly, else the smallest whose sizes
        hold them and that may pad each dim it grows; a GraphError naming the sizes held and why otherwise."""
        held = [p.sizes for p in self._profiles]
        refusal = None
        for profile in self._profiles:
            if profile.sizes == sizes:
                return profile, sizes
            if profile.exact or any(s > p for s, p in zip(sizes, profile.sizes)):
                continue
            padding = self._padding[profile.sizes]
            why = next((padding.refused.get(dim.name, f"{dim.name} {s} is below the {padding.least.get(dim.name)} "
                                            "positions a slice of the model reads")
                        for dim, s, p in zip(self.dims, sizes, profile.sizes)
                        if s != p and not padding.pads(dim.name, s)), None)
            if why is None:
                return profile, sizes
            refusal = refusal or why
        if refusal is not None:
            prefix = f"{self.dims[0].name} {sizes[0]}" if len(self.dims) == 1 else f"sizes {sizes}"
            raise GraphError(f"{prefix}: " + exact_sizes_message(self.path, self.dims, held, refusal)
                             + "; save the package with these sizes too")
        if len(self.dims) == 1:
            largest = max(p.sizes[0] for p in self._profiles)
            name = self.dims[0].name
            raise GraphError(f"{name} {sizes[0]} is larger than the largest {name} size in {self.path} ({largest}; "
                             f"it holds {', '.join(str(s[0]) for s in held)}): save the package with a larger one")
        raise GraphError(f"sizes {sizes} of ({', '.join(d.name for d in self.dims)}) fit none of the sizes "
                         f"{self.path} holds ({', '.join(map(str, held))})")

    def extra_repr(self) -> str:
        if not self.dims:
            return f"path={self.path}, device={self.device}, fixed shapes"
        dims = ", ".join(dim.describe() for dim in self.dims)
        refused = self.padding_refused_because
        return (f"path={self.path}, device={self.device}, dims=[{dims}], sizes={self.sizes_held}, padding="
                + ("rows independent" if refused is None else f"refused ({refused})"))
