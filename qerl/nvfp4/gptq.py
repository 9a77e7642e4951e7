"""Error-compensating NVFP4 quantization (GPTQ, Frantar et al. 2022) on calibration text.

Round-to-nearest (codec.quantize) makes each weight's error as small as it can alone. GPTQ makes the layer's
output error || X W^T - X Q^T || small over calibration inputs X: it rounds one input column at a time and moves
what that column's rounding lost onto the columns not yet rounded, weighted by the inverse of the inputs' second
moment H = 2 X^T X / n. The stored format is the same (E2M1 codes, an FP8 scale per 16 inputs, the fused groups'
global scale): any NVFP4 reader loads the result, and only the numbers differ.

    gptq_weight(W, H, global_scale)          one Linear, given its inputs' H
    gptq_model(model, layers, sequences)     every quantized Linear of a causal LM, layer after layer: each
                                             layer's H comes from the outputs of the layers before it already
                                             quantized (what the model will really feed it), as llmcompressor's
                                             sequential pipeline does; a fused group (q/k/v, gate/up) in one pass
Group scales are set when GPTQ reaches a group's first column, from the weights as updated so far (so they cover
what earlier columns' errors moved there). Columns go in order (no activation reordering: a group's 16 inputs
must stay together).
"""

from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from qerl.nvfp4 import DEFAULT_IGNORE, codec
from qerl.nvfp4.quantize import fused_groups, global_scales, quantization_targets

BLOCK = 128  # columns updated together (a multiple of the group size, so no group straddles two blocks)
DAMPING = 0.01  # added to H's diagonal, as a share of its mean: keeps the Cholesky factorisation well posed


class InputMoments:
    """X^T X and the row count of a Linear's inputs over calibration batches; `add` is its forward pre-hook."""

    def __init__(self):
        self.sum: torch.Tensor | None = None
        self.rows = 0

    def add(self, _module, args) -> None:
        x = args[0].reshape(-1, args[0].shape[-1]).float()
        self.sum = x.T @ x if self.sum is None else self.sum.addmm_(x.T, x)
        self.rows += x.shape[0]

    def hessian(self) -> torch.Tensor:
        """H = 2 X^T X / n in FP32."""
        return 2 * self.sum / self.rows


class _ColumnLoop:
    """GPTQ's inner loop over one block's columns, on fixed buffers: round each column under its group's scale (set
    at the group's first column), keep its error and spread it onto the block's later columns. Seven small kernels a
    column, so on the GPU the host's launches set the pace; there the loop is captured once as a CUDA graph after
    its first (eager) block, and later blocks of the same width replay it: one launch a block."""

    def __init__(self, n: int, width: int, weight_dtype: torch.dtype, global_scale: torch.Tensor, graph: bool):
        device = global_scale.device
        self.weight_dtype, self.global_scale = weight_dtype, global_scale
        self.block = torch.empty(n, width, device=device)  # in: the block's weights; updated as columns round
        self.inv = torch.empty(width, width, device=device)  # in: the block's rows and columns of H^-1's factor
        self.scaled = torch.empty(width, n, device=device)  # out: each column over its scales, a row each
        self.errors = torch.empty(width, n, device=device)  # out: each column's error, over inv's diagonal
        self.scales = torch.empty(n, width // codec.GROUP_SIZE, dtype=torch.float8_e4m3fn, device=device)  # out
        self.graph = graph and device.type == "cuda"
        self._replay = None

    def __call__(self, block: torch.Tensor, inv: torch.Tensor) -> None:
        self.block.copy_(block)
        self.inv.copy_(inv)
        if self._replay is not None:
            self._replay()
            return
        self._run()  # the first block: also the warm-up the capture needs (the rounding tables are made here)
        if self.graph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):  # records the loop; the buffers keep the first block's results
                self._run()
            self._replay = graph.replay

    def _run(self) -> None:
        block, inv = self.block, self.inv
        for i in range(block.shape[1]):
            if i % codec.GROUP_SIZE == 0:
                group = i // codec.GROUP_SIZE
                # in the weight's dtype, as codec.quantize sets them: with H = I this is round-to-nearest
                group_weights = block[:, i : i + codec.GROUP_SIZE].to(self.weight_dtype)
                self.scales[:, group : group + 1] = codec.compute_group_scales(group_weights, self.global_scale)
                effective = self.scales[:, group].float() / self.global_scale
            x = torch.div(block[:, i], effective, out=self.scaled[i])
            torch.div(block[:, i] - codec.round_to_values(x) * effective, inv[i, i], out=self.errors[i])
            block[:, i:].addr_(self.errors[i], inv[i, i:], alpha=-1)


