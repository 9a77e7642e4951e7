// NVFP4 x BF16 GEMMs for few rows, y[M, N] = x[M, K] @ W^T, W packed NVFP4: nvfp4_decode_gemm (mma.sync) for 1-16 rows
// of x (rollout decode), and below it nvfp4_wgmma_gemm (sm_90a) for 17-64.
// Built at first use by NVRTC (qerl/nvfp4/cuda_gemm.py), so: no headers, PTX for every specific instruction.
//
// Reads compressed-tensors' layout as it is in memory (no re-layout, no second copy): packed [N, K/2] bytes, two
// E2M1 codes per byte (even k in the low nibble), FP8 E4M3 scales [N, K/16], one FP32 global scale.
//
// The weight is the MMA's 16-row side (mma.sync m16n8k16, BF16 in, FP32 accumulate), x's rows its 8 columns.
// A warp walks K in chunks of 128 codes. For each weight row of its tile, the 4 threads of a quad read the
// row's 64 bytes of the chunk with one 16-byte load each (thread t: codes 32t..32t+31, scale groups 2t and
// 2t+1), so the loads are fully coalesced and each thread's codes never leave its registers. K is permuted
// inside the MMA: a dot product does not care in which order k runs, as long as x follows the weight. Thread t
// feeds MMA positions {2t, 2t+1, 2t+8, 2t+9} of a step from its own 32 codes, 4 codes per step, and takes the
// matching x values from its own 16-byte loads of x (byte permutes). So no shared memory, no shuffles.
//
// Decode, per 32-bit word of 8 codes (nibble i = code i): the pairs (i, i+4) are 16 bits apart, so one mask,
// one integer multiply (copies each nibble to <<6 for the magnitude and <<12 for the sign) and one mask give a
// BF16 pair whose bits are code x 2^-126 (E2M1's exponent and mantissa bits land in BF16's lowest exponent
// bits and top mantissa bit; code 1 is a BF16 subnormal). One BF16 multiply by scale x 2^110 then gives
// code x scale x 2^-16 exactly (2-bit times 4-bit significands), and the epilogue multiplies by 2^16 before
// dividing by the global scale: the same arithmetic as the Triton kernel.
//
// Grid (1-D): [LoRA CTAs] then (N tile, K split), N tile fastest. A CTA's WK warps split its K range chunk
// by chunk and reduce through shared memory; K splits across CTAs write FP32 partials, and the last CTA of
// an N tile (arrival counter) sums them in split order and re-arms the counter. A LoRA adapter (A [R, K],
// B [N, R]) rides along as in the Triton kernel: the first CTAs compute FP32 partials of s = x @ A^T over K
// ranges and arrive on counters[0]; the last to arrive re-arms it, sums the partials and writes s in BF16 pairs into
// `lora_s`, slots that hold an empty mark (all ones, which the writer never stores) between calls. Each N tile
// loads its s words right after its main loop, waits only while a word is still empty, adds s @ B^T on the tensor
// cores, and arrives on counters[1]; the last to arrive empties the slots and re-arms counters[1]. A word is written
// by one 32-bit store, so a reader sees the empty mark or the value: no flag, no fence, no extra round trip.
// The LoRA CTAs have the lowest block ids, so they are dispatched before any CTA that waits for them.
//
// Launched with programmatic dependent launch: the kernel may start while the previous one still runs. The weights
// (which no kernel writes) may be loaded before griddepcontrol.wait; everything another kernel writes only after it:
// x (plain-asm loads) through addresses that depend on pdl_wait()'s result, the bias, LoRA B and the s slots (C++ loads
// and volatile asm) below the wait's memory clobber. L2 prefetches (LoRA A and B) may come before it whatever they
// touch: no data reaches registers.

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define CHUNK 128      // K codes per warp step: 64 packed bytes per weight row, 16 per thread of the quad
#define LORA_PARTS 8   // at most this many K ranges in the LoRA shrink (cuda_gemm.LORA_PARTS)

__device__ __forceinline__ int imin(int a, int b) { return a < b ? a : b; }

