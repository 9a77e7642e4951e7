"""experiments.cap_sweep: the endpoints fixed before the runs, read off a run's record; the winner rule; and the
train -> record -> report road on the tiny model, each cell's flags reaching qerl.train."""

import argparse
import json
import math
import shutil

import pytest
from arms_folders import _run

from benchmarks import launch
from experiments import arms_results, cap_sweep
from qerl.truncation import FINISHED_REWARD, TRUNCATED_REWARD

DATA = launch.REPO / "tests" / "data" / "gsm8k"


def record(name, shares, rewards, cell="fail", seed=0, **logged):
    """A sweep record whose step k truncated shares[k] of its completions and logged reward rewards[k]."""
    rows = [
        {"step": k, "reward": r, "completions/clipped_ratio": s, **{key: v[k - 1] for key, v in logged.items()}}
        for k, (s, r) in enumerate(zip(shares, rewards, strict=True), 1)
    ]
    columns = {key: [row.get(key) for row in rows] for key in rows[0]}
    return {"name": name, "arm": "nvfp4_lora", "cell": cell, "seed": seed, "steps": len(rows), "curve": columns}


def test_endpoints_of_a_run():
    shares = [0.0] * 9 + [0.2] * 21 + [0.6] + [0.95] * 20  # 51 steps: 10-30 at 0.2, then one >= 50%, then stuck
    ends = cap_sweep.endpoints(record("r", shares, [0.5] * 41 + [0.1] * 10))
    assert ends["any_half"] and ends["stuck"]
    assert ends["truncated_10_30"] == pytest.approx(0.2)
    assert ends["reward_last_10"] == pytest.approx(0.1)
    healthy = cap_sweep.endpoints(record("h", [0.49] * 51, [0.7] * 51))
    assert not healthy["any_half"] and not healthy["stuck"] and healthy["truncated_10_30"] == pytest.approx(0.49)


def test_earned_reward_undoes_the_cut_and_leaves_out_length_rules():
    """Where a cell failed its truncated completions (TRL's reward then counts them 0) or punished length, the earned
    reward is rebuilt from the truncated and finished means; the control's records logged it as reward."""
    row = {"reward": 0.3, "completions/clipped_ratio": 0.25, TRUNCATED_REWARD: 0.8, FINISHED_REWARD: 0.4}
    assert cap_sweep.earned_reward(row) == pytest.approx(0.25 * 0.8 + 0.75 * 0.4)
    assert cap_sweep.earned_reward({"reward": 0.3, "completions/clipped_ratio": 0.0, FINISHED_REWARD: 0.6}) == 0.6
    assert cap_sweep.earned_reward({"reward": 0.3, "completions/clipped_ratio": 0.25}) == 0.3
    assert math.isnan(cap_sweep.earned_reward({"reward": None, "completions/clipped_ratio": 0.25}))


def test_winner_rule(seed):
    import random

    rng = random.Random(seed)

    def runs(cell, n, any_half=0, stuck=0, reward=0.8):
        out = []
        for i in range(n):
            shares = [0.1] * 51
            if i < any_half:
                shares[20] = 0.6
            if i < stuck:
                shares[-6:] = [1.0] * 6
            rewards = [reward + rng.uniform(-0.02, 0.02) for _ in shares]
            out.append(record(f"{cell}-{i}", shares, rewards, cell=cell, seed=i))
        return out

    cells = {
        "recipe": runs("recipe", 10, any_half=4, stuck=1, reward=0.85),
        "fail": runs("fail", 8, any_half=1, reward=0.80),
        "soft128": runs("soft128", 8, reward=0.78),
        "cap1024": runs("cap1024", 7, reward=0.95),  # too few runs to qualify
        "lr1e-4": runs("lr1e-4", 8, any_half=2, reward=0.90),  # too often >= 50% truncated
    }
    result = cap_sweep.summarise(cells)
    assert result["winner"] == "fail"
    assert result["cells"]["recipe"]["any_half"] == 4 and result["cells"]["recipe"]["stuck"] == 1
    against = {c["cell"]: c for c in result["against_recipe"]}
    assert set(against) == {"fail", "soft128", "cap1024", "lr1e-4"}
    assert against["fail"]["reward_last_10"]["difference"] == pytest.approx(-0.05, abs=0.01)
    assert 0 < against["fail"]["stuck_fisher_p"] <= 1
    text = cap_sweep.markdown(result)
    assert "| fail: (a) truncated completions kept in the loss" in text and "Winner (" in text and ": fail." in text
    del cells["fail"]
    assert cap_sweep.summarise(cells)["winner"] == "soft128"


def test_the_control_cell_takes_the_arms_nvfp4_records(tmp_path):
    arms = tmp_path / "arms"
    for arm in ("nvfp4_lora", "bf16_lora"):
        _run(tmp_path / "runs" / arm, [0.5] * 4)
        setting = {"arm": arm, "seed": 0, "steps": 4, "format": "gsm8k_hash", "train_flags": []}
        arms_results.write_record(
            arms / f"{arm}-seed0.json", arms_results.run_record(tmp_path / "runs" / arm, setting, ("greedy",))
        )
    args = argparse.Namespace(
        results=tmp_path / "sweep", arms_results=arms, steps=4, format="gsm8k_hash", train_flags=[]
    )
    cells = cap_sweep.collect(args)
    assert list(cells) == ["recipe"] and [r["name"] for r in cells["recipe"]] == ["nvfp4_lora"]
    args.steps = 51
    assert cap_sweep.collect(args) == {}


