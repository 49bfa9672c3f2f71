"""Triton expressions for the elementwise IR ops: the one table every kernel template's epilogue/prologue uses.

`emit(op, attrs, args)` returns a Triton expression (a string) computing the op on already-loaded float32 values
named in `args`. Generated kernels do all elementwise math in float32 and cast once when storing, but for wide
integers (int32, int64), which `emit_integer` computes in int64 (`INTEGER_OPS`; `opfuse.codegen.operands`).
An op not in the table raises `Unsupported`; the group holding it then runs through PyTorch (and the report says so).
"""

from __future__ import annotations

import math

from typing import Any, Callable, Sequence

from opfuse.fusion.reasons import Code, Reason
from opfuse.ir.graph import dtype_name


class Unsupported(Exception):
    """A template cannot generate this group (an op or attribute without a Triton lowering, a form it does not
    take); the group runs through PyTorch. `code`: the kind of refusal (`opfuse.fusion.reasons.Code`)."""

    def __init__(self, text: str, code: Code = Code.UNSUPPORTED):
        super().__init__(text)
        self.code = code


def refusal(template: str, check: Callable[[], object]) -> Reason | None:
    """None where `check()` (a template's checks, generating nothing) passes, else why the template refuses."""
    try:
        check()
    except Unsupported as error:
        return Reason(error.code, f"unsupported by the {template} template: {error}")
    return None


TRITON_DTYPES = {"float16": "tl.float16", "bfloat16": "tl.bfloat16", "float32": "tl.float32",
                 "float64": "tl.float64", "int64": "tl.int64", "int32": "tl.int32", "int16": "tl.int16",
                 "int8": "tl.int8", "uint8": "tl.uint8", "bool": "tl.int1"}


def triton_dtype(dtype: str) -> str:
    name = dtype_name(dtype)
    if name not in TRITON_DTYPES:
        raise Unsupported(f"no Triton dtype for {name}")
    return TRITON_DTYPES[name]


def literal(value: float) -> str:
    """A float literal Triton parses (repr keeps full precision; inf and nan have no literal)."""
    value = float(value)
    if math.isnan(value) or math.isinf(value):
        return f"float('{value}')"
    return repr(value)


def int_pair(value: Any, node: Any, attr: str) -> tuple[int, int]:
    """An int, or a pair of ints, of attribute `attr` of `node` as a pair: the only form a template pastes a stride,
    padding, dilation or window into its source (anything else, a string above all, is Unsupported)."""
    if type(value) is int:
        return value, value
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(type(v) is int for v in value):
        return value[0], value[1]
    raise Unsupported(f"{node.describe()}: {attr}={value!r} is not an int pair", Code.OPERAND_SHAPE)


def _tanh(x: str) -> str:
    # tanh(x) = 2·sigmoid(2x) − 1 : tl has no tanh in every supported Triton version. That form cancels for small
    # |x| (an absolute error of ~1e-7, so 5e-3 relative at x = 1e-5), so below 0.1 the odd Taylor series is used:
    # its first omitted term, 62/2835·x⁹, is under 1e-10 relative there.
    x2 = f"({x}) * ({x})"
    series = f"({x}) * (1.0 + {x2} * (-0.3333333333333333 + {x2} * (0.13333333333333333 - 0.05396825396825397 * {x2})))"
    return f"tl.where(tl.abs({x}) < 0.1, {series}, 2.0 * tl.sigmoid(2.0 * ({x})) - 1.0)"


# PyTorch's max/min/clamp/relu return NaN for a NaN operand; tl.maximum/minimum drop it unless told to propagate
PROPAGATE_NAN = "propagate_nan=tl.PropagateNan.ALL"


def _clamp(x: str, low: Any, high: Any) -> str:
    if low is not None:
        x = f"tl.maximum({x}, {literal(low)}, {PROPAGATE_NAN})"
    if high is not None:
        x = f"tl.minimum({x}, {literal(high)}, {PROPAGATE_NAN})"
    return x


# erfc(z) / 2 = t·exp(−z² + P(t)) for z >= 0, t = 1 / (1 + z/2): Numerical Recipes' Chebyshev fit of erfc
# (`erfcc`, relative error under 1.2e-7 for every z), its constant term less ln 2 to halve it
_HALF_ERFC = (-1.26551223 - math.log(2.0), 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
              -1.13520398, 1.48851587, -0.82215223, 0.17087277)