// The weight stream is read once: keep it out of L1, which serves the scales and x. L2PF: ask L2 to fetch the
// whole 256-byte block (the next chunks of the same row, which this CTA's other warps read next).
template <int L2PF>
__device__ __forceinline__ void ld_stream(const void* p, u32 (&v)[4]) {
  if (L2PF)
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
  else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

// x and the LoRA A rows: a coherent load (`.nc` is only defined for data no one writes while the kernel lives, and with
// PDL this kernel starts before the previous one has written x). Only after pdl_wait: see there.
__device__ __forceinline__ void ld_16B(const void* p, u32 (&v)[4]) {
  asm("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "l"(p));
}

// griddepcontrol.wait, returning 0: fold it into the x addresses (a pointer or a chunk index). The loads are plain
// asm, which the compiler may move across a volatile asm with a memory clobber; the data dependency keeps them below
// the wait. (Without it the x loads were hoisted above the wait: CUDA-graph decode at 7B widths read x before the
// previous kernel wrote it and sampled NaN log-probs; tests/qerl/rollout/native/test_engine_gpu.py.) Before sm_90
// there is no PDL (the launch never asks for it there): the kernel starts after the previous one has finished.
__device__ __forceinline__ u32 pdl_wait() {
  u32 zero;
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n\tmov.u32 %0, 0;" : "=r"(zero) :: "memory");
#else
  asm volatile("mov.u32 %0, 0;" : "=r"(zero) :: "memory");
#endif
  return zero;
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ u32 ld_u16(const void* p) {
  u16 v;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}

// Ask L2 for `bytes` (a multiple of 16, 16-byte aligned) from p. Nothing reaches registers, and L2 is where every
// kernel's writes meet, so this may run before the PDL wait on any data: it only saves the DRAM round trip later.
__device__ __forceinline__ void prefetch_l2(const void* p, u32 bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p), "r"(bytes));
#else
  for (u32 o = 0; o < bytes; o += 128) asm volatile("prefetch.global.L2 [%0];" :: "l"((const char*)p + o));
#endif
}

// Written by other CTAs of this launch: read from L2, never from a stale L1 line.
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// The LoRA s slots: written by one CTA while others read them (relaxed, i.e. single 32-bit accesses, no data race).
#define S_EMPTY 0xFFFFFFFFu  // two BF16 NaNs, every payload bit set (a written pair never equals it: see the writer)
__device__ __forceinline__ u32 ld_relaxed(const u32* p) {
  u32 v;
  asm volatile("ld.relaxed.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_relaxed(u32* p, u32 v) {
  asm volatile("st.relaxed.gpu.global.b32 [%0], %1;" :: "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

__device__ __forceinline__ u32 bf16x2_mul(u32 a, u32 b) {
  u32 d;  // a * b + (-0): exact here, and -0 keeps the sign of a zero product
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ u32 f32x2_to_bf16x2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

__device__ __forceinline__ float bf16_to_f32(u16 b) {
  float f;
  asm("mov.b32 %0, %1;" : "=f"(f) : "r"(((u32)b) << 16));
  return f;
}

__device__ __forceinline__ u16 f32_to_bf16(float f) {
  u16 d;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(d) : "f"(f));
  return d;
}

// Two E4M3 scale bytes -> (s0 x 2^110, s0 x 2^110) and (s1 x 2^110, s1 x 2^110) as BF16 pairs, exact
// (E4M3 values, subnormals included, are normal in FP16 and in BF16 once scaled).
__device__ __forceinline__ void scales_bf16x2(u32 two, u32& s0, u32& s1) {
  u32 h;
  u16 b = (u16)two;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(b));
  float f0, f1;
  asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %2; cvt.f32.f16 %0, lo; cvt.f32.f16 %1, hi; }"
      : "=f"(f0), "=f"(f1) : "r"(h));
  const float k = 1.2980742146337069e33f;  // 2^110
  s0 = f32x2_to_bf16x2(f0 * k, f0 * k);
  s1 = f32x2_to_bf16x2(f1 * k, f1 * k);
}

// 8 codes (nibble i = code i) times a scale pair -> BF16 pairs (code i, code i+4) for i = 0..3.
__device__ __forceinline__ void decode8(u32 q, u32 s, u32 (&a)[4]) {
  const u32 keep = 0x81C081C0u;  // sign, two exponent bits, top mantissa bit of each half
  const u32 q2 = q >> 8;
  a[0] = bf16x2_mul(((q & 0x000F000Fu) * 0x1040u) & keep, s);
  a[1] = bf16x2_mul(((q & 0x00F000F0u) * 0x0104u) & keep, s);
  a[2] = bf16x2_mul(((q2 & 0x000F000Fu) * 0x1040u) & keep, s);
  a[3] = bf16x2_mul(((q2 & 0x00F000F0u) * 0x0104u) & keep, s);
}

// 8 BF16 values v0..v7 in 4 words (v0, v1) .. (v6, v7) -> pairs (v0, v4), (v1, v5), (v2, v6), (v3, v7): the
// same k order as decode8's output, so x (and a LoRA A row) meets the code it multiplies.
__device__ __forceinline__ void pair_up(const u32 (&v)[4], u32 (&b)[4]) {
  b[0] = prmt(v[0], v[2], 0x5410);
  b[1] = prmt(v[0], v[2], 0x7632);
  b[2] = prmt(v[1], v[3], 0x5410);
  b[3] = prmt(v[1], v[3], 0x7632);
}

__device__ __forceinline__ void mma(float (&c)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of 128 codes against 16 rows (two word sets, rows g and g+8) and the MT x tiles' pairs of 8 k.
template <int MT>
__device__ __forceinline__ void mma_chunk(float (&acc)[MT][4], const u32 (&lo)[4][4], const u32 (&hi)[4][4],
                                          const u32 (&xb)[MT][4][4]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      mma(acc[j], lo[w][0], hi[w][0], lo[w][1], hi[w][1], xb[j][w][0], xb[j][w][1]);
      mma(acc[j], lo[w][2], hi[w][2], lo[w][3], hi[w][3], xb[j][w][2], xb[j][w][3]);
    }
  }
}

