#!/usr/bin/env bash
# Installs qerl and everything its tests and demo need into the current Python environment.
# Usage: bash setup_env.sh [extras]   (default extras: dev; e.g. "dev,quantize" or "dev,vllm")
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-dev}"

# Keep whatever torch is already there (a CUDA build on a GPU machine). Without one, take the CPU build
# 2.13.0: an unpinned `pip install torch` would pull several GB of CUDA packages onto a CPU machine.
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup_env: installing torch 2.13.0 (CPU build)"
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
echo "setup_env: installing qerl[$EXTRAS]"
"$PYTHON" -m pip install -q -e ".[$EXTRAS]"
"$PYTHON" -c "import torch, transformers, trl, peft; print(f'setup_env: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}, cuda={torch.cuda.is_available()}')"
