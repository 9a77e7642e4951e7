"""benchmarks/rollout.py's kernel families, by kernel name as torch's profiler reports them."""

from benchmarks.rollout import kernel_family


def test_profile_families_by_kernel_name():
    """Names as torch's profiler reports them: the CUDA decode GEMM's demangled name holds "gemm" and must not count
    as cuBLAS."""
    assert kernel_family("void nvfp4_decode_gemm<2, 1, 4, 2, 1>(Args)") == "NVFP4 GEMM"
    assert kernel_family("_gemm_tc_kernel") == "NVFP4 GEMM"
    assert kernel_family("void nvfp4_wgmma_gemm<8, 2, 3, 2>(Args)") == "NVFP4 GEMM"  # 33-64 rows: not cuBLAS
    assert kernel_family("_race_merge_kernel") == "sampling"
    assert kernel_family("nvjet_tst_64x8_64x16_4x1_v_bz_TNT") == "cuBLAS GEMM (BF16 base, LoRA, LM head)"
    assert kernel_family("_split_kernel") == "attention"
    assert kernel_family("triton_poi_fused_add_0") == "other"