// f(value, n, m) over a warp's accumulator tile: weight rows n0 + 16i + g (+8 for e >= 2), x rows 8j + 2t (+1 for odd
// e), as mma.sync's C fragment lays them out.
template <int NT, int MT, typename F>
__device__ __forceinline__ void for_each_output(float (&acc)[NT][MT][4], int n0, int g, int t, F f) {
#pragma unroll
  for (int i = 0; i < NT; ++i)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(acc[i][j][e], n0 + 16 * i + g + 8 * (e >> 1), 8 * j + 2 * t + (e & 1));
}

template <int NT, int MT>
struct Stage {
  u32 w[NT][2][4];   // packed codes, rows g and g+8 of each 16-row tile
  u32 s[NT][2];      // their two scale bytes
  u32 x[MT][4][4];   // x row g of each 8-row x tile: the 32 BF16 of the thread's k range
};

struct Args {
  const u16* x; const u8* packed; const u8* scale; const float* gs; const u16* bias; u16* y;
  float* ws; int* counters; const u16* lora_a; const u16* lora_b; float* lws; u32* lora_s;
  int sx, sy, M, N, K, split, split_chunks, lora_r, lora_parts, lora_chunks;
};

// Sum the WK warps' accumulators into warp 0's through shared memory; returns false for the other warps.
template <int E, int WK>
__device__ __forceinline__ bool reduce_warps(float (&acc)[E], float (*red)[E][32], int warp, int lane) {
  if (WK == 1) return true;
  if (warp > 0) {
#pragma unroll
    for (int e = 0; e < E; ++e) red[warp - 1][e][lane] = acc[e];
  }
  __syncthreads();
  if (warp > 0) return false;
#pragma unroll
  for (int w = 0; w < WK - 1; ++w) {
#pragma unroll
    for (int e = 0; e < E; ++e) acc[e] += red[w][e][lane];
  }
  return true;
}

// One x row's 32 BF16 of a chunk (the thread's k range), paired up as mma.sync's B operand wants them.
__device__ __forceinline__ void load_x_tile(const u16* row, u32 (&xb)[4][4]) {
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    u32 v[4];
    ld_16B(row + 8 * w, v);
    pair_up(v, xb[w]);
  }
}

// LoRA CTA: 16 ranks of s = x @ A^T over one K range, FP32 partial to lws[part, M, R], then one arrival.
template <int MT, int WK>
__device__ void lora_shrink(const Args& p, int cta, float (*red)[MT * 4][32]) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int rank_tiles = p.lora_r / 16, part = cta / rank_tiles, r0 = (cta % rank_tiles) * 16;
  const int c_end = imin((part + 1) * p.lora_chunks, p.K / CHUNK);
  if (threadIdx.x < 16)  // this CTA's 16 rows of A over its K range, while the previous kernel still runs
    prefetch_l2(p.lora_a + (u64)(r0 + threadIdx.x) * p.K + part * p.lora_chunks * CHUNK,
                (c_end - part * p.lora_chunks) * CHUNK * 2);
  const u32 after_wait = pdl_wait();
  const u16* arow[2] = {p.lora_a + (u64)(r0 + g) * p.K + 32 * t, p.lora_a + (u64)(r0 + g + 8) * p.K + 32 * t};
  const u16* xrow[MT];
#pragma unroll
  for (int j = 0; j < MT; ++j) xrow[j] = p.x + (u64)imin(8 * j + g, p.M - 1) * p.sx + 32 * t;
  float acc[MT][4] = {};
  for (int c = part * p.lora_chunks + warp + after_wait; c < c_end; c += WK) {  // loads below the wait: pdl_wait
    u32 lo[4][4], hi[4][4];
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      u32 v[4];
      ld_16B(arow[0] + c * CHUNK + 8 * w, v);
      pair_up(v, lo[w]);
      ld_16B(arow[1] + c * CHUNK + 8 * w, v);
      pair_up(v, hi[w]);
    }
    if constexpr (MT <= 2) {  // all x tiles' loads in flight at once
      u32 xb[MT][4][4];
#pragma unroll
      for (int j = 0; j < MT; ++j) load_x_tile(xrow[j] + c * CHUNK, xb[j]);
      mma_chunk<MT>(acc, lo, hi, xb);
    } else {  // the wgmma kernel's 4-8 x tiles: one at a time, or their registers would cost the GEMM occupancy
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        u32 xb[1][4][4];
        load_x_tile(xrow[j] + c * CHUNK, xb[0]);
        mma_chunk<1>(*reinterpret_cast<float(*)[1][4]>(&acc[j][0]), lo, hi, xb);
      }
    }
  }
  float* flat = &acc[0][0];
  __shared__ int last;
  if (reduce_warps<MT * 4, WK>(*reinterpret_cast<float(*)[MT * 4]>(flat), red, warp, lane)) {
#pragma unroll
    for (int j = 0; j < MT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = r0 + g + 8 * (e >> 1), m = 8 * j + 2 * t + (e & 1);
        if (m < p.M) p.lws[((u64)part * p.M + m) * p.lora_r + r] = acc[j][e];
      }
    }
    __threadfence();
    __syncwarp();
    if (lane == 0) last = atomicAdd(p.counters, 1) == p.lora_parts * rank_tiles - 1;
  }
  __syncthreads();
  if (!last) return;
  // The last LoRA CTA sums the partials once, in part order, and rounds s to BF16 (as a separate shrink GEMM would):
  // hundreds of N tiles then read M x R BF16 values instead of each summing every partial from the same L2 lines.
  __threadfence();
  if (threadIdx.x == 0) p.counters[0] = 0;  // every LoRA CTA of this call has arrived: re-armed
