"""Two CPU processes (gloo): under FSDP2 the pieces that read and perturb the policy's sharded parameters
(qerl/sharding.py; AQN, the native engine's gather) and its FULL_STATE_DICT checkpoint.

accelerate runs DeepSpeed on a machine without a GPU when the launch does not ask for the CPU (`use_cpu: false`)
and the processes pass `--ddp-backend gloo` (DeepSpeed's CPU accelerator then talks gloo); it never runs FSDP
without one, so the FSDP2 test shards the policy with accelerate's own `fsdp2_prepare_model` under torch's gloo.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from benchmarks.launch import REPO, child_env, free_port

# Runs inside each process of the FSDP2 test.
FSDP2_HARNESS = textwrap.dedent("""
    import sys, types, torch
    from accelerate import PartialState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model
    from peft import get_peft_model
    from transformers import GenerationConfig
    from qerl import aqn, base_model, lora, norms, sharding
    from qerl.rollout.native.engine import NativeEngine
    from qerl.rollout.native.decoder import Decoder
    from qerl.rollout.native.sampling import Sampler

    checkpoint, out = sys.argv[1:]
    state = PartialState(cpu=True)  # gloo

    def make_policy():
        # The trainer's policy before accelerate prepares it: BF16 base, FP32 LoRA, trainable BF16 norm copies,
        # here with a trained look (LoRA B is zero at initialisation), the same on every rank.
        base = base_model.load_base_model(checkpoint, dtype=torch.bfloat16, device="cpu")
        torch.manual_seed(0)  # peft draws LoRA A from torch's generator
        model = get_peft_model(base, lora.lora_config(base, 4, 8, trainable_norms=True))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
                elif p.requires_grad and p.dim() == 1:
                    p.add_(torch.randn(p.shape, generator=gen).to(p.dtype) * 0.2)
        return model.eval()

    def engine(decoder):
        sampler = Sampler(GenerationConfig(do_sample=True, temperature=1.0, max_new_tokens=5))
        return NativeEngine(decoder, sampler, [-1], 0)

    prompts = [[9, 30, 41, 12, 7], [15, 60, 3]]
    def sample(eng):
        eng.decoder.refresh()
        torch.manual_seed(1)
        ids, _ = eng.generate(prompts, 5)
        return ids

    reference = make_policy()
    for p in reference.parameters():  # the FP32 masters accelerate makes of trainable parameters
        if p.requires_grad:
            p.data = p.data.float()
    reference_engine = engine(Decoder(reference))

    model = make_policy()
    sharded_engine = engine(Decoder(model, gather_each_round=True))  # built before sharding, as the trainer does
    sharding.keep_base_out_of_checkpoints(model)  # as QeRLTrainer does under FSDP2
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            reshard_after_forward=True, mixed_precision_policy="bf16",
                                            state_dict_type="FULL_STATE_DICT")  # configs/accelerate/fsdp.yaml's
    accelerator = types.SimpleNamespace(state=types.SimpleNamespace(fsdp_plugin=plugin), mixed_precision="bf16",
                                        is_main_process=state.is_main_process, device=torch.device("cpu"),
                                        num_processes=state.num_processes, process_index=state.process_index,
                                        is_fsdp2=True, wait_for_everyone=state.wait_for_everyone)
    model = fsdp2_prepare_model(accelerator, model)
    result = {"sharded": [n for n, p in model.named_parameters() if sharding.is_sharded(p)]}
    # A forward without gradients leaves accelerate's tail unit (final norm, LM head) whole: the trainer reshards
    # before and after each rollout, so that AQN and the engine meet the shards every forward all-gathers.
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[1]]))
    final = model.base_model.model.model.norm
    result["tail"] = (sharding.is_sharded(final.weight), sharding.reshard(model) or sharding.is_sharded(final.weight))

    # AQN on the sharded norm scales: the same noise as one process draws, restored bit for bit.
    sites, reference_sites = norms.find_norms(model), norms.find_norms(reference)
    result["norms"] = (list(sites.layer_norms), list(reference_sites.layer_norms))
    shards = [m.weight.to_local().clone() for m in sites.layer_norms.values()]
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        clean = model(input_ids=ids).logits
        with aqn.noisy_norms(model, 0.05, torch.Generator().manual_seed(3), sites=sites) as stats:
            noisy_scales = [sharding.whole(m.weight) for m in sites.layer_norms.values()]
            noisy = model(input_ids=ids).logits
        with aqn.noisy_norms(reference, 0.05, torch.Generator().manual_seed(3), sites=reference_sites):
            reference_scales = [m.weight.clone() for m in reference_sites.layer_norms.values()]
        result["noise_equal"] = all(torch.equal(a, b) for a, b in zip(noisy_scales, reference_scales, strict=True))
        result["restored"] = all(
            torch.equal(m.weight.to_local(), shard) for m, shard in zip(sites.layer_norms.values(), shards, strict=True)
        )
        result["noise_reached_forward"] = not torch.equal(clean, noisy)
        result["clean_again"] = torch.equal(model(input_ids=ids).logits, clean)
        result["stats"] = (stats.num_norms, stats.changed_fraction)

    # The native engine on the sharded policy: the round's gather makes the single-process engine's samples.
    result["samples"] = (sample(sharded_engine), sample(reference_engine))
    sharded_engine.decoder.release()
    result["released"] = sharded_engine.decoder.embed is None
    # After an optimizer step, the next round gathers the new adapter (not what the policy held when it was built).
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    sharded_engine.decoder.refresh()
    qkv = sharded_engine.decoder.layers[0].qkv
    q_a = model.base_model.model.model.layers[0].self_attn.q_proj.lora_A["default"].weight
    result["tracks_training"] = torch.equal(qkv.lora_a[: q_a.shape[0]], sharding.whole(q_a).to(qkv.lora_a.dtype))

    # A checkpoint as transformers' Trainer writes one under FSDP2 with FULL_STATE_DICT (save_model's gathered state
    # dict into peft's adapter file; accelerate's model and optimizer files, adapter_only), then read back after
    # another step moved everything: the trainable tensors and the optimizer state come back exactly.
    from accelerate.utils import load_fsdp_model, load_fsdp_optimizer, save_fsdp_model, save_fsdp_optimizer
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    def trainable():
        return {n: sharding.whole(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad}

    def optimizer_state():
        return [sharding.whole(t).clone() for v in optimizer.state.values() for t in v.values() if torch.is_tensor(t)]

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    def train_step():
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
    train_step()
    ckpt = f"{out}/checkpoint"
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                cpu_offload=True))  # accelerator.get_state_dict's
    if state.is_main_process:
        model.save_pretrained(ckpt, state_dict=full)
    save_fsdp_model(plugin, accelerator, model, ckpt, adapter_only=True)
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, ckpt)
    saved, saved_optimizer = trainable(), optimizer_state()
    state.wait_for_everyone()
    written = torch.load(f"{ckpt}/pytorch_model_fsdp.bin", weights_only=True)
    result["checkpoint_keys"] = sorted(written)
    result["adapter_file_keys"] = sorted(load_file(f"{ckpt}/adapter_model.safetensors"))
    train_step()
    result["moved"] = not all(torch.equal(a, saved[n]) for n, a in trainable().items())
    load_fsdp_model(plugin, accelerator, model, ckpt, adapter_only=True)
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, ckpt, adapter_only=True)
    result["restored_trainable"] = all(torch.equal(a, saved[n]) for n, a in trainable().items())
    result["restored_optimizer"] = all(torch.equal(a, b) for a, b in zip(optimizer_state(), saved_optimizer,
                                                                          strict=True))
    result["trainable_names"] = sorted(saved)
    torch.save(result, f"{out}/rank{state.process_index}.pt")
    # Tear gloo down before the interpreter does: left to exit, its threads were once destroyed unjoined ("terminate
    # called without an active exception", exit -6) after every result had been saved.
    state.wait_for_everyone()
    state.destroy_process_group()
