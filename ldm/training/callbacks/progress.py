"""The training progress bar: optimizer steps out of `max_steps` when the run is bounded by steps."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, counting optimizer steps to `trainer.max_steps` across epochs (the epoch shown as a
    plain count) when `max_steps` bounds the run; by batches of the epoch, as Lightning does, otherwise."""

    @staticmethod
    def _by_steps(trainer: pl.Trainer) -> bool:
        return trainer.max_steps > 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._by_steps(trainer):  # one bar for the whole run; a resumed run starts at its step
            self.train_progress_bar.reset(total=trainer.max_steps)
            self.train_progress_bar.initial = self.train_progress_bar.n = trainer.global_step

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if not self._by_steps(trainer):
            return super().on_train_epoch_start(trainer, *args)
        self.train_progress_bar.set_description(f"epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if not self._by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, *args)
        bar, step = self.train_progress_bar, trainer.global_step
        if self.is_enabled and step != bar.n and (step % self.refresh_rate == 0 or step == trainer.max_steps):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The logged metrics, without Lightning's `v_num` (the log folder's name says which launch)."""
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)
        return metrics

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self._by_steps(trainer):
            return super().on_train_epoch_end(trainer, pl_module)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))
