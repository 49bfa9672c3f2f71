"""Cost model (roofline, group traffic, density rule) and resource model (tiles, registers, shared memory)."""

import dataclasses

import pytest
import torch

from graph_builders import GraphBuilder, conv_bn_relu, conv_relu, resnet_bottleneck, transformer_ffn, attention_block
from opfuse.config import FusionConfig
from opfuse.fusion.cost import (estimate_kernel, group_traffic, is_fusion_candidate, op_density, predict_time,
                                tile_efficiency)
from opfuse.fusion.resources import ADDRESSING_REGISTERS, describe_tile, estimate_resources, gemm_view
from opfuse.fusion.tiles import anchor_tiles
from opfuse.hardware import get_hardware
from opfuse.ir.ops import get_op, node_bytes, node_flops

H200 = get_hardware("h200")


# ---- roofline ----------------------------------------------------------------------------------------

def test_predict_time_is_the_roofline_plus_one_launch_times_the_time_factor():
    assert predict_time(1e9, 1e9, H200, "float16", matrix=False) == pytest.approx(
        H200.time_factor * predict_time(1e9, 1e9, H200.with_calibration(time_factor=1.0), "float16", matrix=False))
    hw = H200.with_calibration(time_factor=1.0)
    memory_rate = hw.memory_bandwidth * hw.memory_efficiency
    # memory bound: 1 GB, 1 GFLOP
    assert predict_time(1e9, 1e9, hw, "float16", matrix=False) == pytest.approx(1e9 / memory_rate
                                                                                  + hw.launch_overhead)
    # compute bound on the vector units, and the same FLOPs on the tensor cores
    vector = predict_time(1e13, 1e6, hw, "float16", matrix=False)
    matrix = predict_time(1e13, 1e6, hw, "float16", matrix=True)
    assert vector == pytest.approx(1e13 / (hw.vector_flops * hw.vector_efficiency) + hw.launch_overhead)
    assert matrix == pytest.approx(1e13 / (hw.matrix_peak("float16") * hw.matrix_efficiency) + hw.launch_overhead)
    # a tile with half the operand reuse halves the tensor-core rate
    halved = predict_time(1e13, 1e6, hw, "float16", matrix=True, tile_efficiency=0.5)
    assert halved - hw.launch_overhead == pytest.approx(2 * (matrix - hw.launch_overhead))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
