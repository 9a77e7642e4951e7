"""compressed-tensors `nvfp4-pack-quantized` checkpoints: load and save.

compressed-tensors decompresses such a folder and vLLM serves it; we load it straight into NVFP4Linear modules
without ever building the BF16 weights, and write it shard by shard, layer by layer, so that neither direction
needs the whole model in memory (quantizing a BF16 folder into one: nvfp4/quantize_checkpoint.py). One module per
job:

    format.py   what such a folder is, and the one check that a folder is one (is_nvfp4_checkpoint)
    load.py     folder -> transformers model with NVFP4Linear layers
    write.py    size-capped shards in a folder that appears only once complete; save_nvfp4_checkpoint
"""

from qerl.nvfp4.checkpoint.format import CheckpointError, is_nvfp4_checkpoint
from qerl.nvfp4.checkpoint.load import load_nvfp4_model
from qerl.nvfp4.checkpoint.write import save_nvfp4_checkpoint

__all__ = ["CheckpointError", "is_nvfp4_checkpoint", "load_nvfp4_model", "save_nvfp4_checkpoint"]