def test_a_sweep_stays_with_the_recipe_it_ran_on(tmp_path):
    """Once the recipe takes the winner, the control pools only arms runs of the recipe the sweep ran on, a sweep
    folder holding two recipes is refused, and train will not add runs of the changed file to the old sweep."""
    arms, sweep = tmp_path / "arms", tmp_path / "sweep"
    for name, digest in (("nvfp4_lora-seed0", "aaaa"), ("nvfp4_lora-seed1", "bbbb")):
        _run(tmp_path / "runs" / name, [0.5] * 4)
        setting = {"arm": "nvfp4_lora", "seed": int(name[-1]), "steps": 4, "format": "gsm8k_hash", "train_flags": [],
                   "recipe_sha256": digest}  # fmt: skip
        arms_results.write_record(
            arms / f"{name}.json", arms_results.run_record(tmp_path / "runs" / name, setting, ("greedy",))
        )
    swept = {
        **record("fail-seed100", [0.0] * 4, [0.5] * 4),
        "recipe_sha256": "aaaa",
        "evals": {},
        "format": "gsm8k_hash",
    }
    arms_results.write_record(sweep / "fail-seed100.json", swept)
    args = argparse.Namespace(results=sweep, arms_results=arms, steps=4, format="gsm8k_hash", train_flags=[])
    cells = cap_sweep.collect(args)
    assert [r["name"] for r in cells["recipe"]] == ["nvfp4_lora-seed0"] and len(cells["fail"]) == 1
    arms_results.write_record(sweep / "fail-seed101.json", {**swept, "name": "fail-seed101", "recipe_sha256": "cccc"})
    with pytest.raises(SystemExit, match="runs of 2 recipes"):
        cap_sweep.collect(args)
    (sweep / "fail-seed101.json").unlink()
    recipe = launch.RECIPES["qwen2.5-coder-1.5b-instruct"].relative_to(launch.REPO)
    with pytest.raises(SystemExit, match=f"holds a sweep of {recipe} as it was \\(SHA-256 aaaa\\)"):
        cap_sweep.main(["train", "--results", str(sweep), "--out", str(tmp_path / "out"), "--gpu-ids", ""])


@pytest.mark.slow
def test_train_record_report_on_the_tiny_model(checkpoints, tmp_path, capsys):
    """The lease's road on CPU: two cells x one seed of the 1.5B recipe shrunk (BF16 base quantized here, the recipe's
    learning rate), each run recorded with its cell; the fail cell's flags reach qerl.train (its records log the
    truncated and finished rewards, and TRL's reward counts the truncated ones 0); recorded runs are not rerun."""
    bf16, _ = checkpoints
    argv = ["train", "--model", bf16, "--recipe", str(launch.RECIPES["qwen2.5-coder-1.5b-instruct"]),
            "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--train-data",
            str(DATA / "train_sample.jsonl"), "--results", str(tmp_path / "results"), "--arms-results",
            str(tmp_path / "none"), "--cells", "fail,lr1e-4", "--seeds", "7", "--steps", "2", "--per-gpu", "2",
            "--train-flags", "--max-completion-length", "3", "--soft-overlong-cache", "0", "--max-prompt-length",
            "4096", "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "1", "--num-generations",
            "4", "--use-cpu", "true"]  # fmt: skip
    cap_sweep.main(argv)
    results = tmp_path / "results"
    assert sorted(p.stem for p in results.glob("*.json")) == ["fail-seed7", "lr1e-4-seed7"]
    fail = json.loads((results / "fail-seed7.json").read_text())
    assert fail["cell"] == "fail" and fail["cell_flags"] == list(cap_sweep.CELLS["fail"].flags)
    assert (fail["arm"], fail["aqn"], fail["seed"], fail["lr"], fail["card"]) == ("nvfp4_lora", False, 7, 3e-4, "cpu")
    curve = fail["curve"]
    assert curve["step"] == [1, 2] and TRUNCATED_REWARD in curve
    for share, reward, done in zip(
        curve["completions/clipped_ratio"], curve["reward"], curve.get(FINISHED_REWARD, [0.0, 0.0]), strict=True
    ):
        assert reward == pytest.approx((1 - share) * (done or 0.0), abs=1e-4)
    assert json.loads((results / "lr1e-4-seed7.json").read_text())["lr"] == 1e-4
    report = json.loads((tmp_path / "out" / "cap_sweep.json").read_text())
    assert set(report["cells"]) == {"fail", "lr1e-4"} and report["winner"] is None
    assert (tmp_path / "out" / "cap_sweep.png").stat().st_size > 10_000
    assert "| fail: (a)" in capsys.readouterr().out
    for folder in (tmp_path / "out").glob("*-seed7"):
        shutil.rmtree(folder)
    cap_sweep.main(argv)  # recorded: nothing runs again
    assert not list((tmp_path / "out").glob("*-seed7"))
