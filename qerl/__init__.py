"""QeRL: RL for LLMs with NVFP4 frozen weights, BF16 LoRA adapters and Adaptive Quantization Noise."""

__version__ = "0.1.0"
