"""The NVFP4 x BF16 GEMMs in CUDA (decode_gemm.cu) for 1-64 rows: built by NVRTC at first use, launched through the
driver with programmatic dependent launch, captured by CUDA graphs like any kernel on the stream.

Why CUDA here and Triton elsewhere: at decode shapes the GEMM must stream the packed weight at memory speed, and
the Triton kernel's loop spends ~4.5 instructions per weight around the decode (shared-memory staging, operand
layouts, K permutations; docs/kernel_notes.md). Written by hand, each thread keeps its own codes in registers from a
coalesced 16-byte load to the tensor-core instruction, ~3 instructions per weight.

Two kernels: `nvfp4_decode_gemm` (mma.sync, x in registers) for 1-16 rows on compute capability 8.9+, and
`nvfp4_wgmma_gemm` (wgmma, x from shared memory, sm_90a only) for 17-64 rows on compute capability 9.0. `gemm` takes
what `triton_kernels.gemm` takes (bias, split-K counters, a LoRA adapter in the same launch) for a BF16 x with K a
multiple of 128 (`supported`). NVRTC ships with the CUDA runtime that torch loads; no compiler or headers are needed
beyond it. Nothing here runs on CPU: the Triton kernel (and its interpreter path) serves everything `supported` refuses.
"""

from __future__ import annotations

import ctypes
import functools
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch

from qerl.dependent_launch import pdl_enabled
from qerl.device_facts import compute_capability, sm_count

SOURCE = Path(__file__).with_name("decode_gemm.cu")
ENABLED = os.environ.get("QERL_CUDA_GEMM", "1") != "0"  # "0": the Triton kernel at every row count
CHUNK = 128  # K codes per warp step (decode_gemm.cu's CHUNK)
DECODE_MAX_M = 16  # nvfp4_decode_gemm's rows
WGMMA_MIN_M = 33  # nvfp4_wgmma_gemm's, up to MAX_M (its 64 columns of x; at 17-32 rows the Triton kernel is faster)
MAX_M = 64
# With a LoRA in the launch the wgmma kernel beats Triton's only within these (H100, 64 rows, docs/benchmarks.md): rank
# 64 costs it 12-14 us (Triton: 7 us or less), and on 3584-row weights (28 tiles of 128 rows) it loses with any LoRA.
WGMMA_LORA_MAX_RANK = 32
WGMMA_LORA_MIN_N = 5120
LORA_PARTS = 8  # K ranges of the LoRA shrink, as in the Triton kernel


class CudaGemmConfig(NamedTuple):
    """tile_n: weight rows per CTA (16 x NT); warps: warps per CTA, splitting its K range chunk by chunk; stages:
    chunks each warp has in flight (register ring); split: K ranges across CTAs;
    l2_prefetch: weight loads ask L2 for the whole 256-byte block."""

    tile_n: int = 32
    warps: int = 4
    stages: int = 2
    split: int = 1
    l2_prefetch: int = 1


class WgmmaConfig(NamedTuple):
    """nvfp4_wgmma_gemm's launch: warpgroups: per CTA (64 weight rows each, sharing the CTA's copy of x); stages:
    chunks of weight each thread has in flight (register ring); split: K ranges across CTAs; occupancy: CTAs per SM
    the registers are capped for (__launch_bounds__)."""

    warpgroups: int = 2
    stages: int = 2
    split: int = 1
    occupancy: int = 1


class _Args(ctypes.Structure):  # decode_gemm.cu's Args, field for field
    _fields_ = [
        (f, ctypes.c_void_p)
        for f in ("x", "packed", "scale", "gs", "bias", "y", "ws", "counters", "lora_a", "lora_b", "lws", "lora_s")
    ] + [
        (f, ctypes.c_int)
        for f in ("sx", "sy", "M", "N", "K", "split", "split_chunks", "lora_r", "lora_parts", "lora_chunks")
    ]


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


