"""ONNX's own operator conformance cases, run against opfuse on each of its paths: which pass, and why not.

Entry points: `run_conformance(cases, path, jobs) -> ConformanceReport` (per-case outcomes, per-operator counts),
`all_cases()`, `claimed_cases()`, and the script

    python -m opfuse.frontend.onnx_conformance                      # the compiled path: summary and every failure
    python -m opfuse.frontend.onnx_conformance --path reference     # the reference path
    python -m opfuse.frontend.onnx_conformance --markdown           # every path; rewrite the tables in docs/onnx.md
    python -m opfuse.frontend.onnx_conformance --check              # exit 1 when docs/onnx.md is not this run's

The cases are `onnx.backend.test.case.node.collect_testcases()`, all 1,884 of onnx 1.23: each a small model with
inputs and the expected outputs, made offline by the onnx package (so no reference evaluator is trusted here). A
case is claimed when every node of its model is an operator opfuse has a converter for
(`onnx_converters.CONVERTERS`): the operators' own cases, and the function expansions of other operators into
claimed ones (ReduceL1 as Abs and ReduceSum). Any other case is `unclaimed` (not run; `missing_operators` names
why). A case counts under each operator its model uses.

The paths (`PATHS`), each labelled so wherever a number is reported:
- reference: `OpfuseBackend.prepare(model)`: the imported graph run op by op through each IR op's PyTorch
  reference. It checks the import (the converters), not opfuse's kernels.
- compiled: `OpfuseBackend.prepare(model, config=FusionConfig())`: the imported graph compiled by
  `opfuse.compile`, its groups run as opfuse's Triton kernels (on the CPU through Triton's interpreter) and what
  has no kernel through PyTorch. Inputs that fix a shape are read as constants (the backend's rule); the others,
  weights given as inputs included, stay run-time inputs. A case's `kernels` is how many opfuse kernels ran.
- compile: the public `opfuse.compile(model_proto, inputs)`, every input of the case given as an example input.

A run case passes when every output has the expected shape and dtype and its values match: integers and booleans
exactly, floating outputs within a relative error ||out - expected|| / ||expected|| of `TOLERANCE[dtype]`, NaN
where NaN is expected and equal infinities. A case whose model has a tensor of a dtype the IR has no equivalent
for (float8, 4-bit, unsigned 16-64-bit integers, strings, sequences, optionals) is not run either: `no_dtype`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from opfuse.frontend.onnx_backend import OpfuseBackend, UnsupportedOnnxNode, standard_opset
from opfuse.frontend.onnx_converters import CONVERTERS, ONNX_DTYPES

# relative error allowed per output dtype: a few units in the last place of a float32 result, a rounding or two
# of float16's 11 and bfloat16's 8 significant bits
TOLERANCE = {"float64": 1e-10, "float32": 1e-5, "float16": 1e-3, "bfloat16": 1e-2}
PATHS = {
    "reference": "reference path (the imported graph op by op through PyTorch)",
    "compiled": "compiled path (OpfuseBackend.prepare(model, config=FusionConfig()): opfuse's kernels)",
    "compile": "opfuse.compile(model_proto, inputs)",
}
OUTCOMES = ("passed", "failed", "no_dtype", "unclaimed")
# operators each of one kind of opfuse kernel (anchor, pool, row reduction, elementwise): the fast tier's compiled run
# checks that a small case of each runs at least one opfuse kernel
SAMPLED = ("Conv", "Gemm", "MatMul", "MaxPool", "AveragePool", "Softmax", "LayerNormalization", "ReduceMean",
           "BatchNormalization", "Relu", "Gelu", "Add")


@dataclass(frozen=True)
class CaseResult:
    """One conformance case on one path: `outcome` is one of `OUTCOMES`, with the reason when not passed;
    `kernels`, on a compiling path, how many opfuse kernels the compiled model ran."""

    name: str
    operators: tuple[str, ...]
    opset: int
    outcome: str
    reason: str = ""
    kernels: int | None = None


@dataclass
class OperatorCounts:
    cases: int = 0
    passed: int = 0
    no_dtype: int = 0
    with_kernels: int = 0
    opsets: set[int] = field(default_factory=set)
    failing: list[str] = field(default_factory=list)


@dataclass
class ConformanceReport:
    """The results of one path over a set of cases."""

    results: list[CaseResult]
    path: str = "reference"
    seconds: float = 0.0

    @property
    def claimed(self) -> list[CaseResult]:
        return [r for r in self.results if r.outcome != "unclaimed"]

    @property
    def run(self) -> list[CaseResult]:
        """The claimed cases that were run (those whose every tensor has an IR dtype)."""
        return [r for r in self.results if r.outcome in ("passed", "failed")]

    @property
    def passed(self) -> int:
        return sum(r.outcome == "passed" for r in self.results)

    @property
    def with_kernels(self) -> int:
        """Passed cases that ran at least one opfuse kernel (compiling paths only)."""
        return sum(r.outcome == "passed" and bool(r.kernels) for r in self.results)

    @property
    def pass_rate(self) -> float:
        return self.passed / len(self.run) if self.run else 0.0

    @property
    def failures(self) -> list[CaseResult]:
        return [r for r in self.results if r.outcome == "failed"]

    def per_operator(self) -> dict[str, OperatorCounts]:
        """Counts per claimed operator (sorted by name); a case counts under each operator its model uses."""
        counts: dict[str, OperatorCounts] = defaultdict(OperatorCounts)
        for result in self.claimed:
            for op in result.operators:
                row = counts[op]
                row.cases += 1
                row.opsets.add(result.opset)
                row.passed += result.outcome == "passed"
                row.with_kernels += result.outcome == "passed" and bool(result.kernels)
                row.no_dtype += result.outcome == "no_dtype"
                if result.outcome == "failed":
                    row.failing.append(result.name)
        return dict(sorted(counts.items()))

    def unclaimed_operators(self) -> dict[str, int]:
        """Per operator opfuse has no converter for, the unclaimed cases that use it (most first)."""
        counts: dict[str, int] = defaultdict(int)
        for result in self.results:
            if result.outcome == "unclaimed":
                for op in missing_operators(result.operators):
                    counts[op] += 1
        return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))

    def summary(self) -> str:
        claimed = len(self.claimed)
        line = (f"{PATHS[self.path]}: {self.passed} of {len(self.run)} run claimed cases pass "
                f"({100 * self.pass_rate:.1f}%)")
        if self.path != "reference":
            line += f", {self.with_kernels} of them ran at least one opfuse kernel"
        line += f"; {claimed - len(self.run)} claimed cases not run (dtype)"
        if len(self.results) > claimed:
            line += (f"; of all {len(self.results)} cases, {self.passed} pass "
                     f"({100 * self.passed / len(self.results):.1f}%), {len(self.results) - claimed} unclaimed")
        return line


def model_operators(model: onnx.ModelProto) -> tuple[str, ...]:
    """The operator types of a model's nodes, domain-qualified outside the standard one (sorted, distinct)."""
    return tuple(sorted({n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}"
                         for n in model.graph.node}))


