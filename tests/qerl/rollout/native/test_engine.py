"""The native rollout engine (qerl/rollout/native/engine.py) against the policy's own forward (CPU; the GPU path is
test_engine_gpu.py): greedy tokens of a plain forward loop, the trainer's log-probs of sampled tokens, EOS per
sequence, waves and prefill chunks, a wave kept between rounds. On the tiny policies of
tests/helpers/native_policies.py."""

import pytest
import torch
from native_policies import ARCHITECTURES, _engine, _hf_greedy, _logprob_differences, _policy, _prompts
from transformers import GenerationConfig

from qerl import aqn
from qerl.errors import UsageError
from qerl.rollout import truncate_at_eos
from qerl.rollout.native import engine as engine_module
from qerl.rollout.native.decoder import Decoder
from qerl.rollout.native.engine import NativeEngine
from qerl.rollout.native.sampling import Sampler


@ARCHITECTURES
def test_greedy_tokens_equal_a_plain_forward_loop(arch):
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id)  # no EOS: every sequence runs to the limit
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 12)
    assert ids == [_hf_greedy(model, p, 12) for p in prompts]
    assert all(len(row) == 12 for row in logprobs)


@ARCHITECTURES
def test_sampled_logprobs_equal_the_trainers_recomputation(seed, arch):
    model, tokenizer = _policy(**arch)
    prompts = _prompts(tokenizer)
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.decoder.refresh()
    ids, logprobs = engine.generate(prompts, 10)
    assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4


def test_early_eos_stops_each_sequence_at_its_own_step():
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer)
    pad = tokenizer.pad_token_id
    engine = _engine(model, [-1], pad)
    engine.decoder.refresh()
    free_ids, free_lps = engine.generate(prompts, 12)
    eos = free_ids[1][3]  # a token of the second sequence becomes EOS
    engine = _engine(model, [eos], pad)
    engine.decoder.refresh()
    ids, lps = engine.generate(prompts, 12)
    for free, row, free_lp, lp in zip(free_ids, ids, free_lps, lps, strict=True):
        stop = free.index(eos) + 1 if eos in free else len(free)
        assert row[:stop] == free[:stop] and lp[:stop] == pytest.approx(free_lp[:stop], abs=1e-5)
        assert all(t == pad for t in row[stop:])  # after EOS: padding (truncate_at_eos cuts it)
    assert ids[1].index(eos) <= 3


def test_waves_and_prefill_chunks_give_the_same_tokens():
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer, (5, 11, 2, 8, 3))
    engine = _engine(model, [-1], tokenizer.pad_token_id)
    engine.decoder.refresh()
    whole, _ = engine.generate(prompts, 6)
    assert engine.last_waves == 1
    engine.kv_cache_bytes = 2 * engine._kv_bytes_per_sequence(11 + 6)  # two sequences per wave
    engine.prefill_tokens = 12  # one or two prompts per prefill chunk
    assert engine.generate(prompts, 6)[0] == whole and engine.last_waves == 3
    engine.kv_cache_bytes = engine._kv_bytes_per_sequence(11 + 6) - 1
    with pytest.raises(RuntimeError, match="KV cache of one sequence"):
        engine.generate(prompts, 6)


def _ending_at_different_steps(model, tokenizer, prompts, steps):
    """EOS ids that end the prompts' greedy completions at different steps (a token each of a few rows, taken at
    steps 2, 5 and 8 of a free run), so that rows finish while others decode on."""
    engine = _engine(model, [-1], tokenizer.pad_token_id)
    engine.decoder.refresh()
    free, _ = engine.generate(prompts, steps)
    return sorted({free[0][2], free[3][5], free[5][8]})


@pytest.mark.parametrize("kv_cache_dtype,row_multiple", [("auto", 1), ("fp8", 1), ("auto", 3)])
def test_live_row_compaction_gives_every_row_the_same_tokens(kv_cache_dtype, row_multiple):
    """Compaction (engine.compact_rows) moves the live rows' KV and state to the front as rows finish: every row's
    greedy tokens up to its EOS, their log-probs, and the padding after it are those of the engine without it
    (log-probs past EOS are padding too: truncate_at_eos cuts them). With a row multiple of 3, finished rows fill
    the compacted batches up to it and decode on as padding."""
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer, (5, 11, 2, 8, 3, 9, 4, 7))
    eos = _ending_at_different_steps(model, tokenizer, prompts, 24)
    runs = {}
    for compact in (False, True):
        engine = _engine(model, eos, tokenizer.pad_token_id)
        engine.kv_fp8 = kv_cache_dtype == "fp8"
        engine.compact_rows, engine.row_multiple, engine.sync_every = compact, row_multiple, 2
        engine.decoder.refresh()
        ids, logprobs = engine.generate(prompts, 24)
        runs[compact] = ids, truncate_at_eos(ids, logprobs, eos), engine.last_compactions
    plain_ids, plain, never = runs[False]
    ids, compacted, compactions = runs[True]
    assert never == 0 and compactions >= (2 if row_multiple == 1 else 1)  # rows finished at several checks
    assert ids == plain_ids
    assert len({len(row) for row in compacted.completion_ids}) >= 3  # the rows did end at different steps
    for row, plain_row in zip(compacted.logprobs, plain.logprobs, strict=True):
        assert row == pytest.approx(plain_row, abs=1e-5)


