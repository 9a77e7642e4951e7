"""The native rollout engine (qerl/rollout/native/engine.py) against the policy's own forward (CPU; the GPU path is
test_engine_gpu.py): greedy tokens of a plain forward loop, the trainer's log-probs of sampled tokens, EOS per
sequence, waves and prefill chunks. On the tiny policies of tests/helpers/native_policies.py."""

import pytest
from native_policies import ARCHITECTURES, _engine, _hf_greedy, _logprob_differences, _policy, _prompts


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