def missing_operators(operators: Iterable[str]) -> list[str]:
    """The operators of `operators` opfuse has no converter for."""
    return [op for op in operators if op not in CONVERTERS]


def all_cases() -> list[Any]:
    """Every one of ONNX's node conformance cases, sorted by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():   # the case generators overflow casts and divide by zero on purpose
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    return sorted((c for c in cases if c.model is not None), key=lambda c: c.name)


def claimed_cases(operators: Iterable[str] = CONVERTERS) -> list[Any]:
    """ONNX's node conformance cases whose every node is one of `operators`, sorted by name."""
    claimed = set(operators)
    return [c for c in all_cases() if set(model_operators(c.model)) <= claimed]


def unsupported_dtype(model: onnx.ModelProto) -> str | None:
    """Why a model's tensors cannot be opfuse IR values (a graph input, output or value of an unknown dtype)."""
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if not value.type.HasField("tensor_type"):
            return f"{value.name!r} is not a tensor ({value.type.WhichOneof('value')})"
        elem_type = value.type.tensor_type.elem_type
        if elem_type not in ONNX_DTYPES:
            return f"{value.name!r} is {onnx.TensorProto.DataType.Name(elem_type)}"
    return None


def as_array(value: Any) -> np.ndarray:
    """An expected output as an array (cases keep some, bfloat16 and float16 ones, as TensorProtos)."""
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


