"""Peak host memory of the streaming quantizer and of loading an NVFP4 checkpoint, against their sizes.

    python -m benchmarks.load_memory [--hidden 2048 --layers 12 --intermediate 8192] [--out runs/load_memory.json]

Writes a synthetic BF16 Qwen2 checkpoint (random weights, sharded), quantizes it with the native CLI
backend, then loads it on the CPU with load_nvfp4_model, each step in a fresh process that reports its
peak RSS over its RSS right after imports. The point: peak memory follows the packed size (loading) or
one layer (quantizing), never the BF16 model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.launch import REPO

_MEASURE = """
import sys, json, torch, transformers
import qerl.nvfp4.checkpoint as ckpt
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint
def status_mb(key):  # VmHWM/VmRSS, not ru_maxrss: ru_maxrss keeps the parent's peak across fork+exec
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024
base = status_mb("VmRSS")
step, src, dst = sys.argv[1:4]
if step == "quantize":
    quantize_checkpoint(src, dst, max_shard_bytes=512 * 1024**2)
else:
    model = ckpt.load_nvfp4_model(src, device="cpu")
    checksum = sum(t.view(torch.uint8).max().item() for t in model.state_dict().values())  # touch every page
print(json.dumps({"baseline_mb": base, "peak_mb": status_mb("VmHWM")}))
"""


def write_bf16_checkpoint(out: Path, hidden: int, layers: int, intermediate: int, vocab: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    heads, kv_heads, head_dim = hidden // 128, max(1, hidden // 512), 128
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    out.mkdir(parents=True)
    config.save_pretrained(out)
    shapes = {
        "self_attn.q_proj": (heads * head_dim, hidden),
        "self_attn.k_proj": (kv_heads * head_dim, hidden),
        "self_attn.v_proj": (kv_heads * head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * head_dim),
        "mlp.gate_proj": (intermediate, hidden),
        "mlp.up_proj": (intermediate, hidden),
        "mlp.down_proj": (hidden, intermediate),
    }
    weight_map = {}

    def shard(name: str, tensors: dict) -> None:
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    for i in range(layers):
        t = {f"model.layers.{i}.{m}.weight": torch.randn(s, dtype=torch.bfloat16) * 0.02 for m, s in shapes.items()}
        for m in ("q_proj", "k_proj", "v_proj"):
            t[f"model.layers.{i}.self_attn.{m}.bias"] = torch.zeros(shapes[f"self_attn.{m}"][0], dtype=torch.bfloat16)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            t[f"model.layers.{i}.{norm}.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        shard(f"layers-{i:03d}.safetensors", t)
    shard(
        "rest.safetensors",
        {
            "model.embed_tokens.weight": torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02,
            "lm_head.weight": torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02,
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        },
    )
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def folder_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.glob("*.safetensors")) / 1024**2


def measure(step: str, src: Path, dst: Path) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", _MEASURE, step, str(src), str(dst)], capture_output=True, text=True, cwd=REPO
    )
    if result.returncode != 0:
        raise RuntimeError(f"{step} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--out", default="runs/load_memory.json")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        bf16, nvfp4 = Path(tmp) / "bf16", Path(tmp) / "nvfp4"
        write_bf16_checkpoint(bf16, args.hidden, args.layers, args.intermediate, args.vocab)
        quant = measure("quantize", bf16, nvfp4)
        load = measure("load", nvfp4, nvfp4)
        rows = {
            "bf16_checkpoint_mb": folder_mb(bf16),
            "nvfp4_checkpoint_mb": folder_mb(nvfp4),
            "quantize_peak_over_baseline_mb": quant["peak_mb"] - quant["baseline_mb"],
            "load_peak_over_baseline_mb": load["peak_mb"] - load["baseline_mb"],
            "load_baseline_mb": load["baseline_mb"],
        }
    print(f"{'what':36s} {'MiB':>10s}")
    for key, value in rows.items():
        print(f"{key:36s} {value:10.1f}")
    print(f"load peak / NVFP4 checkpoint size: {rows['load_peak_over_baseline_mb'] / rows['nvfp4_checkpoint_mb']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), **rows}, indent=2))


if __name__ == "__main__":
    main()