def _normal_cdf(x: str) -> str:
    """Φ(x) = erfc(−x/√2) / 2, the standard normal CDF, as 1 − erfc(z)/2 (x >= 0) or erfc(z)/2 (x < 0) with
    z = |x|/√2: relative error about 1e-7 (5e-6 where x² rounds, |x| > 5), with no cancellation in the negative
    tail, where 1 + erf(x/√2) is 0 in float32 (x < −5.8) and GELU is not. One exponential, one division and 12
    multiply-adds: libdevice's erf is about twice as many instructions (offline PTX for sm_90), which made exact
    GELU epilogues compute-bound (RESULTS.md, run 69)."""
    z = f"(tl.abs({x}) * 0.7071067811865476)"
    t = f"(1.0 / (1.0 + 0.5 * {z}))"
    polynomial = literal(_HALF_ERFC[-1])
    for coefficient in reversed(_HALF_ERFC[:-1]):
        polynomial = f"({literal(coefficient)} + {t} * {polynomial})"
    half_erfc = f"({t} * tl.exp({polynomial} - {z} * {z}))"
    return f"tl.where(({x}) >= 0.0, 1.0 - {half_erfc}, {half_erfc})"


def _gelu(attrs: dict, x: str) -> str:
    if attrs.get("approximate", "none") == "tanh":
        inner = f"0.7978845608028654 * (({x}) + 0.044715 * ({x}) * ({x}) * ({x}))"
        return f"(0.5 * ({x}) * (1.0 + {_tanh(inner)}))"
    return f"(({x}) * {_normal_cdf(x)})"


def _pow(x: str, y: str) -> str:
    """torch.pow on float32 values: |x|^y as exp(y·log|x|); a negative base keeps its sign for odd integer
    exponents, is NaN for non-integer ones; x^0 = 1 for every x (NaN included), as PyTorch has it. The exponent is
    usually a constant (GELU-tanh's x^3, RMSNorm's x^2), but any operand works."""
    magnitude = f"tl.exp(({y}) * tl.log(tl.abs({x})))"
    integer = f"(({y}) == tl.floor({y}))"
    odd = f"({integer} & ((({y}) - 2.0 * tl.floor(({y}) * 0.5)) == 1.0))"
    negative_base = f"tl.where({integer}, tl.where({odd}, -{magnitude}, {magnitude}), float('nan'))"
    return f"tl.where(({y}) == 0.0, 1.0, tl.where(({x}) < 0.0, {negative_base}, {magnitude}))"


def _log1p(u: str) -> str:
    """log(1 + u) without losing u's digits when |u| is small: log(w) * u / (w - 1), w = 1 + u rounded, cancels the
    rounding of w (Goldberg, "What every computer scientist should know about floating-point", theorem 4); u where
    w rounds to 1, w where it overflows. Triton has no log1p of its own in every version."""
    w = f"(1.0 + ({u}))"
    return (f"tl.where({w} == 1.0, ({u}), tl.where({w} == float('inf'), {w}, "
            f"tl.log({w}) * (({u}) / ({w} - 1.0))))")


def _half_exp(x: str) -> str:
    """exp(|x|) / 2, as exp(|x| - ln 2): finite up to |x| = ln(2 * float32's max)."""
    return f"tl.exp(tl.abs({x}) - {math.log(2)!r})"


def _expm1(x: str) -> str:
    """exp(x) - 1 without cancellation near 0: for |x| < 0.5, (u - 1) * x / log(u), u = exp(x) rounded, cancels
    u's rounding (Kahan's), x itself where u rounds to 1; elsewhere u - 1 loses nothing (and cannot overflow in a
    product first)."""
    u = f"tl.exp({x})"
    return (f"tl.where(tl.abs({x}) < 0.5, tl.where({u} == 1.0, ({x}), ({u} - 1.0) * ({x}) / tl.log({u})), "
            f"{u} - 1.0)")


def _softplus(attrs: dict, x: str) -> str:
    """PyTorch's: x where beta * x > threshold, else log1p(exp(beta * x)) / beta."""
    beta, threshold = literal(attrs["beta"]), literal(attrs["threshold"])
    return f"tl.where(({x}) * {beta} > {threshold}, ({x}), {_log1p(f'tl.exp(({x}) * {beta})')} / {beta})"


def _elu(attrs: dict, x: str) -> str:
    """scale * x where x > 0, else scale * alpha * expm1(input_scale * x): ELU, SELU and CELU."""
    alpha, scale, input_scale = (literal(attrs[k]) for k in ("alpha", "scale", "input_scale"))
    return f"tl.where(({x}) > 0.0, ({x}) * {scale}, {_expm1(f'({x}) * {input_scale}')} * {alpha} * {scale})"