def test_live_row_compaction_samples_each_row_from_its_own_context(seed):
    """Sampled rows after compactions: every token's log-prob up to EOS is the trainer's for that row's own prompt
    and tokens (a row that read another row's KV or state would be far off)."""
    model, tokenizer = _policy()
    prompts = _prompts(tokenizer, (5, 11, 2, 8, 3, 9, 4, 7))
    eos = _ending_at_different_steps(model, tokenizer, prompts, 16)
    engine = _engine(model, eos, tokenizer.pad_token_id, temperature=0.7)
    engine.compact_rows, engine.row_multiple, engine.sync_every = True, 1, 1
    engine.decoder.refresh()
    out = truncate_at_eos(*engine.generate(prompts, 16), eos)
    assert engine.last_compactions >= 1
    assert _logprob_differences(model, prompts, out.completion_ids, out.logprobs, 0.7).max() < 1e-4


@pytest.mark.parametrize(
    "live,batch,multiple,expected",
    [
        (40, 64, 8, None),
        (32, 64, 8, 32),
        (30, 64, 8, 32),
        (5, 32, 8, 8),
        (7, 8, 8, None),
        (3, 8, 1, 3),
        (4, 8, 8, None),
    ],
)
def test_compaction_halves_at_least_and_rounds_to_the_row_multiple(live, batch, multiple, expected):
    engine = NativeEngine.__new__(NativeEngine)
    engine.row_multiple = multiple
    assert engine._compacted_size(live, batch) == expected


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_a_repeated_prompt_is_prefilled_once_and_shared(kv_cache_dtype):
    """GRPO's rounds repeat every prompt num_generations times: the prefill runs each distinct prompt once (rows
    through the model counted) and copies its keys and values to the rows that repeat it, whose greedy tokens and
    log-probs are those of the prompt decoded alone (and of a plain forward loop)."""
    model, tokenizer = _policy()
    a, b, c = _prompts(tokenizer, (5, 11, 3))
    prompts = [a, a, b, a, c, c, b]
    engine = _engine(model, [-1], tokenizer.pad_token_id)
    engine.kv_fp8 = kv_cache_dtype == "fp8"
    engine.decoder.refresh()
    alone = {tuple(p): engine.generate([p], 10) for p in (a, b, c)}
    forward, prefilled_tokens = engine.decoder.forward, []

    def counting_forward(tokens, *args):
        if tokens.numel() > len(prompts):  # a prefill chunk (a decode step has one token a row)
            prefilled_tokens.append(tokens.numel())
        return forward(tokens, *args)

    engine.decoder.forward = counting_forward
    ids, logprobs = engine.generate(prompts, 10)
    assert sum(prefilled_tokens) == 3 * 11  # the three distinct prompts, padded to the longest, in one chunk
    for prompt, row, lps in zip(prompts, ids, logprobs, strict=True):
        alone_ids, alone_lps = alone[tuple(prompt)]
        assert row == alone_ids[0] and lps == pytest.approx(alone_lps[0], abs=1e-5)
    if kv_cache_dtype == "auto":
        assert ids[2] == _hf_greedy(model, b, 10)


def test_rows_of_a_repeated_prompt_sample_independently(seed):
    """The rows sharing a prompt's prefill draw their own first tokens and go their own ways; each token's log-prob
    is the trainer's for that row."""
    model, tokenizer = _policy()
    (prompt,) = _prompts(tokenizer, (6,))
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=1.0)
    engine.decoder.refresh()
    ids, logprobs = engine.generate([prompt] * 8, 8)
    assert len({tuple(row) for row in ids}) > 1
    assert _logprob_differences(model, [prompt] * 8, ids, logprobs, 1.0).max() < 1e-4


