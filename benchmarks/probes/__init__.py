"""Kernel-development probes: what the NVFP4 and native-engine kernels cost against their bytes, cuBLAS and FA3, per
config and per kernel family. For whoever changes a kernel; what a user runs to measure QeRL is one folder up."""
