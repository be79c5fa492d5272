"""Exponential moving average of the trained weights, saved in every checkpoint."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch


class EMA(pl.Callback):
    """Keep an EMA of the trainable parameters (Polyak averaging), with decay warm-up.

    The effective decay at update n is min(decay, (1 + n) / (10 + n)), so early averages are
    not dominated by the initial weights. Checkpoints hold the averages as `ema_state_dict`,
    keyed like the model's `state_dict`; `scripts/export_diffusers.py --ema` exports them.
    """

    def __init__(self, decay: float = 0.9999, every_n_steps: int = 1, start_step: int = 0) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: got {decay}; must be in (0, 1)")
        self.decay, self.every_n_steps, self.start_step = decay, every_n_steps, start_step
        self.shadow: dict[str, torch.Tensor] = {}
        self.updates = 0
        self._last_step = -1

    def _trainable(self, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return {n: p for n, p in pl_module.named_parameters() if p.requires_grad}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = self._trainable(pl_module)
        if not self.shadow:
            self.shadow = {n: p.detach().float().clone() for n, p in params.items()}
        else:
            self.shadow = {n: t.to(params[n].device) for n, t in self.shadow.items()}

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # counts optimizer steps: unchanged while gradients accumulate
        if step == self._last_step or step < self.start_step or step % self.every_n_steps:
            return
        self._last_step = step
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
        params = self._trainable(pl_module)
        same = [n for n in self.shadow if self.shadow[n].dtype == params[n].dtype]
        if same:
            torch._foreach_lerp_([self.shadow[n] for n in same], [params[n].detach() for n in same], 1 - decay)
        for n in self.shadow.keys() - set(same):  # bf16 weights: one fp32 copy at a time, not all at once
            self.shadow[n].lerp_(params[n].detach().float(), 1 - decay)
        self.updates += 1

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["ema_state_dict"] = {n: t.detach().cpu().clone() for n, t in self.shadow.items()}
        checkpoint["ema_updates"] = self.updates

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.shadow = dict(checkpoint.get("ema_state_dict") or {})
        self.updates = int(checkpoint.get("ema_updates", 0))
