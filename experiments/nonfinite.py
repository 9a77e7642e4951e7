"""Replay a micro-batch whose backward made a gradient non-finite, and say where the first non-finite value appears.

    python -m qerl.train ... --dump-nonfinite-grads true       saves OUTPUT_DIR/nonfinite-step<N>-micro<M>.pt
    python -m experiments.nonfinite DUMP --model BASE [--attn sdpa,sdpa-no-cudnn,eager] [--head fused,logits]

The dump holds the micro-batch as TRL's loss saw it (prompt and completion ids and masks, advantages, the token count
the DAPO loss divides by) and the trainable parameters it ran with. The replay rebuilds the policy on BASE (the
checkpoint the run trained: NVFP4 or BF16) with the same LoRA, and runs one forward and backward of a surrogate
with the DAPO loss's gradient: at the sampling policy (num_iterations 1) TRL's clipped ratio is exactly 1, so
d loss / d logp = -advantage * mask / normalizer, and -(advantage * logp * mask).sum() / normalizer has that gradient.
Each variant (attention: transformers' SDPA with torch's default kernels, SDPA without cuDNN's kernel as QeRLTrainer's
training step runs it, or eager; x LM head: TRL's fused chunked head, or full logits + log_softmax) reports
- forward: the modules whose outputs hold non-finite values, with how many of those values sit at padded positions;
- backward: the first module (in backward order) that receives or passes on a non-finite gradient;
- per completion row, whether that row's loss alone makes the gradients non-finite;
- the op autograd's anomaly mode names.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch loads after the flags are read
    import torch
    from torch import nn

ATTENTION = ("sdpa", "sdpa-no-cudnn", "eager")  # torch's default SDPA kernels, the training step's, eager
HEADS = ("fused", "logits")


def _nonfinite(t) -> int:
    import torch

    return int((~torch.isfinite(t)).sum()) if torch.is_tensor(t) and t.is_floating_point() else 0


def build_policy(base: str, dump: dict, attn: str, head: str, device: str) -> nn.Module:
    import torch
    from peft import get_peft_model
    from trl.trainer.utils import add_fused_lm_head

    from qerl import base_model, lora

    model = base_model.load_base_model(base, device=device)
    model.config._attn_implementation = "eager" if attn == "eager" else "sdpa"
    if head == "fused":
        add_fused_lm_head(model, temperature=dump["temperature"], outputs=("log_probs", "entropy"))
    saved = dump["lora"]
    config = lora.lora_config(model, saved["rank"], saved["alpha"], saved["targets"], 0.0, saved["trainable_norms"])
    model = get_peft_model(model, config)
    lora.keep_fp32_masters(model)
    params = dict(model.named_parameters())
    missing = [n for n in dump["trainable"] if n not in params]
    if missing:
        raise ValueError(f"the dump's trainable parameters are not in the rebuilt policy, e.g. {missing[0]}")
    with torch.no_grad():
        for name, value in dump["trainable"].items():
            params[name].copy_(value.to(params[name].device))
    return model


def completion_logps(model: nn.Module, batch: dict, head: str, temperature: float) -> torch.Tensor:
    """Per-token log-probs of the completion, as TRL's loss forward computes them (or from full logits)."""
    import torch

    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    keep = batch["completion_ids"].size(1)
    with torch.autocast(input_ids.device.type, dtype=torch.bfloat16):
        if head == "fused":
            labels = input_ids.masked_fill(attention_mask == 0, -100)
            labels[:, :-keep] = -100
            out = model(input_ids=input_ids, attention_mask=attention_mask, labels=labels, fused_lm_head=True)
            return out.log_probs[:, -keep:]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=keep + 1).logits
    logits = logits[:, :-1].float() / temperature
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def surrogate_loss(logps: torch.Tensor, batch: dict, rows: torch.Tensor | None = None) -> torch.Tensor:
    mask = batch["completion_mask"].to(logps.dtype)
    if rows is not None:
        mask = mask * rows.to(logps.dtype).unsqueeze(1)
    advantages = batch["advantages"].to(logps.device)
    advantages = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
    normalizer = batch["num_items_in_batch"].to(logps.device).float().clamp(min=1.0)
    return -(advantages * logps * mask).sum() / normalizer