#pragma unroll 2
  for (int i = 2 * threadIdx.x; i < p.M * p.lora_r; i += 2 * WK * 32) {
    float v0 = 0.f, v1 = 0.f;
#pragma unroll
    for (int q = 0; q < LORA_PARTS; ++q) {
      if (q < p.lora_parts) {
        v0 += ld_cg(p.lws + (u64)q * p.M * p.lora_r + i);
        v1 += ld_cg(p.lws + (u64)q * p.M * p.lora_r + i + 1);
      }
    }
    const u32 pair = f32x2_to_bf16x2(v0, v1);
    st_relaxed(p.lora_s + i / 2, pair == S_EMPTY ? 0x7FC07FC0u : pair);  // a NaN s must not read as "not yet"
  }
}

#define LORA_G 4  // rank tiles of 16 whose B fragments are loaded together: ranks up to 64 in one round trip

// The tile's B fragments for ranks r0 .. r0 + 16 LORA_G (rows as mma.sync's A operand lays them out).
template <int NT, int G = LORA_G>
__device__ __forceinline__ void lora_b_fragments(const Args& p, u32 (&a)[G][NT][4], int n0, int r0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int q = 0; q < G; ++q) {
    if (r0 + 16 * q >= p.lora_r) continue;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      const u16* row0 = p.lora_b + (u64)imin(n0 + 16 * i + g, p.N - 1) * p.lora_r + r0 + 16 * q + 2 * t;
      const u16* row1 = p.lora_b + (u64)imin(n0 + 16 * i + g + 8, p.N - 1) * p.lora_r + r0 + 16 * q + 2 * t;
      a[q][i][0] = *reinterpret_cast<const u32*>(row0);
      a[q][i][1] = *reinterpret_cast<const u32*>(row1);
      a[q][i][2] = *reinterpret_cast<const u32*>(row0 + 8);
      a[q][i][3] = *reinterpret_cast<const u32*>(row1 + 8);
    }
  }
}

// The tile's s words for ranks r0 .. r0 + 16 LORA_G as mma.sync's B operand lays them out (s[m][r + 2t, +1] and
// s[m][r + 2t + 8, +9]); false while any is still empty.
template <int MT, int G = LORA_G>
__device__ __forceinline__ bool lora_s_fragments(const Args& p, u32 (&b)[G][MT][2], int r0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  bool ready = true;
#pragma unroll
  for (int q = 0; q < G; ++q) {
    if (r0 + 16 * q >= p.lora_r) continue;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
      const u32* row = p.lora_s + (imin(8 * j + g, p.M - 1) * p.lora_r + r0 + 16 * q + 2 * t) / 2;
      b[q][j][0] = ld_relaxed(row);
      b[q][j][1] = ld_relaxed(row + 4);
      ready &= b[q][j][0] != S_EMPTY && b[q][j][1] != S_EMPTY;
    }
  }
  return __all_sync(0xffffffffu, ready);
}

// acc (this tile's y^T, FP32, scaled) += (s @ B^T)^T, s = x @ A^T in BF16 from the last LoRA CTA. `a` and `b` hold the
// first ranks' B fragments and s words, loaded by warp 0 right after the main loop, so their round trip overlaps the
// warps' reduction; `ready` says whether every s word had been written by then.
template <int NT, int MT, int G = LORA_G>
__device__ void lora_expand(const Args& p, float (&acc)[NT][MT][4], int n0, u32 (&a)[G][NT][4], u32 (&b)[G][MT][2],
                            bool ready) {
  for (int r0 = 0; r0 < p.lora_r; r0 += 16 * G) {
    if (r0 > 0) {
      lora_b_fragments<NT, G>(p, a, n0, r0);
      ready = lora_s_fragments<MT, G>(p, b, r0);
    }
    while (!ready) {
      __nanosleep(64);
      ready = lora_s_fragments<MT, G>(p, b, r0);
    }
#pragma unroll
    for (int q = 0; q < G; ++q) {
      if (r0 + 16 * q >= p.lora_r) continue;
#pragma unroll
      for (int i = 0; i < NT; ++i) {
#pragma unroll
        for (int j = 0; j < MT; ++j)
          mma(acc[i][j], a[q][i][0], a[q][i][1], a[q][i][2], a[q][i][3], b[q][j][0], b[q][j][1]);
      }
    }
  }
}

