"""cumsum (and cumprod) as a scan: the IR op (shape, dtype rules, the dtype= argument, cost), its ATen mapping, the
row template's scan on Triton's interpreter (any dim, odd sizes, rows longer than one block, integer inputs carried
exactly in int64), its prologue/epilogue fusion, the planner's reason where it refuses, and RoBERTa's position ids
compiled with nothing of the scan through PyTorch. Eager float32 is the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opfuse
from opfuse.codegen.base import KernelConfig
from opfuse.codegen.reduction import RowReductionKernel, lower_reduction_group
from opfuse.config import FusionConfig
from opfuse.frontend.torch_export import capture_torch
from opfuse.fusion.legality import can_fuse
from opfuse.fusion.plan import FusionGroup, GroupKind
from opfuse.fusion.reasons import Code
from opfuse.fusion.tiles import row_view
from opfuse.ir.graph import Graph, TensorType
from opfuse.ir.interpret import interpret
from opfuse.ir.ops import FusionKind, get_op, infer_type, node_bytes, node_flops
from opfuse.ir.rows import row_dependence
from tests.kernels.test_reduction_kernels import SMALL_CHUNKS, Builder, run_group

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


# ---- the op ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,attrs,want", [
    ("float16", {}, "float16"), ("float32", {}, "float32"), ("bool", {}, "int64"), ("int32", {}, "int64"),
    ("int8", {}, "int64"), ("int64", {}, "int64"), ("float16", {"dtype": "float32"}, "float32"),
    ("int32", {"dtype": "float32"}, "float32"), ("float32", {"dtype": "int32"}, "int32"),
])
def test_the_op_keeps_the_shape_and_follows_torch_dtype_rules(dtype, attrs, want):
    out = infer_type("cumsum", [TensorType((2, 5, 3), dtype)], {"dim": 1, **attrs})
    assert out == TensorType((2, 5, 3), want)
    assert get_op("cumsum").kind is FusionKind.REDUCTION


def test_the_reference_is_torch_cumsum_with_its_dtype_argument():
    x = torch.randn(3, 7)
    run = get_op("cumsum").run
    torch.testing.assert_close(run([x], {"dim": 1}), torch.cumsum(x, 1))
    torch.testing.assert_close(run([x * 3], {"dim": 0, "dtype": "int64"}), torch.cumsum(x * 3, 0, dtype=torch.int64))


def test_cost_one_add_per_element_and_the_input_and_output_moved_once():
    g = Graph("cost")
    x = g.add_input("x", TensorType((4, 33), "float16")).name
    y = g.add_node("cumsum", [x], TensorType((4, 33), "float16"), {"dim": 1})
    assert node_flops(g, y) == 4 * 33
    assert node_bytes(g, y) == (4 * 33 * 2, 4 * 33 * 2)
    view = row_view(g, y)
    assert (view.mode, view.dims, view.rows, view.length) == ("cumsum", (1,), 4, 33)


def test_rows_along_the_scanned_dim_depend_on_each_other():
    g = Graph("rows")
    x = g.add_input("x", TensorType((4, 6), "float32")).name
    y = g.add_node("cumsum", [x], TensorType((4, 6), "float32"), {"dim": 0})
    g.outputs = [y.name]
    dependence = row_dependence(g)
    assert dependence is not None and "scans along" in dependence.why
    y.attrs["dim"] = 1
    assert row_dependence(g) is None


# ---- the frontend ----------------------------------------------------------------------------------------------

class Scans(nn.Module):
    def forward(self, x, mask):
        return (torch.cumsum(x, dim=-1), torch.cumsum(x, 1, dtype=torch.float64).float(), mask.cumsum(0),
                torch.cumprod(x, -2), mask.int().cumsum(1, dtype=torch.int32))


def test_aten_cumsum_and_cumprod_map_to_the_ir_ops_with_their_dim_and_dtype():
    x, mask = torch.randn(2, 5, 7), torch.rand(4, 3) > 0.5
    graph = capture_torch(Scans().eval(), (x, mask))
    scans = [n for n in graph if n.op in ("cumsum", "cumprod")]
    assert not [n for n in graph if n.op == "opaque"]
    assert [(n.op, n.attrs) for n in scans] == [("cumsum", {"dim": 2}), ("cumsum", {"dim": 1, "dtype": "float64"}),
                                                ("cumsum", {"dim": 0}), ("cumprod", {"dim": 1}),
                                                ("cumsum", {"dim": 1, "dtype": "int32"})]
    assert scans[2].type.dtype == "int64" and scans[4].type.dtype == "int32"   # (an int32 scan asked for stays so)
    for got, want in zip(interpret(graph, [x, mask]), Scans()(x, mask)):
        torch.testing.assert_close(got, want)


# ---- the kernel ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dim", [((3, 1), 1), ((3, 7), 1), ((2, 33), -1), ((4, 300), 1), ((2, 7, 5), 1),
                                       ((3, 33, 2, 4), 1), ((1, 5, 33), 2), ((33, 3), 0)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["default", "small-chunks"])
def test_cumsum_over_any_dim_and_odd_sizes(shape, dim, config):
    """Odd row lengths, rows longer than one block (300 > the interpreter's 128; 33 > SMALL_CHUNKS' 16), and a
    middle dim of a 3-D and a 4-D (channels-last) input."""
    b = Builder()
    kernel, _ = run_group(b, [b.op("cumsum", b.input("x", shape), dim=dim)], config)
    assert isinstance(kernel, RowReductionKernel)


@pytest.mark.parametrize("shape,dim", [((3, 7), 1), ((4, 300), 1), ((3, 33, 2, 4), 1), ((33, 3), 0)],
                         ids=lambda v: str(v))
@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["default", "small-chunks"])
def test_cumprod_carries_the_product_of_the_chunks_before(shape, dim, config):
    """The product scan: each chunk's tl.cumprod times the carry (lanes past the row multiply by 1); values of
    either sign near 1 so that 300 of them stay finite."""
    b = Builder()
    values = torch.exp(torch.randn(shape) * 0.05) * torch.where(torch.rand(shape) < 0.1, -1.0, 1.0)
    kernel, _ = run_group(b, [b.op("cumprod", b.input("x", shape, values), dim=dim)], config)
    assert isinstance(kernel, RowReductionKernel)


def test_integer_cumprod_is_exact_in_int64():
    values = torch.randint(1, 4, (3, 37), dtype=torch.int32) * torch.where(torch.rand(3, 37) < 0.2, -1, 1).int()
    b = Builder()
    x = b.graph.add_input("x", TensorType((3, 37), "int32")).name
    y = b.op("cumprod", x, dim=1)
    kernel = lower_reduction_group(b.graph, b.group([y]), "cpu")
    (got,) = kernel.run([values], SMALL_CHUNKS)
    want = torch.cumprod(values, 1)
    assert got.dtype == torch.int64 and torch.equal(got, want) and want.abs().max() > 2 ** 24


def test_float16_cumsum_carries_float32():
    b = Builder("float16")
    run_group(b, [b.op("cumsum", b.input("x", (3, 200), b.random(3, 200)), dim=1)], SMALL_CHUNKS)


def test_prologue_and_epilogue_fuse_with_the_scan():
    """Mamba2's segment sum: a masked fill (where) before the scan, its exp after; the prologue value is stored."""
    b = Builder()
    x = b.input("x", (2, 6, 9))
    keep = b.const("keep", torch.tril(torch.ones(9, 9), -1)[:6])
    filled = b.op("mul", x, keep)
    scanned = b.op("cumsum", filled, dim=-2)
    y = b.op("exp", b.op("mul", scanned, b.const("s", torch.tensor(0.25))))
    run_group(b, [filled, y], SMALL_CHUNKS)
    run_group(b, [filled, y])


