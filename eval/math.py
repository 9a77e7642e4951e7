"""Moved to eval/competition_math.py (a module named math hid the standard one): python -m eval.competition_math."""

raise SystemExit("eval.math moved: python -m eval.competition_math (same flags)")
