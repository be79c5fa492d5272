"""Exponential moving average of the trained weights, saved in every checkpoint."""

from __future__ import annotations

from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist

try:
    from torch.distributed.tensor import DTensor, distribute_tensor
except ImportError:  # torch < 2.5 (the Colossal-AI stack's is 2.5.1)
    from torch.distributed._tensor import DTensor, distribute_tensor


class EMA(pl.Callback):
    """Keep an EMA of the trainable parameters (Polyak averaging), from `start_step`, with decay warm-up.

    Nothing is kept before `start_step` (MosaicML's SD2 recipe averages only its last 50 k of 850 k steps): the
    average starts there as a copy of the weights. The effective decay at update n is
    min(decay, (1 + n) / (10 + n)), so early averages are not dominated by where they started. `device: cpu`
    keeps the average in host memory instead of beside the weights (each update copies them there).

    Each process averages only its share: under FSDP its local shards of every parameter; under DDP and
    Colossal-AI ZeRO, where every process holds every weight, 1/N of the parameters (the largest first, each
    to the least loaded process). An update costs 1/N and needs no communication; a checkpoint gathers the
    whole average once. Checkpoints hold it as `ema_state_dict` (fp32), keyed like the model's `state_dict`;
    `scripts/export_diffusers.py --ema` exports it."""

    def __init__(
        self, decay: float = 0.9999, every_n_steps: int = 1, start_step: int = 0, device: Literal["cpu"] | None = None
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay: got {decay}; must be in (0, 1)")
        if every_n_steps < 1 or start_step < 0:
            raise ValueError(f"every_n_steps, start_step: got {every_n_steps}, {start_step}; must be >= 1 and >= 0")
        if device not in (None, "cpu"):
            raise ValueError(f"device: got {device!r}; valid: cpu (host memory), or leave it out (the weights')")
        self.decay, self.every_n_steps, self.start_step, self.device = decay, every_n_steps, start_step, device
        self.shadow: dict[str, torch.Tensor] = {}  # this process's share, fp32
        self.updates = 0
        self._loaded: dict[str, torch.Tensor] = {}  # a checkpoint's whole average, until split into shares
        self._owner: dict[str, int] = {}  # parameter -> the process that averages it (unsharded parameters)
        self._rank, self._last_step = 0, -1

    def _trainable(self, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        return {n: p for n, p in pl_module.named_parameters() if p.requires_grad}

    def _mine(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This process's share of `params`, as local tensors (a DTensor's local shard)."""
        return {
            n: p.to_local() if isinstance(p, DTensor) else p
            for n, p in params.items()
            if isinstance(p, DTensor) or self._owner.get(n, 0) == self._rank
        }

    def _store(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.detach().to("cpu" if self.device == "cpu" else tensor.device, torch.float32, copy=True)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = self._trainable(pl_module)
        self._rank = trainer.global_rank
        whole = {n: p.numel() for n, p in params.items() if not isinstance(p, DTensor)}
        load = [0] * trainer.world_size
        self._owner = {}
        for name in sorted(whole, key=lambda n: -whole[n]):  # largest first, to the least loaded process
            self._owner[name] = load.index(min(load))
            load[self._owner[name]] += whole[name]

    def _take_loaded(self, pl_module: pl.LightningModule) -> None:
        """After a resume, keep this process's share of the checkpoint's average (the first time it is needed:
        strategies restore checkpoints before or after `on_fit_start`)."""
        if not self._loaded:
            return
        self.shadow = {}
        for name, p in self._trainable(pl_module).items():
            full = self._loaded[name].to(p.device, torch.float32)
            if isinstance(p, DTensor):
                local = distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None).to_local()
                self.shadow[name] = self._store(local)
            elif self._owner.get(name, 0) == self._rank:
                self.shadow[name] = self._store(full)
        self._loaded = {}

    @torch.no_grad()
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step  # counts optimizer steps: unchanged while gradients accumulate
        if step == self._last_step or step < self.start_step or step % self.every_n_steps:
            return
        self._last_step = step
        self._take_loaded(pl_module)
        mine = self._mine(self._trainable(pl_module))
        if not self.updates:  # the average starts as the weights
            self.shadow = {n: self._store(p) for n, p in mine.items()}
        else:
            decay = min(self.decay, (1 + self.updates) / (10 + self.updates))
            shadow = self.shadow
            same = [n for n in shadow if shadow[n].device == mine[n].device and mine[n].dtype == torch.float32]
            if same:
                torch._foreach_lerp_([self.shadow[n] for n in same], [mine[n].detach() for n in same], 1 - decay)
            for n in self.shadow.keys() - set(same):  # bf16 or elsewhere: one fp32 copy at a time, not all at once
                self.shadow[n].lerp_(mine[n].detach().to(self.shadow[n].device, torch.float32), 1 - decay)
        self.updates += 1

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["ema_state_dict"] = self._gather(pl_module) if self.updates else {}
        checkpoint["ema_updates"] = self.updates

    def _gather(self, pl_module: pl.LightningModule) -> dict[str, torch.Tensor]:
        """The whole average on the CPU of every process, one parameter at a time (every process calls this)."""
        self._take_loaded(pl_module)
        params, whole = self._trainable(pl_module), {}
        sharded = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        for name, p in params.items():
            if isinstance(p, DTensor):
                local = self.shadow[name].to(p.device)
                full = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                whole[name] = full.full_tensor().cpu()
            elif sharded:
                owner = self._owner[name]
                buffer = (
                    self.shadow[name].to(p.device)
                    if owner == self._rank
                    else torch.empty(p.shape, dtype=torch.float32, device=p.device)
                )
                dist.broadcast(buffer, src=owner)
                whole[name] = buffer.cpu()
            else:
                whole[name] = self.shadow[name].detach().cpu().clone()
        return whole

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self._loaded = dict(checkpoint.get("ema_state_dict") or {})
        self.updates = int(checkpoint.get("ema_updates", 0))
        self.shadow = {}