// After the tile's stores (so they do not wait for this round trip): the last N tile to have read s empties the s
// slots and re-arms counters[1] for the next call.
__device__ __forceinline__ void lora_arrive(const Args& p, int n_tiles) {
  const int lane = threadIdx.x & 31;
  __syncwarp();
  int last = 0;
  if (lane == 0) last = atomicAdd(p.counters + 1, 1) == n_tiles - 1;
  if (!__shfl_sync(0xffffffffu, last, 0)) return;
  for (int i = lane; i < p.M * p.lora_r / 2; i += 32) st_relaxed(p.lora_s + i, S_EMPTY);
  if (lane == 0) p.counters[1] = 0;
}

// The end of a tile, in the warp that holds its accumulators (rows n0 + ...): with split-K, this split's FP32 partials
// and an arrival on counters[2 + counter], the last to arrive summing every split's and re-arming the counter; then
// the global scale and bias, the LoRA up-projection (`b`, `s`: its first round's fragments, loaded after the main
// loop), the stores, and the LoRA arrival (`lora_arrivals` of them per call).
template <int NT, int MT, int G>
__device__ __forceinline__ void finish_tile(const Args& p, float (&acc)[NT][MT][4], int n0, int split_idx, int counter,
                                            u32 (&b)[G][NT][4], u32 (&s)[G][MT][2], bool lora_ready,
                                            int lora_arrivals) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  if (p.split > 1) {
    for_each_output<NT, MT>(acc, n0, g, t, [&](float& v, int n, int m) {
      if (n < p.N && m < p.M) p.ws[((u64)split_idx * p.M + m) * p.N + n] = v;
    });
    __threadfence();
    __syncwarp();
    int arrived = 0;
    if (lane == 0) arrived = atomicAdd(p.counters + 2 + counter, 1);
    arrived = __shfl_sync(0xffffffffu, arrived, 0);
    if (arrived != p.split - 1) return;
    __threadfence();
    // Split outermost: all of one split's loads are in flight together (a split loop per output waited out one L2
    // round trip per output and split: the downs, which split, were ~10% slower).
    for_each_output<NT, MT>(acc, n0, g, t, [&](float& v, int, int) { v = 0.f; });
    for (int q = 0; q < p.split; ++q) {
      for_each_output<NT, MT>(acc, n0, g, t, [&](float& v, int n, int m) {
        if (n < p.N && m < p.M) v += ld_cg(p.ws + ((u64)q * p.M + m) * p.N + n);
      });
    }
    if (lane == 0) p.counters[2 + counter] = 0;  // every other split has arrived: re-armed
  }
  const float gs = *p.gs;
  for_each_output<NT, MT>(acc, n0, g, t, [&](float& v, int n, int) {
    v = v * 65536.0f / gs;  // undo the decode's 2^-16, then the global scale
    if (p.bias) v += bf16_to_f32(p.bias[imin(n, p.N - 1)]);
  });
  if (p.lora_r) lora_expand<NT, MT, G>(p, acc, n0, b, s, lora_ready);
  for_each_output<NT, MT>(acc, n0, g, t, [&](float& v, int n, int m) {
    if (n < p.N && m < p.M) p.y[(u64)m * p.sy + n] = f32_to_bf16(v);
  });
  if (p.lora_r) lora_arrive(p, lora_arrivals);
}