def _batch_norm(attrs: dict, x: str, weight: str, bias: str, mean: str, var: str) -> str:
    return f"((({x}) - ({mean})) * tl.rsqrt(({var}) + {literal(attrs['eps'])}) * ({weight}) + ({bias}))"


def _sign(x: str) -> str:
    """-1.0 for a negative x, else 1.0 (the sign an odd function's value on |x| takes back)."""
    return f"tl.where(({x}) < 0.0, -1.0, 1.0)"


def _atan(x: str) -> str:
    """atan(x) (Cephes' single-precision atanf): |x| reduced to t in [-tan(pi/8), tan(pi/8)] (past tan(3 pi/8),
    pi/2 + atan(-1 / |x|); past tan(pi/8), pi/4 + atan((|x| - 1) / (|x| + 1))), then t + t z P(z), z = t^2, with
    x's sign: a float32 ulp or two, pi/2 at infinity."""
    a = f"tl.abs({x})"
    big, mid = f"({a} > 2.414213562373095)", f"({a} > 0.41421356237309503)"
    t = f"tl.where({big}, -1.0 / {a}, tl.where({mid}, ({a} - 1.0) / ({a} + 1.0), {a}))"
    base = f"tl.where({big}, {math.pi / 2!r}, tl.where({mid}, {math.pi / 4!r}, 0.0))"
    z = f"(({t}) * ({t}))"
    poly = f"((((0.0805374449538 * {z} - 0.138776856032) * {z} + 0.199777106478) * {z} - 0.333329491539) * {z})"
    return f"({_sign(x)} * ({base} + ({t}) + ({t}) * {poly}))"


def _asin_near_zero(w: str) -> str:
    """asin(w) for |w| <= 1/2 (Cephes' asinf): w + w z P(z), z = w^2."""
    z = f"(({w}) * ({w}))"
    return (f"(({w}) + ({w}) * {z} * ((((0.042163199048 * {z} + 0.024181311049) * {z} + 0.045470025998) * {z} "
            f"+ 0.074953002686) * {z} + 0.16666752422))")


def _asin_reduced(x: str) -> tuple[str, str]:
    """(|x| > 1/2, asin(r)) with r = sqrt((1 - |x|) / 2) past 1/2 (no cancellation near 1; NaN past |x| = 1, the
    square root of a negative), else x itself: what asin and acos build on."""
    far = f"(tl.abs({x}) > 0.5)"
    return far, _asin_near_zero(f"tl.where({far}, tl.sqrt(0.5 * (1.0 - tl.abs({x}))), {x})")


def _asin(x: str) -> str:
    """asin(x): the polynomial near 0; past |x| = 1/2, pi/2 - 2 asin(r) with x's sign (`_asin_reduced`)."""
    far, near = _asin_reduced(x)
    return f"tl.where({far}, {_sign(x)} * ({math.pi / 2!r} - 2.0 * {near}), {near})"


def _acos(x: str) -> str:
    """acos(x): pi/2 - asin(x) for |x| <= 1/2; past it 2 asin(r) (`_asin_reduced`), from pi for a negative x (no
    cancellation where the result is small)."""
    far, near = _asin_reduced(x)
    return (f"tl.where({far}, tl.where(({x}) < 0.0, {math.pi!r} - 2.0 * {near}, 2.0 * {near}), "
            f"{math.pi / 2!r} - {near})")


