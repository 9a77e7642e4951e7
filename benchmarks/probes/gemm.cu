// The chunk loop of nvfp4_wgmma_gemm without the GEMM around it, for `python -m benchmarks.probes.gemm wgmma-ceiling`.
// Not a file to build alone: cuda_gemm._kernel appends it to qerl/nvfp4/decode_gemm.cu and builds both with NVRTC,
// so these kernels use that file's types and helpers (u32, smem_addr, decode8, wgmma_step, Stage, ...) as they are.
//
// wgmma_ceiling runs one chunk per iteration (128 K; per warpgroup 64 weight rows: 4 rounds of 2 m64n64k16, as in
// nvfp4_wgmma_gemm), on whatever shared memory holds. STAGE 0: A from registers, rewritten every round; 1: + each
// thread's codes and scales read from shared memory; 2: + the real decode (scales_bf16x2, decode8); 3: + a ring
// handshake per chunk with a producer warpgroup that copies nothing (mbarriers full/empty, 4 stages); 4: as 0 with A
// from shared memory.

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
