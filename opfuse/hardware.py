"""Hardware profiles: the one place where GPU numbers live (`get_hardware(name)`).

Peak rates are the vendors' dense (no sparsity) datasheet numbers unless a comment says "measured"; the
efficiency factors scale them to what real kernels reach and are calibrated by `opfuse profile` (issue 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

TFLOPS = 1e12
TBPS = 1e12
KIB = 1024


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    # peak FLOP/s on the tensor cores by operand dtype ("float32" means tf32), and on the CUDA cores (vector)
    matrix_flops: dict[str, float]
    vector_flops: float
    memory_bandwidth: float          # bytes/s, device memory
    launch_overhead: float           # seconds per kernel launch seen by a stream of launches
    sm_count: int
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    shared_memory_per_block: int = 227 * KIB   # largest opt-in dynamic shared memory for one block
    shared_memory_per_sm: int = 228 * KIB
    l2_bytes: int = 50 * 1024 * KIB
    # fraction of the peaks a good kernel reaches; calibrated from measurements
    matrix_efficiency: float = 0.7
    memory_efficiency: float = 0.85
    vector_efficiency: float = 0.6
    # seconds one iteration of a loop takes when it waits for its own loads (no pipelining across iterations):
    # the floor of a program that walks a long reduction alone. The H200's value is the whole-block conv-conv
    # kernels' per-iteration time measured on mobilenet_v2 at batch 1 (2026-11-30: ~0.6 ms over 446 serial
    # iterations); the other profiles share it unmeasured
    serial_step: float = 1.3e-6
    # the same for one mid-channel chunk of a depthwise + pointwise kernel, by its tile: a fixed part, per element
    # of the BLOCK_M x BLOCK_K depthwise tile (its taps) and per multiply-add of the BLOCK_M x BLOCK_N x BLOCK_K dot.
    # Fitted on the H200 to the spill-free 4-warp kernels of 576 timings (2026-11-30, `benchmarks/conv_conv_sweep.py`,
    # runs 16-17: mobilenet_v2's blocks at batch 1 and 64; median error 11% at batch 1, 16% at batch 64); the other
    # profiles share it unmeasured
    conv_conv_step: float = 0.15e-6
    conv_conv_tap_step: float = 0.35e-9
    conv_conv_mac_step: float = 1.8e-12
    # the depthwise + pointwise kernel's efficiency relative to what the model assumes of other kernels (its
    # traffic and FLOPs; the chain above is its own floor): on the H200 it ran 4.7x slower than predicted (median
    # of mobilenet_v2's 14 such blocks at batch 64, 2026-11-30, with the old wide tiles) where the blocks' unfused
    # kernels ran 2.2x slower, so 0.47; the whole-block kernel (with the expansion) matched the others and keeps
    # 1.0. The other profiles share it unmeasured
    conv_conv_efficiency: float = 0.47
    # what one program (one SM) streams alone from L2 or device memory, and the latency of a load it waits for:
    # the floor of a kernel whose work ends in one program per sample (the squeeze's two small GEMMs,
    # `opfuse.fusion.squeeze`). Estimates for Hopper (about 64 B per clock per SM; a device-memory round trip),
    # unmeasured; the other profiles share them
    program_bandwidth: float = 100e9
    load_latency: float = 0.6e-6
    # what the kernels take in a CUDA graph replay over what the model above says (roofline at these efficiencies,
    # loop floors, launch): every kernel time is multiplied by it, so it moves no decision of the planner, only
    # the predicted times. Fitted to the zoo's measured replays by `benchmarks/zoo.py --fit` where measured
    time_factor: float = 1.0
    # kernels run through Triton's CPU interpreter (tests): each template launches one tiny tile (`kernel_profile`)
    interpreted: bool = False
    notes: str = field(default="", compare=False)

    def matrix_peak(self, dtype: str) -> float:
        """Peak FLOP/s of a matrix product in `dtype` (`opfuse.numerics.matrix_dtype`): "tf32x3" takes three tf32
        products per float32 one; a dtype without tensor cores ("ieee": float32 in full) runs on the CUDA cores."""
        if dtype == "tf32x3":
            return self.matrix_flops["float32"] / 3
        return self.matrix_flops.get(dtype, self.vector_flops)

    @property
    def launch_time(self) -> float:
        """Seconds one launch adds to a kernel's predicted time."""
        return self.launch_overhead * self.time_factor

    def with_calibration(self, **factors: float) -> "HardwareProfile":
        return replace(self, **factors)

    def with_ideal_conv_conv(self) -> "HardwareProfile":
        """This profile without the conv-conv measurements (loop floor, efficiency): the planner then fuses every
        block where the fusion saves traffic; what benchmarks and tests compare the calibrated choice with."""
        return replace(self, serial_step=0.0, conv_conv_step=0.0, conv_conv_tap_step=0.0, conv_conv_mac_step=0.0,
                       conv_conv_efficiency=1.0)


