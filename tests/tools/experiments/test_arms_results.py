"""experiments.arms_results: what a run's record keeps (the curve and scores, not the samples), and the loader's
errors naming the bad file."""

import json

import pytest
from arms_folders import _run

from experiments import arms_results


def test_a_record_keeps_the_curve_and_scores_not_the_samples(tmp_path):
    folder = tmp_path / "run"
    _run(folder, [0.2, 0.4, 0.6], nan_from=3, protocols=("greedy",))
    (folder / "eval-greedy-step2.jsonl").write_text(json.dumps({"accuracy": 0.25}) + "\n")
    record = arms_results.run_record(folder, {"arm": "bf16_lora", "seed": 4, "sharing": "mps"}, ("greedy",))
    arms_results.write_record(tmp_path / "r" / "bf16_lora-seed4.json", record)
    text = (tmp_path / "r" / "bf16_lora-seed4.json").read_text()
    assert "#### 3" not in text and "/tmp/x" not in text and "NaN" not in text  # no samples, no paths; NaN -> null
    (loaded,) = arms_results.load_records(tmp_path / "r")
    assert loaded["evals"]["greedy"] == {"protocol": "greedy", "examples": 100, "accuracy": 0.01,
                                         "accuracy_ci95": [0.0, 0.02], "accuracy_flexible": 0.02,
                                         "accuracy_flexible_ci95": [0.0, 0.03]}  # fmt: skip
    assert loaded["checkpoint_greedy_accuracy"] == {"2": 0.25} and loaded["name"] == "run"
    rows = arms_results.curve_rows(loaded)
    assert [r["reward"] for r in rows] == [0.2, 0.4, 0.0] and rows[2]["grad_norm"] is None
    kept = {"step", "loss", "reward", "step_time", "grad_norm", "entropy", "completions/clipped_ratio"}
    assert rows[2]["entropy"] == 0.7 and set(rows[0]) == kept
    assert len(text) < 4000  # a few KB a run: committed as data
    with pytest.raises(FileNotFoundError, match="eval-reference.jsonl"):
        arms_results.run_record(folder, {"arm": "bf16_lora"}, ("greedy", "reference"))


def test_the_results_loader_names_the_bad_file(tmp_path):
    (tmp_path / "a.json").write_text("{")
    with pytest.raises(SystemExit, match=r"a.json: not JSON"):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "arm": "bf16_lora", "evals": {}}))
    with pytest.raises(SystemExit, match="a.json: a trained run's record without its training curve"):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "evals": {}}))
    with pytest.raises(SystemExit, match="a.json: not a run record .no arm."):
        arms_results.load_records(tmp_path)
    (tmp_path / "a.json").write_text(json.dumps({"name": "a", "arm": None, "evals": {}, "sharing": "gpu"}))
    with pytest.raises(SystemExit, match="a.json: sharing 'gpu'"):
        arms_results.load_records(tmp_path)
    assert arms_results.load_records(tmp_path / "none") == []
