"""What each IR op's attributes may hold: the rules `OpDef.attrs` states per op, and `check_attrs` that applies them.

An attribute is a plain value (a number, a bool, a dtype name, one word of a fixed set, or a list of those), never
something that becomes code: templates paste attribute values into kernel source, so a value that is not exactly
the type its rule says is refused before any source is generated. Integers stay integers (a float or a bool is not
an integer; 1.0 is refused where a stride is expected), dtypes are the IR's dtype names, words come from their
rule's set. A node carrying an attribute its op does not declare is refused too.

`check_attrs(node)` is what the package loader runs on every node of an untrusted package
(`opfuse.runtime.package`), and the verifier on every graph a frontend or pass builds (`opfuse.ir.verify`), so a
rule that misses what a frontend emits fails the tests, not a user's load. Opaque nodes are the one exception: they
carry what their PyTorch call needs (a Python callable among it) and never reach a template; a package refuses them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from opfuse.ir.graph import DTYPE_BYTES, GraphError, Node

MAX_DIMS = 8                  # ranks and list lengths an attribute may have (the IR's tensors have at most 6 dims)
MAX_INT = 1 << 62             # magnitude bound on an integer attribute (slice ends may be "to the end": 2^63 - 1)


class Rule:
    """One attribute's rule: `problem(value)` says what is wrong with a value in words, or None."""

    def problem(self, value: Any) -> str | None:
        raise NotImplementedError


@dataclass(frozen=True)
class Int(Rule):
    """An int (not a bool, not a float) within [low, high]."""

    low: int = -MAX_INT
    high: int = MAX_INT

    def problem(self, value: Any) -> str | None:
        if type(value) is not int:
            return f"must be an integer, not {_describe(value)}"
        if not self.low <= value <= self.high:
            return f"must lie in [{self.low}, {self.high}], got {value}"
        return None


@dataclass(frozen=True)
class Float(Rule):
    """A float or an int (not a bool); NaN only where `nan`, infinities only where `infinite`."""

    infinite: bool = False
    nan: bool = False

    def problem(self, value: Any) -> str | None:
        if type(value) not in (int, float):
            return f"must be a number, not {_describe(value)}"
        if math.isnan(value) and not self.nan:
            return "must not be NaN"
        if math.isinf(value) and not self.infinite:
            return f"must be finite, got {value}"
        return None


@dataclass(frozen=True)
class Bool(Rule):
    def problem(self, value: Any) -> str | None:
        return None if type(value) is bool else f"must be True or False, not {_describe(value)}"


@dataclass(frozen=True)
class Word(Rule):
    """One string of a fixed set."""

    choices: tuple[str, ...]

    def problem(self, value: Any) -> str | None:
        return None if type(value) is str and value in self.choices else \
            f"must be one of {', '.join(map(repr, self.choices))}, not {_describe(value)}"


@dataclass(frozen=True)
class Dtype(Rule):
    """An IR dtype name ('float16', ...) or a torch dtype of one."""

    def problem(self, value: Any) -> str | None:
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        return None if type(value) is str and value in DTYPE_BYTES else \
            f"must be a dtype name ({', '.join(DTYPE_BYTES)}), not {_describe(value)}"


@dataclass(frozen=True)
class Ints(Rule):
    """A list or tuple of `length` (any up to MAX_DIMS where None) values each following `item`."""

    item: Rule = Int()
    length: int | None = None

    def problem(self, value: Any) -> str | None:
        if not isinstance(value, (list, tuple)):
            return f"must be a list, not {_describe(value)}"
        if len(value) > MAX_DIMS or (self.length is not None and len(value) != self.length):
            return f"must have {self.length or f'at most {MAX_DIMS}'} entries, got {len(value)}"
        for index, item in enumerate(value):
            problem = self.item.problem(item)
            if problem is not None:
                return f"entry {index} {problem}"
        return None


@dataclass(frozen=True)
class Either(Rule):
    """A value that follows one of `rules` (an int or a list of ints, say)."""

    rules: tuple[Rule, ...]

    def problem(self, value: Any) -> str | None:
        problems = [rule.problem(value) for rule in self.rules]
        if None in problems:
            return None
        # the problem of the rule of the same form (a list's, for a list) says what is wrong inside it
        listed = isinstance(value, (list, tuple))
        same_form = [p for rule, p in zip(self.rules, problems) if isinstance(rule, Ints) == listed]
        return (same_form or problems)[0]


@dataclass(frozen=True)
class Optional(Rule):
    """None, or a value following `rule`."""

    rule: Rule

    def problem(self, value: Any) -> str | None:
        return None if value is None else self.rule.problem(value)


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


# the shapes common rules take
DIM = Int(-MAX_DIMS, MAX_DIMS)                 # a dimension, negative from the end
DIMS = Ints(DIM)
SIZE = Int(0, MAX_INT)                          # a length along a dimension
SHAPE = Ints(Int(-1, MAX_INT))                  # a reshape's target (-1: inferred)
SPATIAL = Either((Int(0, 1 << 20), Ints(Int(0, 1 << 20))))    # stride, padding, dilation, kernel size
ANY = None                                      # the opaque op's attributes: not checked (never in a template)


def check_attrs(node: Node, rules: Mapping[str, Rule] | None) -> None:
    """Raise GraphError naming `node` and the attribute if one is not declared by its op (`rules`) or breaks its
    rule; `rules` None (the opaque op) checks nothing."""
    if rules is None:
        return
    for key, value in node.attrs.items():
        rule = rules.get(key)
        if rule is None:
            declared = ", ".join(rules) or "none"
            raise GraphError(f"node {node.describe()} has attribute {key!r}, which op {node.op} does not take "
                             f"(it takes: {declared})")
        problem = rule.problem(value)
        if problem is not None:
            raise GraphError(f"node {node.describe()}: attribute {key!r} {problem}")
