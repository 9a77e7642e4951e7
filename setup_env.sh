#!/usr/bin/env bash
# Installs qerl and everything its tests and demo need into the current Python environment.
# Usage: bash setup_env.sh [extras]   (default extras: dev; e.g. "dev,quantize" or "dev,vllm")
set -euo pipefail
cd "$(dirname "$0")"
PYTHON="${PYTHON:-python3}"
EXTRAS="${1:-dev}"

# Keep whatever torch is already there (a CUDA build on a GPU machine). Without one, pip installs torch 2.13.0
# from the configured package index: from the public PyPI on Linux that is the CUDA build (about 17 nvidia-*
# packages, several GB). For the CPU-only build, install it first from PyTorch's CPU index, then re-run:
#     python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# (Not done here: a CI machine may reach only its own index.)
if ! "$PYTHON" -c "import torch" 2>/dev/null; then
    echo "setup_env: no torch here: installing torch 2.13.0 from your package index (public PyPI on Linux: the" \
         "CUDA build, several GB). CPU only? Stop, run" \
         "'$PYTHON -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu', re-run."
    "$PYTHON" -m pip install -q "torch==2.13.0"
fi
echo "setup_env: installing qerl[$EXTRAS]"
"$PYTHON" -m pip install -q -e ".[$EXTRAS]"
"$PYTHON" -c "import torch, transformers, trl, peft; print(f'setup_env: torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, peft {peft.__version__}, cuda={torch.cuda.is_available()}')"