def lora_s_offset(n: int) -> int:
    """Where the LoRA s slots start in the counters of a weight of n rows: after the two LoRA counters and one split-K
    counter per N tile of the smallest tile (16 rows), so that no config's counters reach them."""
    return 2 - (-n // 16)


def counters_size(n: int, lora_rank: int = 0) -> int:
    """int32 words of the counters `gemm` keeps between calls on a weight of n rows with a LoRA of this rank."""
    return lora_s_offset(n) + MAX_M * lora_rank // 2


def new_counters(n: int, lora_rank: int = 0, device=None) -> torch.Tensor:
    """Counters at rest: zeros, then the LoRA s slots empty (all ones, decode_gemm.cu's S_EMPTY)."""
    counters = torch.zeros(counters_size(n, lora_rank), dtype=torch.int32, device=device)
    counters[lora_s_offset(n) :] = -1
    return counters


def supported(x: torch.Tensor, k: int, lora_rank: int = 0, n: int = 0) -> bool:
    """Whether `gemm` takes this x (on a weight of n rows, with a LoRA of `lora_rank` or none): BF16 on a CUDA device,
    K a multiple of 128, QERL_CUDA_GEMM not "0", and a kernel for its row count builds there: 1-16 rows on compute
    capability 8.9+ (FP8 conversions); 33-64 rows on 9.0 (wgmma), where it beats the Triton kernel: without a LoRA, or
    with one of rank <= 32 on a weight of >= 5120 rows (docs/benchmarks.md, "the wgmma GEMM's LoRA")."""
    m = x.shape[0]
    if not (x.is_cuda and x.dtype == torch.bfloat16 and 0 < m <= MAX_M and k % CHUNK == 0 and ENABLED):
        return False
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    capability = compute_capability(index)
    if m <= DECODE_MAX_M:
        return capability >= (8, 9) and available(index)
    lora_pays = not lora_rank or (lora_rank <= WGMMA_LORA_MAX_RANK and n >= WGMMA_LORA_MIN_N)
    return m >= WGMMA_MIN_M and lora_pays and capability == (9, 0) and available(index, wgmma=True)


def _wgmma_shared_bytes(mt: int, warpgroups: int) -> int:
    """nvfp4_wgmma_gemm's dynamic shared memory: three x buffers of 8 mt rows x 128 K, or the LoRA CTAs' reduction."""
    return max(3 * mt * 2048, (4 * warpgroups - 1) * mt * 4 * 32 * 4)


@functools.cache
def _kernel(name: str, arch: str, shared_bytes: int, device_index: int, extra_source: str = ""):
    """The compiled kernel (a driver function handle) for one template instance on one device. `extra_source` is
    appended to decode_gemm.cu: probe kernels of benchmarks/probes/gemm.cu that reuse its helpers."""
    from torch.cuda._utils import _cuda_load_module, _nvrtc_compile  # torch's NVRTC wrapper (private, no copy)

    with torch.cuda.device(device_index):
        cubin, mangled = _nvrtc_compile(SOURCE.read_text() + extra_source, name, arch, nvcc_options=["-std=c++17"])
        func = _cuda_load_module(cubin, [mangled])[mangled].func
    if shared_bytes:  # past 48 KB with the static shared memory, dynamic shared memory must be asked for
        err = _libcuda().cuFuncSetAttribute(func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes)
        if err:
            raise RuntimeError(f"decode_gemm.cu: cuFuncSetAttribute failed with CUDA error {err}")
    return func


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


def _decode_kernel(nt: int, mt: int, warps: int, stages: int, l2_prefetch: int, device_index: int):
    major, minor = compute_capability(device_index)
    return _kernel(
        f"nvfp4_decode_gemm<{nt}, {mt}, {warps}, {stages}, {l2_prefetch}>", f"{major}{minor}", 0, device_index
    )


def _wgmma_kernel(mt: int, cfg: WgmmaConfig, device_index: int):
    return _kernel(
        f"nvfp4_wgmma_gemm<{mt}, {cfg.warpgroups}, {cfg.stages}, {cfg.occupancy}>",
        "90a",
        _wgmma_shared_bytes(mt, cfg.warpgroups),
        device_index,
    )


@functools.cache
def available(device_index: int, wgmma: bool = False) -> bool:
    """Whether the kernel builds here (NVRTC and CUDA's headers found by torch); said once when it does not."""
    try:
        if wgmma:
            _wgmma_kernel(8, WgmmaConfig(), device_index)  # the instance wgmma_config picks below a tile per SM
        else:
            _decode_kernel(2, 1, 4, 2, 1, device_index)
    except Exception as e:  # noqa: BLE001 - any build failure means: use the Triton kernel
        which = "wgmma GEMM (17-64 rows)" if wgmma else "decode GEMM (1-16 rows)"
        warnings.warn(
            f"qerl: the CUDA {which} ({SOURCE.name}) did not build ({e}); using the Triton kernel", stacklevel=2
        )
        return False
    return True


@functools.lru_cache(maxsize=4096)  # called on every launch
def default_config(m: int, n: int, k: int, device_index: int) -> CudaGemmConfig:
    """Fitted to the H100 sweep (docs/kernel_notes.md, "CUDA decode GEMM"): 32-row tiles, a 2-deep ring (deeper rings
    cost occupancy). 8 warps per CTA where the N tiles alone do not fill the GPU four times over (qkv, o, down at
    up to 8 rows; only the narrowest, N <= 4096, at 9-16 rows, whose two x tiles double the x registers), else 4.
    K splits across CTAs only for the long-K down projections: their partials' round trip costs more than the extra
    CTAs give anywhere else (7B down: 2 splits, which still fit one wave; 32B down: 3; at 9-16 rows 2 for the 14B and
    32B downs).
    """
    sms = sm_count(torch.device("cuda", device_index))
    n_tiles = -(-n // 32)
    warps = 8 if (n_tiles < 4 * sms if m <= 8 else n_tiles <= 128) else 4
    chunks_per_warp = k // CHUNK // warps
    slots = sms * (2 if warps == 8 else 4)  # CTAs resident at ~120 registers per thread
    split = 1
    if m > 8:  # two x tiles per warp: partials cost more, only the long-K downs gain
        split = 2 if chunks_per_warp >= 24 else 1
    elif chunks_per_warp >= 16 and 2 * n_tiles <= slots:
        split = 2
    elif chunks_per_warp >= 24:
        split = 3
    return CudaGemmConfig(32, warps, 2, split, 1)


@functools.lru_cache(maxsize=4096)  # called on every launch
def wgmma_config(n: int, k: int, device_index: int) -> WgmmaConfig:
    """From the H100 sweep at 64 rows (docs/kernel_notes.md): 128 weight rows per CTA. Weights with a tile per SM or
    more (the MLP up-projections) run 2 CTAs per SM at registers capped to 128, a 3-deep ring, no split; the rest 1 CTA
    per SM, uncapped, K split in up to 3 so that the CTAs come close to one per SM (fewer CTAs than SMs beat more
    splits: each split adds 64 x N FP32 partials and a serial sum)."""
    n_tiles = -(-n // 128)
    sms = sm_count(torch.device("cuda", device_index))
    if n_tiles >= sms:
        return WgmmaConfig(2, 3, 1, 2)
    split = min(3, max(1, sms // n_tiles), k // CHUNK)
    return WgmmaConfig(2, 2, split, 1)


def gemm(
    x,
    packed,
    scale,
    global_scale,
    bias=None,
    out=None,
    counters=None,
    lora=None,
    config: CudaGemmConfig | WgmmaConfig | None = None,
):
    """y = x @ W^T (+ bias) (+ (x @ A^T) @ B^T), arguments as for `triton_kernels.gemm` (check `supported` first).
    `config`: a CudaGemmConfig for 1-16 rows, a WgmmaConfig for 17-64 (sm_90; any row count there runs, `supported`
    says where it pays)."""
    m, k = x.shape
    n = packed.shape[0]
    if packed.shape[1] * 2 != k:
        raise ValueError(f"x has K={k} but the packed weight holds K={packed.shape[1] * 2}")
    if x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)  # read with 16-byte loads
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    chunks = k // CHUNK
    if m <= DECODE_MAX_M:
        cfg = config or default_config(m, n, k, dev)
        mt = 1 if m <= 8 else 2
        func, block, tile_n, shared = (
            _decode_kernel(cfg.tile_n // 16, mt, cfg.warps, cfg.stages, cfg.l2_prefetch, dev),
            32 * cfg.warps,
            cfg.tile_n,
            0,
        )
    else:
        cfg = config or wgmma_config(n, k, dev)
        mt = 8
        func, block, tile_n = _wgmma_kernel(mt, cfg, dev), 128 * cfg.warpgroups, 64 * cfg.warpgroups
        shared = _wgmma_shared_bytes(mt, cfg.warpgroups)
    split_chunks = -(-chunks // cfg.split)
    split = -(-chunks // split_chunks)  # no split without chunks
    n_tiles = -(-n // tile_n)
    lora_r = lora_parts = lora_chunks = 0
    lora_a = lora_b = None
    if lora is not None:
        lora_a, lora_b = lora
        lora_r = lora_a.shape[0]
        if lora_r < 16 or lora_r % 16 or lora_a.shape != (lora_r, k) or lora_b.shape != (n, lora_r):
            raise ValueError(
                f"lora: A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} do not fit x {m}x{k}, W "
                f"{n}x{k} with a rank that is a multiple of 16"
            )
        if not (lora_a.is_contiguous() and lora_b.is_contiguous()) or {lora_a.dtype, lora_b.dtype} != {x.dtype}:
            raise ValueError(f"lora: A and B must be contiguous and in x's dtype {x.dtype}")
        lora_chunks = -(-chunks // min(LORA_PARTS, chunks))
        lora_parts = -(-chunks // lora_chunks)
    ws = None
    if split > 1 or lora_r:
        ws = torch.empty(split * m * n + lora_parts * m * lora_r, dtype=torch.float32, device=x.device)  # partials
        if counters is None or counters.numel() < counters_size(n, lora_r) or counters.device != x.device:
            counters = new_counters(n, lora_r, x.device)

    def ptr(t):
        return None if t is None else t.data_ptr()

    args = _Args(
        ptr(x),
        ptr(packed),
        ptr(scale),
        ptr(global_scale),
        ptr(bias),
        ptr(out),
        ptr(ws),
        ptr(counters),
        ptr(lora_a),
        ptr(lora_b),
        None if ws is None else ws.data_ptr() + 4 * split * m * n,
        counters.data_ptr() + 4 * lora_s_offset(n) if lora_r else None,
        x.stride(0),
        out.stride(0),
        m,
        n,
        k,
        split,
        split_chunks,
        lora_r,
        lora_parts,
        lora_chunks,
    )
    grid = lora_parts * (lora_r // 16) + n_tiles * split
    _launch(func, grid, block, shared, args, x.device)
    return out


def _launch(func, grid: int, block: int, shared_bytes: int, args: _Args, device: torch.device) -> None:
    attr = _LaunchAttribute(_PROGRAMMATIC_STREAM_SERIALIZATION, b"", (1).to_bytes(4, "little"))
    use_pdl = pdl_enabled(device)
    config = _LaunchConfig(
        (grid, 1, 1),
        (block, 1, 1),
        shared_bytes,
        torch.cuda.current_stream(device).cuda_stream,
        ctypes.pointer(attr) if use_pdl else None,
        1 if use_pdl else 0,
    )
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), func, params, None)
    if err:
        raise RuntimeError(f"decode_gemm.cu: cuLaunchKernelEx failed with CUDA error {err}")


@functools.cache
def _libcuda():
    from torch.cuda._utils import _get_gpu_runtime_library

    lib = _get_gpu_runtime_library()
    lib.cuLaunchKernelEx.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
    lib.cuFuncSetAttribute.restype = ctypes.c_int
    return lib