def compare(got: np.ndarray, want: np.ndarray) -> str | None:
    """Why an output differs from the expected one (None when it matches; see the module docstring)."""
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, expected {list(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if want.dtype.name not in TOLERANCE:
        mismatched = int(np.sum(got != want))
        return f"{mismatched} of {want.size} values differ" if mismatched else None
    got64, want64 = got.astype(np.float64), want.astype(np.float64)
    finite = np.isfinite(want64)
    if not np.array_equal(got64[~finite], want64[~finite], equal_nan=True) or not np.isfinite(got64[finite]).all():
        return "NaN or infinity where the expected output differs"
    norm = np.linalg.norm(want64[finite])
    error = np.linalg.norm(got64[finite] - want64[finite]) / (norm if norm > 0 else 1.0)
    if error > TOLERANCE[want.dtype.name]:
        return f"relative error {error:.2e} over {TOLERANCE[want.dtype.name]:.0e}"
    return None


# ---- running one case on one path ------------------------------------------------------------------------

def _backend_runner(case: Any, config: Any, constants: Sequence[str]):
    rep = OpfuseBackend.prepare(case.model, "CPU", config=config, constants=constants)
    kernels = (lambda: sum(len(i.compiled.compiled.kernels) for i in rep.imported.values()
                           if i.compiled is not None)) if config else None
    return (lambda inputs: list(rep.run(list(inputs)))), kernels


def _compile_runner(case: Any):
    """Each data set compiled by `opfuse.compile(model, inputs)` (a case's data sets may fix other shapes)."""
    import torch

    import opfuse
    from opfuse.frontend.onnx_backend import to_array, to_tensor
    from opfuse.ir.graph import TensorType

    compiled = []

    def run(inputs):
        tensors = [to_tensor(x, f"input {i}", TensorType(tuple(as_array(x).shape), _dtype_of(x)), case.name)
                   for i, x in enumerate(inputs)]
        model = opfuse.compile(case.model, tensors)
        compiled.append(model)
        with torch.inference_mode():
            outputs = model(*tensors)
        return [to_array(y) for y in (outputs if isinstance(outputs, tuple) else (outputs,))]
    return run, lambda: sum(len(m.compiled.kernels) for m in compiled)


def _dtype_of(value: Any) -> str:
    array = as_array(value)
    return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name


def run_case(case: Any, path: str = "reference", config: Any = None, weights_as_constants: bool = False
             ) -> CaseResult:
    """Run one case on `path` (see the module docstring; `config` is the FusionConfig of the compiled path,
    FusionConfig() by default) and compare with its expected outputs. With `weights_as_constants` the backend paths
    read every input but the first as a constant, as an exported model holds its weights."""
    operators, opset = model_operators(case.model), standard_opset(case.model)
    result = lambda outcome, reason="", kernels=None: CaseResult(case.name, operators, opset,  # noqa: E731
                                                                 outcome, reason, kernels)
    if path not in PATHS:
        raise ValueError(f"no path {path!r}; the paths are {', '.join(PATHS)}")
    missing = missing_operators(operators)
    if missing:
        return result("unclaimed", f"no converter for {', '.join(missing)}")
    reason = unsupported_dtype(case.model)
    if reason is not None:
        return result("no_dtype", reason)
    try:
        weights = [v.name for v in case.model.graph.input][1:] if weights_as_constants else ()
        if path == "reference":
            run, kernels = _backend_runner(case, None, weights)
        elif path == "compiled":
            import opfuse

            run, kernels = _backend_runner(case, config or opfuse.FusionConfig(), weights)
        else:
            run, kernels = _compile_runner(case)
        for inputs, expected in case.data_sets:
            outputs = run(inputs)
            if len(outputs) != len(expected):
                return result("failed", f"{len(outputs)} outputs, expected {len(expected)}")
            for index, (got, want) in enumerate(zip(outputs, expected)):
                mismatch = compare(got, as_array(want))
                if mismatch is not None:
                    return result("failed", f"output {index}: {mismatch}", kernels() if kernels else None)
        ran = kernels() if kernels else None
    except UnsupportedOnnxNode as error:
        return result("failed", f"unsupported {error.op_type}: {error.reason}")
    except Exception as error:  # anything else is a failure of this case, reported, not a crash of the run
        return result("failed", f"{type(error).__name__}: {error}".splitlines()[0])
    return result("passed", "", ran)


# ---- running many, in parallel ---------------------------------------------------------------------------

_WORKER_CASES: dict[str, Any] = {}


def _run_named(name: str, path: str) -> CaseResult:
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")   # cases divide by zero and overflow on purpose
        return run_case(_WORKER_CASES[name], path)


def run_conformance(cases: Sequence[Any] | None = None, path: str = "reference", jobs: int = 1
                    ) -> ConformanceReport:
    """Every claimed case (or `cases`, claimed or not) on `path`, in `jobs` processes (forked: each inherits the
    cases; a compiling path on the CPU needs TRITON_INTERPRET=1 set before triton is imported)."""
    if path not in PATHS:
        raise ValueError(f"no path {path!r}; the paths are {', '.join(PATHS)}")
    cases = claimed_cases() if cases is None else list(cases)
    start = time.perf_counter()
    _WORKER_CASES.clear()
    _WORKER_CASES.update((c.name, c) for c in cases)
    names = [c.name for c in cases]
    if jobs <= 1:
        results = [_run_named(name, path) for name in names]
    else:
        import multiprocessing

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            results = list(pool.map(_run_named, names, [path] * len(names), chunksize=4))
    return ConformanceReport(results, path, time.perf_counter() - start)


def kernel_sample(cases: Sequence[Any], operators: Sequence[str] = SAMPLED, most_elements: int = 512) -> list[Any]:
    """Per operator of `operators` (one per kind of opfuse kernel), the first case (by name) of that operator alone
    whose first input is a float32 tensor of 2 dims or more and whose inputs hold at most `most_elements` values."""
    sample = []
    for op in operators:
        for case in cases:
            if model_operators(case.model) != (op,) or unsupported_dtype(case.model) is not None:
                continue
            inputs = [as_array(x) for x in case.data_sets[0][0]]
            if (inputs and inputs[0].ndim >= 2 and inputs[0].dtype == np.float32
                    and sum(x.size for x in inputs) <= most_elements):
                sample.append(case)
                break
    return sample


def fast_subset(cases: Sequence[Any]) -> list[Any]:
    """A few claimed cases that together use every claimed operator (per operator, the first by name of it alone,
    else of it with others) and every kind of kernel (`kernel_sample`): the default test tier's compiled run."""
    cases = [c for c in cases if not missing_operators(model_operators(c.model))]
    chosen = {case.name: case for case in kernel_sample(cases)}
    for op in sorted(CONVERTERS):
        alone = [c for c in cases if model_operators(c.model) == (op,) and unsupported_dtype(c.model) is None]
        mixed = [c for c in cases if op in model_operators(c.model) and unsupported_dtype(c.model) is None]
        for case in (alone or mixed)[:1]:
            chosen[case.name] = case
    return sorted(chosen.values(), key=lambda c: c.name)


def main(argv: Sequence[str] | None = None) -> int:
    from opfuse.frontend import onnx_conformance_docs as docs

    parser = argparse.ArgumentParser(prog="python -m opfuse.frontend.onnx_conformance",
                                     description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--markdown", action="store_true", help="run every path on every case; rewrite the tables")
    mode.add_argument("--check", action="store_true", help="exit 1 when the docs file's tables are not this run's")
    parser.add_argument("--path", choices=list(PATHS), default="compiled", help="the path to run (default compiled)")
    parser.add_argument("--all", action="store_true", help="every case, not only the claimed ones")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one per core)")
    parser.add_argument("--docs", default=str(docs.DOCS), help=f"the docs file (default {docs.DOCS})")
    args = parser.parse_args(argv)
    os.environ.setdefault("TRITON_INTERPRET", "0" if _has_gpu() else "1")
    cases = all_cases() if (args.all or args.markdown or args.check) else claimed_cases()
    paths = list(PATHS) if (args.markdown or args.check) else [args.path]
    reports = {}
    for path in paths:
        reports[path] = run_conformance(cases, path, args.jobs)
        print(f"{reports[path].summary()} [{reports[path].seconds:.0f} s, {args.jobs} processes]", flush=True)
    if args.markdown or args.check:
        return docs.write_or_check(reports, args.docs, check=args.check)
    for failure in reports[args.path].failures:
        print(f"  {failure.name}: {failure.reason}")
    return 0


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())
