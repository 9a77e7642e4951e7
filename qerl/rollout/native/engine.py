"""The native engine's loop: KV cache sized from the round's lengths, prefill in large GEMMs, one CUDA graph per
wave for the whole decode step, stop on EOS.

A round of B prompts runs in waves of as many sequences as the KV budget holds (all of them when it fits). A
wave:
  1. allocates its KV cache [layers, B, longest prompt + max_new_tokens, kv heads, head dim] in one tensor
     (per-sequence rows: attention reads only each sequence's valid keys, so the capacity costs memory, not time),
     in the model's dtype or, with kv_cache_dtype "fp8", as E4M3 codes with a scale per token and head (kv_cache.py:
     half the bytes, so twice the sequences per wave and half the attention reads);
  2. prefills each distinct prompt once, in chunks of at most `prefill_tokens` tokens (right-padded, causal
     attention through PyTorch's SDPA, masked to each layer's sliding window where it has one; pad rows write keys
     past the prompt that decode overwrites before it reads them), copies its keys and values to the rows that
     repeat it, and samples each sequence's first token from its prompt's last row;
  3. captures one decode step (embedding -> layers -> LM head -> sampling -> bookkeeping) in a CUDA graph and
     replays it, checking every `sync_every` steps whether all sequences have emitted EOS;
  4. with `compact_rows`, at that check, once at most half the rows are live, moves the live rows (their KV cache
     rows and decode state) to the front, decodes only those (rounded up to a multiple of `row_multiple`) and
     captures the smaller step: finished rows stop costing GEMM rows and attention reads. Completions are about half
     as long as the longest on average, so about half of a wave's row-steps are finished rows. Each compaction costs
     one copy of the live rows' KV and one capture; halving bounds them at log2(B / row_multiple) a wave;
  5. frees the cache and the graph, so the trainer gets the memory back for its log-prob and backward passes; or,
     with `keep_between_rounds` (None, a training run's default: while the cache takes at most KEPT_AUTO_SHARE of
     the memory the passes could have, so not the 32B recipe's ~21 GB), keeps them for the next round when it is
     one wave of as many sequences and as many new tokens (GRPO's rounds are): that round writes its prompts into
     the same cache and replays the same graph, skipping an allocation and a capture (~0.1 s a round), and so for
     each smaller step compaction reached (its rows sit at the front of the same cache; a later round that compacts
     to that size copies its live rows into the kept step's state and replays it: with compaction, up to 0.24 s of
     captures a step), at the cost of holding that memory through the training passes (the cache, and the graphs'
     pool of the step's temporaries). Its capacity is rounded up to KEPT_CAPACITY_MULTIPLE so that rounds whose
     longest prompts differ by a few tokens share it; one over twice what a round needs is rebuilt. The graphs read
     the adapter, norm and noise buffers in place (Projection.refresh, NormScales.refresh and AQN write into them),
     so a kept graph samples from the current policy.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

from qerl.device_facts import MemoryRule, available_bytes
from qerl.errors import UsageError
from qerl.rollout.native import kv_cache
from qerl.rollout.native.attention import decode_attention
from qerl.rollout.native.decode_state import DecodeState, KeptStep, KeptWave
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.sampling import Sampler

logger = logging.getLogger(__name__)

KEPT_CAPACITY_MULTIPLE = 128  # a kept cache's capacity in tokens is a multiple of it
# keep_between_rounds None keeps a cache taking at most this share of the memory available with it freed: 1.4 GB of
# ~130 GB at 1.5B on an H200 is kept; the 32B recipe's (64 rows of 1,280 tokens, ~21 GB of ~55) is not, so that its
# training passes keep their memory.
KEPT_AUTO_SHARE = 0.1


class NativeEngine:
    def __init__(
        self,
        decoder: Decoder,
        sampler: Sampler,
        eos_token_ids: list[int],
        pad_token_id: int,
        kv_cache_bytes: int | None = None,
        prefill_tokens: int = 8192,
        sync_every: int = 16,
        cuda_graphs: bool | None = None,
        kv_cache_dtype: str = "auto",
        compact_rows: bool = False,
        row_multiple: int = 8,
        keep_between_rounds: bool | None = False,
    ):
        self.decoder = decoder
        self.sampler = sampler
        self.eos = torch.tensor(sorted(set(eos_token_ids)), dtype=torch.long, device=decoder.device)
        self.pad_token_id = pad_token_id
        self.kv_cache_bytes = kv_cache_bytes
        self.kv_fp8 = kv_cache.resolve(kv_cache_dtype)
        self.prefill_tokens = prefill_tokens
        self.sync_every = sync_every
        self.cuda_graphs = decoder.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        self.compact_rows = compact_rows
        self.row_multiple = row_multiple  # compacted batches: multiples of it (few captured shapes, whole GEMM tiles)
        if keep_between_rounds and decoder.gather_each_round:
            raise UsageError(
                "rollout_keep_between_rounds: the policy is sharded (FSDP2 or ZeRO-3) and gathered into new tensors "
                "every round, which a kept decode graph would not read; turn it off"
            )
        # None (by memory, KEPT_AUTO_SHARE): never for a sharded policy
        self.keep_between_rounds = (
            False if keep_between_rounds is None and decoder.gather_each_round else keep_between_rounds
        )
        self._kept: KeptWave | None = None
        self._kept_by_memory = MemoryRule(
            logger, "native rollout: the KV cache and decode graphs between rounds", KEPT_AUTO_SHARE,
            "rollout_keep_between_rounds", "kept", "not kept",
        )  # fmt: skip
        # The engine's own capture stream: cuBLAS keeps a workspace per stream that captured graphs bake in, and
        # a graph's destruction frees it; with one stream per engine a kept graph never shares it with another's.
        self._capture_stream: torch.cuda.Stream | None = None
        self.last_kept_wave_reused = False  # whether the last round replayed the round before's cache and graph
        self.last_waves = 0  # waves of the last round (for benchmarks and logs)
        self.last_compactions = 0  # ... and the times their live rows were compacted
        self.last_step_builds = 0  # ... and the decode steps built (captured, with CUDA graphs) rather than kept

    # ------------------------------------------------------------------------------------------------ sizing

    def _kv_bytes_per_sequence(self, capacity: int) -> int:
        d = self.decoder
        return len(d.layers) * capacity * kv_cache.bytes_per_token(d.num_kv_heads, d.head_dim, d.dtype, self.kv_fp8)

    def _kv_budget(self) -> int | None:
        """Bytes a round's KV cache may take: kv_cache_bytes, or 80% of what is free (the rest: activations,
        logits) counting a kept cache as free; None on the CPU without kv_cache_bytes (no limit)."""
        if self.kv_cache_bytes is not None:
            return self.kv_cache_bytes
        if self.decoder.device.type != "cuda":
            return None
        free = torch.cuda.mem_get_info(self.decoder.device)[0] + (self._kept.cache.nbytes if self._kept else 0)
        return int(free * 0.8)

    def wave_size(self, num_prompts: int, capacity: int) -> int:
        """Sequences per wave: all, or as many as the KV budget holds (balanced across waves)."""
        budget = self._kv_budget()
        if budget is None:
            return num_prompts
        per_sequence = self._kv_bytes_per_sequence(capacity)
        fits = budget // per_sequence
        if fits < 1:
            raise RuntimeError(
                f"native rollout: the KV cache of one sequence of {capacity} tokens needs "
                f"{per_sequence / 2**30:.2f} GiB, the budget is {budget / 2**30:.2f} GiB"
            )
        waves = math.ceil(num_prompts / fits)
        return math.ceil(num_prompts / waves)

    # -------------------------------------------------------------------------------------------------- round

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
        """Completion token ids [B][max_new_tokens or fewer] (pad after EOS) and their log-probs."""
        if not prompts:
            return [], []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("native rollout: empty prompt")
        needed = max(len(p) for p in prompts) + max_new_tokens
        keep_for_next = self._keep_for_next(len(prompts), self._capacity(needed, True))
        if not keep_for_next:  # a round in waves keeps nothing
            self._kept = None
        capacity = self._capacity(needed, keep_for_next)
        size = self.wave_size(len(prompts), capacity)
        self.decoder.ensure_positions(capacity)
        self.decoder.lay_out_head_norms()
        ids, logprobs = [], []
        self.last_waves = self.last_compactions = self.last_step_builds = 0
        self.last_kept_wave_reused = False
        for start in range(0, len(prompts), size):
            wave_ids, wave_lps = self._wave(prompts[start : start + size], max_new_tokens, keep_for_next)
            ids += wave_ids
            logprobs += wave_lps
            self.last_waves += 1
        return ids, logprobs

    def _keep_for_next(self, num_prompts: int, capacity: int) -> bool:
        """Whether this round's cache and steps are kept for the next: never for a round in waves; with
        keep_between_rounds None, while the cache takes at most KEPT_AUTO_SHARE of the memory it would leave."""
        if self.keep_between_rounds is False or not self._fits_one_wave(num_prompts, capacity):
            return False
        if self.keep_between_rounds:
            return True
        cache = num_prompts * self._kv_bytes_per_sequence(capacity)
        return self._kept_by_memory(
            cache, available_bytes(self.decoder.device) + (self._kept.cache.nbytes if self._kept else 0)
        )

    def _fits_one_wave(self, num_prompts: int, capacity: int) -> bool:
        budget = self._kv_budget()
        return budget is None or budget // self._kv_bytes_per_sequence(capacity) >= num_prompts

    @staticmethod
    def _capacity(needed: int, kept: bool) -> int:
        """KV positions a wave's cache holds: what it needs, rounded up for a cache kept for the next round."""
        return -(-needed // KEPT_CAPACITY_MULTIPLE) * KEPT_CAPACITY_MULTIPLE if kept else needed

    def _wave(self, prompts: list[list[int]], max_new_tokens: int, keep_for_next: bool = False):
        d, device = self.decoder, self.decoder.device
        lengths = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=device)
        capacity = self._capacity(max(len(p) for p in prompts) + max_new_tokens, keep_for_next)
        kept = self._kept if keep_for_next else None
        if kept is not None and not kept.fits(len(prompts), capacity, max_new_tokens, d, self.kv_fp8):
            kept = None
        self._kept = kept  # one that does not fit goes before the new cache is allocated
        if kept is None:
            cache = kv_cache.KVCache(
                len(d.layers), len(prompts), capacity, d.num_kv_heads, d.head_dim, d.dtype, self.kv_fp8, device
            )
        else:
            cache = kept.cache  # its stale rows are never read: prefill and decode write each position first
        first, first_logprob = self._prefill(prompts, cache)
        if kept is None:
            state = DecodeState(first, first_logprob, lengths, max_new_tokens, self.pad_token_id)
        else:
            state = kept.steps[len(prompts)].state
            state.reset(first, first_logprob, lengths)
        self.last_kept_wave_reused = kept is not None
        state.done |= self._is_eos(first)
        out_ids, out_logprobs = state.out_ids, state.out_logprobs  # every row's, written back after compactions
        rows = None  # the wave's row of each of the state's rows, once compacted (None: all rows, in order)

        def write_back():  # the compacted rows' outputs into the wave's
            if rows is not None:
                out_ids.index_copy_(0, rows, state.out_ids)
                out_logprobs.index_copy_(0, rows, state.out_logprobs)

        # One memory pool for the wave's captures (and a kept graph's with later rounds'): their replays never
        # overlap, and none reads what another left in the pool (its outputs go to the state's tensors).
        pool = kept.pool if kept else torch.cuda.graph_pool_handle() if self.cuda_graphs else None
        t, steps = 0, max_new_tokens - 1
        while t < steps:
            if kept is not None and len(state.tokens) in kept.steps:
                run = kept.steps[len(state.tokens)].run
            else:
                step = self._decode_step(state, cache)
                run = self._capture(step, state, pool) if self.cuda_graphs else step
                self.last_step_builds += 1
                if keep_for_next:
                    if kept is None:
                        self._kept = kept = KeptWave(cache, pool, max_new_tokens, d.cos)
                    kept.steps[len(state.tokens)] = KeptStep(state, run)
            smaller = None
            while t < steps and smaller is None:
                run()
                t += 1
                if t % self.sync_every == 0:
                    live = int((~state.done).sum())  # the one host sync of the check
                    if live == 0:
                        t = steps
                    elif self.compact_rows:
                        smaller = self._compacted_size(live, len(state.tokens))
            if smaller is not None:
                keep = torch.sort(state.done.to(torch.int8), stable=True).indices[:smaller]  # live rows first
                keep = keep.sort().values  # in wave order: each row moves to a lower index (kv_cache.keep_rows)
                write_back()
                rows = keep if rows is None else rows[keep]
                cache = cache.keep_rows(keep)  # a view at the front of the same memory: the same addresses
                if kept is not None and smaller in kept.steps:  # a step of this size kept from an earlier round
                    state = kept.steps[smaller].state.take_rows(state, keep)
                else:
                    state = state.keep_rows(keep)
                self.last_compactions += 1
        write_back()
        return out_ids.tolist(), out_logprobs.tolist()  # the cache and graph go with this frame, unless kept

    def _compacted_size(self, live: int, batch: int) -> int | None:
        """The batch `live` rows move to, or None to stay at `batch`: once at most half are live (so that each
        compaction at least halves the work a step does), rounded up to a multiple of row_multiple."""
        size = -(-live // self.row_multiple) * self.row_multiple
        return size if live <= batch // 2 and size < batch else None

    def _decode_step(self, state: DecodeState, cache: kv_cache.KVCache):
        """One decode step of the state's rows over their cache rows (what a CUDA graph captures)."""
        d = self.decoder
        batch = len(state.tokens)

        def attend(i: int, q: torch.Tensor) -> torch.Tensor:
            k, v, k_scale, v_scale = cache.layer(i)
            return decode_attention(
                q, k, v, state.seq_lens, d.scaling, k_scale=k_scale, v_scale=v_scale, window=d.layers[i].window
            ).reshape(batch, -1)

        def step():
            torch.add(state.positions, 1, out=state.seq_lens)  # this step's key is written before attention
            hidden = d.forward(state.tokens, state.batch_idx, state.positions, cache, attend)
            tokens, logprobs = self.sampler(d.logits(hidden))
            tokens = torch.where(state.done, self.pad_token_id, tokens)
            state.out_ids.index_copy_(1, state.step, tokens[:, None])
            state.out_logprobs.index_copy_(1, state.step, logprobs[:, None])
            state.done |= self._is_eos(tokens)
            state.tokens.copy_(tokens)
            state.positions += 1
            state.step += 1

        return step

    def _is_eos(self, tokens: torch.Tensor) -> torch.Tensor:
        return (tokens[:, None] == self.eos[None]).any(-1)

    def _capture(self, step, state: DecodeState, pool):
        """One decode step as a CUDA graph. A first eager step on a side stream compiles the Triton kernels and
        sets up cuBLAS; the state and the random generator it advanced are put back (the KV rows it wrote are
        rewritten by the first replay, which feeds the same tokens at the same positions), so that graph and
        eager runs draw the same samples."""
        saved, rng = state.snapshot(), torch.cuda.get_rng_state()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        state.restore(saved)
        torch.cuda.set_rng_state(rng)
        graph = torch.cuda.CUDAGraph()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream()
        with torch.cuda.graph(graph, pool=pool, stream=self._capture_stream):
            step()
        return graph.replay

    def _prefill(self, prompts: list[list[int]], cache: kv_cache.KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """Run each distinct prompt through the model once, in chunks, and give its keys and values to the rows
        that repeat it (GRPO samples every prompt num_generations times); returns each row's first sampled token
        and log-prob, drawn independently from its prompt's last logits."""
        d, device = self.decoder, self.decoder.device
        first_row: dict[tuple[int, ...], int] = {}
        source = [first_row.setdefault(tuple(p), row) for row, p in enumerate(prompts)]  # the row prefilled for it
        distinct = list(first_row.values())
        last_hidden = []
        start = 0
        while start < len(distinct):
            longest = len(prompts[distinct[start]])
            end = start + 1
            while end < len(distinct) and max(longest, len(prompts[distinct[end]])) * (end + 1 - start) <= (
                self.prefill_tokens
            ):
                longest = max(longest, len(prompts[distinct[end]]))
                end += 1
            chunk = [prompts[row] for row in distinct[start:end]]
            rows = torch.full((len(chunk), longest), self.pad_token_id, dtype=torch.long)
            for i, p in enumerate(chunk):
                rows[i, : len(p)] = torch.tensor(p)
            rows = rows.to(device).reshape(-1)
            cache_rows = torch.tensor(distinct[start:end], device=device)
            batch_idx = cache_rows.to(torch.int32).repeat_interleave(longest)
            positions = torch.arange(longest, dtype=torch.int32, device=device).repeat(len(chunk))
            n = len(chunk)
            masks = _window_masks({layer.window for layer in d.layers} - {None}, longest, device)

            def attend(i: int, q: torch.Tensor, span=cache_rows, n=n, length=longest, masks=masks) -> torch.Tensor:
                q = q.view(n, length, d.num_heads, d.head_dim).transpose(1, 2)
                k, v = (t.transpose(1, 2) for t in cache.read(i, span, length))  # as decode will read them
                mask = masks.get(d.layers[i].window)
                out = F.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=d.scaling,
                    enable_gqa=d.num_heads != d.num_kv_heads,
                )
                return out.transpose(1, 2).reshape(n * length, -1)

            hidden = d.forward(rows, batch_idx, positions, cache, attend)
            last = torch.tensor([i * longest + len(p) - 1 for i, p in enumerate(chunk)], device=device)
            last_hidden.append(hidden[last])
            start = end
        repeats = [row for row, src in enumerate(source) if src != row]
        if repeats:
            cache.copy_rows(
                torch.tensor([source[row] for row in repeats], device=device),
                torch.tensor(repeats, device=device),
                max(len(prompts[row]) for row in repeats),
            )
        position = {row: i for i, row in enumerate(distinct)}  # distinct row -> its index in last_hidden
        index = torch.tensor([position[src] for src in source], device=device)
        return self.sampler(d.logits(torch.cat(last_hidden))[index])  # each row draws its own token


def _window_masks(windows: set[int], length: int, device) -> dict[int, torch.Tensor]:
    """Prefill's attention mask per sliding window: causal, and key position > query position - window."""
    query = torch.arange(length, device=device)[:, None]
    key = torch.arange(length, device=device)[None]
    return {w: (key <= query) & (key > query - w) for w in windows}