template <int NT, int MT, int WK, int STAGES, int L2PF>
__global__ void __launch_bounds__(WK * 32) nvfp4_decode_gemm(Args p) {
  constexpr int E = NT * MT * 4;
  __shared__ float red[WK > 1 ? WK - 1 : 1][E][32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int cta = blockIdx.x;
  const int lora_ctas = p.lora_r ? p.lora_parts * (p.lora_r / 16) : 0;
  if (cta < lora_ctas) {
    lora_shrink<MT, WK>(p, cta, reinterpret_cast<float(*)[MT * 4][32]>(&red[0][0][0]));
    return;
  }
  cta -= lora_ctas;
  const int n_tiles = (p.N + 16 * NT - 1) / (16 * NT);
  const int tile = cta % n_tiles, split_idx = cta / n_tiles, n0 = tile * 16 * NT;
  const int K2 = p.K / 2, KS = p.K / 16;

  // Rows past N and x rows past M read row N-1 / M-1 (in bounds); their outputs are never stored.
  const u8* prow[NT][2];
  const u8* srow[NT][2];
#pragma unroll
  for (int i = 0; i < NT; ++i) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int n = imin(n0 + 16 * i + 8 * h + g, p.N - 1);
      prow[i][h] = p.packed + (u64)n * K2 + 16 * t;
      srow[i][h] = p.scale + (u64)n * KS + 2 * t;
    }
  }
  const u16* xrow[MT];  // set after the PDL wait

  const int c_begin = split_idx * p.split_chunks;
  const int c_end = imin(c_begin + p.split_chunks, p.K / CHUNK);
  float acc[NT][MT][4] = {};
  Stage<NT, MT> st[STAGES];

  auto load_weights = [&](Stage<NT, MT>& s, int c) {
    if (c >= c_end) return;
#pragma unroll
    for (int i = 0; i < NT; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ld_stream<L2PF>(prow[i][h] + (u64)c * (CHUNK / 2), s.w[i][h]);
        s.s[i][h] = ld_u16(srow[i][h] + c * (CHUNK / 16));
      }
    }
  };
  auto load_x = [&](Stage<NT, MT>& s, int c) {
    if (c >= c_end) return;
#pragma unroll
    for (int j = 0; j < MT; ++j) {
#pragma unroll
      for (int w = 0; w < 4; ++w) ld_16B(xrow[j] + (u64)c * CHUNK + 8 * w, s.x[j][w]);
    }
  };
  auto compute = [&](const Stage<NT, MT>& s) {
    u32 xb[MT][4][4];
#pragma unroll
    for (int j = 0; j < MT; ++j) {
#pragma unroll
      for (int w = 0; w < 4; ++w) pair_up(s.x[j][w], xb[j][w]);
    }
#pragma unroll
    for (int i = 0; i < NT; ++i) {
      u32 lo[4][4], hi[4][4];
      u32 sl0, sl1, sh0, sh1;
      scales_bf16x2(s.s[i][0], sl0, sl1);
      scales_bf16x2(s.s[i][1], sh0, sh1);
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // words 0, 1: scale group 2t; words 2, 3: group 2t + 1
        decode8(s.w[i][0][w], w < 2 ? sl0 : sl1, lo[w]);
        decode8(s.w[i][1][w], w < 2 ? sh0 : sh1, hi[w]);
      }
      mma_chunk<MT>(acc[i], lo, hi, xb);
    }
  };

  // Register ring: chunk c + (STAGES - 1) * WK is in flight while chunk c is decoded. No kernel writes the weights,
  // so the first chunks' loads come before the PDL wait (to overlap the previous kernel's tail), and x, that kernel's
  // output, after it (in the sm_90 SASS: the weight and scale LDGs, then ACQBULK, then the x LDGs).
  int c = c_begin + warp;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_weights(st[s], c + s * WK);
  if (p.lora_r && split_idx == 0 && threadIdx.x == 0)  // the tile's rows of B, read at its tail
    prefetch_l2(p.lora_b + (u64)n0 * p.lora_r, imin(16 * NT, p.N - n0) * p.lora_r * 2);
  const u32 after_wait = pdl_wait();
#pragma unroll
  for (int j = 0; j < MT; ++j) xrow[j] = p.x + after_wait + (u64)imin(8 * j + g, p.M - 1) * p.sx + 32 * t;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_x(st[s], c + s * WK);
  for (; c < c_end; c += STAGES * WK) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int cs = c + s * WK;
      if (cs < c_end) {
        load_weights(st[(s + STAGES - 1) % STAGES], cs + (STAGES - 1) * WK);
        load_x(st[(s + STAGES - 1) % STAGES], cs + (STAGES - 1) * WK);
        compute(st[s]);
      }
    }
  }
  u32 lora_b[LORA_G][NT][4], lora_s[LORA_G][MT][2];
  bool lora_ready = false;
  if (p.lora_r && warp == 0) {  // the LoRA epilogue's first loads, in flight while the warps reduce
    lora_b_fragments<NT>(p, lora_b, n0, 0);
    lora_ready = lora_s_fragments<MT>(p, lora_s, 0);
  }
  pdl_launch_dependents();

  float* flat = &acc[0][0][0];
  if (!reduce_warps<E, WK>(*reinterpret_cast<float(*)[E]>(flat), red, warp, lane)) return;

  finish_tile<NT, MT, LORA_G>(p, acc, n0, split_idx, tile, lora_b, lora_s, lora_ready, n_tiles);  // warp 0: the tile
}

// ------------------------------------------------------------------------------------------------------------------
// 17-64 rows on sm_90a: wgmma with the weight decoded into its register A operand and x read from shared memory.
//
// Why a second kernel: at 64 rows every weight meets 64 columns of x, so mma.sync with x in registers either keeps
// 8 x fragments per warp (255 registers, 2 CTAs per SM, the decode's dependent chains unhidden: 0.74-1.23x of the
// Triton kernel, kernel_notes.md) or stages x per warp (7x the weight's bytes). wgmma reads x from shared memory
// itself, asynchronously: a warpgroup decodes the next 32 K of its weight while the tensor cores run this one's.
//
// A warpgroup owns 64 weight rows (warp w: 16 rows, as an m64 A operand lays them out), a CTA WG warpgroups. Each
// thread loads and decodes its codes exactly as the decode kernel does (same K permutation, decode8, scales): the
// BF16 pairs land in wgmma's A fragment, which for 16 rows of one warp is mma.sync's. x goes the other way: the CTA
// copies each 128-K chunk of its rows into shared memory, pair_up applied on the way so that x follows the codes'
// K order, in the no-swizzle K-major layout (8 x rows by 16 bytes per 128-byte core matrix; cores along K 128
// bytes apart, row groups of 8 XS_ROWGROUP bytes apart); a warp's 32 stores of one word go to 32 banks.
// Three x buffers rotate: the chunk being multiplied, the next one being stored, and the one before, which wgmmas may
// still read until every warpgroup has waited on them; one barrier per chunk.
//
// The epilogue is per warp: its 16 rows x the x rows are mma.sync's C fragments (wgmma's D fragment has that layout),
// so split-K (one arrival counter per 16 rows), bias, the LoRA up-projection and the stores reuse the helpers above.