_UNARY: dict[str, Callable[[dict, str], str]] = {
    "relu": lambda a, x: f"tl.maximum({x}, 0.0, {PROPAGATE_NAN})",
    "clamp": lambda a, x: _clamp(x, a.get("min"), a.get("max")),
    "sigmoid": lambda a, x: f"tl.sigmoid({x})",
    "tanh": lambda a, x: _tanh(x),
    "silu": lambda a, x: f"(({x}) * tl.sigmoid({x}))",
    "gelu": _gelu,
    "hardswish": lambda a, x: f"(({x}) * {_clamp(f'({x}) + 3.0', 0.0, 6.0)} * 0.16666666666666666)",
    "hardsigmoid": lambda a, x: _clamp(f"({x}) * 0.16666666666666666 + 0.5", 0.0, 1.0),
    "erf": lambda a, x: f"tl.math.erf({x})",
    "exp": lambda a, x: f"tl.exp({x})",
    "log": lambda a, x: f"tl.log({x})",
    "sqrt": lambda a, x: f"tl.sqrt({x})",
    "rsqrt": lambda a, x: f"tl.rsqrt({x})",
    "neg": lambda a, x: f"(-({x}))",
    "abs": lambda a, x: f"tl.abs({x})",
    "reciprocal": lambda a, x: f"(1.0 / ({x}))",
    "identity": lambda a, x: x,
    "leaky_relu": lambda a, x: f"tl.where(({x}) > 0.0, ({x}), ({x}) * {literal(a['negative_slope'])})",
    "softplus": _softplus,
    "elu": _elu,
    "mish": lambda a, x: f"(({x}) * {_tanh(_log1p(f'tl.exp({x})'))})",
    "log_sigmoid": lambda a, x: f"(tl.minimum({x}, 0.0) - {_log1p(f'tl.exp(-tl.abs({x}))')})",
    "square": lambda a, x: f"(({x}) * ({x}))",
    "sin": lambda a, x: f"tl.sin({x})",
    "cos": lambda a, x: f"tl.cos({x})",
    "tan": lambda a, x: f"(tl.sin({x}) / tl.cos({x}))",
    # sinh and cosh as h ± 1 / (4 h), h = exp(|x| - ln 2): finite wherever the result is; sinh near 0 by expm1;
    # asinh(x) = sign(x) log1p(|x| + x^2 / (1 + sqrt(1 + x^2))), acosh(1 + t) = log1p(t + sqrt(t (t + 2))),
    # each log(2 |x|) past 1e18 (where x^2 overflows), atanh(x) = (log1p(x) - log1p(-x)) / 2: no cancellation
    "sinh": lambda a, x: (f"tl.where(tl.abs({x}) < 1.0, ({_expm1(x)} - {_expm1(f'-({x})')}) * 0.5, "
                          f"{_sign(x)} * ({_half_exp(x)} - 0.25 / {_half_exp(x)}))"),
    "cosh": lambda a, x: f"({_half_exp(x)} + 0.25 / {_half_exp(x)})",
    "asinh": lambda a, x: (f"{_sign(x)} * tl.where(tl.abs({x}) > 1e18, "
                           f"tl.log(tl.abs({x})) + {math.log(2)!r}, "
                           f"{_log1p(f'tl.abs({x}) + ({x}) * ({x}) / (1.0 + tl.sqrt(1.0 + ({x}) * ({x})))')})"),
    "acosh": lambda a, x: (f"tl.where(({x}) > 1e18, tl.log({x}) + {math.log(2)!r}, "
                           f"{_log1p(f'(({x}) - 1.0) + tl.sqrt((({x}) - 1.0) * (({x}) + 1.0))')})"),
    "atanh": lambda a, x: f"(({_log1p(x)} - {_log1p(f'-({x})')}) * 0.5)",
    "atan": lambda a, x: _atan(x),
    "asin": lambda a, x: _asin(x),
    "acos": lambda a, x: _acos(x),
    "log1p": lambda a, x: _log1p(x),
    "expm1": lambda a, x: _expm1(x),
    "floor": lambda a, x: f"tl.floor({x})",
    "ceil": lambda a, x: f"tl.ceil({x})",
    "sign": lambda a, x: f"tl.where(({x}) > 0.0, 1.0, tl.where(({x}) < 0.0, -1.0, 0.0))",   # NaN: 0, as PyTorch
    "logical_not": lambda a, x: f"tl.where(({x}) == 0.0, 1.0, 0.0)",
    "isinf": lambda a, x: f"tl.where(tl.abs({x}) == float('inf'), 1.0, 0.0)",   # a bool as 1.0 / 0.0
    # a cast inside a fused kernel rounds through the target type, then continues in float32
    "cast": lambda a, x: f"({x}).to({triton_dtype(a['dtype'])}).to(tl.float32)",
}

_BINARY: dict[str, Callable[[dict, str, str], str]] = {
    "add": lambda a, x, y: f"(({x}) + ({y}))",
    "sub": lambda a, x, y: f"(({x}) - ({y}))",
    "mul": lambda a, x, y: f"(({x}) * ({y}))",
    "div": lambda a, x, y: f"(({x}) / ({y}))",
    "maximum": lambda a, x, y: f"tl.maximum({x}, {y}, {PROPAGATE_NAN})",
    "minimum": lambda a, x, y: f"tl.minimum({x}, {y}, {PROPAGATE_NAN})",
    "pow": lambda a, x, y: _pow(x, y),
}
# narrow integers and bools, held as float32 values, exactly (a wide integer takes the integer form; a bitwise not
# has none here: its result depends on the dtype's width and sign)
for _name, _symbol in {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}.items():
    _BINARY[_name] = (lambda symbol: lambda a, x, y:
                      f"((({x}).to(tl.int64)) {symbol} (({y}).to(tl.int64))).to(tl.float32)")(_symbol)
