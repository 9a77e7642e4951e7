"""experiments.multi_gpu_suite's command-line namespace, as tests/tools/experiments/test_multi_gpu_runner.py,
test_multi_gpu_suite.py and test_multi_gpu_summary.py give it."""

import argparse


def _args(tmp_path, **kw):
    return argparse.Namespace(**{"out": str(tmp_path), "retry_failed": False, "gpus": 4, "bundle": None, **kw})
