"""One `python -m qerl.train` run whose rounds a native rollout server beside it, on the same GPU, samples one round
ahead (`--rollout-backend server --rollout-max-staleness 1`): the arm that asks whether sampling ahead costs accuracy
(experiments.arms, `nvfp4_lora_ahead`; issue 51's accuracy goal). Where the server runs does not change what is
trained, so one GPU holds both and the arm runs as the colocated arms do, several to a GPU under MPS.

    python -m experiments.beside_server --model ckpt/qwen-1.5b-nvfp4 --seed 20 -- --config ... --output-dir run ...

The flags after `--` are qerl.train's (they name the same base with --model-name); the server's log is
OUTPUT_DIR/rollout-server.log. The server stops when the run ends; the exit code is the run's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.launch import child_env, kill_session, start_rollout_server


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.beside_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="the base checkpoint the server loads (the run's --model-name)")
    parser.add_argument("--seed", type=int, default=0, help="the server's sampling seed (the run's, for a replay)")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="the server's KV cache beside the trainer")
    parser.add_argument("train_flags", nargs=argparse.REMAINDER, help="-- then qerl.train's flags")
    args = parser.parse_args(argv)
    flags = args.train_flags[1:] if args.train_flags[:1] == ["--"] else args.train_flags
    if "--output-dir" not in flags:
        parser.error("qerl.train's flags need --output-dir (the server's log goes there)")
    output = Path(flags[flags.index("--output-dir") + 1])
    output.mkdir(parents=True, exist_ok=True)
    log = output / "rollout-server.log"
    engine = ["--engine", "native", "--kv-cache-gib", str(args.kv_cache_gib)]
    server, url = start_rollout_server(args.model, args.seed, engine, log, child_env())
    ahead = ["--rollout-backend", "server", "--rollout-servers", url, "--rollout-max-staleness", "1"]
    trainer = subprocess.Popen([sys.executable, "-m", "qerl.train", *flags, *ahead], env=child_env(),
                               start_new_session=True)  # fmt: skip
    try:
        # A server that dies (a port taken before it bound, a load that failed) would leave the trainer waiting for
        # its handshake until the timeout: the run stops at once instead.
        while trainer.poll() is None:
            if server.poll() is not None:
                raise SystemExit(f"beside_server: the rollout server exited with code {server.returncode}; see {log}")
            time.sleep(1.0)
        return trainer.returncode
    finally:
        kill_session(trainer)
        kill_session(server)


if __name__ == "__main__":
    sys.exit(main())