#define XS_ROWGROUP 2048  // bytes per 8 x rows of one chunk in shared memory: 16 core matrices of 8 x 16 bytes
#define X_BUFFERS 3

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u32 a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}

// wgmma's matrix descriptor for B: no swizzle, K-major cores of 8 rows x 16 bytes; the two cores of a 16-K step are
// 128 bytes apart (leading byte offset), row groups XS_ROWGROUP bytes (stride byte offset).
__device__ __forceinline__ u64 x_descriptor(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)(128 >> 4) << 16) | ((u64)(XS_ROWGROUP >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;" :: "n"(N) : "memory"); }
// Shared-memory writes by this thread (generic proxy) become visible to wgmma's reads (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Keep the compiler from reading or writing accumulators across a wgmma wait (it cannot see wgmma's asynchrony).
template <int MT>
__device__ __forceinline__ void fence_accumulators(float (&d)[MT][4]) {
#pragma unroll
  for (int j = 0; j < MT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) asm volatile("" : "+f"(d[j][e]) :: "memory");
}

// wgmma reads its A registers until a wait covers it; ptxas only sees the asm's inputs consumed at issue, so a value
// "used" here stays in its register up to this point (otherwise ptxas serializes every wgmma, C7513).
__device__ __forceinline__ void keep_until_here(u32 (&r)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) asm volatile("" : "+r"(r[i]) :: "memory");
}

// d[64 x 8MT] += A[64 x 16] (registers, mma.sync's A fragment per warp) @ B[16 x 8MT] (shared memory, descriptor).
template <int MT>
__device__ __forceinline__ void wgmma_step(float (&d)[MT][4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc);

template <>
__device__ __forceinline__ void wgmma_step<8>(float (&d)[8][4], u32 a0, u32 a1, u32 a2, u32 a3, u64 desc) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, "
      "%24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(1)
      : "memory");
}

// Round w of a chunk (32 K): the two k16 steps of its A fragments against x at xs, then the wait that frees round
// w - 1's A registers.
__device__ __forceinline__ void wgmma_round(float (&d)[8][4], u32 (&a)[4][8], int w, u32 xs) {
  wgmma_fence();
  wgmma_step<8>(d, a[w][0], a[w][4], a[w][1], a[w][5], x_descriptor(xs + (4 * w) * 128));
  wgmma_step<8>(d, a[w][2], a[w][6], a[w][3], a[w][7], x_descriptor(xs + (4 * w + 2) * 128));
  wgmma_commit();
  if (w > 0) {
    wgmma_wait<1>();
    keep_until_here(a[w - 1]);  // the previous round's A registers are free only now
  }
}

// A chunk's scales as BF16 pairs: sc[h] for row g + 8h, [0] for its words 0-1 (scale group 2t), [1] for words 2-3.
__device__ __forceinline__ void chunk_scales(const Stage<1, 1>& s, u32 (&sc)[2][2]) {
  scales_bf16x2(s.s[0][0], sc[0][0], sc[0][1]);
  scales_bf16x2(s.s[0][1], sc[1][0], sc[1][1]);
}

// Round w's A fragments (32 K of the chunk): rows g (words 0-3) and g + 8 (words 4-7).
__device__ __forceinline__ void decode_round(const Stage<1, 1>& s, const u32 (&sc)[2][2], int w, u32 (&a)[4][8]) {
  decode8(s.w[0][0][w], sc[0][w >> 1], *reinterpret_cast<u32(*)[4]>(&a[w][0]));
  decode8(s.w[0][1][w], sc[1][w >> 1], *reinterpret_cast<u32(*)[4]>(&a[w][4]));
}

