"""Stand-ins the tests share."""


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of digits in each completion: it varies across a random model's samples, so advantages are non-zero
    and every GRPO step updates (the real rewards would be 0 on a random model)."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / max(len(c[0]["content"]), 1) for c in completions]
