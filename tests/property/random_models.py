"""Random small models built from the ops opfuse supports: the hypothesis strategy `model_specs()` and
`build_model(spec)`, shared by the CPU property tests (tests/property) and the GPU run (tests/gpu).

A `ModelSpec` is plain data (input shapes, a list of `Layer`s, a weight seed), so a failing example prints as
Python that rebuilds the same model: paste it into a regular test. Each layer reads values made before it (the
first values are the model's inputs) and appends one value (two for sibling anchors); the model returns every
value no layer reads. Shapes are tracked while drawing, so every drawn model is valid for its input shapes.

What is drawn: convolutions (kernel 1/3, stride 1/2, padding, dilation, dense/grouped/depthwise, bias or not),
batch norm with non-trivial statistics, linear, sibling anchors (two 1x1 convs or two linears on one value:
horizontal fusion), batched matmul and attention on sequences, pointwise activations and scalar arithmetic,
binary ops with broadcasting (residual adds, squeeze-excite style products), reductions (softmax, layer_norm,
mean, max/avg/adaptive pools), layout ops (reshape, permute, flatten, channel slice, cat) and ops that once ran
through PyTorch (torch.cumsum, leaky_relu) in between. Sizes are mostly one tile, sometimes several (masked tails).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layer:
    """One step of a random model: `op` on the values `inputs` (indices), with `params`."""

    op: str
    inputs: tuple[int, ...]
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelSpec:
    input_shapes: tuple[Shape, ...]     # values 0 .. len-1 are the model's inputs
    layers: tuple[Layer, ...]
    seed: int = 0

    def describe(self) -> str:
        """One line per layer, for failure messages."""
        lines = [f"inputs {[list(s) for s in self.input_shapes]} seed {self.seed}"]
        for i, layer in enumerate(self.layers):
            lines.append(f"  {i}: {layer.op}{list(layer.inputs)} {layer.params}")
        return "\n".join(lines)


POINTWISE = ["relu", "relu6", "sigmoid", "tanh", "silu", "gelu", "gelu_tanh", "hardswish", "hardsigmoid", "abs",
             "neg", "mul_scalar", "add_scalar", "div_scalar", "clamp"]
OPAQUE = ["cumsum", "leaky_relu"]   # once run through PyTorch between fused groups: a scan and an activation now


def apply_pointwise(kind: str, x: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    if kind == "relu":
        return torch.relu(x)
    if kind == "relu6":
        return F.relu6(x)
    if kind == "sigmoid":
        return torch.sigmoid(x)
    if kind == "tanh":
        return torch.tanh(x)
    if kind == "silu":
        return F.silu(x)
    if kind == "gelu":
        return F.gelu(x)
    if kind == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if kind == "hardswish":
        return F.hardswish(x)
    if kind == "hardsigmoid":
        return F.hardsigmoid(x)
    if kind == "abs":
        return torch.abs(x)
    if kind == "neg":
        return -x
    if kind == "mul_scalar":
        return x * p["value"]
    if kind == "add_scalar":
        return x + p["value"]
    if kind == "div_scalar":
        return x / p["value"]
    if kind == "clamp":
        return torch.clamp(x, p["low"], p["high"])
    raise ValueError(kind)


class RandomModel(nn.Module):
    """The nn.Module of a ModelSpec: parameters in `self.params` keyed by layer index."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.params = nn.ModuleDict()
        shapes: list[Shape] = list(spec.input_shapes)
        for index, layer in enumerate(spec.layers):
            module = self._module(layer, [shapes[i] for i in layer.inputs])
            if module is not None:
                self.params[str(index)] = module
            shapes.extend(layer_output_shapes(layer, [shapes[i] for i in layer.inputs]))
        read = {i for layer in spec.layers for i in layer.inputs}
        self.outputs = [i for i in range(len(shapes)) if i not in read]

    @staticmethod
    def _module(layer: Layer, shapes: list[Shape]) -> nn.Module | None:
        p = layer.params
        if layer.op == "conv":
            return nn.Conv2d(shapes[0][1], p["out"], p["kernel"], p["stride"], p["padding"], p["dilation"],
                             p["groups"], bias=p["bias"])
        if layer.op == "siblings_conv":
            return nn.ModuleList(nn.Conv2d(shapes[0][1], out, 1, bias=p["bias"]) for out in p["outs"])
        if layer.op == "linear":
            return nn.Linear(shapes[0][-1], p["out"], bias=p["bias"])
        if layer.op == "siblings_linear":
            return nn.ModuleList(nn.Linear(shapes[0][-1], out, bias=p["bias"]) for out in p["outs"])
        if layer.op == "batch_norm":
            bn = nn.BatchNorm2d(shapes[0][1])
            bn.running_mean.normal_(0.0, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
            bn.weight.data.uniform_(0.5, 1.5)
            bn.bias.data.normal_(0.0, 0.2)
            return bn
        if layer.op == "layer_norm":
            norm = nn.LayerNorm(shapes[0][-1], elementwise_affine=p["affine"])
            if p["affine"]:
                norm.weight.data.uniform_(0.5, 1.5)
                norm.bias.data.normal_(0.0, 0.2)
            return norm
        if layer.op == "channel_affine":
            return nn.ParameterList([nn.Parameter(torch.randn(1, shapes[0][1], 1, 1) * 0.5 + 1.0)])
        return None

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(inputs)
        for index, layer in enumerate(self.spec.layers):
            module = self.params[str(index)] if str(index) in self.params else None
            values.extend(run_layer(layer, [values[i] for i in layer.inputs], module))
        return tuple(values[i] for i in self.outputs)


def run_layer(layer: Layer, xs: list[torch.Tensor], module: nn.Module | None) -> list[torch.Tensor]:
    p, x = layer.params, xs[0]
    op = layer.op
    if op in ("conv", "linear", "batch_norm", "layer_norm"):
        return [module(x)]
    if op in ("siblings_conv", "siblings_linear"):
        return [m(x) for m in module]
    if op == "channel_affine":
        return [x * module[0] + 0.1]
    if op == "pointwise":
        return [apply_pointwise(p["kind"], x, p)]
    if op == "binary":
        a, b = xs
        return [{"add": torch.add, "sub": torch.sub, "mul": torch.mul, "maximum": torch.maximum}[p["kind"]](a, b)]
    if op == "softmax":
        return [torch.softmax(x, p["dim"])]
    if op == "mean":
        return [x.mean(dim=p["dims"], keepdim=p["keepdim"])]
    if op == "max_pool":
        return [F.max_pool2d(x, p["kernel"], p["stride"], p["padding"], ceil_mode=p["ceil_mode"])]
    if op == "avg_pool":
        return [F.avg_pool2d(x, p["kernel"], p["stride"], p["padding"], ceil_mode=p["ceil_mode"],
                             count_include_pad=p["count_include_pad"])]
    if op == "adaptive_pool":
        return [F.adaptive_avg_pool2d(x, p["size"])]
    if op == "flatten":
        return [torch.flatten(x, 1)]
    if op == "reshape":
        return [x.reshape(p["shape"])]
    if op == "permute":
        return [x.permute(p["dims"])]
    if op == "slice":
        return [x[:, p["start"]:p["end"]:p["step"]]]
    if op == "cat":
        return [torch.cat(xs, p["dim"])]
    if op == "matmul":   # x @ yᵀ: attention scores when y is x
        return [torch.matmul(x, xs[1].transpose(-1, -2))]
    if op == "attention":
        return [F.scaled_dot_product_attention(x, x, x, is_causal=p["causal"])]
    if op == "cumsum":
        return [torch.cumsum(x, p["dim"])]
    if op == "leaky_relu":
        return [F.leaky_relu(x, 0.1)]
    raise ValueError(op)


def layer_output_shapes(layer: Layer, shapes: list[Shape]) -> list[Shape]:
    """Output shapes, from running the layer on meta tensors (one source of truth: run_layer)."""
    torch_state = torch.random.get_rng_state()
    module = RandomModel._module(layer, shapes)
    torch.random.set_rng_state(torch_state)
    if module is not None:
        module = module.to("meta").eval()
    outputs = run_layer(layer, [torch.empty(s, device="meta") for s in shapes], module)
    return [tuple(o.shape) for o in outputs]


def build_model(spec: ModelSpec) -> RandomModel:
    """The model of `spec`, weights drawn from `spec.seed` (the caller's random state is left alone), eval mode."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(spec.seed)
        return RandomModel(spec).eval()


def model_inputs(spec: ModelSpec, seed: int = 0, layout: str = "contiguous", device: str = "cpu",
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """Seeded standard-normal inputs; `layout` gives them other strides with the same values (the compiled model
    must read any strides): contiguous, channels_last (4-D), transposed (a permuted view) or sliced (a strided
    view into a larger tensor)."""
    generator = torch.Generator().manual_seed(seed)
    return tuple(with_layout(torch.randn(shape, generator=generator).to(device, dtype), layout)
                 for shape in spec.input_shapes)


LAYOUTS = ["contiguous", "channels_last", "transposed", "sliced"]


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "channels_last" and x.dim() == 4:
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "transposed" and x.dim() >= 2:
        return x.transpose(0, -1).contiguous().transpose(0, -1)
    if layout == "sliced":
        wide = torch.zeros(*x.shape[:-1], 2 * x.shape[-1], dtype=x.dtype, device=x.device)
        wide[..., ::2] = x
        return wide[..., ::2]
    return x


# ---- the strategy ------------------------------------------------------------------------------------

def _size(draw, small: int, wide: int) -> int:
    """Mostly tiny (one tile), sometimes wide enough for several tiles and masked tails."""
    return draw(st.integers(1, small)) if draw(st.integers(0, 3)) else draw(st.integers(small + 1, wide))


def _conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


@st.composite
def _conv(draw, shape: Shape) -> dict[str, Any]:
    c_in, h, w = shape[1], shape[2], shape[3]
    kernel = draw(st.sampled_from([1, 3]))
    stride = draw(st.sampled_from([1, 2]))
    padding = draw(st.sampled_from([0, 1])) if kernel == 3 else draw(st.sampled_from([0, 0, 1]))
    dilation = draw(st.sampled_from([1, 1, 2])) if kernel == 3 else 1
    if min(_conv_out(h, kernel, stride, padding, dilation), _conv_out(w, kernel, stride, padding, dilation)) < 1:
        padding, dilation = 1, 1
        if min(_conv_out(h, kernel, stride, 1, 1), _conv_out(w, kernel, stride, 1, 1)) < 1:
            kernel, padding = 1, 0
    style = draw(st.sampled_from(["dense", "dense", "grouped", "depthwise"]))
    if style == "depthwise":
        groups, out = c_in, c_in * draw(st.sampled_from([1, 1, 2]))
    elif style == "grouped":
        divisors = [g for g in range(2, c_in + 1) if c_in % g == 0] or [1]
        groups = draw(st.sampled_from(divisors))
        out = groups * draw(st.integers(1, 3))
    else:
        groups, out = 1, _size(draw, 8, 40)
    return {"out": out, "kernel": kernel, "stride": stride, "padding": padding, "dilation": dilation,
            "groups": groups, "bias": draw(st.booleans())}


@st.composite
def _pool(draw, shape: Shape) -> dict[str, Any]:
    h, w = shape[2], shape[3]
    kernel = draw(st.sampled_from([k for k in (2, 3) if k <= min(h, w)] or [1]))
    stride = draw(st.sampled_from([1, 2]))
    padding = draw(st.sampled_from([0, 1])) if kernel >= 2 else 0
    return {"kernel": kernel, "stride": stride, "padding": padding, "ceil_mode": draw(st.booleans())}


def _factor_pairs(n: int) -> list[tuple[int, int]]:
    return [(a, n // a) for a in range(2, n) if n % a == 0]


def _broadcast_partners(shapes: list[Shape], target: int) -> list[int]:
    """Values that can be combined elementwise with value `target` without changing its shape."""
    goal = shapes[target]
    partners = []
    for i, s in enumerate(shapes):
        if len(s) == len(goal) and all(a == b or a == 1 for a, b in zip(s, goal)):
            partners.append(i)
    return partners


@st.composite
def _layer(draw, shapes: list[Shape]) -> Layer:
    """One layer on the values made so far; mostly the last one (a chain), sometimes an earlier one (a branch)."""
    last = len(shapes) - 1
    source = draw(st.one_of(st.just(last), st.just(last), st.integers(0, last)))
    shape = shapes[source]
    rank = len(shape)
    options = ["pointwise", "pointwise", "softmax", "mean", "opaque", "linear", "siblings_linear", "layer_norm"]
    if rank == 4:
        options += ["conv"] * 5 + ["batch_norm", "siblings_conv", "siblings_conv", "max_pool", "avg_pool",
                                   "adaptive_pool", "flatten", "channel_affine", "permute", "reshape"]
        if shape[1] >= 2:
            options.append("slice")
    else:
        if rank == 3 or any(_factor_pairs(shape[-1])):
            options.append("reshape")
        if rank == 3:
            options += ["permute", "matmul", "attention"]
    partners = _broadcast_partners(shapes, source)
    options += ["binary", "binary"]          # with itself at least
    options.append("cat")
    op = draw(st.sampled_from(options))

    if op == "conv":
        return Layer("conv", (source,), draw(_conv(shape)))
    if op == "siblings_conv":
        return Layer("siblings_conv", (source,), {"outs": tuple(_size(draw, 8, 40) for _ in range(2)),
                                                  "bias": draw(st.booleans())})
    if op == "linear":
        return Layer("linear", (source,), {"out": _size(draw, 12, 70), "bias": draw(st.booleans())})
    if op == "siblings_linear":
        return Layer("siblings_linear", (source,), {"outs": tuple(_size(draw, 12, 70) for _ in range(2)),
                                                    "bias": draw(st.booleans())})
    if op == "opaque":
        op = draw(st.sampled_from(OPAQUE))
        return Layer(op, (source,), {"dim": draw(st.integers(1, rank - 1))} if op == "cumsum" else {})
    if op in ("batch_norm", "channel_affine", "flatten"):
        return Layer(op, (source,), {})
    if op == "layer_norm":
        return Layer("layer_norm", (source,), {"affine": draw(st.booleans())})
    if op == "pointwise":
        kind = draw(st.sampled_from(POINTWISE))
        params: dict[str, Any] = {"kind": kind}
        if kind in ("mul_scalar", "add_scalar", "div_scalar"):
            params["value"] = draw(st.sampled_from([-1.5, -0.5, 0.25, 2.0]))
        if kind == "clamp":
            params["low"], params["high"] = draw(st.sampled_from([(-0.5, 0.5), (0.0, 1.0), (-1.0, 2.0)]))
        return Layer("pointwise", (source,), params)
    if op == "softmax":
        return Layer("softmax", (source,), {"dim": draw(st.sampled_from([-1, 1]))})
    if op == "mean":
        dims = draw(st.sampled_from([(-1,), (1,)] + ([(2, 3), (-1, -2)] if rank == 4 else [])))
        keepdim = draw(st.booleans()) or rank - len(dims) < 2    # every value keeps a batch and a feature dim
        return Layer("mean", (source,), {"dims": dims, "keepdim": keepdim})
    if op == "max_pool":
        return Layer("max_pool", (source,), draw(_pool(shape)))
    if op == "avg_pool":
        return Layer("avg_pool", (source,), {**draw(_pool(shape)), "count_include_pad": draw(st.booleans())})
    if op == "adaptive_pool":
        sizes = [1] + ([2] if shape[2] % 2 == 0 and shape[3] % 2 == 0 else [])
        return Layer("adaptive_pool", (source,), {"size": draw(st.sampled_from(sizes))})
    if op == "permute":
        dims = draw(st.sampled_from([(0, 2, 3, 1), (0, 3, 1, 2), (0, 1, 3, 2)])) if rank == 4 else (0, 2, 1)
        return Layer("permute", (source,), {"dims": dims})
    if op == "reshape":
        if rank == 4:
            n, c, h, w = shape
            new = draw(st.sampled_from([(n, c, h * w), (n, c * h, w), (n, c * h * w)]))
        elif rank == 3:
            new = draw(st.sampled_from([(shape[0], shape[1] * shape[2])]
                                       + [(shape[0], shape[1], a, b) for a, b in _factor_pairs(shape[2])
                                          if shape[1] > 0]))
        else:
            a, b = draw(st.sampled_from(_factor_pairs(shape[-1])))
            new = (shape[0], a, b)
        return Layer("reshape", (source,), {"shape": tuple(new)})
    if op == "slice":
        c = shape[1]
        start = draw(st.integers(0, c - 1))
        end = draw(st.integers(start + 1, c))
        return Layer("slice", (source,), {"start": start, "end": end, "step": draw(st.sampled_from([1, 1, 2]))})
    if op == "matmul":
        others = [i for i, s in enumerate(shapes) if len(s) == 3 and s[0] == shape[0] and s[2] == shape[2]]
        return Layer("matmul", (source, draw(st.sampled_from(others))), {})
    if op == "attention":
        return Layer("attention", (source,), {"causal": draw(st.booleans())})
    if op == "binary":
        other = draw(st.sampled_from(partners))
        kind = draw(st.sampled_from(["add", "add", "mul", "sub", "maximum"]))
        return Layer("binary", (source, other), {"kind": kind})
    # cat: with a value of the same shape but for the cat dim (itself at least)
    dim = draw(st.sampled_from([1, -1]))
    axis = dim % rank
    same = [i for i, s in enumerate(shapes)
            if len(s) == rank and all(a == b for d, (a, b) in enumerate(zip(s, shape)) if d != axis)]
    return Layer("cat", (source, draw(st.sampled_from(same))), {"dim": dim})


@st.composite
def model_specs(draw, max_layers: int = 8) -> ModelSpec:
    """A random valid ModelSpec with 1..max_layers layers on a tiny image or sequence input (and sometimes a
    second input of the same or a broadcastable shape)."""
    kind = draw(st.sampled_from(["image", "image", "image", "sequence", "rows"]))
    batch = draw(st.integers(1, 2))
    if kind == "image":
        shape: Shape = (batch, _size(draw, 6, 32), draw(st.integers(3, 8)), draw(st.integers(3, 8)))
    elif kind == "sequence":
        shape = (batch, draw(st.integers(1, 5)), _size(draw, 12, 70))
    else:
        shape = (batch, _size(draw, 12, 70))
    input_shapes = [shape]
    if draw(st.integers(0, 3)) == 0:
        broadcast = shape[:2] + (1,) * (len(shape) - 2) if len(shape) == 4 else (1,) * (len(shape) - 1) + shape[-1:]
        input_shapes.append(draw(st.sampled_from([shape, broadcast])))
    shapes: list[Shape] = list(input_shapes)
    layers = []
    centered: set[int] = set()   # values whose rows have mean 0 (layer_norm without affine)
    for _ in range(draw(st.integers(1, max_layers))):
        layer = draw(_layer(shapes))
        rank = len(shapes[layer.inputs[0]])
        if (layer.op == "mean" and layer.inputs[0] in centered
                and rank - 1 in {d % rank for d in layer.params["dims"]}):
            continue   # the mean of a normalised row is rounding noise around 0: no precision can compare it
        outputs = layer_output_shapes(layer, [shapes[i] for i in layer.inputs])
        if any(math.prod(s) == 0 for s in outputs) or any(math.prod(s) > 8192 for s in outputs):
            continue   # keep tensors small (the interpreter is slow) and never empty
        if layer.op == "layer_norm" and not layer.params["affine"]:
            centered.add(len(shapes))
        layers.append(layer)
        shapes.extend(outputs)
    if not layers:
        layers.append(Layer("pointwise", (0,), {"kind": "relu"}))
    return ModelSpec(tuple(input_shapes), tuple(layers), draw(st.integers(0, 2 ** 16)))


# ---- the property ------------------------------------------------------------------------------------

def check_compiles_to_eager(spec: ModelSpec, *, dtype: str = "float32", device: str = "cpu",
                            tolerance: float = 1e-4, use_cost_model: bool = True, autotune: bool = False,
                            layout: str = "contiguous", calls: int = 1, cache_dir: str | None = None) -> Any:
    """Compile `spec`'s model, then assert: the model is unchanged, no kernel failed its own check (a failing
    kernel would be silently un-fused), and every output matches eager within `tolerance` on `calls` sets of
    fresh inputs of the given `layout`; with calls > 1 the first set is run once more and must give identical
    results (on CUDA the later calls replay a captured CUDA graph, whose inputs are copied in).

    The reference is eager in float64 on the same device; where eager at the compute dtype is itself over the
    tolerance (an ill-conditioned output), the compiled model may be as far off (times 1.25), as opfuse.compile
    allows. Returns the compiled model."""
    import opfuse

    model = build_model(spec).to(device)
    torch_dtype = getattr(torch, dtype)
    low = copy.deepcopy(model).to(torch_dtype)      # what the user compiles, in the compute dtype
    examples = model_inputs(spec, seed=0, device=device, dtype=torch_dtype)
    state = {k: v.clone() for k, v in low.state_dict().items()}
    config = opfuse.FusionConfig(dtype=dtype, use_cost_model=use_cost_model, autotune=autotune,
                                 cache_dir=cache_dir)
    compiled = opfuse.compile(low, examples, config)
    assert all(torch.equal(state[k], v) for k, v in low.state_dict().items()), "compile changed the model"
    failed = [c for c in compiled.checks if not c.passed]
    assert not failed, "kernels failed their own check:\n" + "\n".join(
        f"  {c.kernel} (group {c.group}): error {c.error:.2e} {c.detail}" for c in failed) + "\n" + spec.describe()

    first = None
    for call in range(calls):
        fresh = model_inputs(spec, seed=1 + call, layout=layout, device=device, dtype=torch_dtype)
        outputs = _assert_matches_eager(compiled, model, low, fresh, tolerance, spec, dtype)
        first = first or (fresh, outputs)
    if calls > 1:
        with torch.no_grad():
            again = compiled(*first[0])
        assert all(torch.equal(a, b) for a, b in zip(again, first[1])), "the same inputs gave other outputs"
    return compiled


def _assert_matches_eager(compiled: Any, model: nn.Module, low: nn.Module, inputs: tuple[torch.Tensor, ...],
                          tolerance: float, spec: ModelSpec, dtype: str) -> tuple[torch.Tensor, ...]:
    from opfuse.numerics import acceptable, relative_error, scaled_errors

    with torch.no_grad():
        reference = copy.deepcopy(model).double()(*(x.double() for x in inputs))
        outputs = compiled(*inputs)
        eager = low(*inputs)
    assert len(outputs) == len(reference)
    scaled = None
    for index, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.shape == ref.shape and out.dtype == eager[index].dtype, (index, out.shape, ref.shape, out.dtype)
        error, eager_error = relative_error(out, ref), relative_error(eager[index], ref)
        # the rule opfuse.compile applies: where eager at this precision is itself further off than the tolerance,
        # the compiled model may be as far off, or within the tolerance of its operands' scale
        if scaled is None and error > tolerance and eager_error > tolerance:
            scaled = scaled_errors(compiled.compiled.graph, inputs, outputs, dtype)
        assert acceptable(error, tolerance, eager_error, scaled and scaled[index]), (
            f"output {index}: relative error {error:.2e} (eager {eager_error:.2e}, against the operands' scale "
            f"{'-' if scaled is None else f'{scaled[index]:.2e}'}) > {tolerance:.0e}\n{spec.describe()}\n"
            f"fallbacks: {compiled.fallbacks}")
    return outputs
