"""benchmarks.gptq_speed: a layer's GPTQ passes at Qwen2.5's shapes, and the timing run end to end on the CPU at a
tiny shape (the GPU figures come from a lease)."""

import json

import pytest

from benchmarks import gptq_speed


def test_a_layers_passes_stack_the_fused_groups():
    passes = gptq_speed.layer_passes("1.5b")
    assert passes == {"qkv": (2048, 1536), "o": (1536, 1536), "gate_up": (17920, 1536), "down": (1536, 8960)}
    assert sum(k for _, k in passes.values()) == 13568  # columns GPTQ rounds one by one in a 1.5B layer


def test_the_benchmark_times_real_gptq_and_writes_its_json(tmp_path, monkeypatch):
    monkeypatch.setattr(gptq_speed, "layer_passes", lambda size: {"qkv": (48, 32), "down": (32, 64)})
    out = tmp_path / "gptq.json"
    gptq_speed.main(["--sizes", "0.5b", "--repeats", "2", "--device", "cpu", "--out", str(out)])
    result = json.loads(out.read_text())
    size = result["sizes"]["0.5b"]
    assert result["card"] == "cpu" and set(size["passes"]) == {"qkv", "down"}
    assert all(p["min"] <= p["median"] <= p["max"] and p["min"] > 0 for p in size["passes"].values())
    assert size["model_seconds"] == pytest.approx(24 * size["layer_seconds"])  # Qwen2.5-0.5B's 24 layers
    with pytest.raises(SystemExit):
        gptq_speed.main(["--sizes", "2b", "--device", "cpu"])
