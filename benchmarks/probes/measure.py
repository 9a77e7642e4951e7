"""What the GPU benchmarks share to time a kernel: the Qwen2.5 layer shapes, an NVFP4 weight's bytes, CUDA-graph
timing, weight copies that defeat the L2, and the device's copy-bandwidth and BF16 matmul ceilings.

Used by benchmarks.probes.nvfp4_speed, benchmarks.probes.gemm's probes and benchmarks.probes.decode_attention.
"""

from __future__ import annotations

import math
import statistics

MODELS = {  # hidden, heads, kv heads, intermediate, head_dim (Qwen2.5)
    "0.5B": (896, 14, 2, 4864, 64),
    "1.5B": (1536, 12, 2, 8960, 128),
    "3B": (2048, 16, 2, 11008, 128),
    "7B": (3584, 28, 4, 18944, 128),
    "14B": (5120, 40, 8, 13824, 128),
    "32B": (5120, 40, 8, 27648, 128),
}
L2_BYTES = 60 * 2**20
ROTATE_BYTES = 4 * L2_BYTES  # the weight copies a graph cycles through add up to at least this


def shapes(model):
    h, nh, nkv, inter, head_dim = MODELS[model]
    return {
        "qkv": ((nh + 2 * nkv) * head_dim, h),
        "o": (h, nh * head_dim),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
    }


def nvfp4_bytes(n, k):
    return n * k // 2 + n * k // 16 + 4


# --------------------------------------------------------------------------------------------- timing


def graph_time_us(fns, reps=5, calls=None):
    """Median over `reps` replays of a CUDA graph that runs every fn in `fns` (round robin, `calls` total)."""
    import torch

    calls = calls or max(len(fns), 24)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles, cuBLAS handles) outside the capture
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del g
    return statistics.median(times)


def copies_for(nbytes):
    return max(2, math.ceil(ROTATE_BYTES / max(nbytes, 1)))


def make_weights(n, k, count, device):
    """`count` independent (bf16, nvfp4) weight pairs; the nvfp4 ones are quantized from the bf16 ones."""
    import torch

    from qerl.nvfp4 import codec

    out = []
    for _ in range(count):
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        out.append((w, codec.quantize(w)))
    return out


class Copies:
    """Enough copies of one shape's weights to defeat the L2, bf16 and nvfp4 counted separately."""

    def __init__(self, n, k, device):
        from qerl.nvfp4 import codec, ops

        self.n, self.k = n, k
        self.n_bf16 = copies_for(n * k * 2)
        self.n_fp4 = copies_for(nvfp4_bytes(n, k))
        base = make_weights(n, k, min(self.n_bf16, 2), device)
        self.bf16 = [base[i % len(base)][0].clone() for i in range(self.n_bf16)]
        self.fp4 = []
        for i in range(self.n_fp4):
            q = base[i % len(base)][1]
            self.fp4.append(codec.NVFP4Weight(q.packed.clone(), q.scale.clone(), q.global_scale.clone()))
        # Kept per weight, as NVFP4Linear keeps them: no memset per call (room for the probes' LoRA ranks, up to 64).
        self.counters = [ops.splitk_counters(n, device, lora_rank=64) for _ in self.fp4]


def measure_ceilings(device):
    # Best of a plain copy and a 16-byte-vector elementwise kernel: the roofline a streaming kernel can hit.
    import torch

    x = torch.randn(2**29, device=device)  # 2 GiB in, 2 GiB out
    y = torch.empty_like(x)
    t_copy = graph_time_us([lambda x=x, y=y: y.copy_(x)], reps=5, calls=4)
    t_mul = graph_time_us([lambda x=x, y=y: torch.mul(x, 2.0, out=y)], reps=5, calls=4)
    copy_gbs = 2 * x.numel() * 4 / min(t_copy, t_mul) / 1e3
    del x, y
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    t = graph_time_us([lambda: a @ b], reps=5, calls=5)
    tflops = 2 * 8192**3 / t / 1e6
    return copy_gbs, tflops
