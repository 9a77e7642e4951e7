"""The CUDA GEMMs' probes for benchmarks.probes.gemm (`cuda`, `wgmma`, `wgmma-lora`, `wgmma-ceiling`, `wgmma-by-k`):
the decode and wgmma GEMMs (qerl/nvfp4/cuda_gemm.py) against the Triton one and cuBLAS BF16, and the wgmma loop's
ceilings from the kernels of gemm.cu.

`wgmma-ceiling` runs the chunk loop of nvfp4_wgmma_gemm with no global memory at all: how many weight bytes per second
its tensor-core and decode work could keep up with (docs/kernel_notes.md, "Ninth session"); then the same loop fed
from L2 or DRAM by each thread's own loads, as the kernel feeds it (docs/kernel_notes.md, "Eleventh session").
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from benchmarks.probes.measure import Copies, graph_time_us, measure_ceilings, nvfp4_bytes, shapes
from qerl.device_facts import sm_count
from qerl.nvfp4 import ops
from qerl.nvfp4 import triton_kernels as tk

ENGINE_LORA_RANKS = {"qkv": 64, "o": 16, "gate_up": 32, "down": 16}  # as the engine's fused groups pad r16 adapters


def _engine_lora(name, n, k, dev):
    """A random adapter (A, B) of the rank the rollout engine gives projection `name`."""
    rank = ENGINE_LORA_RANKS[name]
    return (
        torch.randn(rank, k, device=dev, dtype=torch.bfloat16) * 0.05,
        torch.randn(n, rank, device=dev, dtype=torch.bfloat16) * 0.05,
    )


def cuda_vs_triton():
    """The CUDA decode GEMM (cuda_gemm.py) against the Triton one at 1 and 8 rows, bare and with the rollout engine's
    LoRA in the same launch (ENGINE_LORA_RANKS)."""
    from qerl.nvfp4 import cuda_gemm

    dev = torch.device("cuda")
    copy_gbs, _ = measure_ceilings(dev)
    print(f"copy {copy_gbs:.0f} GB/s; us per call (CUDA graph, weights rotated past L2); % = bytes / time of copy")
    for model in ("7B", "14B", "32B"):
        for name, (n, k) in shapes(model).items():
            c = Copies(n, k, dev)
            for m in (1, 8):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                lora = _engine_lora(name, n, k, dev)
                row = []
                for kw in ({}, {"lora": lora}):
                    for gemm in (tk.gemm, cuda_gemm.gemm):
                        row.append(
                            graph_time_us(
                                [
                                    lambda q=q, cn=cn, gemm=gemm, kw=kw, x=x: gemm(
                                        x, q.packed, q.scale, q.global_scale, counters=cn, **kw
                                    )
                                    for q, cn in zip(c.fp4, c.counters, strict=True)
                                ]
                            )
                        )
                pct = nvfp4_bytes(n, k) / row[1] / 1e3 / copy_gbs * 100
                print(
                    f"{model}.{name:8s} M={m}: triton {row[0]:6.1f} cuda {row[1]:6.1f} ({pct:3.0f}%) | with LoRA "
                    f"r{ENGINE_LORA_RANKS[name]}: triton {row[2]:6.1f} cuda {row[3]:6.1f}",
                    flush=True,
                )
            del c
            torch.cuda.empty_cache()


def _dispatch(x, q, counters, lora=None):
    """What a projection's call picks: nvfp4_linear, or with an adapter the rollout engine's nvfp4_linear_lora."""
    if lora is None:
        return ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale, splitk_counters=counters)
    return ops.nvfp4_linear_lora(x, q.packed, q.scale, q.global_scale, None, counters, *lora)


def wgmma_vs_triton(lora: bool = False):
    """The CUDA wgmma GEMM (cuda_gemm.py, 33-64 rows) against the Triton kernel and cuBLAS BF16, at 40 and 64 rows,
    each with its default config; "dispatch" is what nvfp4_linear picks. With `lora`: both GEMMs with the engine's
    LoRA in the same launch (cuBLAS stays bare), and the dispatch is nvfp4_linear_lora (cuda_gemm.supported decides
    per shape and rank)."""
    from qerl.nvfp4 import cuda_gemm

    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    copy_gbs, _ = measure_ceilings(dev)
    print(f"copy {copy_gbs:.0f} GB/s; us per call (CUDA graph, weights rotated past L2); % = bytes / time of copy")
    print(
        "| shape | M | LoRA rank | cuBLAS BF16 | Triton | wgmma | Triton / wgmma | wgmma % of copy | dispatch | "
        "dispatch takes | wgmma config |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for model in ("7B", "14B", "32B"):
        for name, (n, k) in shapes(model).items():
            c = Copies(n, k, dev)
            rank = ENGINE_LORA_RANKS[name] if lora else 0
            counters = [ops.splitk_counters(n, dev, rank) for _ in c.fp4]
            adapter = {"lora": _engine_lora(name, n, k, dev)} if lora else {}
            for m in (40, 64):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                times = [graph_time_us([lambda w=w, x=x: x @ w.t() for w in c.bf16])]
                for gemm in (tk.gemm, cuda_gemm.gemm, None):
                    times.append(
                        graph_time_us(
                            [
                                lambda q=q, cn=cn, gemm=gemm, x=x, a=adapter: (
                                    gemm(x, q.packed, q.scale, q.global_scale, counters=cn, **a)
                                    if gemm
                                    else _dispatch(x, q, cn, **a)
                                )
                                for q, cn in zip(c.fp4, counters, strict=True)
                            ]
                        )
                    )
                bf16, triton_us, wgmma_us, dispatch_us = times
                takes = "wgmma" if cuda_gemm.supported(x, k, rank, n) else "Triton"
                pct = nvfp4_bytes(n, k) / wgmma_us / 1e3 / copy_gbs * 100
                print(
                    f"| {model}.{name} | {m} | {rank or '-'} | {bf16:.1f} | {triton_us:.1f} | {wgmma_us:.1f} | "
                    f"{triton_us / wgmma_us:.2f}x | {pct:.0f}% | {dispatch_us:.1f} | {takes} | "
                    f"{tuple(cuda_gemm.wgmma_config(n, k, idx))} |",
                    flush=True,
                )
            del c
            torch.cuda.empty_cache()


CEILING_SOURCE = Path(__file__).with_name("gemm.cu")  # the ceiling kernels, appended to decode_gemm.cu
CEILING_STAGES = (  # wgmma_ceiling's STAGE 0-4, labelled
    "A in registers (bare wgmma)",
    "+ codes and scales from shared memory",
    "+ decode",
    "+ ring handshake with a producer",
    "A in shared memory (bare wgmma)",
)
CEILING_LDG_SOURCES = (  # wgmma_ceiling_ldg's (SRC, RING), labelled
    (0, 3, "codes and scales from L2, register ring of 3, + decode"),
    (1, 3, "the same from DRAM"),
    (2, 3, "from DRAM, ring of 3 in shared memory by cp.async"),
    (2, 4, "the same, ring of 4"),
    (2, 6, "the same, ring of 6"),
    (3, 3, "from DRAM, register ring of 3, decode only (no wgmma)"),
)
LDG_SHARED_BYTES = 32768 + 6 * 512 * 48  # x buffers, then the deepest cp.async ring of 4 warpgroups


class _CeilingArgs(ctypes.Structure):  # gemm.cu's CeilingArgs, field for field
    _fields_ = [("out", ctypes.c_void_p), ("iters", ctypes.c_int)]


class _CeilingLdgArgs(ctypes.Structure):  # gemm.cu's CeilingLdgArgs, field for field
    _fields_ = [
        ("out", ctypes.c_void_p),
        ("iters", ctypes.c_int),
        ("codes", ctypes.c_void_p),
        ("scales", ctypes.c_void_p),
        ("k2", ctypes.c_int),
        ("chunks", ctypes.c_int),
    ]


def wgmma_ceiling(iters: int = 4000, shared_only_loops: bool = True):
    """nvfp4_wgmma_gemm's chunk loop (CEILING_SOURCE), one CTA per SM: time per chunk, and the NVFP4 weight bandwidth
    (72 bytes per row and chunk: codes and scales) that rate keeps up with. First with no global memory
    (CEILING_STAGES, unless `shared_only_loops` is off), then with the codes and scales loaded by each thread
    (CEILING_LDG_SOURCES)."""
    from qerl.nvfp4 import cuda_gemm

    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    if torch.cuda.get_device_capability(idx) != (9, 0):
        raise SystemExit("wgmma-ceiling: needs compute capability 9.0 (wgmma)")
    sms = sm_count(dev)
    copy_gbs, _ = measure_ceilings(dev)
    print(
        f"{torch.cuda.get_device_name(idx)}, copy {copy_gbs:.0f} GB/s; {sms} CTAs, one per SM; per chunk: 128 K x "
        "64 weight rows per warpgroup (8 m64n64k16)"
    )
    print("| loop | consumer warpgroups | us per chunk | TFLOPS | weight bytes it keeps up with, GB/s | % of copy |")
    print("|---|---|---|---|---|---|")

    source = CEILING_SOURCE.read_text()

    def row(label, wg, name, threads, args, shared_bytes=65536):
        chunks_run = args.iters
        func = cuda_gemm._kernel(name, "90a", shared_bytes, idx, source)
        cuda_gemm._launch(func, sms, threads, shared_bytes, args, dev)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(3):
            cuda_gemm._launch(func, sms, threads, shared_bytes, args, dev)
        end.record()
        torch.cuda.synchronize()
        per_chunk = start.elapsed_time(end) / 3 / 1e3 / chunks_run
        flops = 2 * 64 * 64 * 128 * wg * sms / per_chunk
        weight_gbs = 64 * wg * 72 * sms / per_chunk / 1e9
        print(
            f"| {label} | {wg} | {per_chunk * 1e6:.3f} | {flops / 1e12:.0f} | {weight_gbs:.0f} | "
            f"{weight_gbs / copy_gbs * 100:.0f}% |",
            flush=True,
        )

    for stage, label in enumerate(CEILING_STAGES if shared_only_loops else ()):
        for wg in (1, 2, 3, 4):
            out = torch.empty(sms * 128 * (wg + 1), device=dev)
            row(label, wg, f"wgmma_ceiling<{stage}, {wg}>", 128 * (wg + 1), _CeilingArgs(out.data_ptr(), iters))
    weights = torch.randint(0, 256, (2**30,), dtype=torch.uint8, device=dev)  # past L2: streamed from DRAM
    for src, ring, label in CEILING_LDG_SOURCES:
        for wg in (1, 2, 3, 4):
            rows = sms * 64 * wg
            chunks = weights.numel() // (rows * 72)  # 64 code bytes + 8 scale bytes per row and chunk
            codes, scales = weights.data_ptr(), weights.data_ptr() + rows * chunks * 64
            out = torch.empty(sms * 128 * wg, device=dev)
            row(
                label,
                wg,
                f"wgmma_ceiling_ldg<{src}, {wg}, {ring}>",
                128 * wg,
                _CeilingLdgArgs(out.data_ptr(), iters - iters % ring, codes, scales, chunks * 64, chunks),
                LDG_SHARED_BYTES,
            )


def wgmma_by_k():
    """The wgmma GEMM at 64 rows on two weights' row counts (7B gate_up, 7B qkv) at growing K, default config and
    split 1: the intercept is what a call costs besides its chunks (launch, prologue, epilogue, last CTAs), the slope
    what one chunk of every tile costs."""
    from qerl.nvfp4 import cuda_gemm

    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    print("| N | K | chunks | default config | us | split 1 | us |")
    print("|---|---|---|---|---|---|---|")
    for n in (37888, 4608):
        for k in (256, 512, 1024, 2048, 3584, 7168):
            c = Copies(n, k, dev)
            x = torch.randn(64, k, device=dev, dtype=torch.bfloat16)
            default = cuda_gemm.wgmma_config(n, k, idx)
            row = [f"| {n} | {k} | {k // 128} |"]
            for cfg in (default, default._replace(split=1)):
                us = graph_time_us(
                    [
                        lambda q=q, cfg=cfg, x=x: cuda_gemm.gemm(x, q.packed, q.scale, q.global_scale, config=cfg)
                        for q in c.fp4
                    ]
                )
                row.append(f" {tuple(cfg)} | {us:.1f} |")
            print("".join(row), flush=True)
            del c
            torch.cuda.empty_cache()


SMALL_MODELS = ("0.5B", "1.5B")


def small_configs(m: int, n: int, k: int, idx: int) -> list:
    """The CUDA kernel's configs to try at `m` rows on an n x k weight: its default, then for 1-16 rows the decode
    kernel's 16/32-row tiles on 4/8 warps, for 33-64 the wgmma kernel's 1/2 warpgroups, ring 2/3, 1/2 CTAs per SM,
    each with every K split from 1 up to one chunk of 128 per (warp or warpgroup and) split."""
    from qerl.nvfp4 import cuda_gemm

    chunks = k // cuda_gemm.CHUNK
    if m <= cuda_gemm.DECODE_MAX_M:
        default = cuda_gemm.default_config(m, n, k, idx)
        grid = [
            cuda_gemm.CudaGemmConfig(tile, warps, 2, split, 1)
            for tile in (16, 32)
            for warps in (4, 8)
            for split in range(1, max(1, chunks // warps) + 1)
            if split <= 8
        ]
    else:
        default = cuda_gemm.wgmma_config(n, k, idx)
        grid = [
            cuda_gemm.WgmmaConfig(groups, stages, split, occupancy)
            for groups in (1, 2)
            for stages in (2, 3)
            for occupancy in (1, 2)
            for split in sorted({1, 2, 3, 4, 6, 8, 12} & set(range(1, chunks + 1)))
        ]
    return [default, *(c for c in grid if c != default)]


def _lora_gemm_us(gemm, x, weights, lora, **kw) -> float:
    """Per-call time of `gemm` with the adapter in the same launch, cycling through (weight, counters) pairs."""
    return graph_time_us(
        [
            lambda q=q, cn=cn: gemm(x, q.packed, q.scale, q.global_scale, counters=cn, lora=lora, **kw)
            for q, cn in weights
        ]
    )


def small_shapes():
    """The 0.5B and 1.5B layers' GEMMs at 8 and 64 rows, with the rollout engine's LoRA in the same launch, against
    their bytes and cuBLAS BF16 (bare, and with the adapter as the BF16 engine adds it: two more GEMMs): what the
    dispatch takes now, Triton's kernel, the CUDA kernel at its default config and at the best of small_configs."""
    import json

    from qerl.nvfp4 import cuda_gemm

    dev = torch.device("cuda")
    idx = torch.cuda.current_device()
    copy_gbs, _ = measure_ceilings(dev)
    print(f"{torch.cuda.get_device_name(idx)}, copy {copy_gbs:.0f} GB/s; us per call (CUDA graph, weights past L2)")
    print(
        "| shape | N x K | M | r | bytes floor | cuBLAS | cuBLAS + LoRA | dispatch (takes) | Triton | CUDA default | "
        "CUDA best (config) | best / cuBLAS + LoRA |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for model in SMALL_MODELS:
        for name, (n, k) in shapes(model).items():
            c = Copies(n, k, dev)
            rank = ENGINE_LORA_RANKS[name]
            a, b = _engine_lora(name, n, k, dev)
            for m in (8, 64):
                x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                fp4 = list(zip(c.fp4, c.counters, strict=True))

                bf16 = graph_time_us([lambda w=w, x=x: x @ w.t() for w in c.bf16])
                bf16_lora = graph_time_us(
                    [lambda w=w, x=x, a=a, b=b: torch.addmm(x @ w.t(), x @ a.t(), b.t()) for w in c.bf16]
                )
                dispatch = graph_time_us([lambda q=q, cn=cn, x=x, ab=(a, b): _dispatch(x, q, cn, ab) for q, cn in fp4])
                takes = "CUDA" if cuda_gemm.supported(x, k, rank, n) else "Triton"
                triton_us = _lora_gemm_us(tk.gemm, x, fp4, (a, b))
                timed = [
                    (_lora_gemm_us(cuda_gemm.gemm, x, fp4, (a, b), config=cfg), cfg)
                    for cfg in small_configs(m, n, k, idx)
                ]
                best_us, best = min(timed, key=lambda t: t[0])
                floor = nvfp4_bytes(n, k) / copy_gbs / 1e3
                print(
                    f"| {model}.{name} | {n} x {k} | {m} | {rank} | {floor:.1f} | {bf16:.1f} | {bf16_lora:.1f} | "
                    f"{dispatch:.1f} ({takes}) | {triton_us:.1f} | {timed[0][0]:.1f} | {best_us:.1f} {tuple(best)} | "
                    f"{bf16_lora / best_us:.2f}x |",
                    flush=True,
                )
                print(
                    "#json "
                    + json.dumps(
                        {
                            "model": model,
                            "shape": name,
                            "n": n,
                            "k": k,
                            "m": m,
                            "rank": rank,
                            "floor_us": floor,
                            "bf16_us": bf16,
                            "bf16_lora_us": bf16_lora,
                            "dispatch_us": dispatch,
                            "takes": takes,
                            "triton_us": triton_us,
                            "cuda": [[us, list(cfg)] for us, cfg in timed],
                        }  # fmt: skip
                    ),
                    flush=True,
                )
            del c
            torch.cuda.empty_cache()