def run_integer(values: torch.Tensor, dim: int, config: KernelConfig | None = None, **attrs) -> torch.Tensor:
    """An integer scan lowered alone and run; checked exactly against torch.cumsum."""
    b = Builder()
    g = b.graph
    x = g.add_input("x", TensorType(tuple(values.shape), str(values.dtype).removeprefix("torch."))).name
    y = b.op("cumsum", x, dim=dim, **attrs)
    kernel = lower_reduction_group(g, b.group([y]), "cpu")
    kernel.output_fill = -7
    (got,) = kernel.run([values], config)
    want = get_op("cumsum").run([values], {"dim": dim, **attrs})
    assert got.dtype == want.dtype
    assert torch.equal(got, want)
    return got


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("config", [None, SMALL_CHUNKS], ids=["default", "small-chunks"])
def test_integer_inputs_scan_exactly_into_int64(dtype, config):
    if dtype is torch.bool:
        values = torch.rand(3, 37) > 0.4
    elif dtype is torch.uint8:
        values = torch.randint(0, 255, (3, 37), dtype=dtype)
    else:   # values a float32 carry would round: past 2^24
        values = torch.randint(-(2 ** 30), 2 ** 30, (3, 37), dtype=dtype)
    got = run_integer(values, 1, config)
    assert got.dtype == torch.int64


def test_integer_scan_over_a_middle_dim_and_past_2_to_the_24():
    values = torch.full((2, 40, 3), 2 ** 20 + 1, dtype=torch.int64)
    run_integer(values, 1, SMALL_CHUNKS)


@pytest.mark.parametrize("source,attrs", [(torch.float32, {"dtype": "int64"}), (torch.int32, {"dtype": "float32"}),
                                          (torch.bool, {"dtype": "int32"})])
