"""The NVFP4 (E2M1 values, FP8 E4M3 group scales, FP32 global scale) weight format."""
