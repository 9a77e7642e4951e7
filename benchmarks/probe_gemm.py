"""Where the fused NVFP4 GEMM's time goes: a driver for Nsight Compute and a pure-streaming probe.

    python -m benchmarks.probe_gemm stream            # bandwidth of the GEMM's TMA access pattern alone
    python -m benchmarks.probe_gemm splits            # every split-K on the shapes where wave count matters
    python -m benchmarks.probe_gemm host              # host time per eager call (what bounds eager decode)
    python -m benchmarks.probe_gemm cuda              # CUDA vs Triton decode GEMM, with the engine's LoRA ranks
    python -m benchmarks.probe_gemm wgmma             # CUDA wgmma vs Triton GEMM and cuBLAS BF16 at 40 and 64 rows
    python -m benchmarks.probe_gemm wgmma-lora        # the same with the rollout engine's LoRA in the same launch
    python -m benchmarks.probe_gemm wgmma-ceiling     # the 64-row wgmma loop, built up part by part
    python -m benchmarks.probe_gemm wgmma-by-k        # the 64-row wgmma GEMM's time against K: fixed cost and slope
    ncu --clock-control none -k regex:_gemm_tc_kernel python -m benchmarks.probe_gemm ncu

`stream` runs a kernel with the GEMM's grid, tiles, split-K and TMA ring that only XORs the bytes it
receives: the bandwidth the access pattern allows with no decode and no MMA. `ncu` calls the GEMM on a
few 7B shapes (weights rotated so they stream from HBM) for the profiler to sample. `wgmma-ceiling` runs the
chunk loop of nvfp4_wgmma_gemm with no global memory at all: how many weight bytes per second its tensor-core and
decode work could keep up with (docs/kernel_notes.md, "Ninth session"); then the same loop fed from L2 or DRAM by
each thread's own loads, as the kernel feeds it (docs/kernel_notes.md, "Eleventh session").
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.measure import Copies, graph_time_us, measure_ceilings, nvfp4_bytes, shapes
from qerl.device_facts import sm_count
from qerl.nvfp4 import ops
from qerl.nvfp4 import triton_kernels as tk


@triton.jit
def _stream_kernel(
    p_desc,
    s_desc,
    out_ptr,
    tiles_per_split,
    BLOCK_N: tl.constexpr,
    KW: tl.constexpr,
    KG: tl.constexpr,
    STAGES: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros((BLOCK_N, KW), dtype=tl.int32)
    acc_s = tl.zeros((BLOCK_N, KG), dtype=tl.uint8)
    t0 = pid_k * tiles_per_split
    for i in tl.range(0, tiles_per_split, num_stages=STAGES):
        acc ^= p_desc.load([pid_n * BLOCK_N, (t0 + i) * KW])
        acc_s ^= s_desc.load([pid_n * BLOCK_N, (t0 + i) * KG])
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(acc) + tl.sum(acc_s.to(tl.int32)))


@triton.jit
def _stream_linear_kernel(p_desc, out_ptr, tiles_per_split, k_tiles, ROWS: tl.constexpr, STAGES: tl.constexpr):
    """The same bytes laid out tile after tile (each CTA's K tiles contiguous, 8 KB each): a re-layout's ceiling."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc = tl.zeros((ROWS, 128), dtype=tl.int32)
    t0 = pid_n * k_tiles + pid_k * tiles_per_split
    for i in tl.range(0, tiles_per_split, num_stages=STAGES):
        acc ^= p_desc.load([(t0 + i) * ROWS, 0])
    tl.store(out_ptr + pid_n * tl.num_programs(1) + pid_k, tl.sum(acc))


def stream_linear(packed, cfg, out):
    n, k2 = packed.shape
    rows = cfg.block_n * cfg.block_k // 2 // 512  # 512-byte rows of int32 x 128
    p_desc = TensorDescriptor.from_tensor(packed.view(torch.int32).view(-1, 128), [rows, 128])
    n_tiles = triton.cdiv(n, cfg.block_n)
    k_tiles = triton.cdiv(2 * k2, cfg.block_k)
    tiles = triton.cdiv(k_tiles, cfg.split_k)
    _stream_linear_kernel[(n_tiles, cfg.split_k)](
        p_desc, out, tiles, k_tiles, ROWS=rows, STAGES=cfg.num_stages, num_warps=cfg.num_warps
    )


def stream(packed, scale, cfg, out):
    n, k2 = packed.shape
    k = 2 * k2
    p32 = packed.view(torch.int32)
    s8 = scale.view(torch.uint8)
    p_desc = TensorDescriptor.from_tensor(p32, [cfg.block_n, cfg.block_k // 8])
    s_desc = TensorDescriptor.from_tensor(s8, [cfg.block_n, cfg.block_k // 16])
    n_tiles = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    _stream_kernel[(n_tiles, cfg.split_k)](
        p_desc,
        s_desc,
        out,
        tiles,
        BLOCK_N=cfg.block_n,
        KW=cfg.block_k // 8,
        KG=cfg.block_k // 16,
        STAGES=cfg.num_stages,
        num_warps=cfg.num_warps,
    )


def stream_probe():
    """On the 7B shapes at M = 1, 8, 16: the streaming probe with the Triton GEMM's default config, nvfp4_linear and
    cuBLAS BF16; at M = 8 also the probe at other splits and ring depths, and with each CTA's tiles contiguous."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name, (n, k) in shapes("7B").items():
        c = Copies(n, k, dev)
        for m in (1, 8, 16):
            cfg = tk.default_config(m, n, k, dev)
            out = torch.empty(4096 * 64, dtype=torch.int32, device=dev)
            t_stream = graph_time_us([lambda q=q, cfg=cfg, out=out: stream(q.packed, q.scale, cfg, out) for q in c.fp4])
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_gemm = graph_time_us(
                [lambda q=q, x=x: ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale) for q in c.fp4]
            )
            t_bf = graph_time_us([lambda w=w, x=x: x @ w.t() for w in c.bf16])
            nb = nvfp4_bytes(n, k)
            print(
                f"{name:8s} M={m:2d} cfg={tuple(cfg)} bf16 {t_bf:6.1f} us | stream {t_stream:6.1f} us "
                f"{nb / t_stream / 1e3:5.0f} GB/s | gemm {t_gemm:6.1f} us {nb / t_gemm / 1e3:5.0f} GB/s",
                flush=True,
            )
            if m != 8:
                continue
            for split_mul, stages in ((1, 2), (1, 4), (1, 6), (2, 3), (4, 3), (0.5, 3)):
                v = tk.GemmConfig(
                    cfg.block_m, cfg.block_n, cfg.block_k, max(1, int(cfg.split_k * split_mul)), cfg.num_warps, stages
                )
                t = graph_time_us([lambda q=q, v=v, out=out: stream(q.packed, q.scale, v, out) for q in c.fp4])
                t_lin = graph_time_us([lambda q=q, v=v, out=out: stream_linear(q.packed, v, out) for q in c.fp4])
                print(
                    f"   stream split {v.split_k:2d} stages {stages}: {t:6.1f} us {nb / t / 1e3:5.0f} GB/s | "
                    f"contiguous tiles {t_lin:6.1f} us {n * k // 2 / t_lin / 1e3:5.0f} GB/s",
                    flush=True,
                )


def split_sweep():
    """Time every split-K (not only powers of two) at M = 1, 8, 16 on the shapes where the grid's wave count matters."""
    dev = torch.device("cuda")
    for model, name in (
        ("7B", "gate_up"),
        ("7B", "down"),
        ("14B", "gate_up"),
        ("14B", "down"),
        ("32B", "gate_up"),
        ("32B", "down"),
        ("7B", "qkv"),
        ("32B", "qkv"),
    ):
        n, k = shapes(model)[name]
        c = Copies(n, k, dev)
        k_tiles = triton.cdiv(k, 256)
        n_tiles = triton.cdiv(n, 64)
        for m in (1, 8, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = tk.default_config(m, n, k, dev)
            splits = sorted(
                {
                    s
                    for s in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32)
                    if s <= k_tiles and (triton.cdiv(k_tiles, s) * (s - 1) < k_tiles)
                }
                | {base.split_k}
            )  # no empty split
            res = []
            for s_ in splits:
                cfg = tk.GemmConfig(base.block_m, base.block_n, base.block_k, s_, base.num_warps, base.num_stages)
                t = graph_time_us(
                    [
                        lambda q=q, cnt=cnt, cfg=cfg, x=x: tk.gemm(
                            x, q.packed, q.scale, q.global_scale, config=cfg, counters=cnt
                        )
                        for q, cnt in zip(c.fp4, c.counters, strict=True)
                    ]
                )
                res.append((t, s_))
            best = min(res)
            base_t = dict((s_, t) for t, s_ in res)[base.split_k]
            print(
                f"{model}.{name:8s} M={m:2d} n_tiles {n_tiles} k_tiles {k_tiles}: default split {base.split_k} "
                f"{base_t:6.1f} us, best split {best[1]} {best[0]:6.1f} us | "
                + " ".join(f"s{s_}:{t:.1f}" for t, s_ in res),
                flush=True,
            )


def host_cost():
    """Host time per eager call on a tiny weight (the GPU work is negligible): what bounds eager decode."""
    import time

    dev = torch.device("cuda")
    n, k = 512, 512
    c = Copies(n, k, dev)
    q, cnt = c.fp4[0], c.counters[0]
    w = c.bf16[0]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    cfg = tk.default_config(1, n, k, dev)
    cases = {
        "bf16 x @ w.t()": lambda: x @ w.t(),
        "nvfp4_linear (custom op)": lambda: ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale, None, cnt),
        "triton_kernels.gemm": lambda: tk.gemm(x, q.packed, q.scale, q.global_scale, counters=cnt),
        "default_config": lambda: tk.default_config(1, n, k, dev),
        "TensorDescriptor.from_tensor": lambda: TensorDescriptor.from_tensor(q.packed, [64, 128]),
        "torch.empty (workspace)": lambda: torch.empty((cfg.split_k, 1, n), dtype=torch.float32, device=dev),
        "dequant kernel launch": lambda: tk.dequantize(q.packed, q.scale, q.global_scale),
    }
    if os.environ.get("PROFILE"):  # where the host time goes, by function
        import cProfile
        import pstats

        for name in ("triton_kernels.gemm", "nvfp4_linear (custom op)"):
            for _ in range(20):
                cases[name]()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(500):
                cases[name]()
            prof.disable()
            print(f"--- {name}")
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    for name, fn in cases.items():
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(2000):
            fn()
        torch.cuda.synchronize()
        print(f"host {name:30s} {(time.perf_counter() - t0) / 2000 * 1e6:7.1f} us/call", flush=True)


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


CEILING_SOURCE = Path(__file__).with_name("probe_gemm.cu")  # the ceiling kernels, appended to decode_gemm.cu
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


class _CeilingArgs(ctypes.Structure):  # probe_gemm.cu's CeilingArgs, field for field
    _fields_ = [("out", ctypes.c_void_p), ("iters", ctypes.c_int)]


class _CeilingLdgArgs(ctypes.Structure):  # probe_gemm.cu's CeilingLdgArgs, field for field
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


def ncu_targets():
    """nvfp4_linear at M = 8 on six weight copies of each 7B shape, timing nothing: the calls for Nsight Compute to
    sample."""
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for n, k in shapes("7B").values():
        c = Copies(n, k, dev)
        x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
        for q in c.fp4[:6]:
            ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale)
        torch.cuda.synchronize()


MODES = {  # subcommand: the probe it runs, and what that measures (the module docstring's line)
    "stream": (stream_probe, "bandwidth of the GEMM's TMA access pattern alone"),
    "splits": (split_sweep, "every split-K on the shapes where wave count matters"),
    "host": (host_cost, "host time per eager call (what bounds eager decode)"),
    "cuda": (cuda_vs_triton, "CUDA vs Triton decode GEMM, with the engine's LoRA ranks"),
    "wgmma": (wgmma_vs_triton, "CUDA wgmma vs Triton GEMM and cuBLAS BF16 at 40 and 64 rows"),
    "wgmma-lora": (
        functools.partial(wgmma_vs_triton, lora=True),
        "the same with the rollout engine's LoRA in the same launch",
    ),
    "wgmma-ceiling": (wgmma_ceiling, "the 64-row wgmma loop, built up part by part"),
    "wgmma-by-k": (wgmma_by_k, "the 64-row wgmma GEMM's time against K: fixed cost and slope"),
    "ncu": (
        ncu_targets,
        "the GEMM on a few 7B shapes, untimed, for Nsight Compute to sample: "
        "ncu --clock-control none -k regex:_gemm_tc_kernel python -m benchmarks.probe_gemm ncu",
    ),
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", metavar="MODE", required=True)  # a mistyped mode runs nothing
    for mode, (_, measures) in MODES.items():
        modes.add_parser(mode, help=measures, description=measures)
    probe, _ = MODES[parser.parse_args(argv).mode]
    probe()


if __name__ == "__main__":
    main()
