"""The roofline floor (`opfuse.analysis.roofline.floor`) on examples counted by hand: a GEMM bound by the tensor
cores, an elementwise add bound by memory, an embedding that reads only its gathered rows, a batch-1 workload's
launch-and-bandwidth floor, and the rates a floor takes from a GPU's datasheet."""

from __future__ import annotations

import pytest
import torch

from opfuse.analysis.roofline import (Ceilings, Work, compulsory_bytes, datasheet_ceilings, floor, hardware_of_gpu,
                                      share_of_floor, workload_work)
from opfuse.api import analyze
from opfuse.bench import harness
from opfuse.config import FusionConfig
from opfuse.hardware import get_hardware

H200 = get_hardware("h200")
FP16 = 2          # bytes per float16 element


def analysed(model: torch.nn.Module, *inputs: torch.Tensor, dtype: str = "float16"):
    return analyze(model.eval(), inputs, FusionConfig(dtype=dtype))


class Add(torch.nn.Module):
    def forward(self, a, b):
        return a + b


class Embed(torch.nn.Module):
    """A large token table gathered by a few ids, plus a small table read whole."""

    def __init__(self):
        super().__init__()
        self.tokens = torch.nn.Embedding(50000, 64)
        self.positions = torch.nn.Embedding(16, 64)

    def forward(self, ids):
        return self.tokens(ids) + self.positions.weight


def test_a_large_gemm_is_bound_by_the_tensor_cores():
    m = n = k = 1024
    analysis = analysed(torch.nn.Linear(k, n, bias=False), torch.randn(m, k))
    work = workload_work(analysis)
    assert work.flops == 2 * m * n * k
    assert work.compulsory_bytes == (m * k + k * n + m * n) * FP16      # input, weight, output: each once
    bound = work.floor(datasheet_ceilings(H200, "float16"))
    assert bound.compute == pytest.approx(2 * m * n * k / 989e12)        # H200 SXM: 989 TFLOP/s dense fp16
    assert bound.memory == pytest.approx(3 * m * k * FP16 / 4.8e12)      # 4.8 TB/s
    assert bound.bound == "compute" and bound.roofline == bound.compute
    measured = 2 * bound.compute
    assert share_of_floor(bound.roofline, measured) == pytest.approx(0.5)


def test_an_elementwise_add_is_bound_by_memory():
    rows, columns = 4096, 1024
    analysis = analysed(Add(), torch.randn(rows, columns), torch.randn(rows, columns))
    work = workload_work(analysis)
    elements = rows * columns
    assert work.flops == elements                                        # one add per element
    assert work.compulsory_bytes == 3 * elements * FP16                  # two operands read, one result written
    bound = work.floor(datasheet_ceilings(H200, "float16"))
    assert bound.bound == "memory"
    assert bound.roofline == pytest.approx(3 * elements * FP16 / 4.8e12)
    # a single kernel: the plan moves exactly the compulsory bytes, so its floor is the same
    assert work.plan_bytes == work.compulsory_bytes
    assert work.plan_floor(datasheet_ceilings(H200, "float16")).roofline == pytest.approx(bound.roofline)


def test_an_embedding_table_counts_only_its_gathered_rows():
    ids = torch.randint(0, 50000, (2, 16))
    analysis = analysed(Embed(), ids)
    gathered = 2 * 16 * 64 * FP16
    expected = (ids.numel() * 8             # the int64 ids, read whole
                + gathered                  # the 32 rows of the 50000-row table the ids pick
                + 16 * 64 * FP16            # the position table, read whole by the add
                + 2 * 16 * 64 * FP16)       # the output
    assert compulsory_bytes(analysis.prepared) == expected
    assert expected < 50000 * 64 * FP16     # far less than the table


def test_a_convolution_counts_its_folded_weights_once():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU())
    analysis = analysed(model, torch.randn(1, 3, 8, 8))
    # batch norm folds into the conv's weight and bias: the kernels read those, not the norm's four vectors
    expected = (3 * 8 * 8 + 16 * 3 * 3 * 3 + 16 + 16 * 8 * 8) * FP16
    assert compulsory_bytes(analysis.prepared) == expected
    work = workload_work(analysis)
    assert work.plan_bytes >= work.compulsory_bytes      # no plan moves less than the compulsory traffic
    assert work.plan_launches == analysis.plan.kernel_launches