PROFILES: dict[str, HardwareProfile] = {
    "h200": HardwareProfile(
        name="NVIDIA H200 SXM",
        matrix_flops={"float16": 989 * TFLOPS, "bfloat16": 989 * TFLOPS, "float32": 494 * TFLOPS},
        vector_flops=67 * TFLOPS, memory_bandwidth=4.8 * TBPS, launch_overhead=2.5e-6, sm_count=132,
        l2_bytes=60 * 1024 * KIB, time_factor=1.69,     # fitted to the zoo's replays: RESULTS.md run 21
        notes="measured here 2026-10-28: copy 4.3 TB/s (read+write), bf16 8192^3 matmul 788 TFLOP/s"),
    "h100": HardwareProfile(
        name="NVIDIA H100 SXM",
        matrix_flops={"float16": 989 * TFLOPS, "bfloat16": 989 * TFLOPS, "float32": 494 * TFLOPS},
        vector_flops=67 * TFLOPS, memory_bandwidth=3.35 * TBPS, launch_overhead=2.5e-6, sm_count=132),
    "a100": HardwareProfile(
        name="NVIDIA A100 SXM 80GB",
        matrix_flops={"float16": 312 * TFLOPS, "bfloat16": 312 * TFLOPS, "float32": 156 * TFLOPS},
        vector_flops=19.5 * TFLOPS, memory_bandwidth=2.039 * TBPS, launch_overhead=3e-6, sm_count=108,
        shared_memory_per_block=163 * KIB, shared_memory_per_sm=164 * KIB, l2_bytes=40 * 1024 * KIB),
    "rtx4090": HardwareProfile(
        name="NVIDIA GeForce RTX 4090",
        matrix_flops={"float16": 165 * TFLOPS, "bfloat16": 165 * TFLOPS, "float32": 82.6 * TFLOPS},
        vector_flops=82.6 * TFLOPS, memory_bandwidth=1.008 * TBPS, launch_overhead=3e-6, sm_count=128,
        shared_memory_per_block=99 * KIB, shared_memory_per_sm=100 * KIB, l2_bytes=72 * 1024 * KIB),
    "orin": HardwareProfile(
        name="NVIDIA Jetson AGX Orin 64GB",
        matrix_flops={"float16": 42.5 * TFLOPS, "bfloat16": 42.5 * TFLOPS, "float32": 21.3 * TFLOPS},
        vector_flops=5.3 * TFLOPS, memory_bandwidth=204.8e9, launch_overhead=8e-6, sm_count=16,
        shared_memory_per_block=163 * KIB, shared_memory_per_sm=164 * KIB, l2_bytes=4 * 1024 * KIB),
}


DEFAULT_HARDWARE = "h200"     # the profile a compile assumes unless told (FusionConfig.hardware)


def kernel_profile(hw: HardwareProfile | None = None) -> HardwareProfile:
    """The profile a model's kernels are generated for: `hw` (default: the default profile), run by Triton's CPU
    interpreter (`interpreted`: one tiny tile a template) where TRITON_INTERPRET is set. The one place the
    environment decides a tile: the templates read the profile."""
    from opfuse.environment import triton_interpreter

    hw = hw or get_hardware()
    return replace(hw, interpreted=True) if triton_interpreter() and not hw.interpreted else hw


def get_hardware(name: str = DEFAULT_HARDWARE) -> HardwareProfile:
    """The profile of a key of PROFILES (spelled loosely: "H200", "rtx-4090") or of a profile's full name (what a
    FusionPlan records)."""
    named = next((p for p in PROFILES.values() if p.name == name), None)
    if named is not None:
        return named
    key = name.lower().replace("-", "").replace("_", "").replace(" ", "")
    aliases = {"jetsonorin": "orin", "4090": "rtx4090", "h200sxm": "h200", "h100sxm": "h100"}
    key = aliases.get(key, key)
    if key not in PROFILES:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(PROFILES)}")
    return PROFILES[key]
