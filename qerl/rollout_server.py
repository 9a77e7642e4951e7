"""Serve rollouts from one GPU to a trainer elsewhere: an engine (the native one, or --engine vllm) on the trainer's
base checkpoint, sampling each round with the adapter and the AQN noise the trainer sends (qerl/rollout/server.py; the
design: docs/multi_gpu.md).

    CUDA_VISIBLE_DEVICES=1 python -m qerl.rollout_server --model ckpt/qwen-1.5b-nvfp4 --port 8001 --seed 1

One server per rollout GPU, each with its own port and --seed (the trainer refuses two alike: they would draw the
same completions for the same prompts). The native engine is the default: on two H200s it sampled the real 1.5B's
rounds ahead faster than vLLM (docs/multi_gpu.md, "What two H200s showed"); vLLM's takes a repetition penalty.
"""

from __future__ import annotations

import logging
import sys

from qerl import cli

VLLM_MEMORY = 0.85  # vLLM's share of a GPU of its own
ENGINE_FLAGS = {  # each engine's own flags (their names in the parsed arguments)
    "vllm": ("gpu_memory_utilization", "max_model_len", "max_num_seqs", "enforce_eager"),
    "native": ("kv_cache_gib",),
}


def build_parser() -> cli.ArgumentParser:
    parser = cli.ArgumentParser(prog="python -m qerl.rollout_server", description=__doc__)
    parser.add_argument("--model", required=True, help="the base checkpoint folder the trainer loaded (required)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument("--port", type=cli.Range(int, 1, 65535), required=True, help="port to listen on (required)")
    parser.add_argument("--lora-rank", type=cli.COUNT, default=16, help="the largest LoRA rank the server takes")
    parser.add_argument("--seed", type=cli.SEED, default=0, help="the engine's sampling seed: give each server its own")
    parser.add_argument(
        "--engine",
        choices=("native", "vllm"),
        default="native",
        help="the engine that samples: the native one (faster decode with LoRA), or vLLM's (a repetition penalty too)",
    )
    vllm = parser.add_argument_group("--engine vllm")
    vllm.add_argument(
        "--gpu-memory-utilization", type=cli.FRACTION, help=f"vLLM's share of the GPU (default: {VLLM_MEMORY})"
    )
    vllm.add_argument("--max-model-len", type=cli.COUNT, help="the engine's context (default: the model's)")
    vllm.add_argument("--max-num-seqs", type=cli.COUNT, help="sequences per batch (default: vLLM's)")
    vllm.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    native = parser.add_argument_group("--engine native")
    native.add_argument(
        "--kv-cache-gib",
        type=cli.Range(float, 0.0, low_open=True),
        help="KV-cache memory a round may take (default: 80%% of free)",
    )
    return parser


def parse_args(argv: list[str] | None = None):
    """The flags, a flag of the other engine's group refused in one line (it would be ignored)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for engine, names in ENGINE_FLAGS.items():
        given = [name for name in names if getattr(args, name) not in (None, False)]
        if given and engine != args.engine:
            flag = "--" + given[0].replace("_", "-")
            parser.error(f"{flag} is a flag of --engine {engine}; this server runs --engine {args.engine}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from qerl.rollout.server import serve
    from qerl.rollout.wire import base_fingerprint

    base_fingerprint(args.model)  # a wrong folder in one line, before the engine takes a minute to load
    if args.engine == "native":
        settings = {"kv_cache_gib": args.kv_cache_gib}
    else:
        settings = dict(
            gpu_memory_utilization=args.gpu_memory_utilization or VLLM_MEMORY,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
        )
    serve(args.model, args.host, args.port, args.lora_rank, args.seed, args.engine, **settings)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    sys.exit(cli.run_cli(main, "qerl.rollout_server"))