def test_a_batch_one_workload_floor_adds_a_launch_per_kernel():
    ceilings = datasheet_ceilings(H200, "float16")
    work = Work(flops=10 ** 9, compulsory_bytes=48 * 10 ** 6, plan_bytes=96 * 10 ** 6, plan_launches=57)
    bound = work.floor(ceilings, launches=57)
    bandwidth = 48e6 / 4.8e12                                            # 10 us of weights: memory-bound
    assert bound.roofline == pytest.approx(bandwidth) and bound.bound == "memory"
    assert bound.launch == pytest.approx(57 * 2.5e-6)                   # the profile's launch overhead
    assert bound.launch_and_bandwidth == pytest.approx(bandwidth + 57 * 2.5e-6)
    assert floor(10 ** 9, 48e6, ceilings).launch_and_bandwidth == pytest.approx(bandwidth)    # no launches granted
    # a result row grants the fewest kernels any contender launched (here opfuse's 57 against 104 and 280)
    row = {"dtype": "float16", "plan_launches": 57, "work": vars(work),
           "eager": {"median_ms": 2.0, "kernels": 280}, "inductor": {"median_ms": 0.425, "kernels": 104},
           "opfuse": {"median_ms": 0.341, "kernels": 57}, "opfuse_replay": {"median_ms": 0.330}}
    found = harness.row_roofline(row, H200)
    assert found.floor.launches == 57 and found.best_baseline == "inductor"
    floor_ms = (bandwidth + 57 * 2.5e-6) * 1e3
    assert found.launch_shares["opfuse"] == pytest.approx(floor_ms / 0.341)
    assert found.launch_shares["inductor"] == pytest.approx(floor_ms / 0.425)
    assert found.shares["opfuse_replay"] == pytest.approx(bandwidth * 1e3 / 0.330)
    assert found.plan_floor.roofline == pytest.approx(96e6 / 4.8e12)
    assert harness.row_roofline(row | {"plan_launches": 58}, H200).plan_floor is None    # another plan was measured
    assert harness.row_roofline({k: v for k, v in row.items() if k != "work"}, H200) is None


def test_datasheet_ceilings_follow_the_precision_products_run_in(monkeypatch):
    assert datasheet_ceilings(H200, "float16") == Ceilings(989e12, 4.8e12, 2.5e-6)
    assert datasheet_ceilings(H200, "bfloat16").flops == 989e12
    assert datasheet_ceilings(get_hardware("a100"), "float16").flops == 312e12
    precision = torch.get_float32_matmul_precision()
    try:
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", True)
        torch.set_float32_matmul_precision("highest")
        # convolutions as three tf32 products each (opfuse's float32 on the tensor cores), GEMMs in full float32
        assert datasheet_ceilings(H200, "float32").flops == pytest.approx(494e12 / 3)
        monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
        assert datasheet_ceilings(H200, "float32").flops == 67e12       # nothing on the tensor cores
        torch.set_float32_matmul_precision("high")
        assert datasheet_ceilings(H200, "float32").flops == pytest.approx(494e12 / 3)     # GEMMs so too
    finally:
        torch.set_float32_matmul_precision(precision)


def test_the_measured_ceilings_floor_counts_the_same_bytes():
    m = k = 256
    analysis = analysed(torch.nn.Linear(k, k, bias=False), torch.randn(m, k))
    compute_ms, memory_ms = harness.floor_ms(analysis, {"fp16_matrix_flops": 1e14, "copy_bytes_per_s": 1e12})
    assert compute_ms == pytest.approx(2 * m * k * k / 1e14 * 1e3)
    assert memory_ms == pytest.approx(3 * m * k * FP16 / 1e12 * 1e3)


def test_a_gpu_name_picks_its_profile():
    assert hardware_of_gpu("NVIDIA H200") is H200
    assert hardware_of_gpu("NVIDIA H100 80GB HBM3") is get_hardware("h100")
    assert hardware_of_gpu("NVIDIA GeForce RTX 4090") is get_hardware("rtx4090")
    assert hardware_of_gpu("NVIDIA A100-SXM4-80GB") is get_hardware("a100")
    assert hardware_of_gpu("NVIDIA H100 PCIe") is None            # other clocks and memory than the SXM profile
    assert hardware_of_gpu("NVIDIA L4") is None and hardware_of_gpu(None) is None


def test_a_share_needs_both_times():
    assert share_of_floor(1e-3, 4e-3) == pytest.approx(0.25)
    assert share_of_floor(None, 4e-3) is None and share_of_floor(1e-3, None) is None
    assert share_of_floor(1e-3, 0.0) is None
