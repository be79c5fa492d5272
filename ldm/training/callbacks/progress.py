"""The training progress bar: optimizer steps out of `max_steps` when the run is bounded by steps, with the
loss and images/s beside tqdm's rate and time left. Where the output is not a terminal (a log file, a pipe,
`ldm-ui`), a plain line at each tenth of the run instead."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

from ldm.training.callbacks.plan import duration

log = logging.getLogger("ldm")


class StepProgressBar(TQDMProgressBar):
    """Lightning's bar, counting optimizer steps to `trainer.max_steps` across epochs (the epoch shown as a
    plain count) when `max_steps` bounds the run; by batches of the epoch, as Lightning does, otherwise.

    `lines`: log `step N/M (P %): loss L, I images/s, T in, T left` at each tenth of a run bounded by steps (at
    each epoch's end otherwise) instead of drawing the bar; by default, when stdout is not a terminal."""

    def __init__(self, lines: bool | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lines = lines
        self._clock: tuple[float, int] = (0.0, 0)  # when and at which step this launch started
        self._logged_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.lines is None:
            self.lines = not sys.stdout.isatty()
        if self.lines:
            self.disable()
        self._clock = (time.perf_counter(), trainer.global_step)
        super().on_train_start(trainer, pl_module)

    def _log_line(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        step, (started, first) = trainer.global_step, self._clock
        elapsed = time.perf_counter() - started
        where = f"step {step:,}"
        if self._by_steps(trainer):
            where += f"/{trainer.max_steps:,} ({100 * step / trainer.max_steps:.0f} %)"
        metrics = self.get_metrics(trainer, pl_module)
        said = [f"{value} images/s" if key == "img/s" else f"{key} {_number(value)}" for key, value in metrics.items()]
        said.append(f"{duration(elapsed)} in")
        if self._by_steps(trainer) and step > first:
            said.append(f"{duration(elapsed / (step - first) * (trainer.max_steps - step))} left")
        log.info("%s: %s", where, ", ".join(said))

    @staticmethod
    def _by_steps(trainer: pl.Trainer) -> bool:
        return trainer.max_steps > 0

    def init_train_tqdm(self) -> Tqdm:
        """One bar for the whole run, drawn first at its real total and step (a resumed run starts at its step)."""
        trainer = self.trainer
        if not self._by_steps(trainer):
            return super().init_train_tqdm()
        return Tqdm(  # Lightning's bar, given its total and start at once (each change would draw it again)
            desc=f"epoch {trainer.current_epoch}: ",
            total=trainer.max_steps,
            initial=trainer.global_step,
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.lines:
            return None
        if not self._by_steps(trainer):
            return super().on_train_epoch_start(trainer, *args)
        if self.train_progress_bar.desc != f"epoch {trainer.current_epoch}: ":
            self.train_progress_bar.set_description(f"epoch {trainer.current_epoch}")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self.lines:
            tenth, step = max(1, trainer.max_steps // 10), trainer.global_step
            due = step % tenth == 0 or step == trainer.max_steps
            if self._by_steps(trainer) and step != self._logged_step and due and trainer.is_global_zero:
                self._logged_step = step
                self._log_line(trainer, pl_module)
            return
        if not self._by_steps(trainer):
            return super().on_train_batch_end(trainer, pl_module, *args)
        bar, step = self.train_progress_bar, trainer.global_step
        if self.is_enabled and step != bar.n and (step % self.refresh_rate == 0 or step == trainer.max_steps):
            bar.n = step
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # also redraws

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The progress-bar metrics without their `train/` prefix, and images/s once `Throughput` logs it;
        without Lightning's `v_num` (the log folder's name says which launch)."""
        metrics = {k.removeprefix("train/"): v for k, v in super().get_metrics(trainer, pl_module).items()}
        metrics.pop("v_num", None)
        images_per_s = trainer.callback_metrics.get("perf/images_per_s")
        if images_per_s is not None:
            metrics["img/s"] = f"{float(images_per_s):.3g}"
        return metrics

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.lines:
            if not self._by_steps(trainer) and trainer.is_global_zero:
                self._log_line(trainer, pl_module)
            return
        if not self._by_steps(trainer):
            return super().on_train_epoch_end(trainer, pl_module)
        if not self.train_progress_bar.disable:
            self.train_progress_bar.set_postfix(self.get_metrics(trainer, pl_module))


def _number(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
