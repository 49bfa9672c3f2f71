"""Each op's declared attributes (`opfuse.ir.attrs`): what a rule takes and refuses, the verifier applying them, and
the templates pasting only checked integers into kernel source."""

import pytest
import torch

from opfuse.codegen.expr import Unsupported, int_pair
from opfuse.ir.attrs import DIMS, SPATIAL, Bool, Dtype, Either, Float, Int, Ints, Optional, Word, check_attrs
from opfuse.ir.graph import GraphError, Node, TensorType
from opfuse.ir.ops import REGISTRY
from opfuse.ir.verify import verify
from tests.graph_builders import GraphBuilder, inception_siblings

INJECTED = "1 + 0*__import__('os').system('id')"


@pytest.mark.parametrize("rule, good, bad", [
    (Int(0, 4), [0, 4], [5, -1, 1.0, True, "1", None]),
    (Float(), [1e-5, 3, -2.5], [float("inf"), float("nan"), True, "1e-5"]),
    (Float(infinite=True), [float("-inf")], [float("nan")]),
    (Bool(), [True, False], [0, 1, "True"]),
    (Word(("none", "tanh")), ["tanh"], ["erf", 1, None]),
    (Dtype(), ["float16", torch.bfloat16], ["half", "float128", 16]),
    (Ints(Int(), 2), [[1, 2], (3, 4)], [[1], [1, 2, 3], [1, "2"], "12", [1.0, 2]]),
    (DIMS, [[0, -1], ()], [[9], list(range(9))]),
    (SPATIAL, [3, (1, 2), [1, 1, 1]], [[1, INJECTED], 1.5, -1]),
    (Either((Int(), Bool())), [1, True], ["x"]),
    (Optional(Int()), [None, 3], ["3"]),
])
def test_a_rule_takes_its_values_and_refuses_any_other(rule, good, bad):
    assert [rule.problem(v) for v in good] == [None] * len(good)
    assert all(rule.problem(v) for v in bad), [v for v in bad if not rule.problem(v)]


def test_every_op_declares_its_attributes_and_only_the_opaque_op_is_unchecked():
    unchecked = [name for name, op in REGISTRY.items() if op.attrs is None]
    assert unchecked == ["opaque"]
    assert all(isinstance(op.attrs, dict) for name, op in REGISTRY.items() if name != "opaque")


def test_an_attribute_its_op_does_not_take_is_refused_naming_node_and_attribute():
    node = Node("relu1", "relu", ["x"], {"inplace": True}, TensorType((2,), "float32"))
    with pytest.raises(GraphError, match=r"relu1 \[relu\].*'inplace'.*does not take"):
        check_attrs(node, REGISTRY["relu"].attrs)


def test_the_verifier_refuses_a_pool_window_that_is_a_string_before_any_kernel_is_generated():
    """Issue 53: a package's max-pool dilation ["1", "1 + 0*__import__('os').system(...)"] was pasted into the
    generated kernel source. The verifier runs the rules on every graph (and the loader on every package)."""
    graph = inception_siblings(c_in=8, size=8)
    verify(graph)
    pool = next(n for n in graph if n.op == "max_pool2d")
    pool.attrs["dilation"] = ["1", INJECTED]
    with pytest.raises(GraphError, match=r"\[max_pool2d\].*'dilation' entry 0 must be an integer"):
        verify(graph)
    pool.attrs["dilation"] = (1, 1)
    pool.attrs["padding"] = (1.0, 1.0)           # a float where an int belongs: ints stay ints
    with pytest.raises(GraphError, match="'padding' entry 0 must be an integer, not float"):
        verify(graph)


def test_templates_take_strides_and_windows_as_checked_int_pairs_only():
    node = Node("pool", "max_pool2d", ["x"], {}, TensorType((1, 1, 2, 2), "float32"))
    assert int_pair(3, node, "stride") == (3, 3)
    assert int_pair([1, 2], node, "stride") == (1, 2)
    for bad in (["1", INJECTED], (1.0, 1.0), "11", (1, 2, 3)):
        with pytest.raises(Unsupported, match="is not an int pair"):
            int_pair(bad, node, "dilation")


def test_a_graph_built_by_hand_passes_with_list_or_tuple_attributes():
    b = GraphBuilder("g", "float32")
    x = b.input("x", (1, 4, 8, 8))
    y = b.op("max_pool2d", [x], {"kernel_size": [2, 2], "stride": (2, 2), "padding": [0, 0], "dilation": (1, 1),
                                 "ceil_mode": False})
    verify(b.output(b.op("mean", [y], {"dims": [2, 3], "keepdim": True})))
