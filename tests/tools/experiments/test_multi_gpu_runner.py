"""experiments.multi_gpu_runner without launching anything: where jobs go, the wall time it plans for, a job done
earlier skipped on a second start."""

import json
import threading

from multi_gpu_args import _args

from experiments import multi_gpu_runner as runner


def test_jobs_take_aligned_free_gpus():
    assert runner.pick([0, 1, 2, 3], 2) == [0, 1] and runner.pick([0, 2, 3], 2) == [2, 3]
    assert runner.pick([0, 3], 2) == [0, 3] and runner.pick([0, 1, 2, 3], 4) == [0, 1, 2, 3]
    assert runner.pick([3], 1) == [3]


def test_phase_places_jobs_in_order_and_skips_done_ones(tmp_path):
    ran = []
    pair_started = threading.Event()  # "one" holds GPU 0 until "pair" is placed, however fast the machine

    def job(name, gpus, share=0):
        def work(ids, name=name):
            ran.append((name, ids))
            if name == "pair":
                pair_started.set()
            if name == "one":
                assert pair_started.wait(timeout=30)
            return {"ok": 1}

        return runner.Job(name, gpus, work, 1.0, share)

    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "done.json").write_text(json.dumps({"ok": 1}))
    jobs = [job("done", 1), job("one", 1), job("pair", 2), job("beside", 0, share=3), job("all", 4)]
    runner.run_phase(_args(tmp_path), "x", jobs, 4)
    placed = dict(ran)
    assert "done" not in placed and placed["one"] == [0] and placed["pair"] == [2, 3] and placed["beside"] == [3]
    assert placed["all"] == [0, 1, 2, 3]
    assert all((tmp_path / "results" / f"{n}.json").is_file() for n in placed)
    # Placement in list order: 1 GPU, then a pair beside it, then all four once both are done (+ a shared job).
    assert runner.estimate([("x", jobs)], 4) == 2.0
