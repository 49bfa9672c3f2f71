"""FusionConfig: every knob of a compile, passed down explicitly (no global state)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FusionConfig:
    dtype: str = "float16"              # compute dtype of the compiled model (activations and weights)
    hardware: str = "h200"              # key of opfuse.hardware.PROFILES used by the cost and resource models
    density_threshold: float = 10.0     # FLOPs/Byte under which an op is flagged a fusion candidate (the seed's rule)
    # which fusions the planner may make
    vertical: bool = True               # anchor + epilogue, pointwise chains, prologue into reductions
    residual: bool = True               # conv + add(skip) + activation
    horizontal: bool = True             # sibling anchors on one input; independent small pointwise ops
    conv_conv: bool = True              # depthwise + pointwise convolution in one kernel
    use_cost_model: bool = True         # False: take every legal fusion (for tests and experiments)
    # code generation and runtime
    autotune: bool = True
    cuda_graph: bool = True
    verify: bool = True
    fallback: str = "error"             # "error": raise on a failed compile; "eager": return the eager model
    cache_dir: str | None = None        # autotune cache; default ~/.cache/opfuse
    debug_dir: str | None = None        # where each stage dumps what it made
