"""The job runner of experiments.multi_gpu_suite: a phase's jobs started in list order, each on the first free GPUs
it needs (an aligned block where one is free) or beside them without holding any; each job's result (or its error)
written to OUT/results/<job>.json, and a job whose earlier result still stands skipped; the wall time that placement
takes from each job's guess.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import launch


@dataclass
class Job:
    name: str
    gpus: int  # GPUs it holds; 0: runs beside the others on `share` without holding it
    work: Callable[[list[int]], dict]  # (gpu ids) -> result
    guess: float  # seconds
    share: int = 0
    result: dict | None = field(default=None, repr=False)
    # Whether an earlier result still stands: a built model must also still be on disk (a fresh machine has none).
    holds: Callable[[dict], bool] = lambda result: True


say = functools.partial(launch.say, "suite")


def result_path(args, job: Job) -> Path:
    return Path(args.out) / "results" / f"{job.name}.json"


def run_phase(args, phase: str, jobs: list[Job], total_gpus: int) -> None:
    """The jobs, in order, each on the first free GPUs it needs (held ones) or beside them (share)."""
    todo = []
    for job in jobs:
        path = result_path(args, job)
        if path.is_file():
            job.result = json.loads(path.read_text())
            if "error" in job.result and not args.retry_failed or "error" not in job.result and job.holds(job.result):
                continue
        todo.append(job)
    if not todo:
        return
    say(f"phase {phase}: {', '.join(j.name for j in todo)}")
    free = list(range(total_gpus))
    cond = threading.Condition()
    threads = []

    def run(job: Job, gpu_ids: list[int]) -> None:
        start = time.perf_counter()
        say(f"{job.name}: started on GPU(s) {','.join(map(str, gpu_ids))}")
        try:
            result = job.work(gpu_ids)
        except Exception as err:  # a failed job is recorded; the others go on
            result = {"error": f"{type(err).__name__}: {err}"[-600:]}
        result = {**result, "job": job.name, "gpu_ids": gpu_ids, "job_wall_s": time.perf_counter() - start}
        path = result_path(args, job)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        job.result = result
        say(
            f"{job.name}: {'FAILED: ' + result['error'] if 'error' in result else 'done'} "
            f"({result['job_wall_s']:.0f} s)"
        )
        with cond:
            if job.gpus:
                free.extend(gpu_ids)
                free.sort()
            cond.notify_all()

    for job in todo:
        if job.gpus == 0:
            ids = [job.share]
        else:
            with cond:
                cond.wait_for(lambda job=job: len(free) >= job.gpus)
                ids = pick(free, job.gpus)
                free[:] = [g for g in free if g not in ids]
        thread = threading.Thread(target=run, args=(job, ids))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()


def pick(free: list[int], count: int) -> list[int]:
    """`count` of the free GPUs: an aligned block (0-1, 2-3; 0-3) where one is free, as the machine pairs its GPUs,
    else the lowest numbered."""
    for start in range(0, max(free) + 1, count):
        block = list(range(start, start + count))
        if all(g in free for g in block):
            return block
    return free[:count]


def estimate(phases: list[tuple[str, list[Job]]], total_gpus: int) -> float:
    """Wall seconds of the phases under the same in-order placement, from each job's guess."""
    total = 0.0
    for _, jobs in phases:
        free_at = [0.0] * total_gpus  # when each GPU is free again
        now, finish = 0.0, 0.0
        for job in jobs:
            if job.gpus == 0:
                finish = max(finish, now + job.guess)
                continue
            order = sorted(range(total_gpus), key=lambda g: free_at[g])
            picked = order[: job.gpus]
            now = max(now, max(free_at[g] for g in picked))  # in order: no job starts before the one listed above it
            for g in picked:
                free_at[g] = now + job.guess
            finish = max(finish, now + job.guess)
        total += finish
    return total
