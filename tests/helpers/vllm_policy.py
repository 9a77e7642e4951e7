"""A small random Qwen2 NVFP4 checkpoint whose shapes vLLM's Marlin FP4 kernel accepts, a trained-looking LoRA
policy on it (r16, trainable norms), and the colocated vllm backend on both: what the vLLM GPU tests sample with
(test_vllm_gpu.py, test_server_gpu.py)."""

import contextlib

import torch


def random_nvfp4_policy(root):
    """(the checkpoint folder, the peft policy on CUDA in eval mode) under `root`."""
    from peft import get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from qerl import base_model, lora
    from qerl.nvfp4.checkpoint import save_nvfp4_checkpoint
    from qerl.nvfp4.quantize import quantize_model

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=2,
    )
    model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    folder = str(root / "nvfp4")
    save_nvfp4_checkpoint(quantize_model(model), folder)
    base = base_model.load_base_model(folder, device="cuda")
    policy = get_peft_model(base, lora.lora_config(base, rank=16, alpha=16, trainable_norms=True))
    with torch.no_grad():  # a trained-looking adapter: B and the norm scales moved away from their init
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
            elif "modules_to_save" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return folder, policy.eval()


def colocated_vllm(folder, policy, generation_config, sleep: bool = True):
    """The vllm rollout backend on `folder` with `policy`'s adapter, a quarter of the GPU, asleep between rounds unless
    `sleep` is False (sleep mode's CuMem allocator serves one engine per process: a second test module's engine in
    the same pytest process must go without)."""
    from qerl.rollout import RolloutSetup, VLLMSettings
    from qerl.rollout.vllm import VLLMRollout

    setup = RolloutSetup(
        generation_config=generation_config,
        eos_token_ids=[2],
        pad_token_id=0,
        open_policy=lambda: contextlib.nullcontext(policy),
        device=torch.device("cuda"),
        model_path=folder,
        vllm=VLLMSettings(gpu_memory_utilization=0.25, max_model_len=512, sleep=sleep),
    )
    return VLLMRollout(setup)
