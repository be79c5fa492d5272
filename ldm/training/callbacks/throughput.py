"""Measure training speed: optimizer steps/s and images/s, logged and summarised at the end."""

from __future__ import annotations

import logging
import time

import lightning.pytorch as pl

log = logging.getLogger("ldm")


class Throughput(pl.Callback):
    """Log `perf/steps_per_s` and `perf/images_per_s`; the first `warmup_steps` are not counted."""

    def __init__(self, warmup_steps: int = 1) -> None:
        self.warmup_steps = warmup_steps
        self._start: float | None = None
        self._start_step = 0
        self._images = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._start is None:
            if step >= self._start_step + self.warmup_steps or step >= trainer.max_steps > 0:
                self._start, self._start_step, self._images = time.perf_counter(), step, 0
            return
        self._images += len(batch["caption"]) * trainer.world_size
        elapsed = time.perf_counter() - self._start
        if elapsed > 0 and step > self._start_step:
            pl_module.log_dict({"perf/steps_per_s": (step - self._start_step) / elapsed,
                                "perf/images_per_s": self._images / elapsed}, batch_size=1)  # fmt: skip

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start, self._start_step = None, trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._start is None or trainer.global_step <= self._start_step:
            return
        elapsed = time.perf_counter() - self._start
        steps = trainer.global_step - self._start_step
        log.info("throughput: %d steps in %.1f s after warm-up: %.2f steps/s, %.1f images/s",
                 steps, elapsed, steps / elapsed, self._images / elapsed)  # fmt: skip
