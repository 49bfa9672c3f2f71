"""A loaded package (`opfuse.load`): `PackagedModel`, one compiled model per batch size, called like the model
it was saved from (`opfuse.runtime.package` writes and reads the file).

Several batch sizes, as TensorRT's optimisation profiles: `opfuse.save([compiled_b1, compiled_b8, compiled_b64],
path)` stores one compiled model per batch size, each compiled and tuned at its batch. A call runs on the smallest
batch size that holds its batch: its inputs are padded along dim 0 to that size with copies of their last row (real
data, so no padded row is degenerate, as a row of zeros would be for an attention mask), and its outputs are cut
back to the call's batch. A call at exactly a saved batch size runs unpadded, bit for bit as the compiled model it
was saved from. A call larger than the largest batch size is an error naming the sizes the package holds.

Padding is right only where each row of a batch is computed from that row's inputs alone, as inference models do;
a softmax over the batch or `x - x.mean(0)` reads every row, and padding would change the rows kept. So at load each
plan graph a call may be padded to is checked (`padding_problem`, by `opfuse.ir.rows.row_dependence`): where some
node may mix rows, the package runs only the batch sizes it holds, and a call between them is an error naming that
node and the sizes held (`PackagedModel.padding_refused_because` says why; `warn_if_exact_batches` says it at save).
The batch is dim 0 of every input and of every output: a package of several batch sizes must have one
(`check_profiles` refuses it at save otherwise). A package of one compiled model takes exactly the shapes it was
compiled for: nobody declared a batch there (dim 0 may be tokens), so nothing is padded.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_unflatten

from opfuse.ir.graph import Graph, GraphError, dtype_name, torch_dtype
from opfuse.ir.rows import row_dependence


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


def padding_problem(graph: Graph) -> str | None:
    """Why a call's batch may not be padded up to run on `graph` (a plan graph traced at a batch of 2 or more): the
    node whose output rows may read other rows, and how; None where every output row along dim 0 is computed from
    the same row of the inputs alone."""
    found = row_dependence(graph)
    return None if found is None else str(found)


def padding_refused(batches: Sequence[int | None], graphs: Sequence[Graph]) -> str | None:
    """Why a package of one model at these batch sizes (one plan graph each) must run only them, or None where a
    call between them may be padded. Only graphs a call may be padded to are asked: several batch sizes, each 2 or
    more (nothing is padded up to batch 1, and a batch-1 trace cannot tell the batch from any other size-1 dim)."""
    if len(batches) < 2 or None in batches:
        return None
    for batch, graph in sorted(zip(batches, graphs), key=lambda pair: pair[0]):
        problem = padding_problem(graph) if batch >= 2 else None
        if problem is not None:
            return problem
    return None


def exact_batches_message(where: str, batches: Sequence[int], problem: str) -> str:
    return (f"{where} runs only its batch sizes {', '.join(map(str, sorted(batches)))}, never a batch padded up to "
            f"one of them: {problem}")


def warn_if_exact_batches(batches: Sequence[int | None], graphs: Sequence[Graph], where: str) -> str | None:
    """At save: a one-line warning where a package of several batch sizes can run only those (see
    `padding_refused`); returns the reason, or None."""
    problem = padding_refused(batches, graphs)
    if problem is not None:
        warnings.warn(exact_batches_message(where, [b for b in batches if b is not None], problem), stacklevel=3)
    return problem


@dataclass
class Profile:
    """One compiled model of a package and what a call must match."""

    batch: int | None
    compiled: Any                               # CompiledModel
    inputs: list[tuple[tuple[int, ...], torch.dtype]]
    output_spec: TreeSpec
    output_dtypes: list[torch.dtype]
    name: str

    @classmethod
    def of(cls, saved: Any, batch: int | None, compiled: Any) -> "Profile":
        """The profile of a checked `opfuse.runtime.package.SavedProfile` and the model built from it."""
        return cls(batch, compiled, [(shape, torch_dtype(dtype)) for shape, dtype in saved.inputs],
                   saved.output_spec, [torch_dtype(d) for d in saved.output_dtypes], saved.name)


def _format(shape: Sequence[int], dtype: torch.dtype) -> str:
    return f"{dtype_name(dtype)}[{','.join(map(str, shape))}]"


class PackagedModel(torch.nn.Module):
    """A package's compiled models, one per batch size (see the module docstring)."""

    def __init__(self, profiles: Sequence[Profile], path: str, rebuilt_because: str | None = None):
        super().__init__()
        self.path = path
        self._profiles = sorted(profiles, key=lambda p: p.batch or 0)
        self.models = torch.nn.ModuleList(p.compiled for p in self._profiles)
        self.device = self._profiles[0].compiled.device
        self.batched = len(self._profiles) > 1 and all(p.batch is not None for p in self._profiles)
        self.rebuilt_because = rebuilt_because     # why the saved plan was built again here (recompile=True)
        # why a call between the batch sizes held is refused instead of padded (None: it is padded, or not batched)
        self.padding_refused_because = None
        if self.batched:
            self.padding_refused_because = padding_refused([p.batch for p in self._profiles],
                                                           [p.compiled.plan.graph for p in self._profiles])

    @property
    def name(self) -> str:
        return self._profiles[0].name

    @property
    def batch_sizes(self) -> list[int]:
        """The batch sizes the package holds, smallest first (empty for a model without a batch dimension)."""
        return [p.batch for p in self._profiles] if self.batched else []

    @property
    def input_dtypes(self) -> list[torch.dtype]:
        """The dtype each input is passed in (as the model saved took it)."""
        return [dtype for _, dtype in self._profiles[0].inputs]

    def compiled_for(self, batch: int | None = None) -> Any:
        """The CompiledModel a call of this batch runs on (None: the only one)."""
        return self._choose_batch(batch)[0].compiled if batch is not None else self._profiles[0].compiled

    def example_inputs(self, batch: int | None = None) -> list[torch.Tensor]:
        """Inputs this model takes, at `batch` (default: the smallest batch size held): seeded normal floats, zeros
        for integers (token ids, masks); for benchmarks and smoke tests."""
        from opfuse.ir.graph import TensorType
        from opfuse.runtime.binaries import example_inputs

        shapes = [shape for shape, _ in self._profiles[0].inputs]
        if self.batched:
            batch = self.batch_sizes[0] if batch is None else batch
            shapes = [(batch,) + shape[1:] for shape in shapes]
        types = [TensorType(shape, dtype_name(dtype)) for shape, (_, dtype) in zip(shapes, self._profiles[0].inputs)]
        return example_inputs(types, self.device)

    def forward(self, *inputs: torch.Tensor) -> Any:
        profile, batch = self._choose(inputs)
        padded = batch is not None and batch != profile.batch
        if padded:
            inputs = tuple(torch.cat([x, x[-1:].expand(profile.batch - batch, *x.shape[1:])]) for x in inputs)
        outputs = profile.compiled.run_matching(inputs)
        flat = list(outputs) if isinstance(outputs, tuple) else [outputs]
        flat = [out if out.dtype == dtype else out.to(dtype) for out, dtype in zip(flat, profile.output_dtypes)]
        if padded:
            flat = [out[:batch] for out in flat]
        return flat[0] if profile.output_spec.is_leaf() else tree_unflatten(flat, profile.output_spec)

    def _choose(self, inputs: Sequence[Any]) -> tuple[Profile, int | None]:
        """The profile a call runs on and its batch (None: no batch dimension); an error naming the first input
        that fits none."""
        expected = self._profiles[0].inputs
        if len(inputs) != len(expected):
            raise GraphError(f"{self.path} takes {len(expected)} inputs, got {len(inputs)}")
        for index, (x, (shape, dtype)) in enumerate(zip(inputs, expected)):
            if not isinstance(x, torch.Tensor):
                raise GraphError(f"input {index} must be a tensor, got {type(x).__name__}")
            if x.dtype != dtype or x.device != self.device:
                raise GraphError(f"input {index} is {_format(x.shape, x.dtype)} on {x.device}, {self.path} takes "
                                 f"{_format(shape, dtype)} on {self.device}")
        if not self.batched:
            for index, (x, (shape, dtype)) in enumerate(zip(inputs, expected)):
                if tuple(x.shape) != shape:
                    raise GraphError(f"input {index} is {_format(x.shape, x.dtype)}, {self.path} was compiled "
                                     f"for {_format(shape, dtype)}")
            return self._profiles[0], None
        batches = {x.shape[0] if x.dim() else None for x in inputs}
        if len(batches) != 1 or None in batches:
            raise GraphError(f"inputs of {self.path} share their batch size in dim 0, got shapes "
                             f"{[list(x.shape) for x in inputs]}")
        batch = batches.pop()
        for index, (x, (shape, dtype)) in enumerate(zip(inputs, expected)):
            if tuple(x.shape[1:]) != shape[1:]:
                raise GraphError(f"input {index} is {_format(x.shape, x.dtype)}, {self.path} takes "
                                 f"{_format(('N',) + shape[1:], dtype)} for N up to {self.batch_sizes[-1]}")
        return self._choose_batch(batch)

    def _choose_batch(self, batch: int) -> tuple[Profile, int]:
        if batch < 1:
            raise GraphError(f"{self.path} runs batches of at least 1, got {batch}")
        for profile in self._profiles:
            if profile.batch == batch or (profile.batch > batch and self.padding_refused_because is None):
                return profile, batch
            if profile.batch > batch:
                raise GraphError(f"batch {batch}: " + exact_batches_message(self.path, self.batch_sizes,
                                                                            self.padding_refused_because)
                                 + f"; save the package with batch size {batch} too")
        raise GraphError(f"batch {batch} is larger than the largest batch size in {self.path} "
                         f"({self.batch_sizes[-1]}; it holds {', '.join(map(str, self.batch_sizes))}): save the "
                         "package with a larger one")

    def extra_repr(self) -> str:
        sizes = ", ".join(map(str, self.batch_sizes)) or "fixed shapes"
        text = f"path={self.path}, device={self.device}, batch_sizes=[{sizes}]"
        if self.batched:
            refused = self.padding_refused_because
            text += ", padding=" + ("rows independent" if refused is None else f"refused ({refused})")
        return text
