"""The policy's decoder as the native engine runs it: a few fused steps per layer over the policy's own tensors.

`Decoder` binds to a peft-wrapped (or plain) Llama/Qwen2/Qwen3/Mistral-style or Gemma-3 text causal LM, NVFP4 or
BF16, and computes hidden states for any set of (sequence, position, token) rows against a KV cache, in a form that
a CUDA graph can capture: no host syncs, no allocation that depends on data.

What it shares with the policy and what it keeps of its own:
  * Frozen weights: shared. q/k/v and gate/up of each layer are laid out once in one buffer per group and the
    policy's modules keep views of it (same memory, same values; their forward is unchanged), so one GEMM reads
    a group. No second copy of any weight exists. This is the only change building a Decoder makes to the policy,
    and it happens in one function: projection.fuse_as_views.
  * LoRA: unmerged. peft keeps the adapters in FP32 (its autocast), the GEMMs take BF16, so every round
    `refresh()` writes them in BF16 into fixed buffers: per group, the A matrices stacked [sum r, K] and the B
    matrices block-diagonal [N, sum r] with peft's scaling folded in (sum r zero-padded to a power of two >= 16),
    so a group's LoRA is two GEMMs whatever its size, and on an NVFP4 base both run inside the base GEMM's
    launch (its first programs do the shrink, its epilogue the up-projection). ~1% of the base's bytes at rank
    16; the buffers' addresses never change, so a captured graph sees each round's adapter without being
    captured again.
  * Norm scales: FP32 buffers (`norms`, an nn.Module tree the AQN hook perturbs in place), refreshed from the
    policy's norms every round, as the vLLM backend copies them into vLLM's norms. Gemma's norms scale by 1 + w:
    the buffers hold w as the policy does, the kernels add the 1 in FP32.
  * Per layer: its sliding window (Mistral's on every layer; Qwen2/Gemma-3 by config.layer_types) and its rotary
    tables (Gemma-3's sliding and global layers have their own bases and scaling).
  * A sharded policy (FSDP2, or ZeRO-3 inside TRL's gather; `gather_each_round`): the packed NVFP4 weights are
    buffers, which both leave whole on every rank, so the engine runs on them as on one GPU. Every parameter it
    reads (LoRA, norms, embedding, LM head, biases) is read from the policy's modules at each `refresh()`, FSDP2's
    DTensors all-gathered whole (qerl.sharding.whole), and the round's whole copies are dropped at `release()`,
    so that training keeps FSDP's memory saving. A BF16 base is refused there: its weights are what is sharded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from qerl.norms import find_norms
from qerl.nvfp4.linear import NVFP4Linear
from qerl.rollout.base import Unsupported
from qerl.rollout.native import elementwise
from qerl.rollout.native.kv_cache import KVCache
from qerl.rollout.native.projection import Projection, active_lora, base_layer
from qerl.sharding import whole

# Model types whose decoder is exactly what Decoder computes. A type outside it is refused even where its modules
# look the same: Gemma 1 (two norms per layer) and Gemma 2 (softcapped attention) differ from Gemma-3, Granite
# multiplies its residuals, MoE models route their MLPs; any of these would run here, wrongly.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
# Gemma-3: norms scale by (1 + w), the attention output and the MLP output are normed too before their residual add.
UNIT_OFFSET_NORMS = ("gemma3_text",)
SUPPORTED = (
    "Llama/Qwen2/Qwen3/Mistral-style decoder layers (self_attn.{q,k,v,o}_proj, optional per-head "
    "self_attn.{q,k}_norm, mlp.{gate,up,down}_proj, RMSNorms) and Gemma-3 text"
)
# The MLP's activation -> its gate in kernels (by name, looked up per call as the other kernels are, so that
# benchmarks.probes.step_costs can swap one out)
GATES = {"silu": "silu_mul", "gelu_pytorch_tanh": "gelu_tanh_mul"}
# Per-layer norm roles: (before attention, on the attention's output, before the MLP, on the MLP's output).
PRE_NORM_ROLES = ("input_layernorm", None, "post_attention_layernorm", None)
SANDWICH_NORM_ROLES = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


class NormScales(nn.Module):
    """FP32 copies of the policy's RMSNorm scales, in a tree that norms.find_norms reads as the policy's: per-layer
    norms (hidden-size ones, and per-head q/k norms where the policy has them) inside a ModuleList under their
    layer's index and the policy's names, the final norm outside it, so that AQN draws the same noise for each
    norm here as on the policy (qerl.norms.noise_keys: a norm's layer and name); `config` is the policy's, whose
    hidden size tells the two kinds of layer norms apart."""

    def __init__(
        self, layer_norms: list[dict[str, nn.Module]], final_norm: nn.Module, config, eps: float, device: torch.device
    ):
        super().__init__()
        self.config = config

        def holder(norm: nn.Module) -> nn.RMSNorm:
            return nn.RMSNorm(norm.weight.shape[0], eps=eps, device=device, dtype=torch.float32).requires_grad_(False)

        self.layers = nn.ModuleList(nn.ModuleDict({role: holder(n) for role, n in d.items()}) for d in layer_norms)
        self.norm = holder(final_norm)
        # (holder, policy norm) pairs; a plain list, so the policy's modules do not become children of this tree.
        self.pairs = [(self.layers[i][role], norm) for i, d in enumerate(layer_norms) for role, norm in d.items()]
        self.pairs.append((self.norm, final_norm))

    @torch.no_grad()
    def refresh(self) -> None:
        for holder, norm in self.pairs:
            holder.weight.copy_(whole(norm.weight))


class HeadNorms:
    """A layer's per-head query and key RMSNorm scales (Qwen3, Gemma-3), laid out at every round from their FP32
    holders in NormScales (refreshed from the policy's, perturbed there when AQN includes them) into one fixed
    buffer [Hq + Hkv, D]: a scale row per query head, then per key head, as elementwise.qk_rmsnorm applies them. Qwen3's
    in the policy's dtype (transformers multiplies in it); Gemma-3's as 1 + w in FP32 (transformers' order)."""

    def __init__(
        self,
        q_holder: nn.Module,
        k_holder: nn.Module,
        dtype: torch.dtype,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        unit_offset: bool,
        device: torch.device,
    ):
        self.q, self.k, self.num_heads, self.unit_offset = q_holder.weight, k_holder.weight, num_heads, unit_offset
        dtype = torch.float32 if unit_offset else dtype
        self.scale = torch.empty(num_heads + num_kv_heads, head_dim, device=device, dtype=dtype)

    @torch.no_grad()
    def lay_out(self) -> None:
        self.scale[: self.num_heads].copy_(self.q)
        self.scale[self.num_heads :].copy_(self.k)
        if self.unit_offset:
            self.scale.add_(1.0)


@dataclass
class Layer:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    input_norm: torch.Tensor  # before attention
    pre_mlp_norm: torch.Tensor  # before the MLP (Llama's post_attention_layernorm)
    attn_out_norm: torch.Tensor | None = None  # Gemma-3: on the attention's output, before its residual add
    mlp_out_norm: torch.Tensor | None = None  # Gemma-3: on the MLP's output, before its residual add
    head_norms: HeadNorms | None = None  # Qwen3, Gemma-3: queries and keys normalized per head before rotary
    window: int | None = None  # sliding-window attention: the last `window` keys
    rope: int = 0  # index of the layer's rotary tables in Decoder.cos / Decoder.sin


# Attention of one layer: (layer index, rotated queries [M, Hq, D]) -> [M, Hq * D]; the engine supplies it
# (prefill: causal attention over each prompt; decode: the KV cache up to each sequence's length).
Attend = Callable[[int, torch.Tensor], torch.Tensor]


def _causal_lm(policy: nn.Module) -> nn.Module:
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    if not hasattr(model, "model") or not hasattr(model.model, "layers"):
        raise Unsupported(f"not a causal LM with model.layers; supported: {SUPPORTED}")
    return model


def _norms_by_layer(
    policy: nn.Module, num_layers: int, roles: tuple[str | None, ...]
) -> tuple[list[dict[str, nn.Module]], nn.Module]:
    """The active copy of each layer's norms of these roles, in the policy's order, and the final norm
    (norms.find_norms sees through peft's modules_to_save wrappers); per-head q/k norms come first (the policy's
    attention precedes its norms)."""
    names = [r for r in roles if r is not None]
    sites = find_norms(policy)
    layers: list[dict[str, nn.Module]] = [{} for _ in range(num_layers)]
    for path, module in sites.head_norms.items():
        match = re.search(r"layers\.(\d+)\.self_attn\.([qk]_norm)$", path)
        if match is None:
            raise Unsupported(f"unexpected per-head norm {path!r}; supported: {SUPPORTED}")
        layers[int(match.group(1))][match.group(2)] = module
    for path, module in sites.layer_norms.items():
        match = re.search(rf"layers\.(\d+)\.({'|'.join(names)})(\.|$)", path)
        if match is None:
            raise Unsupported(f"unexpected norm {path!r}; supported: {SUPPORTED}")
        layers[int(match.group(1))][match.group(2)] = module
    finals = list(sites.final_norms.values())
    if any(set(d) - {"q_norm", "k_norm"} != set(names) for d in layers) or len(finals) != 1:
        raise Unsupported(
            f"expected the norms {', '.join(names)} in every layer and one final norm; supported: {SUPPORTED}"
        )
    return layers, finals[0]


def _windows(config, model_type: str, num_layers: int) -> list[int | None]:
    """Each layer's sliding window, as transformers applies it: Mistral's on every layer; otherwise on the layers
    config.layer_types names sliding_attention (Qwen2/Qwen3 with use_sliding_window, Gemma-3's local layers)."""
    window = getattr(config, "sliding_window", None)
    if model_type == "mistral":
        return [window] * num_layers
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * num_layers
    unknown = set(layer_types) - {"full_attention", "sliding_attention"}
    if unknown:
        raise Unsupported(f"layer types {sorted(unknown)}; the engine runs full_attention and sliding_attention")
    if "sliding_attention" in layer_types and not window:
        raise Unsupported("sliding_attention layers without a sliding_window")
    return [window if t == "sliding_attention" else None for t in layer_types]


class Decoder:
    """Forward of the policy's decoder on rows (sequence index, position, token) against a KV cache."""

    def __init__(self, policy: nn.Module, gather_each_round: bool = False):
        try:
            self._build(policy, gather_each_round)
        except Unsupported as err:  # named by architecture for whoever builds the engine (training, eval)
            model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
            raise Unsupported(f"the native engine cannot run {type(model).__name__}: {err}") from None

    def _build(self, policy: nn.Module, gather_each_round: bool):
        model = _causal_lm(policy)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        model_type = getattr(config, "model_type", None)
        if model_type not in MODEL_TYPES:
            experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
            kind = " (mixture of experts)" if experts else ""
            raise Unsupported(f"model_type {model_type!r}{kind}; the engine runs {', '.join(MODEL_TYPES)}")
        activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if activation not in GATES:
            raise Unsupported(f"hidden_act {activation!r}; the engine's MLP gates are {', '.join(GATES)}")
        self.gate = GATES[activation]
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise Unsupported(f"attention logit softcapping ({config.attn_logit_softcapping}) is not supported")
        if getattr(config, "use_bidirectional_attention", False):
            raise Unsupported("bidirectional attention (an encoder) is not a causal LM to sample from")
        self.final_softcap = getattr(config, "final_logit_softcapping", None)
        inner = model.model
        self.gather_each_round = gather_each_round
        self._embedding, self._head = inner.embed_tokens, base_layer(model.lm_head)
        self.dtype = self._embedding.weight.dtype
        device = self._embedding.weight.device
        self.device = device
        # Gemma scales the embeddings by sqrt(hidden) rounded to their dtype (transformers' rounding), else None.
        scale = getattr(self._embedding, "embed_scale", None)
        self.embed_scale = None if scale is None else scale.to(device, self.dtype)
        if not isinstance(self._head, nn.Linear) or isinstance(self._head, NVFP4Linear) or active_lora(model.lm_head):
            raise Unsupported("the LM head must be a plain Linear (no LoRA, not quantized)")
        self.embed = self.lm_head = self.lm_head_bias = None
        if not gather_each_round:
            self._bind_embeddings()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.hidden = config.hidden_size
        self.head_dim = getattr(config, "head_dim", None) or self.hidden // self.num_heads
        if self.head_dim < 16 or self.head_dim & (self.head_dim - 1):
            raise Unsupported(f"head_dim {self.head_dim}: the engine's attention takes powers of two >= 16")
        self.eps = float(config.rms_norm_eps)
        self.scaling = float(getattr(inner.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.unit_offset = model_type in UNIT_OFFSET_NORMS
        roles = SANDWICH_NORM_ROLES if self.unit_offset else PRE_NORM_ROLES
        windows = _windows(config, model_type, len(inner.layers))
        self.rotary = inner.rotary_emb
        # Gemma-3's rotary module takes the layer type and has tables per type; the others one for all layers.
        layer_types = getattr(config, "layer_types", None)
        self.rope_kinds = sorted(set(layer_types)) if hasattr(self.rotary, "layer_types") else [None]
        layer_norms, final_norm = _norms_by_layer(policy, len(inner.layers), roles)
        self.norms = NormScales(layer_norms, final_norm, config, self.eps, device)
        self.layers = []
        for i, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            head_norms = [getattr(attn, n, None) for n in ("q_norm", "k_norm")]
            if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")) or (
                (head_norms[0] is None) != (head_norms[1] is None)
            ):
                raise Unsupported(f"layer {i} attention is not supported; supported: {SUPPORTED}")
            if head_norms[0] is not None and {n.weight.numel() for n in head_norms} != {self.head_dim}:
                raise Unsupported(
                    f"q/k norms of {head_norms[0].weight.numel()}/{head_norms[1].weight.numel()} "
                    f"elements, not one scale per head dimension ({self.head_dim})"
                )
            holders = self.norms.layers[i]
            if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj")):
                raise Unsupported(f"layer {i} MLP is not supported; supported: {SUPPORTED}")
            norm = [None if role is None else self.norms.layers[i][role].weight for role in roles]
            self.layers.append(
                Layer(
                    qkv=Projection([attn.q_proj, attn.k_proj, attn.v_proj], device, self.dtype, gather_each_round),
                    o=Projection([attn.o_proj], device, self.dtype, gather_each_round),
                    gate_up=Projection([mlp.gate_proj, mlp.up_proj], device, self.dtype, gather_each_round),
                    down=Projection([mlp.down_proj], device, self.dtype, gather_each_round),
                    input_norm=norm[0],
                    attn_out_norm=norm[1],
                    pre_mlp_norm=norm[2],
                    mlp_out_norm=norm[3],
                    head_norms=None
                    if head_norms[0] is None
                    else HeadNorms(
                        holders["q_norm"],
                        holders["k_norm"],
                        head_norms[0].weight.dtype,
                        self.num_heads,
                        self.num_kv_heads,
                        self.head_dim,
                        self.unit_offset,
                        device,
                    ),
                    window=windows[i],
                    rope=0 if self.rope_kinds == [None] else self.rope_kinds.index(layer_types[i]),
                )
            )
        self.cos = self.sin = [torch.empty(0, device=device)] * len(self.rope_kinds)

    def projections(self):
        for layer in self.layers:
            yield from (layer.qkv, layer.o, layer.gate_up, layer.down)

    def _bind_embeddings(self) -> None:
        embed = self._embedding.weight
        self.embed = whole(embed)
        self.lm_head = self.embed if self._head.weight is embed else whole(self._head.weight)  # tied: one gather
        self.lm_head_bias = None if self._head.bias is None else whole(self._head.bias)

    def refresh(self) -> None:
        """The policy's current adapter and norms, before a round (a sharded policy's parameters gathered whole:
        a collective, which every rank runs in the same order)."""
        if self.gather_each_round:
            self._bind_embeddings()
        for projection in self.projections():
            projection.refresh()
        self.norms.refresh()

    def lay_out_head_norms(self) -> None:
        """Per-head q/k scales from their holders, at the start of a round: after AQN has perturbed them, if it
        includes them (the engine calls this inside the noise's context)."""
        for layer in self.layers:
            if layer.head_norms is not None:
                layer.head_norms.lay_out()

    def release(self) -> None:
        """After a round: drop the whole copies that `refresh` gathered from a sharded policy (nothing otherwise)."""
        if self.gather_each_round:
            self.embed = self.lm_head = self.lm_head_bias = None
            for projection in self.projections():
                projection.release()

    @torch.no_grad()
    def ensure_positions(self, length: int) -> None:
        """Rotary tables for positions [0, length), from the model's own rotary module (any RoPE scaling), one per
        layer type where the module keeps one per type (Gemma-3)."""
        if self.cos[0].shape[0] >= length:
            return
        positions = torch.arange(length, device=self.device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=self.device)
        half = self.head_dim // 2
        self.cos, self.sin = [], []
        for kind in self.rope_kinds:
            # [1, length, D], halves repeated (rotate-half convention)
            cos, sin = self.rotary(probe, positions) if kind is None else self.rotary(probe, positions, kind)
            self.cos.append(cos[0, :, :half].float().contiguous())
            self.sin.append(sin[0, :, :half].float().contiguous())

    def forward(
        self, tokens: torch.Tensor, batch_idx: torch.Tensor, positions: torch.Tensor, cache: KVCache, attend: Attend
    ) -> torch.Tensor:
        """Final-normed hidden states [M, H] of rows (batch_idx, positions, tokens); writes each row's key and
        value into layer l's cache [B, S, Hkv, D] at (batch_idx, position)."""
        residual = F.embedding(tokens, self.embed)
        if self.embed_scale is not None:
            residual = residual * self.embed_scale
        unit = self.unit_offset
        h = elementwise.rmsnorm(residual, self.layers[0].input_norm, self.eps, unit_offset=unit)
        for i, layer in enumerate(self.layers):
            k, v, k_scale, v_scale = cache.layer(i)
            qkv = layer.qkv(h)
            if layer.head_norms is not None:
                qkv = elementwise.qk_rmsnorm(qkv, layer.head_norms.scale, self.eps)
            q = elementwise.rope_cache(
                qkv,
                self.cos[layer.rope],
                self.sin[layer.rope],
                batch_idx,
                positions,
                k,
                v,
                self.num_heads,
                self.num_kv_heads,
                k_scale,
                v_scale,
            )
            out = layer.o(attend(i, q))
            if layer.attn_out_norm is not None:
                out = elementwise.rmsnorm(out, layer.attn_out_norm, self.eps, unit_offset=unit)
            h = elementwise.rmsnorm(out, layer.pre_mlp_norm, self.eps, residual=residual, unit_offset=unit)
            out = layer.down(getattr(elementwise, self.gate)(layer.gate_up(h)))
            if layer.mlp_out_norm is not None:
                out = elementwise.rmsnorm(out, layer.mlp_out_norm, self.eps, unit_offset=unit)
            after = self.layers[i + 1].input_norm if i + 1 < len(self.layers) else self.norms.norm.weight
            h = elementwise.rmsnorm(out, after, self.eps, residual=residual, unit_offset=unit)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.lm_head, self.lm_head_bias).float()
        if self.final_softcap is not None:  # Gemma 2's kind: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