template <int MT, int WG, int STAGES, int OCC>
__global__ void __launch_bounds__(WG * 128, OCC) nvfp4_wgmma_gemm(Args p) {
  constexpr int X_BUFFER = MT * XS_ROWGROUP;  // bytes of one chunk of x: MT row groups of 8 rows
  extern __shared__ __align__(128) u8 smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  int cta = blockIdx.x;
  const int lora_ctas = p.lora_r ? p.lora_parts * (p.lora_r / 16) : 0;
  if (cta < lora_ctas) {
    lora_shrink<MT, WG * 4>(p, cta, reinterpret_cast<float(*)[MT * 4][32]>(smem));
    return;
  }
  cta -= lora_ctas;
  const int n_tiles = (p.N + 64 * WG - 1) / (64 * WG);
  const int tile = cta % n_tiles, split_idx = cta / n_tiles;
  const int n0 = tile * 64 * WG + 16 * warp;  // this warp's 16 weight rows
  const int K2 = p.K / 2, KS = p.K / 16;
  const u8* prow[2];
  const u8* srow[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = imin(n0 + 8 * h + g, p.N - 1);
    prow[h] = p.packed + (u64)n * K2 + 16 * t;
    srow[h] = p.scale + (u64)n * KS + 2 * t;
  }
  const int c_begin = split_idx * p.split_chunks;
  const int c_end = imin(c_begin + p.split_chunks, p.K / CHUNK);

  // x copy: unit u = (row group u / 32, row (u % 32) / 4 of it, 32-K quarter u % 4 of the chunk); its thread loads the
  // quarter's 64 bytes and stores word q of each 8-K pair_up group into core 4w + q, word u % 4 of the row.
  static_assert(32 * MT % (WG * 128) == 0, "every thread copies the same number of x units");
  constexpr int X_UNITS = 32 * MT / (WG * 128);
  u32 xr[X_UNITS][4][4];
  const u16* xsrc[X_UNITS];
  u32 xdst[X_UNITS];
  const u32 xs_base = smem_addr(smem);

  Stage<1, 1> st[STAGES];  // weight words and scales only (x goes through shared memory)
  auto load_weights = [&](Stage<1, 1>& s, int c) {
    if (c >= c_end) return;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ld_stream<1>(prow[h] + (u64)c * (CHUNK / 2), s.w[0][h]);
      s.s[0][h] = ld_u16(srow[h] + c * (CHUNK / 16));
    }
  };
  auto load_x = [&](int c) {
    if (c >= c_end) return;
#pragma unroll
    for (int i = 0; i < X_UNITS; ++i) {
#pragma unroll
      for (int w = 0; w < 4; ++w) ld_16B(xsrc[i] + (u64)c * CHUNK + 8 * w, xr[i][w]);
    }
  };
  auto store_x = [&](int c) {
    if (c >= c_end) return;
    const u32 buf = ((c - c_begin) % X_BUFFERS) * X_BUFFER;
#pragma unroll
    for (int i = 0; i < X_UNITS; ++i) {
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        u32 b[4];
        pair_up(xr[i][w], b);
#pragma unroll
        for (int q = 0; q < 4; ++q)
          asm volatile("st.shared.b32 [%0], %1;" :: "r"(xs_base + buf + xdst[i] + (4 * w + q) * 128), "r"(b[q])
                       : "memory");
      }
    }
    fence_proxy_async();
  };

  int c = c_begin;
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) load_weights(st[s], c + s);
  if (p.lora_r && split_idx == 0 && lane == 0 && n0 < p.N)  // the warp's rows of B, read at its tail
    prefetch_l2(p.lora_b + (u64)n0 * p.lora_r, imin(16, p.N - n0) * p.lora_r * 2);
  const u32 after_wait = pdl_wait();
#pragma unroll
  for (int i = 0; i < X_UNITS; ++i) {
    const int u = threadIdx.x + i * WG * 128, row = 8 * (u / 32) + (u % 32) / 4;
    xsrc[i] = p.x + after_wait + (u64)imin(row, p.M - 1) * p.sx + 32 * (u % 4);
    xdst[i] = (u / 32) * XS_ROWGROUP + ((u % 32) / 4) * 16 + 4 * (u % 4);
  }
  load_x(c);
  store_x(c);
  load_x(c + 1);
  __syncthreads();

  float acc[1][MT][4] = {};
  for (; c < c_end; c += STAGES) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      const int cs = c + s;
      if (cs < c_end) {
        store_x(cs + 1);  // its buffer's last reader, chunk cs - 2, is done in every warpgroup (barrier below)
        load_x(cs + 2);
        load_weights(st[(s + STAGES - 1) % STAGES], cs + STAGES - 1);
        const u32 xs = xs_base + ((cs - c_begin) % X_BUFFERS) * X_BUFFER;
        u32 sc[2][2];
        chunk_scales(st[s], sc);
        u32 a[4][8];  // each round's A fragments
#pragma unroll
        for (int w = 0; w < 4; ++w) {  // 32 K per round: decode, then two k16 steps on the tensor cores
          decode_round(st[s], sc, w, a);
          wgmma_round(acc[0], a, w, xs);
        }
        wgmma_wait<0>();  // nothing in flight across chunks (ptxas would serialize every wgmma)
        keep_until_here(a[3]);
        __syncthreads();  // x of chunk cs + 1 is stored; every warpgroup is done with chunk cs - 1
      }
    }
  }
  wgmma_wait<0>();
  fence_accumulators<MT>(acc[0]);
  if (n0 >= p.N) return;

  constexpr int G = 16 / MT;  // rank tiles per round of LoRA loads: the s words of 64 x rows take 32 registers
  u32 lora_b[G][1][4], lora_s[G][MT][2];
  bool lora_ready = false;
  if (p.lora_r) {
    lora_b_fragments<1, G>(p, lora_b, n0, 0);
    lora_ready = lora_s_fragments<MT, G>(p, lora_s, 0);
  }
  pdl_launch_dependents();

  // Per warp: its 16 rows have their own split-K counter, and every warp of the weight arrives on the LoRA counter.
  finish_tile<1, MT, G>(p, acc, n0, split_idx, n0 / 16, lora_b, lora_s, lora_ready, (p.N + 15) / 16);
}
