"""The codec against compressed-tensors' own compressor, byte for byte, on fresh random weights."""

import pytest
import torch
from reference import reference_compress, reference_decompress, reference_global_scale

from qerl.nvfp4 import codec

SHAPES = [(16, 16), (48, 64), (96, 160), (256, 512)]


def _weights(kind: str, shape, dtype=torch.bfloat16) -> torch.Tensor:
    n, k = shape
    if kind == "normal":
        w = torch.randn(n, k) * 0.02
    elif kind == "heavy_tailed":  # Student-t with 2 degrees of freedom: rare huge outliers
        w = torch.distributions.StudentT(2.0).sample((n, k)) * 0.01
    elif kind == "tiny":  # group scales near the bottom of fp8's range, some flush to zero
        w = torch.randn(n, k) * 1e-6
        w[0, :16] = 1.0  # one large group pushes the rest towards fp8 underflow
    elif kind == "ties":  # every value exactly on a rounding midpoint of the grid after scaling
        grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
        w = grid[torch.randint(0, len(grid), (n, k))] * torch.where(torch.rand(n, k) < 0.5, -1.0, 1.0)
        w[:, ::16] = 6.0  # the group amax is 6, so the group scale is 1 and midpoints stay midpoints
    elif kind == "zero_rows":
        w = torch.randn(n, k)
        w[::3] = 0.0
        w[1, 16:32] = 0.0  # an all-zero group inside a non-zero row
    else:
        raise ValueError(kind)
    return w.to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", ["normal", "heavy_tailed", "tiny", "ties", "zero_rows"])
def test_quantize_matches_compressed_tensors(seed, shape, kind):
    w = _weights(kind, shape)
    ours = codec.quantize(w)
    ref = reference_compress(w)
    assert torch.equal(ours.global_scale, ref["weight_global_scale"].to(torch.float32).reshape(1))
    assert ours.scale.dtype == torch.float8_e4m3fn == ref["weight_scale"].dtype
    assert torch.equal(ours.scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert ours.packed.dtype == torch.uint8 and ours.packed.shape == (shape[0], shape[1] // 2)
    assert torch.equal(ours.packed, ref["weight_packed"])


@pytest.mark.parametrize("kind", ["normal", "heavy_tailed", "zero_rows"])
def test_dequantize_matches_compressed_tensors(seed, kind):
    w = _weights(kind, (64, 128))
    q = codec.quantize(w)
    ours = q.dequantize(torch.bfloat16)
    ref = reference_decompress(q.packed, q.scale, q.global_scale)
    assert ours.dtype == torch.bfloat16
    assert torch.equal(ours.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16))


def test_fused_group_shares_one_global_scale(seed):
    q, k, v = (_weights("normal", (64, 128)) * s for s in (1.0, 3.0, 0.5))
    gs = codec.compute_global_scale(q, k, v)
    assert torch.equal(gs, reference_global_scale(q, k, v).to(torch.float32).reshape(1))
    for w in (q, k, v):
        ours = codec.quantize(w, global_scale=gs)
        ref = reference_compress(w, global_scale=reference_global_scale(q, k, v))
        assert torch.equal(ours.packed, ref["weight_packed"])
        assert torch.equal(ours.scale.view(torch.uint8), ref["weight_scale"].view(torch.uint8))


def test_global_scale_keeps_bf16_precision():
    w = torch.full((16, 16), 0.3, dtype=torch.bfloat16)
    gs = codec.compute_global_scale(w)
    assert gs.dtype == torch.float32 and gs.shape == (1,)
    assert gs.item() == (torch.tensor(2688.0, dtype=torch.bfloat16) / w.abs().amax()).float().item()
    assert gs.item() != 2688.0 / w.float().abs().amax().item()  # fp32 math would differ


def test_ties_round_half_to_even():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 7.0, -0.1, -0.0])
    codes = codec.round_to_codes(x)
    values = codec.FP4_CODE_VALUES[codes.long()]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -4.0, 6.0, -0.0, 0.0])
    assert torch.equal(values, expected)
    assert codes[-2] == 8 and codes[-1] == 0  # small negative -> -0 (code 8); exact -0.0 -> +0


def test_round_to_values_is_the_value_of_round_to_codes(seed):
    """GPTQ's two-kernel rounding against the codes: on every bound of the buckets and the FP32 values next to it
    (where ties go to the even mantissa, both signs), saturation, and random values at three scales."""
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    inf = torch.tensor(float("inf"))
    near = torch.cat([bounds, torch.nextafter(bounds, inf), torch.nextafter(bounds, -inf)])
    edges = torch.tensor([0.0, 7.0, 1e30, float("inf")])
    x = torch.cat([near, -near, edges, -edges, *(torch.randn(4096) * scale for scale in (0.5, 3.0, 10.0))])
    expected = codec.FP4_CODE_VALUES[codec.round_to_codes(x).long()]
    assert torch.equal(codec.round_to_values(x), expected)  # torch.equal: -0.0 == 0.0, the sign of a zero aside


def test_pack_unpack_round_trip(seed):
    codes = torch.randint(0, 16, (32, 64), dtype=torch.uint8)
    packed = codec.pack_codes(codes)
    assert torch.equal(packed[:, 0] & 0xF, codes[:, 0]) and torch.equal(packed[:, 0] >> 4, codes[:, 1])
    assert torch.equal(codec.unpack_codes(packed), codes)


def test_dequantized_error_is_bounded(seed):
    w = torch.randn(128, 256, dtype=torch.float64)
    q = codec.quantize(w.to(torch.bfloat16))
    err = (q.dequantize(torch.float32).double() - w).norm() / w.norm()
    assert err < 0.12  # 4-bit E2M1 with 16-element groups: ~8-10% relative error on Gaussians


@pytest.mark.parametrize(
    "weight, message",
    [
        (torch.randn(8, 24), "not divisible by the NVFP4 group size"),
        (torch.tensor([[float("nan")] * 16]), "NaN or Inf"),
        (torch.tensor([[float("inf")] * 16]), "NaN or Inf"),
        (torch.randn(16), "2-D"),
    ],
)
def test_bad_weights_are_named(weight, message):
    with pytest.raises(ValueError, match=message) as info:
        codec.quantize(weight, name="model.layers.0.mlp.down_proj.weight")
    assert "model.layers.0.mlp.down_proj.weight" in str(info.value)
