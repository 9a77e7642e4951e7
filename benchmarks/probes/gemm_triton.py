"""The Triton GEMM's probes for benchmarks.probes.gemm (`stream`, `splits`, `host`, `ncu`): a pure-streaming kernel
with the GEMM's access pattern, every split-K, the host time of an eager call, and the calls for Nsight Compute.

`stream` runs a kernel with the GEMM's grid, tiles, split-K and TMA ring that only XORs the bytes it receives: the
bandwidth the access pattern allows with no decode and no MMA. `ncu` calls the GEMM on a few 7B shapes (weights
rotated so they stream from HBM) for the profiler to sample.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.probes.measure import Copies, graph_time_us, nvfp4_bytes, shapes
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
