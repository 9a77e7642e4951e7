"""Decode attention (qerl/rollout/native/attention.py): the torch reference, the split rule, the Triton kernels.

* CPU, plain: the reference against SDPA with an explicit mask; decode_attention falls back to the reference.
* CPU, TRITON_INTERPRET=1: the kernels on small odd shapes against a float64 reference, with NaN written past
  every sequence's length (they must never be read). The flag is read when triton is imported, so these run
  in a subprocess (this file run as a script), as in tests/qerl/nvfp4/test_triton_kernels.py.
* GPU (marked `gpu`): Qwen2.5-7B shapes and CUDA-graph replay with new lengths.
"""

from __future__ import annotations

import pytest
import torch
from interpreter import run_under_interpreter
from seeds import seed_torch

from qerl.rollout.native import attention, kv_cache


def _inputs(b, hq, hkv, d, s_max, lens, dtype=torch.bfloat16, device="cpu", garbage=float("nan"), window=None):
    """q as a strided slice of a wider tensor, K and V as interleaved views of one cache buffer (the kernels
    take strides), every cache position past a sequence's length (or before its sliding window) set to `garbage`."""
    q = torch.randn(b, hq + 2, d, dtype=dtype, device=device)[:, 1:-1]
    kv = torch.randn(b, s_max, 2, hkv, d, dtype=dtype, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    keys = torch.arange(s_max, device=device)
    unread = (keys >= seq_lens[:, None]) | (keys < seq_lens[:, None] - (window or s_max))
    kv.masked_fill_(unread[:, :, None, None, None], garbage)
    return q, kv[:, :, 0], kv[:, :, 1], seq_lens


def _fp8_caches(k, v, seq_lens):
    """k, v in kv_cache's FP8 format, with NaN codes and NaN scales where k holds NaN (past every sequence's length,
    before its window)."""
    (k8, ks), (v8, vs) = kv_cache.quantize_reference(k.nan_to_num()), kv_cache.quantize_reference(v.nan_to_num())
    past = k.isnan().flatten(2).any(-1)
    for codes, scale in ((k8, ks), (v8, vs)):
        codes.view(torch.uint8).masked_fill_(past[:, :, None, None], 0x7F)  # E4M3's NaN
        scale.masked_fill_(past[:, :, None], float("nan"))
    return k8, v8, ks, vs


def _max_err(out, ref):
    """The largest error, counted relative to the reference where it exceeds 1: bf16 outputs are off by up to an
    ulp of their own size (the interpreter's cast truncates), 0.03 at values of 4-8 (few keys, large V)."""
    ref = ref.double()
    return ((out.double() - ref).abs() / ref.abs().clamp(min=1)).max().item()


# ------------------------------------------------------------------------------------ CPU, torch path


def test_reference_matches_sdpa_with_mask(seed):
    b, hq, hkv, d, s_max = 3, 6, 2, 32, 40
    q, k, v, seq_lens = _inputs(b, hq, hkv, d, s_max, [1, 40, 17], torch.float64, garbage=1e3)
    ref = attention.decode_attention_reference(q, k, v, seq_lens, 0.3)
    mask = (torch.arange(s_max) < seq_lens[:, None])[:, None, None, :]  # [B, 1, 1, S_max]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None],
        k.transpose(1, 2).repeat_interleave(hq // hkv, 1),
        v.transpose(1, 2).repeat_interleave(hq // hkv, 1),
        attn_mask=mask,
        scale=0.3,
    )[:, :, 0]
    torch.testing.assert_close(ref, expected, rtol=1e-12, atol=1e-12)


def test_reference_window_is_transformers_sliding_window(seed):
    """A window of 7: the query at position seq_len - 1 sees keys at positions > seq_len - 1 - 7 (transformers'
    sliding_window_overlay), 7 keys, or all of a shorter sequence."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    b, hq, hkv, d, s_max, window = 3, 4, 2, 16, 20, 7
    lens = [1, 20, 9]
    q, k, v, seq_lens = _inputs(b, hq, hkv, d, s_max, lens, torch.float64, garbage=1e3, window=window)
    ref = attention.decode_attention_reference(q, k, v, seq_lens, 0.3, window=window)
    rule = sliding_window_causal_mask_function(window)
    t = torch.tensor
    mask = torch.tensor([[bool(rule(t(i), t(0), t(n - 1), t(kv))) for kv in range(s_max)] for i, n in enumerate(lens)])
    assert mask.sum(-1).tolist() == [1, 7, 7]
    expected = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None],
        k.transpose(1, 2).repeat_interleave(hq // hkv, 1),
        v.transpose(1, 2).repeat_interleave(hq // hkv, 1),
        attn_mask=mask[:, None, None, :],
        scale=0.3,
    )[:, :, 0]
    torch.testing.assert_close(ref, expected, rtol=1e-12, atol=1e-12)


def test_cpu_falls_back_to_reference(seed):
    q, k, v, seq_lens = _inputs(2, 4, 2, 16, 24, [3, 24])
    out = torch.full_like(q, float("nan"))
    assert attention.decode_attention(q, k, v, seq_lens, 0.25, out=out) is out
    assert torch.equal(out, attention.decode_attention_reference(q, k, v, seq_lens, 0.25))
    assert not out.isnan().any()


@pytest.mark.parametrize(
    "q_shape,cache_shape,match",
    [
        ((2, 4, 24), (2, 8, 2, 24), "D=24 must be a power of two"),
        ((2, 4, 8), (2, 8, 2, 8), "D=8 must be a power of two"),
        ((2, 5, 16), (2, 8, 2, 16), "not a multiple"),
        ((3, 4, 16), (2, 8, 2, 16), "disagree"),
    ],
)
def test_rejects_bad_shapes(q_shape, cache_shape, match):
    b = q_shape[0]
    q, k = torch.zeros(q_shape), torch.zeros(cache_shape)
    with pytest.raises(ValueError, match=match):
        attention.decode_attention(q, k, k, torch.ones(b, dtype=torch.int32), 1.0)


def test_fp8_cache_needs_its_scales_and_falls_back_on_cpu(seed):
    q, k, v, seq_lens = _inputs(2, 4, 2, 16, 24, [3, 24])
    k8, v8, ks, vs = _fp8_caches(k, v, seq_lens)
    with pytest.raises(ValueError, match="FP8 cache needs k_scale"):
        attention.decode_attention(q, k8, v8, seq_lens, 0.25)
    with pytest.raises(ValueError, match="FP8 cache needs v_scale"):
        attention.decode_attention(q, k8, v8, seq_lens, 0.25, k_scale=ks, v_scale=vs[:, :3])
    out = attention.decode_attention(q, k8, v8, seq_lens, 0.25, k_scale=ks, v_scale=vs)
    expected = attention.decode_attention_reference(q.double(), k8, v8, seq_lens, 0.25, ks, vs)
    # the reference on the dequantized cache is plain attention on it
    deq = [kv_cache.dequantize_reference(c, s, torch.float64) for c, s in ((k8, ks), (v8, vs))]
    torch.testing.assert_close(expected, attention.decode_attention_reference(q.double(), *deq, seq_lens, 0.25))
    torch.testing.assert_close(out, expected.to(out.dtype), rtol=0, atol=0)


def test_fp8_caches_take_the_wide_launch_shape_only_where_programs_fill_the_gpu():
    q, k = torch.zeros(64, 28, 128), torch.zeros(64, 16, 4, 128)
    assert attention.default_config(q, k) is attention.DEFAULT_CONFIG  # a BF16 cache: always the default
    assert attention.default_config(q, k.to(kv_cache.FP8)) is attention.FP8_WIDE_CONFIG  # 64 x 4 = 256 programs
    assert attention.default_config(q[:8], k[:8].to(kv_cache.FP8)) is attention.DEFAULT_CONFIG


def test_rejects_int64_lengths():
    q, k = torch.zeros(2, 4, 16), torch.zeros(2, 8, 2, 16)
    with pytest.raises(ValueError, match="int32"):
        attention.decode_attention(q, k, k, torch.ones(2, dtype=torch.int64), 1.0)


def test_split_rule(monkeypatch):
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)  # H100
    cuda = torch.device("cuda", 0)
    expected = {  # (B, Hkv, S_max) -> (splits, keys per split)
        (64, 4, 2304): (3, 768),  # Qwen2.5-7B rollout: 768 programs
        (1, 4, 32768): (64, 512),  # one long sequence: capped at MAX_SPLITS
        (256, 8, 4096): (1, 4096),  # the batch alone fills the GPU: no merge kernel at any capacity
        (8, 2, 100): (1, 128),  # two tiles: no split shorter than MIN_TILES_PER_SPLIT tiles
    }
    for (b, hkv, s_max), want in expected.items():
        assert attention._splits(b, hkv, s_max, cuda, None) == want, (b, hkv, s_max)
    for s_max in (1, 63, 64, 65, 300, 2304, 5000):  # any requested count: whole tiles, none empty at S_max
        for requested in (None, 1, 2, 3, 7, 100):
            splits, split_len = attention._splits(4, 2, s_max, cuda, requested)
            assert split_len % attention.DEFAULT_CONFIG.block_s == 0 and 1 <= splits <= attention.MAX_SPLITS
            assert (splits - 1) * split_len < s_max <= splits * split_len, (s_max, requested)


def compiled_for(kernel, args: tuple, kwargs: dict) -> tuple:
    """What Triton compiles a launch of `kernel` for: its compile-time constants and launch options, each
    specialized integer's class (1, a multiple of 16, other) and each tensor's dtype and 16-byte alignment; integers
    the kernel does not specialize (do_not_specialize) and floats are plain runtime values and do not count."""
    key = []
    for i, param in enumerate(kernel.params):
        value = args[i] if i < len(args) else kwargs[param.name]
        if param.is_constexpr:
            key.append((param.name, value))
        elif isinstance(value, torch.Tensor):
            key.append((param.name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, int) and not param.do_not_specialize:
            key.append((param.name, value == 1, value % 16 == 0))
    options = {k: v for k, v in kwargs.items() if k not in {p.name for p in kernel.params}}
    return (*key, *sorted(options.items()))


class Recorder:
    """Stands in for a Triton kernel: each launch's compiled_for key goes to `keys` (nothing runs)."""

    def __init__(self, kernel, keys: list):
        self.kernel, self.keys = kernel, keys

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.keys.append(compiled_for(self.kernel, args, kwargs))


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize(("batch", "hq", "hkv", "d"), [(8, 12, 2, 128), (64, 12, 2, 128), (8, 28, 4, 128)])
def test_no_compiled_constant_follows_the_kv_capacity(monkeypatch, batch, hq, hkv, d, kv_dtype):
    """A round's KV capacity (longest prompt + new tokens) changes from round to round; the kernels of the decode
    step (attention's split and merge, the rotary + cache write) must compile once for a batch shape, never again
    inside a timed call or a training step (issue 50). Every capacity from 1 token to 4,352, the 1.5B's and 7B's
    head shapes, with and without a sliding window."""
    pytest.importorskip("triton")
    from qerl.rollout.native import elementwise

    keys = {"split": [], "merge": [], "rope": []}
    monkeypatch.setattr(attention, "sm_count", lambda device: 132)  # an H100's/H200's split rule
    monkeypatch.setattr(attention, "triton_runs_on", lambda tensor: True)
    monkeypatch.setattr(attention, "_split_kernel", Recorder(attention._split_kernel, keys["split"]))
    monkeypatch.setattr(attention, "_merge_kernel", Recorder(attention._merge_kernel, keys["merge"]))
    monkeypatch.setattr(elementwise, "triton_runs_on", lambda tensor: True)
    monkeypatch.setattr(elementwise, "_rope_cache_kernel", Recorder(elementwise._rope_cache_kernel, keys["rope"]))
    fp8 = kv_dtype == "fp8"
    for capacity in [*range(1, 300, 7), *range(300, 4353, 61), 4352]:
        cache = torch.zeros(2, batch, capacity, hkv, d, dtype=kv_cache.FP8 if fp8 else torch.bfloat16)
        scales = torch.ones(2, batch, capacity, hkv) if fp8 else (None, None)
        lens = torch.full((batch,), capacity, dtype=torch.int32)
        q = torch.zeros(batch, hq, d, dtype=torch.bfloat16)
        for window in (None, 4096):
            attention.decode_attention(q, cache[0], cache[1], lens, 0.1, k_scale=scales[0], v_scale=scales[1],
                                       window=window)  # fmt: skip
        qkv = torch.zeros(batch, (hq + 2 * hkv) * d, dtype=torch.bfloat16)
        table = torch.zeros(capacity, d // 2)
        positions = torch.zeros(batch, dtype=torch.int32)
        elementwise.rope_cache(qkv, table, table, positions, positions, cache[0], cache[1], hq, hkv,
                               k_scale=scales[0], v_scale=scales[1])  # fmt: skip
    assert keys["split"] and keys["rope"]
    for name, seen in keys.items():
        assert len(set(seen)) <= 1, f"{name}: {len(set(seen))} compilations over the capacities: {set(seen)}"


# ------------------------------------------------------------------------------------ CPU, interpreter


def _interpreter_checks():
    """The kernels under TRITON_INTERPRET=1 (run in a subprocess; see test_triton_interpreter)."""
    assert attention.INTERPRET
    seed_torch()  # the subprocess's output is shown when the test fails
    # Lengths of 1, not multiples of BLOCK_S (64) and equal to S_max; split counts that leave short sequences'
    # later splits empty (S_max=300 in 5 splits: 64 keys each, length 5 uses one); GQA groups of 1, 2 and 7.
    cases = (  # (Hq, Hkv, D, lengths (S_max = the longest), scale, num_splits to try, dtype)
        (2, 2, 16, [1, 200, 77, 130], 0.25, (None, 1, 2, 4), torch.bfloat16),
        (4, 2, 32, [65, 1, 160], 0.5, (None, 3), torch.float16),
        (7, 1, 16, [300, 5, 129, 64], 0.25, (None, 1, 5), torch.bfloat16),
        (14, 2, 16, [2, 130], 0.6, (2,), torch.bfloat16),
        (3, 1, 16, [40, 7], 0.4, (None,), torch.bfloat16),  # one tile: one split, through the merge the batch sizes
    )
    for hq, hkv, d, lens, scale, split_counts, dtype in cases:
        q, k, v, seq_lens = _inputs(len(lens), hq, hkv, d, max(lens), lens, dtype)
        ref = attention.decode_attention_reference(q.double(), k.double(), v.double(), seq_lens, scale)
        assert not ref.isnan().any()
        for num_splits in split_counts:
            out = torch.full_like(q, float("nan"))
            attention.decode_attention(q, k, v, seq_lens, scale, out=out, num_splits=num_splits)
            err = _max_err(out, ref)
            assert err < 2e-2, (hq, hkv, d, lens, num_splits, err)
        # The same attention over an FP8 cache against float64 attention over its dequantized values.
        k8, v8, ks, vs = _fp8_caches(k, v, seq_lens)
        ref8 = attention.decode_attention_reference(q.double(), k8, v8, seq_lens, scale, ks, vs)
        assert not ref8.isnan().any()
        for num_splits, config in [(n, None) for n in split_counts] + [(None, attention.FP8_WIDE_CONFIG)]:
            out = attention.decode_attention(
                q, k8, v8, seq_lens, scale, num_splits=num_splits, k_scale=ks, v_scale=vs, config=config
            )
            assert _max_err(out, ref8) < 2e-2, ("fp8", hq, hkv, d, lens, num_splits, config, _max_err(out, ref8))
        # A preallocated workspace gives the same answer as one allocated per call.
        ws = attention.decode_workspace(q, k, num_splits=2)
        assert torch.equal(
            attention.decode_attention(q, k, v, seq_lens, scale, num_splits=2, workspace=ws),
            attention.decode_attention(q, k, v, seq_lens, scale, num_splits=2),
        )
    # Sliding windows, NaN before each window as past each length: a window inside one tile, one across splits
    # (a sequence's first splits then hold no key), one of a single key, one longer than every sequence, and
    # Gemma-3-4B's heads (8 on 4 KV heads of 256).
    for hq, hkv, d, lens, window, split_counts in (
        (4, 2, 16, [1, 200, 77, 130], 50, (None, 1, 4)),
        (8, 4, 256, [150, 3], 70, (None, 2)),
        (7, 1, 32, [300, 5, 129], 100, (None, 5)),
        (2, 2, 16, [3, 70], 1, (None, 2)),
        (4, 2, 16, [65, 9], 500, (None, 2)),
    ):
        q, k, v, seq_lens = _inputs(len(lens), hq, hkv, d, max(lens), lens, window=window)
        ref = attention.decode_attention_reference(q.double(), k.double(), v.double(), seq_lens, 0.3, window=window)
        assert not ref.isnan().any()
        for num_splits in split_counts:
            out = attention.decode_attention(q, k, v, seq_lens, 0.3, num_splits=num_splits, window=window)
            assert _max_err(out, ref) < 2e-2, ("window", hq, hkv, d, lens, window, num_splits, _max_err(out, ref))
        k8, v8, ks, vs = _fp8_caches(k, v, seq_lens)
        ref8 = attention.decode_attention_reference(q.double(), k8, v8, seq_lens, 0.3, ks, vs, window=window)
        out = attention.decode_attention(q, k8, v8, seq_lens, 0.3, k_scale=ks, v_scale=vs, window=window)
        assert _max_err(out, ref8) < 2e-2, ("fp8 window", hq, hkv, d, lens, window, _max_err(out, ref8))
    print("interpreter checks passed")


def test_triton_interpreter():
    run_under_interpreter(__file__)


# ------------------------------------------------------------------------------------ GPU

gpu = pytest.mark.gpu


@gpu
def test_gpu_qwen7b_shapes_and_cuda_graph(seed):
    b, hq, hkv, d, s_max = 16, 28, 4, 128, 2304
    lens = torch.randint(1, s_max + 1, (b,)).tolist()
    lens[:3] = [1, s_max, 300]
    q, k, v, seq_lens = _inputs(b, hq, hkv, d, s_max, lens, device="cuda")
    scale = d**-0.5
    ref = attention.decode_attention_reference(q, k, v, seq_lens, scale)
    for num_splits in (None, 1, 7):
        assert _max_err(attention.decode_attention(q, k, v, seq_lens, scale, num_splits=num_splits), ref) < 2e-2
    k8, v8, ks, vs = _fp8_caches(k, v, seq_lens)
    ref8 = attention.decode_attention_reference(q.double(), k8, v8, seq_lens, scale, ks, vs)
    for num_splits, config in ((None, None), (1, None), (7, None), (None, attention.FP8_WIDE_CONFIG)):
        out = attention.decode_attention(
            q, k8, v8, seq_lens, scale, num_splits=num_splits, k_scale=ks, v_scale=vs, config=config
        )
        assert _max_err(out, ref8) < 2e-2

    k.copy_(torch.randn_like(k))  # the lengths below grow past the ones above: no NaN to read there
    v.copy_(torch.randn_like(v))
    out, ws = torch.empty_like(q), attention.decode_workspace(q, k)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        attention.decode_attention(q, k, v, seq_lens, scale, out=out, workspace=ws)  # warm-up: compile
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attention.decode_attention(q, k, v, seq_lens, scale, out=out, workspace=ws)
    for _ in range(3):  # new lengths and queries each step, same graph
        seq_lens.copy_(torch.randint(1, s_max + 1, (b,), dtype=torch.int32, device="cuda"))
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.testing.assert_close(out, attention.decode_attention(q, k, v, seq_lens, scale), rtol=0, atol=0)


if __name__ == "__main__":
    _interpreter_checks()
