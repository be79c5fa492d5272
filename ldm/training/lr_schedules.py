"""Learning-rate schedules given as a factor of the learning rate per step (for `torch.optim.lr_scheduler.LambdaLR`).

`LambdaLinear` is the warm-up-then-linear-decay schedule of CompVis / Stability Stable Diffusion
configs (`ldm.lr_scheduler.LambdaLinearScheduler`), so their `scheduler_config` trains as it did there.
"""

from __future__ import annotations

from collections.abc import Sequence


class LambdaLinear:
    """A factor of the learning rate, per cycle: linear from `f_start` to `f_max` over `warm_up_steps`,
    then linear from `f_max` towards `f_min`, reaching it at the cycle's end (`cycle_lengths` steps).

    Every argument is a list with one value per cycle, as in CompVis configs."""

    def __init__(
        self,
        warm_up_steps: Sequence[int],
        f_min: Sequence[float],
        f_max: Sequence[float],
        f_start: Sequence[float],
        cycle_lengths: Sequence[int],
        verbosity_interval: int = 0,  # CompVis printed the factor every N steps; the LR is logged here
    ) -> None:
        lists = {"warm_up_steps": warm_up_steps, "f_min": f_min, "f_max": f_max, "f_start": f_start}
        cycles = len(cycle_lengths)
        for name, values in lists.items():
            if len(values) != cycles:
                raise ValueError(
                    f"{name}: {len(values)} values for {cycles} cycles (cycle_lengths); give one per cycle"
                )
        if any(length <= 0 for length in cycle_lengths):
            raise ValueError(f"cycle_lengths: got {list(cycle_lengths)}; each cycle must be at least one step")
        self.warm_up_steps, self.cycle_lengths = [int(w) for w in warm_up_steps], [int(c) for c in cycle_lengths]
        self.f_min, self.f_max, self.f_start = ([float(f) for f in values] for values in (f_min, f_max, f_start))

    def __call__(self, step: int) -> float:
        start = 0
        for cycle, length in enumerate(self.cycle_lengths):
            if step <= start + length or cycle == len(self.cycle_lengths) - 1:
                break
            start += length
        n, warm = step - start, self.warm_up_steps[cycle]
        if n < warm:
            return self.f_start[cycle] + (self.f_max[cycle] - self.f_start[cycle]) * n / warm
        length = self.cycle_lengths[cycle]
        return self.f_min[cycle] + (self.f_max[cycle] - self.f_min[cycle]) * (length - n) / length
