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

import ctypes
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.kernels import Copies, graph_time_us, measure_ceilings, nvfp4_bytes, shapes
from qerl.device_facts import sm_count
from qerl.nvfp4 import ops
from qerl.nvfp4 import triton_kernels as tk


@triton.jit
def _stream_kernel(p_desc, s_desc, out_ptr, tiles_per_split, BLOCK_N: tl.constexpr, KW: tl.constexpr,
                   KG: tl.constexpr, STAGES: tl.constexpr):
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
    _stream_linear_kernel[(n_tiles, cfg.split_k)](p_desc, out, tiles, k_tiles, ROWS=rows, STAGES=cfg.num_stages,
                                                  num_warps=cfg.num_warps)


def stream(packed, scale, cfg, out):
    n, k2 = packed.shape
    k = 2 * k2
    p32 = packed.view(torch.int32)
    s8 = scale.view(torch.uint8)
    p_desc = TensorDescriptor.from_tensor(p32, [cfg.block_n, cfg.block_k // 8])
    s_desc = TensorDescriptor.from_tensor(s8, [cfg.block_n, cfg.block_k // 16])
    n_tiles = triton.cdiv(n, cfg.block_n)
    tiles = triton.cdiv(triton.cdiv(k, cfg.block_k), cfg.split_k)
    _stream_kernel[(n_tiles, cfg.split_k)](p_desc, s_desc, out, tiles, BLOCK_N=cfg.block_n, KW=cfg.block_k // 8,
                                           KG=cfg.block_k // 16, STAGES=cfg.num_stages, num_warps=cfg.num_warps)


def split_sweep():
    """Time every split-K (not only powers of two) at M = 1, 8, 16 on the shapes where the grid's wave count matters."""
    dev = torch.device("cuda")
    for model, name in (("7B", "gate_up"), ("7B", "down"), ("14B", "gate_up"), ("14B", "down"), ("32B", "gate_up"),
                        ("32B", "down"), ("7B", "qkv"), ("32B", "qkv")):
        n, k = shapes(model)[name]
        c = Copies(n, k, dev)
        k_tiles = triton.cdiv(k, 256)
        n_tiles = triton.cdiv(n, 64)
        for m in (1, 8, 16):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            base = tk.default_config(m, n, k, dev)
            splits = sorted({s for s in (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20, 24, 32) if s <= k_tiles
                             and (triton.cdiv(k_tiles, s) * (s - 1) < k_tiles)} | {base.split_k})  # no empty split
            res = []
            for s_ in splits:
                cfg = tk.GemmConfig(base.block_m, base.block_n, base.block_k, s_, base.num_warps, base.num_stages)
                t = graph_time_us([lambda q=q, cnt=cnt, cfg=cfg, x=x: tk.gemm(x, q.packed, q.scale, q.global_scale,
                                                                               config=cfg, counters=cnt)
                                   for q, cnt in zip(c.fp4, c.counters, strict=True)])
                res.append((t, s_))
            best = min(res)
            base_t = dict((s_, t) for t, s_ in res)[base.split_k]
            print(f"{model}.{name:8s} M={m:2d} n_tiles {n_tiles} k_tiles {k_tiles}: default split {base.split_k} "
                  f"{base_t:6.1f} us, best split {best[1]} {best[0]:6.1f} us | "
                  + " ".join(f"s{s_}:{t:.1f}" for t, s_ in res), flush=True)


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
    return (torch.randn(rank, k, device=dev, dtype=torch.bfloat16) * 0.05,
            torch.randn(n, rank, device=dev, dtype=torch.bfloat16) * 0.05)


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
                        row.append(graph_time_us([lambda q=q, cn=cn, gemm=gemm, kw=kw, x=x: gemm(
                            x, q.packed, q.scale, q.global_scale, counters=cn, **kw)
                            for q, cn in zip(c.fp4, c.counters, strict=True)]))
                pct = nvfp4_bytes(n, k) / row[1] / 1e3 / copy_gbs * 100
                print(f"{model}.{name:8s} M={m}: triton {row[0]:6.1f} cuda {row[1]:6.1f} ({pct:3.0f}%) | with LoRA "
                      f"r{ENGINE_LORA_RANKS[name]}: triton {row[2]:6.1f} cuda {row[3]:6.1f}", flush=True)
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
    print("| shape | M | LoRA rank | cuBLAS BF16 | Triton | wgmma | Triton / wgmma | wgmma % of copy | dispatch | "
          "dispatch takes | wgmma config |")
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
                    times.append(graph_time_us([
                        lambda q=q, cn=cn, gemm=gemm, x=x, a=adapter: gemm(x, q.packed, q.scale, q.global_scale,
                                                                           counters=cn, **a)
                        if gemm else _dispatch(x, q, cn, **a)
                        for q, cn in zip(c.fp4, counters, strict=True)]))
                bf16, triton_us, wgmma_us, dispatch_us = times
                takes = "wgmma" if cuda_gemm.supported(x, k, rank, n) else "Triton"
                pct = nvfp4_bytes(n, k) / wgmma_us / 1e3 / copy_gbs * 100
                print(f"| {model}.{name} | {m} | {rank or '-'} | {bf16:.1f} | {triton_us:.1f} | {wgmma_us:.1f} | "
                      f"{triton_us / wgmma_us:.2f}x | {pct:.0f}% | {dispatch_us:.1f} | {takes} | "
                      f"{tuple(cuda_gemm.wgmma_config(n, k, idx))} |", flush=True)
            del c
            torch.cuda.empty_cache()


# One chunk per iteration (128 K; per warpgroup 64 weight rows: 4 rounds of 2 m64n64k16, as in nvfp4_wgmma_gemm), on
# whatever shared memory holds. STAGE 0: A from registers, rewritten every round; 1: + each thread's codes and scales
# read from shared memory; 2: + the real decode (scales_bf16x2, decode8); 3: + a ring handshake per chunk with a
# producer warpgroup that copies nothing (mbarriers full/empty, 4 stages); 4: as 0 with A from shared memory.
CEILING_SOURCE = r"""
struct CeilingArgs { float* out; int iters; };

__device__ __forceinline__ void wgmma_step_ss(float (&d)[8][4], u64 a_desc, u64 b_desc) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1, 0, 0;"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(a_desc), "l"(b_desc) : "memory");
}

__device__ __forceinline__ void ceiling_mbar_wait(u32 bar, u32 parity) {
  asm volatile("{\n.reg .pred done;\nWAIT:\nmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
               "@!done bra WAIT;\n}" :: "r"(bar), "r"(parity) : "memory");
}
__device__ __forceinline__ void ceiling_mbar_arrive(u32 bar) {
  asm volatile("{ .reg .b64 st; mbarrier.arrive.shared::cta.b64 st, [%0]; }" :: "r"(bar) : "memory");
}

// Shared memory (64 KB): codes of 64 WG rows at 0 (64 bytes a row), their scales at 16 KB, two x buffers at 32 KB,
// A for STAGE 4 at 24 KB, the mbarriers in the last 64 bytes.
template <int STAGE, int WG>
__global__ void __launch_bounds__(128 * (WG + 1), 1) wgmma_ceiling(CeilingArgs p) {
  extern __shared__ __align__(128) u8 smem[];
  const u32 base = smem_addr(smem), full = base + 65536 - 64, empty = full + 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  if (threadIdx.x < 4) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 128;" :: "r"(full + 8 * threadIdx.x) : "memory");
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(empty + 8 * threadIdx.x), "r"(4 * WG) : "memory");
  }
  __syncthreads();
  if (warp < 4) {  // the producer warpgroup: hands over a stage per chunk once it is released, copies nothing
    if (STAGE == 3) {
      for (int i = 0; i < p.iters; ++i) {
        if (i >= 4) ceiling_mbar_wait(empty + 8 * (i % 4), ((i / 4) & 1) ^ 1);
        ceiling_mbar_arrive(full + 8 * (i % 4));
      }
    }
    return;
  }
  const int row = 16 * (warp - 4) + g;  // warpgroup (warp - 4) / 4 owns rows 64 of them
  float acc[8][4] = {};
  u32 words[2][4] = {{0x12345678u ^ threadIdx.x, 0x9abcdef0u, 0x0f1e2d3cu, 0x4b5a6978u}, {1u, 2u, 3u, 4u}};
  u32 sc[2][2] = {{0x3f803f80u, 0x3f803f80u}, {0x3f803f80u, 0x3f803f80u}};
  for (int it = 0; it < p.iters; ++it) {
    if (STAGE == 3) ceiling_mbar_wait(full + 8 * (it % 4), (it / 4) & 1);
    if (STAGE >= 1 && STAGE <= 3) {
      const u32 st = base + (it & 3) * 256;  // addresses that move like a ring's
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(words[h][0]), "=r"(words[h][1]), "=r"(words[h][2]), "=r"(words[h][3])
                     : "r"(st + (row + 8 * h) * 64 + t * 16) : "memory");
        u16 two;
        asm volatile("ld.shared.u16 %0, [%1];" : "=h"(two) : "r"(st + 16384 + (row + 8 * h) * 8 + 2 * t) : "memory");
        if (STAGE >= 2) scales_bf16x2(two | 0x3030u, sc[h][0], sc[h][1]);
        else sc[h][0] ^= two;
      }
    }
    const u32 xs = base + 32768 + (it & 1) * 16384;
    u32 a[4][8];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      if (STAGE >= 2) {
        decode8(words[0][w], sc[0][w >> 1], *reinterpret_cast<u32(*)[4]>(&a[w][0]));
        decode8(words[1][w], sc[1][w >> 1], *reinterpret_cast<u32(*)[4]>(&a[w][4]));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          a[w][e] = words[0][w] ^ (sc[0][0] + e + it);
          a[w][4 + e] = words[1][w] ^ (e + it);
        }
      }
      wgmma_fence();
      if (STAGE == 4) {
        const u64 ad = x_descriptor(base + 24576 + (4 * w) * 128) & ~(0x3FFFull << 32) | ((u64)(256 >> 4) << 32);
        wgmma_step_ss(acc, ad, x_descriptor(xs + (4 * w) * 128));
        wgmma_step_ss(acc, ad + 16, x_descriptor(xs + (4 * w + 2) * 128));
      } else {
        wgmma_step<8>(acc, a[w][0], a[w][4], a[w][1], a[w][5], x_descriptor(xs + (4 * w) * 128));
        wgmma_step<8>(acc, a[w][2], a[w][6], a[w][3], a[w][7], x_descriptor(xs + (4 * w + 2) * 128));
      }
      wgmma_commit();
      if (w > 0) {
        wgmma_wait<1>();
        keep_until_here(a[w - 1]);
      }
    }
    wgmma_wait<0>();
    keep_until_here(a[3]);
    if (STAGE == 3) {
      __syncwarp();
      if (lane == 0) ceiling_mbar_arrive(empty + 8 * (it % 4));
    }
  }
  fence_accumulators<8>(acc);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s += acc[j][e];
  p.out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}

// The same loop with each thread's codes and scales loaded from global memory into a 3-chunk register ring, as
// nvfp4_wgmma_gemm loads them (the loads of chunk i + 2 issued before chunk i's decode). SRC 0: every CTA reads the
// same 4 chunks of the same rows (L2 hits); 1: each CTA streams its own rows of a buffer larger than L2 (DRAM);
// 2: as 1 with the ring in shared memory instead (each thread's own slots, filled by cp.async, waited for with
// cp.async.wait_group), RING chunks deep, so that no load into a register is in flight at a wgmma.fence (ptxas puts
// one before every wgmma that reads registers, asked for or not); 3: as 1 without the wgmma (the decoded words are
// summed): the loads and the decode alone.
struct CeilingLdgArgs { float* out; int iters; const u8* codes; const u8* scales; int k2; int chunks; };

template <int SRC, int WG, int RING>
__global__ void __launch_bounds__(128 * WG, 1) wgmma_ceiling_ldg(CeilingLdgArgs p) {
  extern __shared__ __align__(128) u8 smem[];
  const u32 base = smem_addr(smem);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int row = (SRC == 0 ? 0 : blockIdx.x * 64 * WG) + 16 * warp + g;
  const u8* prow[2];
  const u8* srow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    prow[h] = p.codes + (u64)(row + 8 * h) * p.k2 + 16 * t;
    srow[h] = p.scales + (u64)(row + 8 * h) * (p.k2 / 8) + 2 * t;
  }
  const int wrap = SRC == 0 ? 4 : p.chunks;
  Stage<1, 1> st[RING];
  auto load = [&](Stage<1, 1>& s, int it) {
    const int c = it % wrap;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ld_stream<1>(prow[h] + (u64)c * 64, s.w[0][h]);
      s.s[0][h] = ld_u16(srow[h] + c * 8);
    }
  };
  // SRC 2: per chunk 48 bytes a thread (two 16-byte code loads, two 8-byte scale loads), after the two x buffers
  const u32 slot = base + 32768 + threadIdx.x * 48;
  auto load_async = [&](int stage, int it) {
    const int c = it % wrap;
    const u32 dst = slot + stage * 128 * WG * 48;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst + 16 * h), "l"(prow[h] + (u64)c * 64)
                   : "memory");
      asm volatile("cp.async.ca.shared.global [%0], [%1], 8;" :: "r"(dst + 32 + 8 * h), "l"(srow[h] - 2 * t + c * 8)
                   : "memory");
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  auto read_async = [&](Stage<1, 1>& s, int stage) {
    asm volatile("cp.async.wait_group %0;" :: "n"(RING - 1) : "memory");  // the RING - 1 newer chunks may fly
    const u32 src = slot + stage * 128 * WG * 48;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(s.w[0][h][0]), "=r"(s.w[0][h][1]), "=r"(s.w[0][h][2]), "=r"(s.w[0][h][3])
                   : "r"(src + 16 * h) : "memory");
      u16 two;
      asm volatile("ld.shared.u16 %0, [%1];" : "=h"(two) : "r"(src + 32 + 8 * h + 2 * t) : "memory");
      s.s[0][h] = two;
    }
  };
  float acc[8][4] = {};
  u32 sink = 0;
#pragma unroll
  for (int s = 0; s < RING - 1; ++s) {
    if (SRC == 2) load_async(s, s);
    else load(st[s], s);
  }
  for (int it = 0; it < p.iters; it += RING) {
#pragma unroll
    for (int s = 0; s < RING; ++s) {
      if (SRC == 2) {
        load_async((s + RING - 1) % RING, it + s + RING - 1);
        read_async(st[s], s);
      } else {
        load(st[(s + RING - 1) % RING], it + s + RING - 1);
      }
      const u32 xs = base + ((it + s) & 1) * 16384;
      u32 sc[2][2];
      chunk_scales(st[s], sc);
      u32 a[4][8];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        decode_round(st[s], sc, w, a);
        if (SRC == 3) {
#pragma unroll
          for (int e = 0; e < 8; ++e) sink += a[w][e];
          continue;
        }
        wgmma_round(acc, a, w, xs);
      }
      if (SRC != 3) {
        wgmma_wait<0>();
        keep_until_here(a[3]);
      }
    }
  }
  fence_accumulators<8>(acc);
  float s = (float)sink;
#pragma unroll
  for (int j = 0; j < 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s += acc[j][e];
  p.out[blockIdx.x * blockDim.x + threadIdx.x] = s;
}
"""
CEILING_LDG_SOURCES = (  # (source, ring depth, label)
    (0, 3, "codes and scales from L2, register ring of 3, + decode"), (1, 3, "the same from DRAM"),
    (2, 3, "from DRAM, ring of 3 in shared memory by cp.async"), (2, 4, "the same, ring of 4"),
    (2, 6, "the same, ring of 6"), (3, 3, "from DRAM, register ring of 3, decode only (no wgmma)"))
LDG_SHARED_BYTES = 32768 + 6 * 512 * 48  # x buffers, then the deepest cp.async ring of 4 warpgroups
CEILING_STAGES = ("A in registers (bare wgmma)", "+ codes and scales from shared memory", "+ decode",
                  "+ ring handshake with a producer", "A in shared memory (bare wgmma)")


class _CeilingArgs(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("iters", ctypes.c_int)]


class _CeilingLdgArgs(ctypes.Structure):
    _fields_ = [("out", ctypes.c_void_p), ("iters", ctypes.c_int), ("codes", ctypes.c_void_p),
                ("scales", ctypes.c_void_p), ("k2", ctypes.c_int), ("chunks", ctypes.c_int)]


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
    print(f"{torch.cuda.get_device_name(idx)}, copy {copy_gbs:.0f} GB/s; {sms} CTAs, one per SM; per chunk: 128 K x "
          "64 weight rows per warpgroup (8 m64n64k16)")
    print("| loop | consumer warpgroups | us per chunk | TFLOPS | weight bytes it keeps up with, GB/s | % of copy |")
    print("|---|---|---|---|---|---|")

    def row(label, wg, name, threads, args, shared_bytes=65536):
        chunks_run = args.iters
        func = cuda_gemm._kernel(name, "90a", shared_bytes, idx, CEILING_SOURCE)
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
        print(f"| {label} | {wg} | {per_chunk * 1e6:.3f} | {flops / 1e12:.0f} | {weight_gbs:.0f} | "
              f"{weight_gbs / copy_gbs * 100:.0f}% |", flush=True)

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
            row(label, wg, f"wgmma_ceiling_ldg<{src}, {wg}, {ring}>", 128 * wg,
                _CeilingLdgArgs(out.data_ptr(), iters - iters % ring, codes, scales, chunks * 64, chunks),
                LDG_SHARED_BYTES)


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
                us = graph_time_us([lambda q=q, cfg=cfg, x=x: cuda_gemm.gemm(x, q.packed, q.scale, q.global_scale,
                                                                              config=cfg) for q in c.fp4])
                row.append(f" {tuple(cfg)} | {us:.1f} |")
            print("".join(row), flush=True)
            del c
            torch.cuda.empty_cache()


def main(mode):
    dev = torch.device("cuda")
    torch.manual_seed(0)
    for name, (n, k) in shapes("7B").items():
        c = Copies(n, k, dev)
        if mode == "ncu":
            x = torch.randn(8, k, device=dev, dtype=torch.bfloat16)
            for q in c.fp4[:6]:
                ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale)
            torch.cuda.synchronize()
            continue
        for m in (1, 8, 16):
            cfg = tk.default_config(m, n, k, dev)
            out = torch.empty(4096 * 64, dtype=torch.int32, device=dev)
            t_stream = graph_time_us([lambda q=q, cfg=cfg, out=out: stream(q.packed, q.scale, cfg, out) for q in c.fp4])
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            t_gemm = graph_time_us([lambda q=q, x=x: ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale)
                                    for q in c.fp4])
            t_bf = graph_time_us([lambda w=w, x=x: x @ w.t() for w in c.bf16])
            nb = nvfp4_bytes(n, k)
            print(f"{name:8s} M={m:2d} cfg={tuple(cfg)} bf16 {t_bf:6.1f} us | stream {t_stream:6.1f} us "
                  f"{nb / t_stream / 1e3:5.0f} GB/s | gemm {t_gemm:6.1f} us {nb / t_gemm / 1e3:5.0f} GB/s", flush=True)
            if m != 8:
                continue
            for split_mul, stages in ((1, 2), (1, 4), (1, 6), (2, 3), (4, 3), (0.5, 3)):
                v = tk.GemmConfig(cfg.block_m, cfg.block_n, cfg.block_k, max(1, int(cfg.split_k * split_mul)),
                                  cfg.num_warps, stages)
                t = graph_time_us([lambda q=q, v=v, out=out: stream(q.packed, q.scale, v, out) for q in c.fp4])
                t_lin = graph_time_us([lambda q=q, v=v, out=out: stream_linear(q.packed, v, out) for q in c.fp4])
                print(f"   stream split {v.split_k:2d} stages {stages}: {t:6.1f} us {nb / t / 1e3:5.0f} GB/s | "
                      f"contiguous tiles {t_lin:6.1f} us {n * k // 2 / t_lin / 1e3:5.0f} GB/s", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "stream"
    {"splits": split_sweep, "host": host_cost, "cuda": cuda_vs_triton, "wgmma": wgmma_vs_triton,
     "wgmma-lora": lambda: wgmma_vs_triton(lora=True), "wgmma-ceiling": wgmma_ceiling,
     "wgmma-by-k": wgmma_by_k}.get(mode, lambda: main(mode))()