""")


@pytest.mark.slow
def test_fsdp2_shards_aqn_and_native_engine(checkpoints, tmp_path):
    _, nvfp4_dir = checkpoints
    harness = tmp_path / "fsdp2.py"
    harness.write_text(FSDP2_HARNESS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           str(harness), nvfp4_dir, str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, env=child_env(threads=1), capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    for rank in range(2):
        r = torch.load(tmp_path / f"rank{rank}.pt")
        # FSDP2 shards the BF16 parameters (LoRA, norms, embedding, LM head, biases); the packed weights are buffers.
        assert any("lora_A" in n for n in r["sharded"]) and any("embed_tokens" in n for n in r["sharded"])
        assert r["norms"][0] == r["norms"][1] and len(r["norms"][0]) == 4
        assert r["noise_equal"] and r["restored"] and r["noise_reached_forward"] and r["clean_again"]
        assert r["stats"][0] == 4 and r["stats"][1] > 0.9
        sharded, reference = r["samples"]
        assert sharded == reference and len(sharded) == 2
        assert r["released"] and r["tracks_training"]
        assert r["tail"] == (False, True)
        # FSDP2's FULL_STATE_DICT checkpoint: the trainable tensors alone, restored exactly.
        assert r["checkpoint_keys"] == r["trainable_names"]  # no packed base
        assert any("lora_B" in k for k in r["adapter_file_keys"]) and any("norm" in k for k in r["adapter_file_keys"])
        assert r["moved"] and r["restored_trainable"] and r["restored_optimizer"]
