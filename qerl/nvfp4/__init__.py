"""The NVFP4 (E2M1 values, FP8 E4M3 group scales, FP32 global scale) weight format."""

# The quantizer's defaults, here apart from the modules that need torch: its --help shows them.
DEFAULT_IGNORE = ("lm_head",)  # Linears kept in BF16, as llmcompressor's NVFP4A16 recipe keeps them
DEFAULT_SHARD_BYTES = 4 * 1024**3  # the largest shard a checkpoint is written in
