"""NVFP4 kernel benchmark: dequant bandwidth, fused W4A16 GEMM vs cuBLAS BF16, large-M forward/backward.

    python -m benchmarks.probes.nvfp4_speed                 # full table + JSON under runs/
    python -m benchmarks.probes.nvfp4_speed --quick         # 7B shapes only
    python -m benchmarks.probes.nvfp4_speed --sweep         # also time a grid of GEMM configs per shape (tuning)

Every timing is the median over several replays of a CUDA graph holding many calls, each call on the next
of several weight copies (together well over the 60 MB L2), so the weights stream from HBM as in decode.
BF16 is `x @ w.t()` (cuBLAS). Correctness is checked before timing (bit-exact dequant, GEMM error vs
float64); a failed check aborts the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from benchmarks.probes.measure import (
    MODELS,
    Copies,
    copies_for,
    graph_time_us,
    make_weights,
    measure_ceilings,
    nvfp4_bytes,
    shapes,
)

SMALL_M = (1, 2, 4, 8, 16, 32, 64)
LARGE_M = (2048, 4096)


# --------------------------------------------------------------------------------------------- checks


def rel_err(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def check_shape(n, k, device, ms=(1, 7, 16, 64)):
    import torch

    from qerl.nvfp4 import codec, ops
    from qerl.nvfp4 import triton_kernels as tk

    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    q = codec.quantize(w)
    ref = codec.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16)
    out = torch.full_like(ref, float("nan"))
    tk.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16, out=out)
    if not torch.equal(out.view(torch.int16), ref.view(torch.int16)):
        raise SystemExit(f"dequant not bit-exact at {n}x{k}")
    w64 = ref.double()
    worst = 0.0
    for m in ms:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        y = torch.full((m, n), float("nan"), device=device, dtype=torch.bfloat16)
        ops._linear_2d(x, q.packed, q.scale, q.global_scale, None)  # dispatch path compiles
        tk.gemm(x, q.packed, q.scale, q.global_scale, out=y)
        e = rel_err(y, x.double() @ w64.t())
        if not (e < 1e-2):
            raise SystemExit(f"gemm error {e} at M={m} {n}x{k}")
        worst = max(worst, e)
    return worst


# --------------------------------------------------------------------------------------------- benches


def bench_dequant(c: Copies, copy_gbs):
    import torch

    from qerl.nvfp4 import triton_kernels as tk

    outs = [torch.empty(c.n, c.k, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    fns = [
        lambda q=q, o=outs[i % 2]: tk.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16, out=o)
        for i, q in enumerate(c.fp4)
    ]
    t = graph_time_us(fns)
    gbs = (nvfp4_bytes(c.n, c.k) + 2 * c.n * c.k) / t / 1e3
    return dict(us=t, gbs=gbs, pct=100 * gbs / copy_gbs)


def bench_small(c: Copies, m, copy_gbs, config=None, use_asm=None):
    import torch

    from qerl.nvfp4 import ops
    from qerl.nvfp4 import triton_kernels as tk

    x = torch.randn(m, c.k, device="cuda", dtype=torch.bfloat16)
    t_bf = graph_time_us([lambda w=w: x @ w.t() for w in c.bf16])
    if config is None:
        fns = [
            lambda q=q, cnt=cnt: ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale, None, cnt)
            for q, cnt in zip(c.fp4, c.counters, strict=True)
        ]
    else:
        fns = [lambda q=q: tk.gemm(x, q.packed, q.scale, q.global_scale, config=config, use_asm=use_asm) for q in c.fp4]
    t_fp = graph_time_us(fns)
    nbytes = nvfp4_bytes(c.n, c.k) + 2 * m * (c.k + c.n)
    gbs = nbytes / t_fp / 1e3
    return dict(
        bf16_us=t_bf,
        nvfp4_us=t_fp,
        speedup=t_bf / t_fp,
        gbs=gbs,
        pct=100 * gbs / copy_gbs,
        bf16_gbs=(2 * c.n * c.k + 2 * m * (c.k + c.n)) / t_bf / 1e3,
    )


def bench_large(c: Copies, m, tflops):
    import torch

    from qerl.nvfp4 import ops

    x = torch.randn(m, c.k, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(m, c.n, device="cuda", dtype=torch.bfloat16)
    ws, qs = c.bf16[:2], c.fp4[:2]  # compute bound: two copies are enough
    t_bf = graph_time_us([lambda w=w: x @ w.t() for w in ws], calls=4)
    t_fp = graph_time_us([lambda q=q: ops.nvfp4_linear(x, q.packed, q.scale, q.global_scale) for q in qs], calls=4)
    t_bf_b = graph_time_us([lambda w=w: g @ w for w in ws], calls=4)
    t_fp_b = graph_time_us(
        [lambda q=q: g @ ops.dequantize(q.packed, q.scale, q.global_scale, torch.bfloat16) for q in qs], calls=4
    )
    flops = 2 * m * c.n * c.k
    return dict(
        fwd_bf16_us=t_bf,
        fwd_nvfp4_us=t_fp,
        fwd_ratio=t_bf / t_fp,
        bwd_bf16_us=t_bf_b,
        bwd_nvfp4_us=t_fp_b,
        bwd_ratio=t_bf_b / t_fp_b,
        bf16_tflops=flops / t_bf / 1e6,
        pct_mma=100 * flops / t_fp / 1e6 / tflops,
    )


def bench_layer(model, m, copy_gbs):
    """All four linears of one decoder layer (qkv, o, gate_up, down) back to back at M rows."""
    import torch

    from qerl.nvfp4 import codec, ops

    sh = shapes(model)
    per_layer_bf16 = sum(n * k * 2 for n, k in sh.values())
    layers = copies_for(per_layer_bf16)
    ws = {name: make_weights(n, k, 1, "cuda")[0] for name, (n, k) in sh.items()}
    xs = {name: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for name, (n, k) in sh.items()}
    bf = [{name: w.clone() for name, (w, q) in ws.items()} for _ in range(layers)]
    fp = [
        {
            name: (
                codec.NVFP4Weight(q.packed.clone(), q.scale.clone(), q.global_scale.clone()),
                ops.splitk_counters(q.packed.shape[0], "cuda"),
            )
            for name, (w, q) in ws.items()
        }
        for _ in range(copies_for(sum(nvfp4_bytes(n, k) for n, k in sh.values())))
    ]

    def run_bf(layer):
        for name in sh:
            xs[name] @ layer[name].t()

    def run_fp(layer):
        for name in sh:
            q, counters = layer[name]
            ops.nvfp4_linear(xs[name], q.packed, q.scale, q.global_scale, None, counters)

    t_bf = graph_time_us([lambda L=L: run_bf(L) for L in bf])
    t_fp = graph_time_us([lambda L=L: run_fp(L) for L in fp])
    nbytes = sum(nvfp4_bytes(n, k) for n, k in sh.values())
    gbs = nbytes / t_fp / 1e3
    return dict(bf16_us=t_bf, nvfp4_us=t_fp, speedup=t_bf / t_fp, gbs=gbs, pct=100 * gbs / copy_gbs)


def sweep_configs(m, n, k):
    """A targeted grid per row bucket: (block_m, block_n, block_k, warps, stages) x split (auto for 1, 2 and 4
    CTAs per SM)."""
    import torch

    from qerl.nvfp4 import triton_kernels as tk

    dev = torch.device("cuda")
    bm = 16 if m <= 16 else max(16, 1 << (m - 1).bit_length())
    grid = [(bm, 64, 256, 4, 3), (bm, 64, 256, 4, 4), (bm, 128, 256, 8, 3), (bm, 64, 128, 4, 4), (bm, 64, 128, 4, 6)]
    out = {tk.default_config(m, n, k, dev)}
    for bm_, bn, bk, warps, stages in grid:
        for waves in (1, 2, 4):
            out.add(tk.GemmConfig(bm_, bn, bk, tk.auto_split(n, k, bn, bk, dev, waves), warps, stages))
    return sorted(out)


DEQUANT_CONFIGS = ((32, 256, 4), (64, 128, 4), (16, 256, 4), (32, 128, 4), (16, 128, 2), (32, 256, 8))


def sweep_dequant(c: Copies, copy_gbs):
    import torch

    from qerl.nvfp4 import triton_kernels as tk

    rows = []
    for bn, bk2, warps in DEQUANT_CONFIGS:
        out = torch.empty(c.n, c.k, device="cuda", dtype=torch.bfloat16)
        fns = [
            lambda q=q, out=out, bn=bn, bk2=bk2, warps=warps: tk.dequantize(
                q.packed, q.scale, q.global_scale, torch.bfloat16, out=out, block_n=bn, block_k2=bk2, num_warps=warps
            )
            for q in c.fp4
        ]
        t = graph_time_us(fns)
        rows.append(((bn, bk2, warps), t, (nvfp4_bytes(c.n, c.k) + 2 * c.n * c.k) / t / 1e3))
    return rows


# --------------------------------------------------------------------------------------------- main


def fmt_table(header, rows):
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(header)]
    lines = [" | ".join(str(h).ljust(w) for h, w in zip(header, widths, strict=True))]
    lines.append("-|-".join("-" * w for w in widths))
    lines += [" | ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="JSON path (default runs/bench_kernels_<time>.json)")
    ap.add_argument("--models", default="7B,14B,32B", help=f"of {', '.join(MODELS)}")
    ap.add_argument("--quick", action="store_true", help="7B only, fewer M")
    ap.add_argument("--sweep", action="store_true", help="time a grid of GEMM configs (slow: many compiles)")
    ap.add_argument("--sweep-m", default="1,16,64")
    ap.add_argument("--no-large", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from qerl.nvfp4 import ops
    from qerl.nvfp4 import triton_kernels as tk

    if not torch.cuda.is_available():
        sys.exit("benchmarks.probes.nvfp4_speed needs a CUDA GPU")
    torch.manual_seed(0)
    models = ["7B"] if args.quick else args.models.split(",")
    small_m = (1, 8, 16, 64) if args.quick else SMALL_M
    dev = torch.device("cuda")
    result = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=__import__("triton").__version__,
        command=" ".join(sys.argv),
        time=time.ctime(),
    )
    t_start = time.time()
    copy_gbs, tflops = measure_ceilings(dev)
    result["ceilings"] = dict(copy_gbs=copy_gbs, bf16_tflops=tflops)
    print(f"# {result['device']}: copy {copy_gbs:.0f} GB/s (read+write), bf16 mm {tflops:.0f} TFLOP/s", flush=True)

    result["checks"] = {}
    for model in models:
        for name, (n, k) in shapes(model).items():
            result["checks"][f"{model}.{name}"] = check_shape(n, k, dev)
    odd = check_shape(1000 + 37, 3584 + 48, dev, ms=(1, 3, 17, 33, 50))
    result["checks"]["odd"] = odd
    print(f"# checks passed (dequant bit-exact; worst gemm rel err {max(result['checks'].values()):.2e})", flush=True)

    deq_rows, small_rows, large_rows, sweep_rows = [], [], [], []
    result["dequant"], result["small"], result["large"], result["layer"], result["sweep"] = [], [], [], [], []
    for model in models:
        for name, (n, k) in shapes(model).items():
            c = Copies(n, k, dev)
            d = bench_dequant(c, copy_gbs)
            result["dequant"].append(dict(model=model, shape=name, n=n, k=k, **d))
            deq_rows.append((f"{model}.{name}", f"{n}x{k}", f"{d['us']:.1f}", f"{d['gbs']:.0f}", f"{d['pct']:.0f}%"))
            for m in small_m:
                r = bench_small(c, m, copy_gbs)
                cfg = tk.default_config(m, n, k, dev) if m <= ops.FUSED_MAX_M else None
                result["small"].append(dict(model=model, shape=name, n=n, k=k, m=m, config=cfg, **r))
                small_rows.append(
                    (
                        f"{model}.{name}",
                        f"{n}x{k}",
                        m,
                        f"{r['bf16_us']:.1f}",
                        f"{r['nvfp4_us']:.1f}",
                        f"{r['speedup']:.2f}x",
                        f"{r['gbs']:.0f}",
                        f"{r['pct']:.0f}%",
                    )
                )
                print("  ", small_rows[-1], flush=True)
            if args.sweep and model in ("7B", "32B"):
                for cfg, t, gbs in sweep_dequant(c, copy_gbs):
                    result["sweep"].append(dict(model=model, shape=name, dequant=cfg, us=t, gbs=gbs))
                    print("  dequant sweep", name, cfg, f"{t:.1f} us {gbs:.0f} GB/s", flush=True)
                for m in (int(v) for v in args.sweep_m.split(",")):
                    best = None
                    for cfg in sweep_configs(m, n, k):
                        r = bench_small(c, m, copy_gbs, config=cfg)
                        result["sweep"].append(dict(model=model, shape=name, m=m, config=cfg, **r))
                        if best is None or r["nvfp4_us"] < best[1]["nvfp4_us"]:
                            best = (cfg, r)
                    base = tk.default_config(m, n, k, dev)
                    r_noasm = bench_small(c, m, copy_gbs, config=best[0], use_asm=False)
                    top = sorted(
                        (r["nvfp4_us"], tuple(r["config"]))
                        for r in result["sweep"]
                        if r.get("shape") == name and r.get("model") == model and r.get("m") == m
                    )[:5]
                    print("  top5", name, m, [(f"{u:.1f}", cf) for u, cf in top], flush=True)
                    sweep_rows.append(
                        (
                            f"{model}.{name}",
                            m,
                            str(tuple(base)),
                            str(tuple(best[0])),
                            f"{best[1]['nvfp4_us']:.1f}",
                            f"{best[1]['speedup']:.2f}x",
                            f"{r_noasm['nvfp4_us']:.1f}",
                        )
                    )
                    print("  sweep", sweep_rows[-1], flush=True)
            if not args.no_large:
                for m in LARGE_M:
                    r = bench_large(c, m, tflops)
                    result["large"].append(dict(model=model, shape=name, n=n, k=k, m=m, **r))
                    large_rows.append(
                        (
                            f"{model}.{name}",
                            m,
                            f"{r['fwd_bf16_us']:.0f}",
                            f"{r['fwd_nvfp4_us']:.0f}",
                            f"{r['fwd_ratio']:.2f}x",
                            f"{r['bwd_bf16_us']:.0f}",
                            f"{r['bwd_nvfp4_us']:.0f}",
                            f"{r['bwd_ratio']:.2f}x",
                        )
                    )
                    print("  ", large_rows[-1], flush=True)
            del c
            torch.cuda.empty_cache()
    layer_rows = []
    for model in models:
        for m in (1, 8, 16, 64):
            r = bench_layer(model, m, copy_gbs)
            result["layer"].append(dict(model=model, m=m, **r))
            layer_rows.append(
                (
                    f"{model} layer",
                    m,
                    f"{r['bf16_us']:.1f}",
                    f"{r['nvfp4_us']:.1f}",
                    f"{r['speedup']:.2f}x",
                    f"{r['gbs']:.0f}",
                    f"{r['pct']:.0f}%",
                )
            )
    result["seconds"] = time.time() - t_start

    print(
        f"\n## {result['device']}, torch {result['torch']}, triton {result['triton']}; "
        f"copy {copy_gbs:.0f} GB/s, bf16 {tflops:.0f} TFLOP/s"
    )
    print("\n### Dequant (packed NVFP4 -> BF16), bytes read + written\n")
    print(fmt_table(("shape", "NxK", "us", "GB/s", "% copy BW"), deq_rows))
    print("\n### Small M: nvfp4_linear vs cuBLAS BF16 x @ w.t()\n")
    print(fmt_table(("shape", "NxK", "M", "BF16 us", "NVFP4 us", "speedup", "GB/s", "% BW roofline"), small_rows))
    print("\n### Decoder layer linears (qkv, o, gate_up, down)\n")
    print(fmt_table(("layer", "M", "BF16 us", "NVFP4 us", "speedup", "GB/s", "% BW roofline"), layer_rows))
    if large_rows:
        print("\n### Large M: forward (nvfp4_linear) and input grad (dequant + cuBLAS) vs BF16\n")
        print(
            fmt_table(
                ("shape", "M", "fwd BF16 us", "fwd NVFP4 us", "fwd ratio", "bwd BF16 us", "bwd NVFP4 us", "bwd ratio"),
                large_rows,
            )
        )
    if sweep_rows:
        print("\n### Config sweep (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)\n")
        print(fmt_table(("shape", "M", "default", "best", "best us", "speedup", "best w/o asm us"), sweep_rows))

    path = args.out or os.path.join("runs", f"bench_kernels_{time.strftime('%Y%m%d_%H%M%S')}.json")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, default=list)
    print(f"\nwrote {path} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
