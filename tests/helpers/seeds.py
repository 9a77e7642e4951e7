"""One fresh random torch seed per test, printed so that pytest shows it on failure; QERL_TEST_SEED=N replays it."""

import os

import torch


def seed_torch() -> int:
    value = int(os.environ.get("QERL_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    print(f"torch seed {value} (replay: QERL_TEST_SEED={value})")
    torch.manual_seed(value)
    return value