for _name, _symbol in {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}.items():
    _BINARY[_name] = (lambda symbol: lambda a, x, y: f"tl.where(({x}) {symbol} ({y}), 1.0, 0.0)")(_symbol)  # bools

_TERNARY: dict[str, Callable[[dict, str, str, str], str]] = {
    "where": lambda a, c, x, y: f"tl.where(({c}) != 0.0, {x}, {y})",
}

SUPPORTED_OPS = frozenset(_UNARY) | frozenset(_BINARY) | frozenset(_TERNARY) | {"batch_norm"}
# ops whose result is discrete (a bool): their operands are rounded to their own dtype first, since a value kept in
# float32 inside a kernel may cross the threshold eager sees (inf, a comparison's bound) where eager's does not
DISCRETE_OPS = frozenset({"isinf", "lt", "le", "gt", "ge", "eq", "ne", "logical_not", "floor", "ceil", "sign",
                          "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not"})


# ops a kernel computes exactly on wide integers (int32, int64: token ids, positions), in int64; a bool operand is
# 0 or 1, `where`'s condition a float32 0.0 / 1.0 as elsewhere
_INTEGER: dict[str, Callable[[Sequence[str]], str]] = {
    "add": lambda a: f"(({a[0]}) + ({a[1]}))",
    "sub": lambda a: f"(({a[0]}) - ({a[1]}))",
    "mul": lambda a: f"(({a[0]}) * ({a[1]}))",
    "square": lambda a: f"(({a[0]}) * ({a[0]}))",
    "neg": lambda a: f"(-({a[0]}))",
    "abs": lambda a: f"tl.abs({a[0]})",
    "maximum": lambda a: f"tl.maximum({a[0]}, {a[1]})",
    "minimum": lambda a: f"tl.minimum({a[0]}, {a[1]})",
    "identity": lambda a: a[0],
    "where": lambda a: f"tl.where(({a[0]}) != 0.0, {a[1]}, {a[2]})",
    "floor_div": lambda a: _rounded_quotient(a[0], a[1], floor=True),
    "trunc_div": lambda a: _rounded_quotient(a[0], a[1], floor=False),
    "bitwise_and": lambda a: f"(({a[0]}) & ({a[1]}))",
    "bitwise_or": lambda a: f"(({a[0]}) | ({a[1]}))",
    "bitwise_xor": lambda a: f"(({a[0]}) ^ ({a[1]}))",
    "bitwise_not": lambda a: f"(~({a[0]}))",
}


def _rounded_quotient(a: str, b: str, floor: bool) -> str:
    """a / b rounded toward minus infinity (`floor`: a nonzero remainder takes b's sign) or zero (a's), in int64,
    whichever way `//` rounds: the quotient steps by one where the remainder has the other sign."""
    q = f"(({a}) // ({b}))"
    r = f"(({a}) - {q} * ({b}))"
    step = f"(({r} != 0) & (({r} < 0) != (({b if floor else a}) < 0))).to(tl.int64)"
    return f"({q} {'-' if floor else '+'} {step})"


INTEGER_OPS = frozenset(_INTEGER)


def emit_integer(op: str, args: Sequence[str]) -> str:
    """Triton expression for integer op `op` (`INTEGER_OPS`) on the int64 expressions `args`."""
    return _INTEGER[op](args)


def emit(op: str, attrs: dict, args: Sequence[str]) -> str:
    """Triton expression for `op` applied to the float32 expressions `args` (in the IR node's input order)."""
    if op in _UNARY and len(args) == 1:
        return _UNARY[op](attrs, args[0])
    if op in _BINARY and len(args) == 2:
        return _BINARY[op](attrs, args[0], args[1])
    if op in _TERNARY and len(args) == 3:
        return _TERNARY[op](attrs, *args)
    if op == "batch_norm" and len(args) == 5:
        return _batch_norm(attrs, *args)
    raise Unsupported(f"no Triton lowering for {op} with {len(args)} operands")
