"""Learning-rate schedules (linear, cosine, constant, constant_with_warmup) as multipliers of the base lr.

Each is a pure function of the optimizer step, so a resumed run lands on exactly the same lr.
"""

from __future__ import annotations

import math

from torch.optim.lr_scheduler import LambdaLR


def lr_multiplier(kind: str, step: int, warmup: int, total: int) -> float:
    """The factor applied to the base lr before optimizer step ``step`` (0-based)."""
    if kind == "constant":
        return 1.0
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant_with_warmup":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    if kind == "cosine":
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))
    raise ValueError(f"unknown lr_scheduler_type {kind!r}")


def resolve_warmup(warmup_steps: float, warmup_ratio: float | None, total_steps: int) -> int:
    """Warmup in steps: an int is taken as is; a float in (0, 1) or warmup_ratio is a share of the run."""
    if warmup_ratio:
        return math.ceil(warmup_ratio * total_steps)
    if 0 < warmup_steps < 1:
        return math.ceil(warmup_steps * total_steps)
    return int(warmup_steps)


class _Multiplier:
    # A picklable callable (LambdaLR stores lambdas in its state only when they are objects).
    def __init__(self, kind: str, warmup: int, total: int):
        self.kind, self.warmup, self.total = kind, warmup, total

    def __call__(self, step: int) -> float:
        return lr_multiplier(self.kind, step, self.warmup, self.total)


def build_scheduler(optimizer, kind: str, warmup: int, total: int) -> LambdaLR:
    return LambdaLR(optimizer, _Multiplier(kind, warmup, total))
