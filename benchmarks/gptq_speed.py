"""How long GPTQ into NVFP4 (qerl/nvfp4/gptq.py, `qerl.quantize --gptq-calibration`) takes a decoder layer of a real
model's shape: its four passes (q/k/v stacked, o, gate/up stacked, down) on random BF16 weights and a random
positive-definite H, each repeated, median and spread, with the card; then the whole model's estimate (the calibration
forwards left out).

    python -m benchmarks.gptq_speed --sizes 1.5b,7b --repeats 3 --out runs/gptq_speed.json

GPTQ rounds one input column at a time with seven small kernels each (13,568 columns a 1.5B layer), so it runs at the
host's launch rate when the host queues ahead of the GPU; a wait for the GPU inside the column loop shows here. On a
GPU each pass is timed twice: the column loop eager, and replayed as a CUDA graph (gptq_weight(graph=True)).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from benchmarks.random_models import QWEN25
from benchmarks.timing import spread


def layer_passes(size: str) -> dict[str, tuple[int, int]]:
    """(rows N, input columns K) of each GPTQ pass of one decoder layer of Qwen2.5 `size` (fused groups stacked)."""
    hidden, intermediate, _, heads, kv_heads, _ = QWEN25[size]
    head_dim = hidden // heads
    return {
        "qkv": ((heads + 2 * kv_heads) * head_dim, hidden),
        "o": (hidden, heads * head_dim),
        "gate_up": (2 * intermediate, hidden),
        "down": (hidden, intermediate),
    }


def time_pass(rows: int, columns: int, repeats: int, device: str, graph: bool = False) -> list[float]:
    """Seconds of gptq_weight on one [rows, columns] BF16 weight, `repeats` times (after one untimed warm-up);
    `graph`: its column loop replayed as a CUDA graph (captured inside every call, as a quantization does)."""
    import torch

    from qerl.nvfp4 import codec
    from qerl.nvfp4.gptq import gptq_weight

    generator = torch.Generator(device=device).manual_seed(0)
    weight = (torch.randn(rows, columns, device=device, generator=generator) * 0.02).to(torch.bfloat16)
    inputs = torch.randn(2 * columns, columns, device=device, generator=generator)
    h = 2 * inputs.T @ inputs / inputs.shape[0]
    global_scale = codec.global_scale_from_amax(weight.abs().amax())

    def run() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        gptq_weight(weight, h, global_scale, graph=graph)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    run()
    return [run() for _ in range(repeats)]


def measure(sizes: list[str], repeats: int, device: str) -> dict:
    import torch

    card = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    result = {"card": card, "device": device, "repeats": repeats, "sizes": {}}
    loops = ("eager", "graph") if device.startswith("cuda") else ("eager",)
    for size in sizes:
        layers = QWEN25[size][2]
        for loop in loops:
            per_pass = {
                name: {"rows": n, "columns": k, **spread(time_pass(n, k, repeats, device, graph=loop == "graph"))}
                for name, (n, k) in layer_passes(size).items()
            }
            layer = sum(p["median"] for p in per_pass.values())
            timed = {"passes": per_pass, "layer_seconds": layer, "model_seconds": layer * layers}
            if loop == "eager":  # the layout of the records before the graph existed
                result["sizes"][size] = timed
            else:
                result["sizes"][size]["graph"] = timed
            print(
                f"{size}, {loop} column loop: {layer:.2f} s a layer ("
                + ", ".join(f"{name} {p['median']:.2f}" for name, p in per_pass.items())
                + f"), ~{layer * layers / 60:.1f} min for {layers} layers  [{card}]"
            )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1.5b,7b", help=f"comma-separated, of {', '.join(QWEN25)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, help="JSON file to write")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    unknown = [s for s in sizes if s not in QWEN25]
    if unknown:
        parser.error(f"--sizes: {', '.join(unknown)} unknown; choose from {', '.join(QWEN25)}")
    result = measure(sizes, args.repeats, args.device)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
