"""A package's JSON checked against the types it must hold, before anything is built from it (`opfuse.load`).

A package is untrusted input (a serving fleet loads it from shared storage), so every value read from it is
decoded against a declared type and refused, naming where it sits in the file, when it is anything else:
`decoded(value, type, where)` follows a type hint (int, float, bool, str, None, list[...], tuple[..., ...],
dict[str, ...], X | None, an Enum, a dataclass, Any for plain JSON), and `dataclass_of(cls, data, where)` builds
a dataclass from a JSON object of exactly its fields. Integers stay integers (a float or a bool is not one), a
string has a bounded length, nesting a bounded depth. The graph, its nodes and their attributes have rules of their
own (`decode_graph`: names that are identifiers, registered ops, `opfuse.ir.attrs`' rule per attribute, then the
verifier), and the kernels' configs theirs (`decode_config`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from enum import Enum
from typing import Any, Union

from opfuse.ir.graph import DTYPE_BYTES, GraphError

MAX_TEXT = 4 << 20           # characters of one string (a kernel's source is the longest: tens of kilobytes)
MAX_DEPTH = 32               # nesting of plain JSON (Any)
NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.]{0,255}")      # a node's or a group's name


class PackageError(GraphError):
    """A package that cannot be written or loaded here; the message names the file and the problem."""


class SchemaError(ValueError):
    """A value of a package that is not what its place holds; the message says where and what."""


def decoded(value: Any, hint: Any, where: str) -> Any:
    """`value` (parsed JSON) as the type `hint` says, or SchemaError naming `where`."""
    origin = typing.get_origin(hint)
    if hint is Any:
        _plain(value, where, MAX_DEPTH)
        return value
    if hint is type(None) or hint is None:
        _expect(value is None, value, "null", where)
        return None
    if hint is list or hint is dict:     # the container alone: its items are decoded by the caller
        _expect(isinstance(value, hint), value, "a list" if hint is list else "an object", where)
        return value
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        problems = []
        for option in (o for o in options if o is not type(None)):
            try:
                return decoded(value, option, where)
            except SchemaError as error:
                problems.append(str(error))
        raise SchemaError(problems[0] if len(problems) == 1 else f"{where}: not any of {_name(hint)}")
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        _expect(isinstance(value, list), value, "a list", where)
        return [decoded(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        args = typing.get_args(hint)
        _expect(isinstance(value, list), value, "a list", where)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decoded(v, args[0], f"{where}[{i}]") for i, v in enumerate(value))
        _expect(len(value) == len(args), value, f"a list of {len(args)}", where)
        return tuple(decoded(v, a, f"{where}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict:
        key_type, item = typing.get_args(hint) or (str, Any)
        _expect(isinstance(value, dict), value, "an object", where)
        return {decoded(k, key_type, f"{where} key"): decoded(v, item, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise SchemaError(f"{where}: {_show(value)} is not one of {', '.join(repr(m.value) for m in hint)}") \
                from None
    if dataclasses.is_dataclass(hint):
        return dataclass_of(hint, value, where)
    if hint is bool:
        _expect(type(value) is bool, value, "true or false", where)
        return value
    if hint is int:
        _expect(type(value) is int, value, "an integer", where)
        return value
    if hint is float:
        _expect(type(value) in (int, float), value, "a number", where)
        return float(value)
    if hint is str:
        _expect(type(value) is str and len(value) <= MAX_TEXT, value, f"a string of at most {MAX_TEXT} characters",
                where)
        return value
    raise SchemaError(f"{where}: no rule to read a {_name(hint)}")


def dataclass_of(cls: type, data: Any, where: str, **overrides: Any) -> Any:
    """An instance of dataclass `cls` from a JSON object holding some of its init fields (the others keep their
    defaults; a field without one must be there) and nothing else, each decoded by its type hint; `overrides`
    replace fields after decoding (a value this machine decides, not the package)."""
    _expect(isinstance(data, dict), data, "an object", where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - set(fields)
    if unknown:
        raise SchemaError(f"{where}: unknown field {sorted(unknown)[0]!r} of a {cls.__name__}")
    values = {}
    for name, field in fields.items():
        if name in data:
            values[name] = decoded(data[name], hints[name], f"{where}.{name}")
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise SchemaError(f"{where}: the field {name!r} of a {cls.__name__} is missing")
    values.update(overrides)
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:     # a dataclass's own checks (__post_init__)
        raise SchemaError(f"{where}: {error}") from None


def name(value: Any, where: str) -> str:
    """A node's or a group's name: letters, digits, '_' and '.', at most 256."""
    _expect(type(value) is str and NAME.fullmatch(value) is not None, value, "a name (letters, digits, _ and .)",
            where)
    return value


def dtype(value: Any, where: str) -> str:
    """One of the IR's dtype names."""
    _expect(type(value) is str and value in DTYPE_BYTES, value, f"a dtype ({', '.join(DTYPE_BYTES)})", where)
    return value


def shape(value: Any, where: str) -> tuple[int, ...]:
    """A tensor's shape: at most 8 sizes, each an integer from 0 to 2^40."""
    _expect(isinstance(value, list) and len(value) <= 8
            and all(type(d) is int and 0 <= d <= 1 << 40 for d in value), value,
            "a shape (at most 8 integer sizes from 0 to 2^40)", where)
    return tuple(value)


def _plain(value: Any, where: str, depth: int) -> None:
    """SchemaError unless `value` is plain JSON no deeper than `depth` (NaN allowed: JSON as Python writes it)."""
    if depth < 0:
        raise SchemaError(f"{where}: nested too deep")
    if value is None or type(value) in (bool, int, float):
        return
    if type(value) is str:
        _expect(len(value) <= MAX_TEXT, value, f"a string of at most {MAX_TEXT} characters", where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _plain(item, f"{where}[{i}]", depth - 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _plain(item, f"{where}[{key!r}]", depth - 1)
    else:
        raise SchemaError(f"{where}: {_show(value)} is not JSON data")


def _expect(ok: bool, value: Any, what: str, where: str) -> None:
    if not ok:
        raise SchemaError(f"{where}: expected {what}, found {_show(value)}")


def _show(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and math.isnan(value):
        text = "NaN"
    return f"{type(value).__name__} {text[:60] + '...' if len(text) > 60 else text}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
