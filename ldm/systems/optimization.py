"""How a system's trained weights are optimized: the optimizer and its LR schedule (`LatentDiffusion`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Optimization:
    """How the trained weights are optimized: the optimizer (a `{target, params}` node) and its LR schedule."""

    learning_rate: float = 1e-4
    optimizer: dict = field(default_factory=lambda: {"target": "torch.optim.AdamW", "params": {"weight_decay": 1e-2}})
    lr_schedule: str = "constant"  # constant | linear | cosine, after lr_warmup_steps
    lr_warmup_steps: int = 0
    lr_lambda: Callable[[int], float] | None = None  # a factor of the LR per step, instead of lr_schedule
    expert_lr_multiplier: float = 1.0  # the LR of mixture-of-experts parameters (modules with lr_group "experts")
    lr_min: float = 0.0  # where a linear or cosine schedule ends (MicroDiT's 256 px stage: 8e-5 of 2.4e-4)


@dataclass
class WarmupDecay:
    """The LR factor at a step: linear warm-up from 0 over `warmup` steps, then a `shape` (linear | cosine)
    decay from 1 to `floor` at step `total` (diffusers' schedules, which end at 0, when `floor` is 0)."""

    warmup: int
    total: int
    floor: float
    shape: str

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return step / max(1, self.warmup)
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        fall = 0.5 * (1 + math.cos(math.pi * progress)) if self.shape == "cosine" else 1 - progress
        return self.floor + (1 - self.floor) * fall