@pytest.mark.parametrize("tf32", [False, True])
def test_a_float32_product_is_priced_at_the_precision_it_runs_in(conv, tf32, monkeypatch):
    """float32 matrix products run as PyTorch's settings say (`opfuse.numerics.dot_precision`): three tf32
    products where tf32 is allowed, else full float32 on the CUDA cores; fp16 is untouched."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", tf32)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high" if tf32 else "highest")
    graph = conv_relu(c_in=256, c_out=256, size=64) if conv else transformer_ffn(batch=8, seq=512, d=1024,
                                                                               hidden=4096)
    node = "conv" if conv else "fc1"
    users = graph.users()
    estimate = estimate_kernel(graph, [node], users, H200, "float32")
    expected = predict_time(estimate.traffic.flops, estimate.traffic.bytes_moved, H200,
                            "tf32x3" if tf32 else "ieee", matrix=True,
                            tile_efficiency=tile_efficiency(estimate.resources))
    assert estimate.time == pytest.approx(expected)
    # compute bound: three tf32 products take 3x one, full float32 on the CUDA cores longer still
    one_tf32 = estimate.traffic.flops / (H200.matrix_peak("float32") * H200.matrix_efficiency
                                         * tile_efficiency(estimate.resources))
    assert estimate.time / H200.time_factor - H200.launch_overhead > 2.9 * one_tf32
    assert H200.matrix_peak("tf32x3") == H200.matrix_peak("float32") / 3
    assert H200.matrix_peak("ieee") == H200.vector_flops


def test_fusing_a_pointwise_op_into_its_producer_is_predicted_faster():
    graph = conv_bn_relu()
    users = graph.users()
    apart = sum(estimate_kernel(graph, [n], users, H200, "float16").time for n in ("conv", "bn", "relu"))
    fused = estimate_kernel(graph, ["conv", "bn", "relu"], users, H200, "float16").time
    assert fused < apart - 2 * H200.launch_overhead   # two launches fewer, and less traffic


def test_tile_efficiency_follows_operand_reuse():
    graph = conv_relu(c_out=128)
    default = estimate_resources(graph, ["conv"], "conv", H200, "float16",
                                 tile={"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 32, "num_stages": 3,
                                       "num_warps": 8})
    small = estimate_resources(graph, ["conv"], "conv", H200, "float16",
                               tile={"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_stages": 3, "num_warps": 4})
    assert tile_efficiency(default) == 1.0
    assert tile_efficiency(small) == pytest.approx((64 * 64 / 128) / (128 * 128 / 256))   # 32 / 64
    assert tile_efficiency(None) == 1.0


# ---- traffic -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("build", [conv_bn_relu, resnet_bottleneck, transformer_ffn, attention_block])
def test_one_node_group_moves_exactly_what_the_registry_says(build):
    graph = build()
    users = graph.users()
    for node in graph:
        if get_op(node.op).launches_kernel:
            traffic = group_traffic(graph, [node.name], users)
            assert (traffic.bytes_read, traffic.bytes_written) == node_bytes(graph, node), node.name
            assert traffic.flops == node_flops(graph, node)


def test_group_reads_each_outside_value_once_and_writes_only_what_leaves():
    b = GraphBuilder("g")
    x = b.input("x", (1024,))
    square = b.op("mul", [x, x], name="square")          # reads x twice as one op
    out = b.unary("exp", square, "exp")
    graph = b.output(out)
    users = graph.users()
    assert node_bytes(graph, graph["square"]) == (2 * 2048, 2048)
    traffic = group_traffic(graph, ["square", "exp"], users)
    assert traffic.inputs == ("x",)
    assert traffic.outputs == ("exp",)
    assert (traffic.bytes_read, traffic.bytes_written) == (2048, 2048)
    assert traffic.flops == 1024 + 4 * 1024   # mul 1 + exp 4 FLOPs per element (the registry's)


def test_views_are_free():
    graph = attention_block(batch=2, seq=16, heads=2, head_dim=8)
    users = graph.users()
    view = group_traffic(graph, ["q_heads"], users)
    assert (view.bytes_read, view.bytes_written, view.flops) == (0, 0, 0)
    assert estimate_kernel(graph, ["q_heads"], users, H200, "float16").time == 0.0


def test_density_rule_flags_batch_norm_and_relu_not_the_conv():
    graph = conv_bn_relu()
    config = FusionConfig()
    assert op_density(graph, graph["relu"]) == pytest.approx(0.25)   # 1 FLOP per 2 B read + 2 B written
    assert is_fusion_candidate(graph, graph["relu"], config)
    assert is_fusion_candidate(graph, graph["bn"], config)
    assert not is_fusion_candidate(graph, graph["conv"], config)
    assert not is_fusion_candidate(graph, graph["x"], config)        # inputs launch nothing
    assert is_fusion_candidate(graph, graph["conv"], FusionConfig(density_threshold=1e9))


# ---- resources -----------------------------------------------------------------------------------------

def test_conv_default_tile_registers_and_shared_memory_by_hand():
    """The tile priced is the kernel's default (`anchor_tiles`, the list the conv template launches from): a 3x3
    conv of 3136 pixels x 128 channels reducing 288 runs 64x64x64 tiles (3 stages, 4 warps)."""
    graph = conv_relu(c_out=128)
    estimate = estimate_resources(graph, ["conv", "relu"], "conv", H200, "float16")
    assert estimate.fits
    assert estimate.tile == anchor_tiles(3136, 128, 288, 1, 2, False, hw=H200)[0] == \
        {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 3, "num_warps": 4}
    # accumulator 64*64/128 = 32, bias vector ceil(64/128) = 1, addressing 40
    assert estimate.registers_per_thread == 32 + 1 + ADDRESSING_REGISTERS
    assert estimate.shared_memory_bytes == 3 * (64 * 64 + 64 * 64) * 2


def test_residual_operand_costs_a_tile_of_registers_and_staging():
    graph = resnet_bottleneck()
    estimate = estimate_resources(graph, ["conv3", "add", "relu_out"], "conv3", H200, "float16")
    assert estimate.fits
    assert estimate.tile == {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 32, "num_stages": 4, "num_warps": 4}
    # accumulator 64*128/128 = 64, the skip tile 64*128*2 B / 4 B per register / 128 threads = 32 registers (staged
    # through smem), bias 1
    assert estimate.registers_per_thread == 64 + 32 + 1 + ADDRESSING_REGISTERS
    assert estimate.shared_memory_bytes == 4 * (64 * 32 + 32 * 128) * 2 + 64 * 128 * 2


def test_smaller_tile_chosen_before_declaring_over_budget():
    graph = resnet_bottleneck()
    tight = dataclasses.replace(H200, max_registers_per_thread=128)
    estimate = estimate_resources(graph, ["conv3", "add", "relu_out"], "conv3", tight, "float16")
    assert estimate.fits
    assert (estimate.tile["BLOCK_M"], estimate.tile["BLOCK_N"]) == (64, 64)
    assert "needs 137 registers/thread > 128" in estimate.reason   # what the default tile needed


def test_over_budget_reason_lists_where_the_registers_go():
    graph = resnet_bottleneck()
    tiny = dataclasses.replace(H200, max_registers_per_thread=48)
    estimate = estimate_resources(graph, ["conv3", "add", "relu_out"], "conv3", tiny, "float16")
    assert not estimate.fits
    # the smallest tile, 2048 elements on 4 warps (32x64 or 64x32): accumulator 16, skip tile 8, bias 1, addressing 40
    assert estimate.tile["BLOCK_M"] * estimate.tile["BLOCK_N"] == 2048 and estimate.registers_per_thread == 65
    assert "the smallest" in estimate.reason and "needs 65 registers/thread > 48" in estimate.reason
    assert "accumulator 16" in estimate.reason and "1 full-tile operand(s) 8" in estimate.reason


def test_shared_memory_over_budget():
    graph = resnet_bottleneck()
    tiny = dataclasses.replace(H200, shared_memory_per_block=4096)
    estimate = estimate_resources(graph, ["conv3"], "conv3", tiny, "float16")
    assert not estimate.fits
    assert "shared memory > 4096" in estimate.reason


def test_a_row_reduction_holds_chunks_of_its_rows():
    """The row template's default tile (`row_kernel_tiles`): a layer norm over 768 holds 2 rows of 1024 lanes on 4
    warps; a softmax of two rows of 2^20 walks them in chunks of 4096 on 8 warps, so it fits where a whole row would
    not, each row in 128 slices (two rows alone would leave 130 SMs idle)."""
    b = GraphBuilder("rows")
    x = b.input("x", (4, 768))
    graph = b.output(b.layer_norm(x, "ln"))
    estimate = estimate_resources(graph, ["ln"], None, H200, "float16")
    assert estimate.fits
    assert estimate.tile == {"BLOCK_M": 2, "BLOCK_L": 1024, "SPLIT": 1, "num_warps": 4}
    assert describe_tile(estimate.tile) == "2x1024 (4 warps)"          # rows x lanes, as the reasons say it
    # x, weight, bias chunks + a scratch chunk, each 2048 / 128 threads = 16 registers; mean and rstd of 2 rows
    assert estimate.registers_per_thread == 4 * 16 + 2 + ADDRESSING_REGISTERS

    b = GraphBuilder("long_rows")
    x = b.input("x", (2, 1 << 20))
    graph = b.output(b.op("softmax", [x], {"dim": -1}, "softmax"))
    estimate = estimate_resources(graph, ["softmax"], None, H200, "float16")
    assert estimate.fits and estimate.tile == {"BLOCK_M": 1, "BLOCK_L": 4096, "SPLIT": 128, "num_warps": 8}
    assert estimate.registers_per_thread == 2 * 16 + 2 + ADDRESSING_REGISTERS


def test_elementwise_registers_grow_with_live_operands():
    b = GraphBuilder("pw")
    inputs = [b.input(f"x{i}", (1 << 16,)) for i in range(3)]
    y = b.op("add", inputs[:2], name="add0")
    y = b.op("mul", [y, inputs[2]], name="mul0")
    graph = b.output(y)
    one = estimate_resources(graph, ["add0"], None, H200, "float16")
    two = estimate_resources(graph, ["add0", "mul0"], None, H200, "float16")
    per_operand = 1024 // 128
    assert one.registers_per_thread == (2 + 1) * per_operand + ADDRESSING_REGISTERS
    assert two.registers_per_thread == (3 + 1) * per_operand + ADDRESSING_REGISTERS


@pytest.mark.parametrize("x_shape, w_shape, view", [((4,), (4,), (1, 1, 4, 1)), ((3, 4), (4,), (3, 1, 4, 1)),
                                                    ((4,), (2, 4, 5), (1, 5, 4, 2)), ((2, 3, 4), (4, 5), (3, 5, 4, 2))])
def test_a_matmul_with_a_1d_operand_is_one_row_or_column(x_shape, w_shape, view):
    """torch.matmul reads a 1-D left operand as one row and a 1-D right one as one column (ONNX's MatMul too): (rows,
    columns, reduction, GEMMs) of each."""
    b = GraphBuilder("matmul_1d", dtype="float32")
    y = b.op("matmul", [b.input("x", x_shape), b.input("w", w_shape)])
    graph = b.output(y)
    assert gemm_view(graph, y) == view
    assert estimate_resources(graph, [y], y, H200, "float32").fits
