"""Compiling an ONNX model whose inputs include values that fix a shape: what `opfuse.compile(model_proto, inputs)`
needs to run every model ONNX's backend path runs.

Entry point: `compile_onnx(source, example_inputs, config, quiet) -> nn.Module`. opfuse's shapes are static, so a
graph input that some node reads where its converter needs a constant (a Reshape's shape, a Slice's starts, a
ReduceSum's axes: `onnx_converters.CONSTANT_INPUTS`), or whose value no node reads at all (CastLike's target,
Shape's input), is read from the example inputs as a constant, as `OpfuseBackend` does
(`onnx_backend.shape_inputs_of`). The model is imported with those values as initializers and compiled for the
other inputs. The module returned takes every input of the model, in its order, like the model: it checks, at each
call, that the inputs read as constants hold the values compiled for (a small host-side comparison; on a GPU one
synchronisation per such input) and refuses others by name, or with `config.recompile` compiles again for them.
A model without such inputs is compiled as it is, and the compiled module is returned unwrapped.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from opfuse.frontend.onnx_backend import check_constant_input, shape_inputs_of
from opfuse.frontend.onnx_import import OnnxSource, _read_model, describe_source, runtime_inputs
from opfuse.ir.graph import GraphError


def symbolic_shapes(model: onnx.ModelProto) -> dict[str, dict[int, Any]]:
    """The dynamic_shapes that make every symbolic dim of the (read) model's call inputs dynamic over [1, inf): by
    input name, {axis: torch.export.Dim}, one Dim per dim_param (inputs naming it share its size), one per unnamed
    dim; empty for a model of fixed shapes, or one with inputs read as constants (`constant_inputs`: those are
    compiled for their examples' values, `compile_onnx`)."""
    if constant_inputs(model):
        return {}
    dims: dict[str, Any] = {}
    shapes: dict[str, dict[int, Any]] = {}
    for value in runtime_inputs(model):
        if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
            continue
        for axis, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.HasField("dim_value"):
                continue
            name = dim.dim_param or f"{value.name}_{axis}"
            if name not in dims:
                dims[name] = torch.export.Dim(_identifier(name), min=1)
            shapes.setdefault(value.name, {})[axis] = dims[name]
    return shapes


def _identifier(name: str) -> str:
    """A dim_param as a Dim's name (a Python identifier, which torch.export.Dim requires)."""
    cleaned = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"d_{cleaned}"


def constant_inputs(model: onnx.ModelProto) -> list[int]:
    """The positions, among the model's inputs that are not initializers, of those read as constants."""
    names = [v.name for v in runtime_inputs(model)]
    read = set(shape_inputs_of(model))
    return [index for index, name in enumerate(names) if name in read]


def _as_array(tensor: torch.Tensor) -> np.ndarray:
    from opfuse.frontend.onnx_backend import to_array

    return to_array(tensor)


def specialised(model: onnx.ModelProto, values: dict[str, torch.Tensor], where: str) -> onnx.ModelProto:
    """A copy of `model` with these inputs' values as initializers (each checked against its declared type)."""
    inputs = {v.name: v for v in model.graph.input}
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for name, tensor in values.items():
        array = _as_array(tensor)
        check_constant_input(array, inputs[name], where)
        copy.graph.initializer.append(numpy_helper.from_array(array, name))
    return copy


def compile_onnx(source: OnnxSource, example_inputs: Sequence[torch.Tensor], config: Any = None,
                 quiet: bool = True) -> torch.nn.Module:
    """`source` (a path, bytes or ModelProto, never changed) compiled for `example_inputs`, the inputs that fix a
    shape read as constants (see the module docstring)."""
    import opfuse
    from opfuse.frontend.onnx_module import onnx_module

    config = opfuse.FusionConfig() if config is None else config
    example_inputs = tuple(example_inputs)
    where = describe_source(source)
    model = _read_model(source)
    names = [v.name for v in runtime_inputs(model)]
    positions = constant_inputs(model)
    if not positions:
        module = onnx_module(source, example_inputs).eval()      # (errors name the file)
        return opfuse.compile(module, example_inputs, config, quiet)
    if len(example_inputs) != len(names):
        raise GraphError(f"{where}: the model takes {len(names)} inputs ({', '.join(names)}), "
                         f"{len(example_inputs)} example inputs given")
    for index in positions:
        if not isinstance(example_inputs[index], torch.Tensor):
            raise GraphError(f"{where}: example input {names[index]!r} must be a tensor, got "
                             f"{type(example_inputs[index]).__name__}")
    return SpecialisedOnnxModel(model, where, names, positions, example_inputs, config, quiet)


class SpecialisedOnnxModel(torch.nn.Module):
    """An ONNX model compiled with some inputs read as constants: called with all of the model's inputs, it runs the
    model compiled for those constants' values (`inner`, the module opfuse.compile made). Attributes it lacks
    (fallbacks, analysis, compiled, launches) are that module's."""

    def __init__(self, model: onnx.ModelProto, where: str, names: list[str], positions: list[int],
                 example_inputs: Sequence[torch.Tensor], config: Any, quiet: bool):
        super().__init__()
        self.where, self.names, self.positions = where, names, positions
        self.__dict__["_model"] = model      # the ONNX model, kept to compile again (config.recompile)
        self.__dict__["_config"], self.__dict__["_quiet"] = config, quiet
        key = self._key(example_inputs)
        self.constants = {names[i]: example_inputs[i].detach().cpu().clone() for i in positions}
        self.inner = self._compile(example_inputs)
        self.__dict__["_variants"] = {key: self.inner}

    def _key(self, inputs: Sequence[torch.Tensor]) -> tuple:
        return tuple((i, str(inputs[i].dtype), tuple(inputs[i].shape), _as_array(inputs[i]).tobytes())
                     for i in self.positions)

    def _compile(self, inputs: Sequence[torch.Tensor]) -> torch.nn.Module:
        import opfuse
        from opfuse.frontend.onnx_module import onnx_module

        values = {self.names[i]: inputs[i] for i in self.positions}
        model = specialised(self._model, values, self.where)
        runtime = [x for i, x in enumerate(inputs) if i not in self.positions]
        module = onnx_module(model, runtime).eval()
        return opfuse.compile(module, runtime, self._config, self._quiet)

    def forward(self, *inputs: torch.Tensor) -> Any:
        if len(inputs) != len(self.names):
            raise GraphError(f"{self.where}: the model takes {len(self.names)} inputs ({', '.join(self.names)}), "
                             f"{len(inputs)} given")
        compiled = self.inner
        for i in self.positions:
            x, want = inputs[i], self.constants[self.names[i]]
            if not (isinstance(x, torch.Tensor) and x.dtype == want.dtype and x.shape == want.shape
                    and torch.equal(x.detach().cpu(), want)):
                compiled = self._other_constants(inputs, i)
                break
        return compiled(*[x for i, x in enumerate(inputs) if i not in self.positions])

    def _other_constants(self, inputs: Sequence[torch.Tensor], index: int) -> torch.nn.Module:
        """The model compiled for these values of the constant inputs (config.recompile), or an error naming the
        first that differs."""
        x = inputs[index]
        if not isinstance(x, torch.Tensor):
            raise GraphError(f"{self.where}: input {self.names[index]!r} must be a tensor, got {type(x).__name__}")
        if not getattr(self._config, "recompile", False):
            want = self.constants[self.names[index]]
            raise GraphError(f"{self.where}: input {self.names[index]!r} fixes a shape, so it was read as a constant "
                             f"when compiling: the model was compiled for its value {want.tolist()}, got "
                             f"{x.detach().cpu().tolist()}; compile again for it, or compile with "
                             "FusionConfig(recompile=True) to do so automatically")
        key = self._key(inputs)
        if key not in self._variants:
            self._variants[key] = self._compile(inputs)
        return self._variants[key]

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)
