"""FusionConfig: every knob of a compile, passed down explicitly (no global state)."""

from __future__ import annotations

from dataclasses import dataclass

from opfuse.hardware import DEFAULT_HARDWARE


@dataclass(frozen=True)
class FusionConfig:
    dtype: str | None = None            # compute dtype (activations and weights); None: the model's input dtype
    hardware: str = DEFAULT_HARDWARE    # key of opfuse.hardware.PROFILES used by the cost and resource models
    density_threshold: float = 10.0     # FLOPs/Byte under which an op is flagged a fusion candidate (the seed's rule)
    # which fusions the planner may make
    vertical: bool = True               # anchor + epilogue, pointwise chains, prologue into reductions
    residual: bool = True               # conv + add(skip) + activation
    horizontal: bool = True             # sibling anchors on one input; independent small pointwise ops
    conv_conv: bool = True              # depthwise + pointwise convolution in one kernel
    conv_conv_expand: bool = True       # ... and the 1x1 expansion before it (whole inverted residual), where it pays
    norm_prologue: bool = False         # a linear absorbs the layer norm or RMS norm before it (row statistics in
                                        # its GEMM); off: measured 0.4-5% slower than without (RESULTS.md, run 32)
    rms_norm_prologue: bool = False     # ... an RMS norm alone (its rstd applied after the GEMM's K loop, no pass
                                        # of its own: `opfuse.codegen.prologue`); off: measured even (RESULTS.md,
                                        # session 34)
    norm_epilogue: bool = False         # a depthwise conv's kernel normalizes its rows: the layer norm or RMS norm
                                        # over the channels after it (ConvNeXt's 7x7 conv -> permute -> LayerNorm)
                                        # in its epilogue, each tile spanning every channel; off until measured
    concat_in_place: bool = True        # a cat a conv or linear reads: its parts' kernels store into its slices
    squeeze: bool = True                # global average pool -> small GEMM -> small GEMM (squeeze-and-excitation)
                                        # as one kernel (RESULTS.md, run 88: a third fewer launches, about half
                                        # the cold compile, faster or even on the SE models)
    split_epilogues: bool = True        # a group of one anchor whose fastest form runs the anchor apart from its
                                        # other ops (unfused, or the library form with an epilogue kernel) is planned
                                        # again with the anchor apart, so that they may join another kernel (a
                                        # residual add into the next layer norm, as torch.compile does; not a later
                                        # anchor's as a prologue), where one does (`compiler.splits_that_join`);
                                        # kept where its kernels measure faster (`compiler.measured_slower`;
                                        # RESULTS.md, runs 71, 104). Groups of several anchors that lose so are
                                        # always split back
    split_k: bool = True                # anchors whose tile grid leaves most SMs idle split K (the autotuner also
                                        # times them unsplit and keeps the faster); conv-conv kernels' mid-channel
                                        # slices are part of their tile (one launch) and do not follow this switch
    use_cost_model: bool = True         # False: take every legal fusion (for tests and experiments)
    # code generation and runtime
    autotune: bool = True
    tune_top: int | None = 4            # autotune among each kernel's first N configs (None: all), and its next N
                                        # while every one tried spills; compiling is slow
    tune_cold: bool = False             # where a forward's weights outgrow L2, the tuner times each kernel that
                                        # mostly reads weights with them out of L2, as the forward finds them
                                        # (`opfuse.runtime.clock.cold_groups`); off: measured to choose as warm
                                        # timing does (RESULTS.md, session 34)
    library_anchors: bool = True        # autotuning also times each conv/GEMM anchor through cuBLAS/cuDNN with its
                                        # epilogue as a generated kernel, and the group unfused (its ops through
                                        # PyTorch), and keeps either where it is faster than the fused kernel
    compile_workers: int | None = None  # processes compiling the autotuner's candidates in parallel before it times
                                        # them (opfuse.runtime.precompile; None: half the CPUs, at most 8; 1: none)
    cuda_graph: bool = True
    dependent_launch: bool = True       # on Hopper and later, each kernel launched so that it may start while the one
                                        # before it drains (`opfuse.codegen.base.DEPENDENT_LAUNCH_CODE`)
    weight_prefetch: bool = False       # on Hopper and later, a GEMM after a light kernel asks L2 for its own weight
                                        # while that kernel runs (`opfuse.runtime.prefetch`); off until measured
    verify: bool = True
    fallback: str = "error"             # "error": raise on a failed compile; "eager": return the eager model
    recompile: bool = False             # inputs of another shape/dtype/device: compile for them instead of raising
    bucket_steps: int = 1               # a dynamic dim's buckets per power of two (runtime.dynamic.bucket_sizes): more
                                        # buckets, each a compile at its first call, pad a call less
    memory_limit: int | None = None     # bytes a compile may use; None: free CUDA memory / available host memory
    cache_dir: str | None = None        # autotune cache; default ~/.cache/opfuse
    debug_dir: str | None = None        # where each stage dumps what it made


def resolve_dtype(config: FusionConfig, example_inputs=()) -> FusionConfig:
    """The config with `dtype` fixed: as given, else the first floating example input's dtype, else float32."""
    from dataclasses import replace

    from opfuse.ir.graph import dtype_name

    if config.dtype is not None:
        return replace(config, dtype=dtype_name(config.dtype))
    for x in example_inputs:
        if getattr(x, "is_floating_point", lambda: False)():
            return replace(config, dtype=dtype_name(x.dtype))
    return replace(config, dtype="float32")


def for_graph(config: FusionConfig | None, graph) -> FusionConfig:
    """`config` (default FusionConfig()) with `dtype` fixed from the graph's first floating input or constant."""
    from dataclasses import replace

    config = config or FusionConfig()
    if config.dtype is not None:
        return resolve_dtype(config)
    for node in graph:
        if node.op in ("input", "constant") and node.type.is_float:
            return replace(config, dtype=node.type.dtype)
    return replace(config, dtype="float32")
