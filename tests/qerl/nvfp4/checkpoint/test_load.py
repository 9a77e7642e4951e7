"""Loading an NVFP4 checkpoint (qerl/nvfp4/checkpoint/load.py): a sharded one gives compressed-tensors' logits, and a
missing shard is named."""

import pytest
import torch
from checkpoint_models import SIZES, _bf16_model, _decompressed_by_compressed_tensors
from safetensors import safe_open

from qerl.nvfp4.checkpoint import CheckpointError, load_nvfp4_model
from qerl.nvfp4.checkpoint.format import INDEX_FILE, tensor_index
from qerl.nvfp4.quantize_checkpoint import quantize_checkpoint


def test_sharded_checkpoint_loads_and_missing_shard_is_named(seed, tmp_path):
    _bf16_model("qwen2", tmp_path / "bf16")
    quantize_checkpoint(tmp_path / "bf16", tmp_path / "nvfp4", max_shard_bytes=8 * 1024)
    shards = sorted((tmp_path / "nvfp4").glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and (tmp_path / "nvfp4" / INDEX_FILE).is_file()
    index = tensor_index(tmp_path / "nvfp4")
    for name, shard in index.items():
        with safe_open(shard, "pt") as f:
            assert name in f.keys()
    model = load_nvfp4_model(tmp_path / "nvfp4", device="cpu")
    ref = _decompressed_by_compressed_tensors(tmp_path / "nvfp4")
    tokens = torch.randint(0, SIZES["vocab_size"], (2, 9))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, ref(tokens).logits)
    shards[1].unlink()
    with pytest.raises(CheckpointError, match=shards[1].name):
        load_nvfp4_model(tmp_path / "nvfp4", device="cpu")