def _round_prompts(tokenizer, lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, len(tokenizer), (n,), generator=gen).tolist() for n in lengths]


# (prompt lengths, new tokens) of successive rounds, and whether each replays the round before's cache and state:
# the same batch and new tokens within the kept capacity (rounded up to 128) do; another new-token count, batch, a
# capacity past the kept one, or under half of it, build anew, and what they build is kept in turn.
KEPT_ROUNDS = [
    ((5, 11, 2, 8, 3, 9, 4, 7), 12, False),
    ((9, 3, 7, 4, 12, 6, 2, 5), 12, True),
    ((9, 3, 7, 4, 12, 6, 2, 5), 8, False),
    ((6, 6, 6, 6, 6, 6), 8, False),
    ((2, 12, 4, 8, 3, 5), 8, True),
    ((130, 5, 6, 2, 9, 4), 8, False),
    ((3, 125, 7, 5, 1, 8), 8, True),
    ((3, 14, 7, 5, 1, 8), 8, False),
]


@pytest.mark.parametrize("compact,kv_cache_dtype", [(False, "auto"), (True, "auto"), (True, "fp8")])
def test_a_kept_wave_gives_every_round_a_fresh_engines_tokens(compact, kv_cache_dtype):
    """keep_between_rounds: a round replays the round before's KV cache and decode state where it fits (KEPT_ROUNDS),
    and its greedy tokens and log-probs are those of a fresh engine without it: no stale key of the last round, nor
    a row that compaction moved in it, is read, and the reset state starts where a new one would. In BF16, as real
    runs sample: the two engines run the same kernels on the same rows, so they agree exactly there too."""
    model, tokenizer = _policy(dtype=torch.bfloat16)
    pad = tokenizer.pad_token_id
    eos = _ending_at_different_steps(model, tokenizer, _round_prompts(tokenizer, KEPT_ROUNDS[0][0], 0), 12)
    engines = {}
    for keep in (False, True):
        engines[keep] = engine = _engine(model, eos, pad)
        engine.kv_fp8 = kv_cache_dtype == "fp8"
        engine.compact_rows, engine.row_multiple, engine.sync_every = compact, 1, 2
        engine.keep_between_rounds = keep
        engine.decoder.refresh()
    compactions = compacted_steps_replayed = 0
    for seed, (lengths, new_tokens, reused) in enumerate(KEPT_ROUNDS):
        prompts = _round_prompts(tokenizer, lengths, seed)
        fresh_ids, fresh_lps = engines[False].generate(prompts, new_tokens)
        ids, lps = engines[True].generate(prompts, new_tokens)
        assert engines[True].last_kept_wave_reused == reused and not engines[False].last_kept_wave_reused
        kept = engines[True]
        compactions += kept.last_compactions
        # every step size a round runs is built once, unless kept from an earlier round: the wave's and compactions'
        assert kept.last_step_builds <= 1 + kept.last_compactions
        compacted_steps_replayed += 1 + kept.last_compactions - kept.last_step_builds - reused
        assert ids == fresh_ids
        fresh = truncate_at_eos(fresh_ids, fresh_lps, eos)
        for row, fresh_row in zip(truncate_at_eos(ids, lps, eos).logprobs, fresh.logprobs, strict=True):
            assert row == pytest.approx(fresh_row, abs=1e-5)
    assert compactions >= (2 if compact else 0)
    assert compacted_steps_replayed >= (1 if compact else 0)  # a smaller step kept from a round before replayed


def test_a_kept_wave_samples_each_round_from_its_own_prompts(seed):
    """Sampled rounds replaying a kept cache: every token's log-prob is the trainer's for its own prompt and tokens;
    a round in waves keeps nothing."""
    model, tokenizer = _policy()
    engine = _engine(model, [-1], tokenizer.pad_token_id, temperature=0.7)
    engine.keep_between_rounds = True
    engine.decoder.refresh()
    for round_seed, (lengths, new_tokens, reused) in enumerate(KEPT_ROUNDS[:3]):
        prompts = _round_prompts(tokenizer, lengths, round_seed + 10)
        ids, logprobs = engine.generate(prompts, new_tokens)
        assert engine.last_kept_wave_reused == reused
        assert _logprob_differences(model, prompts, ids, logprobs, 0.7).max() < 1e-4
    engine.kv_cache_bytes = 2 * engine._kv_bytes_per_sequence(9 + 8)  # two sequences a wave (none at 128 tokens)
    engine.generate(_round_prompts(tokenizer, (9, 3, 7, 4), 20), 8)
    assert engine.last_waves == 2 and not engine.last_kept_wave_reused and engine._kept is None