@torch.no_grad()
def gptq_weight(
    weight: torch.Tensor, h: torch.Tensor, global_scale: torch.Tensor, name: str = "weight", graph: bool = True
) -> codec.NVFP4Weight:
    """GPTQ of one [N, K] weight given its inputs' H [K, K]; `global_scale` as codec.quantize takes it (the fused
    group's). An input that never fired (H's diagonal 0) gets its weights rounded alone. `graph`: on a CUDA device,
    replay the column loop as a CUDA graph (the same kernels, so the same numbers, checked bit for bit by a GPU
    test): 0.42 s a 1.5B layer against 1.39 eager on an H200 (docs/benchmarks.md, "GPTQ's speed")."""
    codec.check_weight(weight, name)
    n, k = weight.shape
    w = weight.float().clone()
    h = h.float().clone()
    global_scale = global_scale.to(device=w.device, dtype=torch.float32).reshape(1)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(DAMPING * h.diagonal().mean())
    # The upper Cholesky factor of H^-1: row i holds how column i's error spreads onto columns > i.
    identity = torch.eye(k, dtype=h.dtype, device=h.device)
    h_inv = torch.linalg.cholesky(torch.cholesky_solve(identity, torch.linalg.cholesky(h)), upper=True)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // codec.GROUP_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    loops: dict[int, _ColumnLoop] = {}  # by block width: all BLOCK but a narrower last one
    for start in range(0, k, BLOCK):
        end = min(start + BLOCK, k)
        width = end - start
        if width not in loops:  # a graph pays only where blocks of its width follow: never for a narrower last one
            loops[width] = _ColumnLoop(n, width, weight.dtype, global_scale, graph and k - start >= 2 * width)
        loop = loops[width]
        loop(w[:, start:end], h_inv[start:end, start:end])
        codes[:, start:end] = codec.round_to_codes(loop.scaled).T
        scales[:, start // codec.GROUP_SIZE : end // codec.GROUP_SIZE] = loop.scales
        w[:, end:] -= loop.errors.T @ h_inv[start:end, end:]
    return codec.NVFP4Weight(codec.pack_codes(codes), scales, global_scale)


@torch.no_grad()
def gptq_model(
    model: nn.Module,
    layers: nn.ModuleList,
    sequences: list[torch.Tensor],
    ignore=DEFAULT_IGNORE,
    progress: bool = True,
) -> dict[str, codec.NVFP4Weight]:
    """GPTQ of every Linear quantization_targets names, on `sequences` (token ids [1, T] each, on the model's
    device), one of the model's decoder `layers` after another; returns the quantized weights by module name. The
    model's targeted weights are left holding their dequantized values (what the next layers were calibrated on)."""
    targets = set(quantization_targets(model, ignore))
    modules = dict(model.named_modules())
    inside = {module for layer in layers for module in layer.modules()}
    outside = sorted(t for t in targets if modules[t] not in inside)
    if outside:
        raise ValueError(f"GPTQ quantizes decoder layers' Linears; these lie outside them: {', '.join(outside[:4])}")
    scales = global_scales({name: modules[name].weight for name in targets})  # from the weights as they are

    # One forward per sequence records what the model passes each layer besides the hidden states (masks and
    # rotary tables differ between local and global layers), and the first layer's hidden states.
    hidden: list[torch.Tensor] = []
    extras: list[list[tuple[tuple, dict]]] = [[] for _ in layers]

    def record(index):
        def hook(_module, args, kwargs):
            if not args:  # the hidden states passed by name
                kwargs = dict(kwargs)
                args = (kwargs.pop("hidden_states"),)
            if index == 0:
                hidden.append(args[0])
            extras[index].append((args[1:], kwargs))

        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        for ids in tqdm(sequences, desc="GPTQ calibration inputs", unit="sequence", disable=not progress):
            model(input_ids=ids, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()

    quantized: dict[str, codec.NVFP4Weight] = {}
    names = {module: name for name, module in modules.items()}
    for index, layer in enumerate(tqdm(layers, desc="GPTQ", unit="layer", disable=not progress)):
        linears = {names[m]: m for m in layer.modules() if names.get(m) in targets}
        # Fused siblings (q/k/v, gate/up) read the same input: one sum, on the group's first member, serves it.
        groups = fused_groups(linears)
        sums = {group: InputMoments() for group in groups}
        handles = [linears[group[0]].register_forward_pre_hook(moments.add) for group, moments in sums.items()]
        try:
            for h, (args, kwargs) in zip(hidden, extras[index], strict=True):
                layer(h, *args, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        # A group (q/k/v, gate/up) shares H and the global scale and GPTQ treats rows alone, so the group's
        # weights stacked are one pass over the columns instead of one per member: the same codes, fewer launches.
        for group, moments in sums.items():
            weight = torch.cat([linears[name].weight for name in group])
            q = gptq_weight(weight, moments.hessian(), scales[group[0]], name=f"{', '.join(group)} weights")
            row = 0
            for name in group:
                module = linears[name]
                rows = slice(row, row + module.out_features)
                quantized[name] = codec.NVFP4Weight(q.packed[rows].clone(), q.scale[rows].clone(), q.global_scale)
                module.weight.copy_(quantized[name].dequantize(module.weight.dtype))
                row += module.out_features
        hidden = [_hidden(layer(h, *args, **kwargs)) for h, (args, kwargs) in zip(hidden, extras[index], strict=True)]
    return quantized


def _hidden(output):
    """A decoder layer's hidden states, whether it returns them alone or first in a tuple."""
    return output[0] if isinstance(output, tuple) else output