def test_the_dtype_argument(source, attrs):
    values = (torch.randn(3, 33) * 5).to(source) if source is not torch.bool else torch.rand(3, 33) > 0.5
    if attrs["dtype"] == "float32":
        b = Builder()
        x = b.graph.add_input("x", TensorType((3, 33), "int32")).name
        y = b.op("cumsum", x, dim=1, **attrs)
        kernel = lower_reduction_group(b.graph, b.group([y]), "cpu")
        (got,) = kernel.run([values], SMALL_CHUNKS)
        torch.testing.assert_close(got, torch.cumsum(values, 1, dtype=torch.float32))
    else:
        run_integer(values, 1, SMALL_CHUNKS, **attrs)


def test_float_dtype_argument_rounds_the_input_first():
    b = Builder()
    y = b.op("cumsum", b.input("x", (2, 45), b.random(2, 45) * 100), dim=1, dtype="float16")
    run_group(b, [y], SMALL_CHUNKS)


# ---- legality ----------------------------------------------------------------------------------------------------

def test_an_integer_scan_takes_wide_integer_prologue_and_epilogue_exactly():
    """ids - 7 (int64, past 2^24) scanned, then times 3 wrapped to int32 and compared: every step exact."""
    g = Graph("int")
    ids = g.add_input("ids", TensorType((2, 37), "int64")).name
    seven = g.add_constant("seven", torch.tensor(7)).name
    three = g.add_constant("three", torch.tensor(3, dtype=torch.int32)).name
    shifted = g.add_node("sub", [ids, seven], TensorType((2, 37), "int64")).name
    scan = g.add_node("cumsum", [shifted], TensorType((2, 37), "int64"), {"dim": 1}).name
    narrow = g.add_node("cast", [scan], TensorType((2, 37), "int32"), {"dtype": "int32"}).name
    wrapped = g.add_node("mul", [narrow, three], TensorType((2, 37), "int32")).name
    odd = g.add_node("ne", [wrapped, scan], TensorType((2, 37), "bool")).name
    g.outputs = [wrapped, odd]
    users = g.users()
    assert can_fuse(g, [shifted], [scan], users) is None and can_fuse(g, [shifted, scan], [narrow, wrapped, odd],
                                                                    users) is None
    group = FusionGroup(0, GroupKind.REDUCTION, [shifted, scan, narrow, wrapped, odd], inputs=[ids],
                        outputs=[wrapped, odd])
    kernel = lower_reduction_group(g, group, "cpu")
    values = torch.randint(2 ** 40, 2 ** 41, (2, 37))
    for config in (None, SMALL_CHUNKS):
        got = kernel.run([values], config)
        want = interpret(g, [values])
        assert [t.dtype for t in got] == [torch.int32, torch.bool]
        assert all(torch.equal(a, b) for a, b in zip(got, want))


# ---- models ------------------------------------------------------------------------------------------------------

class PositionIds(nn.Module):
    """RoBERTa's create_position_ids_from_input_ids, on a mask given as floats or as integers."""

    def __init__(self, past: int = 2, pad: int = 1):
        super().__init__()
        self.past, self.pad = past, pad

    def forward(self, x):
        mask = x.ne(self.pad).to(x.dtype)
        return (torch.cumsum(mask, 1).type_as(mask) + self.past) * mask + self.pad


def scan_groups(analysis) -> list:
    return [g for g in analysis.plan.groups if any(analysis.prepared[n].op == "cumsum" for n in g.nodes)]


def test_position_ids_of_a_float_mask_compile_into_one_kernel_with_nothing_through_pytorch():
    x = torch.tensor([[0.0, 5, 7, 1, 1, 3, 1], [1, 1, 4, 4, 2, 9, 8]])
    model = PositionIds().eval()
    config = FusionConfig(dtype="float32")
    analysis = opfuse.analyze(model, (x,), config)
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    (group,) = scan_groups(analysis)
    assert group.kind.value == "reduction" and len(group.nodes) >= 4, group.nodes
    compiled = opfuse.compile(model, (x,), config)
    torch.testing.assert_close(compiled(x), model(x))


def test_position_ids_of_token_ids_compile_into_one_kernel_with_nothing_through_pytorch():
    """RoBERTa's own: int64 ids, an int32 mask, the scan and the casts after it: one kernel, exact."""
    ids = torch.tensor([[0, 5, 7, 1, 1, 3, 1], [1, 1, 4, 4, 2, 9, 8]])

    class TokenPositions(nn.Module):
        def forward(self, input_ids):
            mask = input_ids.ne(1).int()
            return (torch.cumsum(mask, dim=1).type_as(mask) + 2) * mask + 1

    model = TokenPositions().eval()
    config = FusionConfig(dtype="float32")
    analysis = opfuse.analyze(model, (ids,), config)
    assert not analysis.opaque_ops and analysis.pytorch_groups == {}
    (group,) = scan_groups(analysis)
    assert len([g for g in analysis.plan.groups if g.launches]) == 1, analysis.plan.groups
    compiled = opfuse.compile(model, (ids,), config)
    got = compiled(ids)
    assert got.dtype == torch.int32 and torch.equal(got, model(ids))
