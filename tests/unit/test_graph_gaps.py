"""`opfuse.bench.gaps`: the idle stretches of a replay between GPU activities, and the totals that split a replay's
span into kernels, copies/memsets and idle time (synthetic timelines; the profiler side needs a GPU)."""

from opfuse.bench.gaps import Activity, by_family, idle_gaps, kernel_family, summarize


def test_gaps_between_activities_largest_first_with_their_neighbours():
    timeline = [Activity("gemm", 0, 10), Activity("Memcpy DtoD", 12, 13), Activity("relu", 13, 15),
                Activity("softmax", 20, 21)]
    gaps = idle_gaps(timeline[::-1])            # any order in
    assert [(g.before, g.after, g.microseconds) for g in gaps] == [("relu", "softmax", 5), ("gemm", "Memcpy DtoD", 2)]


def test_overlapping_activities_are_one_stretch_of_work():
    # the short kernel starts and ends inside the long one: no gap after it, the next gap counts from the long one
    timeline = [Activity("long", 0, 10), Activity("short", 2, 4), Activity("next", 11, 12)]
    (gap,) = idle_gaps(timeline)
    assert (gap.before, gap.after, gap.microseconds) == ("long", "next", 1)


def test_summary_splits_the_span():
    timeline = [Activity("gemm", 0, 10), Activity("Memset (Device)", 11, 12), Activity("relu", 14, 15)]
    assert summarize(timeline) == {"span_us": 15, "kernels_us": 11, "kernels": 2, "copies_us": 1, "copies": 1,
                                   "idle_us": 3}
    assert summarize([])["span_us"] == 0.0


def test_kernel_families_by_name_as_run_45_and_47_profiled_them():
    names = {
        "fused_add_layer_norm_8ccdf033": "opfuse fused", "flat_conv2d_relu_e60ed0b4": "opfuse flat epilogue",
        "splitk_linear_4db8f723": "opfuse split-K", "triton_poi_fused_gelu_view_1": "inductor triton",
        "nvjet_sm90_hsh_192x192_64x4_2x1_v_bz_coopB_bias_TNN": "cuBLAS", "void cublasLt::splitKreduce_kernel": "cuBLAS",
        "conv2d_c1_k1_nhwc_specialized": "cuDNN/CUTLASS",
        "sm80_xmma_fprop_implicit_gemm_indexed_wo_smem_f16f16_f16f32_f32_nhwckrsc_nhwc": "cuDNN/CUTLASS",
        "void cutlass::Kernel2<cutlass_80_tensorop_f16_s16816gemm_f16_64x128_64x3_tn_align2>": "cuDNN/CUTLASS",
        "void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl>": "PyTorch ATen",
        "Memset (Unknown)": "copy/memset", "some_other_kernel": "other"}
    assert {name: kernel_family(name) for name in names} == names


def test_time_by_family_largest_first():
    timeline = [Activity("fused_conv2d_ab", 0, 3), Activity("flat_relu_cd", 3, 4), Activity("fused_mean_ef", 4, 6),
                Activity("nvjet_x", 6, 16)]
    assert by_family(timeline) == {"cuBLAS": {"count": 1, "us": 10}, "opfuse fused": {"count": 2, "us": 5},
                                   "opfuse flat epilogue": {"count": 1, "us": 1}}
    assert list(by_family(timeline)) == ["cuBLAS", "opfuse fused", "opfuse flat epilogue"]