@contextlib.contextmanager
def watch(model: nn.Module, pad_mask: torch.Tensor):
    """Records, per module, non-finite forward outputs (and how many sit at padded positions) and non-finite
    gradients in backward order."""
    import torch

    forward, backward, handles = [], [], []

    def on_forward(name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            bad = _nonfinite(out)
            if bad:
                at_pad = 0
                if out.dim() >= 2 and out.shape[:2] == pad_mask.shape:
                    at_pad = int((~torch.isfinite(out) & pad_mask.view(*pad_mask.shape, *[1] * (out.dim() - 2))).sum())
                forward.append({"module": name, "nonfinite": bad, "of": out.numel(), "at_padding": at_pad})

        return hook

    def on_backward(name):
        def hook(module, grad_input, grad_output):
            got = sum(_nonfinite(g) for g in grad_output)
            passed = sum(_nonfinite(g) for g in grad_input)
            if got or passed:
                backward.append({"module": name, "grad_output_nonfinite": got, "grad_input_nonfinite": passed})

        return hook

    for name, module in model.named_modules():
        if name and not list(module.children()):  # leaves, plus the attention blocks (where masks meet)
            handles.append(module.register_forward_hook(on_forward(name)))
            handles.append(module.register_full_backward_hook(on_backward(name)))
        elif name.endswith("self_attn"):
            handles.append(module.register_forward_hook(on_forward(name)))
    try:
        yield forward, backward
    finally:
        for handle in handles:
            handle.remove()


def replay(model: nn.Module, batch: dict, head: str, temperature: float, attn: str) -> dict:
    from torch.nn.attention import sdpa_kernel

    from qerl.trainer import TRAINING_SDPA_BACKENDS

    with sdpa_kernel(TRAINING_SDPA_BACKENDS) if attn == "sdpa-no-cudnn" else contextlib.nullcontext():
        return _replay(model, batch, head, temperature)


def _replay(model: nn.Module, batch: dict, head: str, temperature: float) -> dict:
    import torch

    from qerl.nonfinite_dump import nonfinite_grads

    input_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    model.zero_grad(set_to_none=True)
    with watch(model, input_mask == 0) as (forward, backward):
        logps = completion_logps(model, batch, head, temperature)
        loss = surrogate_loss(logps, batch)
        loss.backward()
    mask = batch["completion_mask"].bool()
    result = {
        "loss": loss.item(),
        "logps_nonfinite_in_mask": _nonfinite(logps[mask]),
        "logps_nonfinite_anywhere": _nonfinite(logps),
        "nonfinite_grads": len(nonfinite_grads(model)),
        "forward": forward[:5],
        "forward_modules_nonfinite": len(forward),
        "backward_first": backward[:5],
    }
    rows = []
    for row in range(mask.size(0)):  # each row's loss alone: which completions carry the failure
        model.zero_grad(set_to_none=True)
        only = torch.zeros(mask.size(0), dtype=torch.bool, device=mask.device)
        only[row] = True
        surrogate_loss(completion_logps(model, batch, head, temperature), batch, only).backward()
        if nonfinite_grads(model):
            rows.append(row)
    result["rows_nonfinite"] = rows
    model.zero_grad(set_to_none=True)
    try:
        with torch.autograd.detect_anomaly(check_nan=True):
            surrogate_loss(completion_logps(model, batch, head, temperature), batch).backward()
        result["anomaly"] = None
    except RuntimeError as err:
        result["anomaly"] = str(err).splitlines()[0]
        result["anomaly_trace"] = traceback.format_exc(limit=3)
    return result


def describe(batch: dict, tokenizer=None) -> dict:
    prompt_len = batch["prompt_mask"].sum(1)
    completion_len = batch["completion_mask"].sum(1)
    info = {
        "rows": int(prompt_len.numel()),
        "padded_length": batch["prompt_ids"].size(1) + batch["completion_ids"].size(1),
        "prompt_tokens": prompt_len.tolist(),
        "completion_tokens": completion_len.tolist(),
        "advantages": [round(float(a), 4) for a in batch["advantages"].flatten().tolist()],
        "num_items_in_batch": float(batch["num_items_in_batch"]),
    }
    if tokenizer is not None:
        pairs = zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)
        info["prompts"] = sorted({tokenizer.decode(ids[mask.bool()]) for ids, mask in pairs})
    return info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump", help="a nonfinite-step<N>-micro<M>.pt file written by dump_nonfinite_grads")
    parser.add_argument("--model", required=True, help="the base checkpoint the run trained (NVFP4 or BF16 folder)")
    parser.add_argument("--attn", default="sdpa,sdpa-no-cudnn,eager", help="attention variants to replay with")
    parser.add_argument("--head", default="fused,logits", help="fused: TRL's chunked LM head; logits: full logits")
    parser.add_argument("--device", help="(default: cuda if there is one, else cpu)")
    parser.add_argument("--out", help="write the report as JSON here too")
    args = parser.parse_args(argv)
    for flag, given, known in (("--attn", args.attn, ATTENTION), ("--head", args.head, HEADS)):
        unknown = set(given.split(",")) - set(known)
        if unknown:
            parser.error(f"{flag}: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}")
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    dump = torch.load(args.dump, map_location="cpu", weights_only=False)
    batch = {k: v.to(args.device) if torch.is_tensor(v) else v for k, v in dump["batch"].items()}
    from qerl.base_model import load_tokenizer

    report = {
        "dump": args.dump,
        "step": dump["step"],
        "micro_batch": dump["micro_batch"],
        "training_nonfinite_grads": len(dump["nonfinite_grads"]),
        "first_nonfinite_grad": dump["nonfinite_grads"][0],
        "batch": describe(dump["batch"], load_tokenizer(args.model)),
        "variants": {},
    }
    for attn in args.attn.split(","):
        for head in args.head.split(","):
            model = build_policy(args.model, dump, attn, head, args.device)
            report["variants"][f"{attn}/{head}"] = replay(model, batch, head, dump["temperature"], attn)
            del model
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