def test_keeping_waves_refuses_a_sharded_policy():
    model, tokenizer = _policy()
    decoder = Decoder(model)
    decoder.gather_each_round = True
    with pytest.raises(UsageError, match="^rollout_keep_between_rounds: the policy is sharded"):
        NativeEngine(decoder, Sampler(GenerationConfig()), [-1], tokenizer.pad_token_id, keep_between_rounds=True)
    # by memory (a training run's default) it is simply off
    assert (
        NativeEngine(decoder, Sampler(GenerationConfig()), [-1], 0, keep_between_rounds=None).keep_between_rounds
        is False
    )


def test_keeping_waves_by_memory_keeps_a_cache_of_at_most_a_tenth_of_what_is_available(monkeypatch):
    """keep_between_rounds None (a training run's default): a round's cache is kept while it takes at most
    KEPT_AUTO_SHARE of the memory available with the kept cache counted as free, so the 1.5B recipe's 1.4 GB are kept
    on a large card and the 32B recipe's ~21 GB are not; once memory is short again the cache goes."""
    model, tokenizer = _policy()
    engine = _engine(model, [-1], tokenizer.pad_token_id)
    engine.keep_between_rounds = None
    engine.decoder.refresh()
    (lengths, new_tokens, _), (lengths2, _, _) = KEPT_ROUNDS[:2]
    cache = len(lengths) * engine._kv_bytes_per_sequence(engine._capacity(max(lengths) + new_tokens, True))
    limit = cache / engine_module.KEPT_AUTO_SHARE  # the memory at which the cache is exactly the share
    available = {"bytes": int(1.01 * limit)}
    monkeypatch.setattr(engine_module, "available_bytes", lambda device: available["bytes"])
    engine.generate(_round_prompts(tokenizer, lengths, 0), new_tokens)
    # the kept cache counts as available: without it 0.91 of the limit would be
    available["bytes"] = int(1.01 * limit) - cache
    engine.generate(_round_prompts(tokenizer, lengths2, 1), new_tokens)
    assert engine.last_kept_wave_reused and engine._kept is not None
    available["bytes"] = int(0.9 * limit) - cache
    engine.generate(_round_prompts(tokenizer, lengths2, 2), new_tokens)
    assert not engine.last_kept_wave_reused and engine._kept is None


def _addresses(decoder: Decoder) -> dict[str, int]:
    """data_ptr of every tensor reachable from the decoder (its layers, projections, norm holders and per-head
    scales, embeddings, rotary tables; the policy's modules it refers to too), by attribute path."""
    found, seen = {}, set()

    def walk(obj, path):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found[path] = obj.data_ptr()
        elif isinstance(obj, torch.nn.Module):
            for name, tensor in [*obj.named_parameters(), *obj.named_buffers()]:
                walk(tensor, f"{path}.{name}")
        elif isinstance(obj, (list, tuple)):
            for i, item in enumerate(obj):
                walk(item, f"{path}[{i}]")
        elif isinstance(obj, dict):
            for key, item in obj.items():
                walk(item, f"{path}[{key!r}]")
        elif type(obj).__module__.startswith("qerl.rollout.native"):
            for name, item in vars(obj).items():
                walk(item, f"{path}.{name}")

    walk(decoder, "decoder")
    return found


@ARCHITECTURES
def test_what_a_kept_graph_reads_stays_where_it_was_captured(arch):
    """A kept decode graph replays on the addresses it captured (keep_between_rounds; the CPU runs the step eagerly,
    so this is what holds the GPU's replays to the current policy): every tensor the decoder reads keeps its
    storage through what happens between rounds: the adapter and norms moving in place (an optimizer step),
    Decoder.refresh, one round's AQN noise on the engine's holders (per-head norms included) and its undo, and
    lay_out_head_norms."""
    model, _ = _policy(**arch)
    decoder = Decoder(model)
    decoder.refresh()
    decoder.ensure_positions(64)
    decoder.lay_out_head_norms()
    before = _addresses(decoder)
    assert any(".lora_a" in path for path in before) and any("cos[" in path for path in before)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    decoder.refresh()
    noise = aqn.RoundNoise(seed=3, include_final=True, dtype_rule="fp32", include_head_norms=bool(arch))
    with noise.of_round(decoder.norms, 1e-2, (1, 0), fp32_compute=False):
        decoder.lay_out_head_norms()
        assert _addresses(decoder) == before
    decoder.ensure_positions(64)
    assert _addresses(decoder) == before
