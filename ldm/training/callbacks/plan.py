"""What a run says about itself: its plan in one block when training starts, and a summary when it ends.

The plan names each part with its parameters and how many train, the data (examples, batch, processes,
steps per epoch), the length of the run and its checkpoints, and where it runs (device, strategy,
precision). It replaces Lightning's model-summary table (`lightning.trainer.enable_model_summary: true`
brings that back).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import lightning.pytorch as pl
import torch

log = logging.getLogger("ldm")


def count(n: float) -> str:
    """A parameter or example count in three digits: 953 K, 1.08 M, 2.57 B."""
    for size, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """`41 s`, `4 min 41 s`, `2 h 05 min`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


@dataclass
class Plan:
    """What a run will do; `lines()` is the block it prints."""

    parts: list[tuple[str, str, int, int]]  # (name, class, parameters, trained parameters)
    examples: int | None  # None: a stream that does not say
    batch_size: int | None  # per process
    processes: int
    accumulate: int
    steps_per_epoch: int | None
    max_steps: int  # -1: bounded by epochs
    max_epochs: int | None
    start_step: int
    checkpoint_every: int | None
    where: str  # device, strategy and precision
    notes: list[tuple[str, str]] = field(default_factory=list)  # (label, text): more lines of the block

    def lines(self) -> list[str]:
        parts = []
        for name, cls, total, trained in self.parts:
            if trained == total:
                parts.append(f"{name} ({cls}) {count(total)} trained")
            elif trained:
                parts.append(f"{name} ({cls}) {count(trained)} of {count(total)} trained")
            else:
                parts.append(f"{name} ({cls}) {count(total)} frozen")
        data = f"{self.examples:,} examples" if self.examples is not None else "a stream of examples"
        if self.batch_size is not None:
            per_step = self.batch_size * self.processes * self.accumulate
            data += f", batches of {self.batch_size} x {self.processes} process{'es' if self.processes > 1 else ''}"
            data += f" x {self.accumulate} accumulated = {per_step} per step" if self.accumulate > 1 else ""
        if self.steps_per_epoch:
            data += f", {self.steps_per_epoch:,} steps per epoch"
        if self.max_steps > 0:
            length = f"{self.max_steps:,} steps"
            if self.steps_per_epoch:
                epochs = math.ceil(self.max_steps / self.steps_per_epoch)
                length += f" (~{epochs} epochs)" if epochs > 1 else " (within one epoch)"
        else:
            length = f"{self.max_epochs} epochs" if self.max_epochs is not None else "until stopped"
        length += f", from step {self.start_step:,}" if self.start_step else ""
        if self.checkpoint_every:
            length += f"; a checkpoint every {self.checkpoint_every:,} steps and at the end"
        return [
            "plan:",
            f"  model  {'; '.join(parts)}",
            f"  data   {data}",
            f"  run    {length}",
            f"  on     {self.where}",
            *(f"  {label:<6} {text}" for label, text in self.notes),
        ]


def model_parts(model: torch.nn.Module) -> list[tuple[str, str, int, int]]:
    """Each child module that holds weights: its name, class, parameters and trained parameters."""
    parts = []
    for name, child in model.named_children():
        params = list(child.parameters())
        if params:
            total = sum(p.numel() for p in params)
            trained = sum(p.numel() for p in params if p.requires_grad)
            parts.append((name, type(child).__name__, total, trained))
    return parts


def where(trainer: pl.Trainer) -> str:
    """`cuda:0 (NVIDIA H100, 79.1 GiB, 78.6 free), SingleDeviceStrategy, precision bf16-mixed`."""
    device = trainer.strategy.root_device
    text = str(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        text += f" ({torch.cuda.get_device_name(device)}, {total / 2**30:.1f} GiB, {free / 2**30:.1f} free)"
    return f"{text}, {type(trainer.strategy).__name__}, precision {trainer.precision}"


def examples_of(trainer: pl.Trainer) -> int | None:
    """The dataset's length, where it has one: the data module's `dataset`, else the train loader's."""
    for owner in (trainer.datamodule, getattr(trainer, "train_dataloader", None)):
        dataset = getattr(owner, "dataset", None)
        try:
            return len(dataset) if dataset is not None else None
        except TypeError:
            continue
    return None


class RunPlan(pl.Callback):
    """Log the plan when training starts (global rank 0)."""

    def __init__(self, checkpoint_every: int | None = None) -> None:
        self.checkpoint_every = checkpoint_every
        self.started: float | None = None
        self.start_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started, self.start_step = time.perf_counter(), trainer.global_step
        if not trainer.is_global_zero:
            return
        batches = trainer.num_training_batches
        steps_per_epoch = batches // trainer.accumulate_grad_batches if math.isfinite(batches) else None
        batch_size = getattr(trainer.datamodule, "batch_size", None)
        plan = plan_of(trainer, pl_module, examples_of(trainer), batch_size, steps_per_epoch, self.checkpoint_every)
        for line in plan.lines():
            log.info(line)


def plan_of(
    trainer: pl.Trainer,
    model: torch.nn.Module,
    examples: int | None,
    batch_size: int | None,
    steps_per_epoch: int | None,
    checkpoint_every: int | None,
) -> Plan:
    """The plan of `model` trained by `trainer` (fitting or not yet) on `examples` in batches of `batch_size`
    per process, `steps_per_epoch` optimizer steps an epoch."""
    return Plan(
        parts=model_parts(model),
        examples=examples,
        batch_size=batch_size,
        processes=trainer.world_size,
        accumulate=trainer.accumulate_grad_batches,
        steps_per_epoch=steps_per_epoch,
        max_steps=trainer.max_steps,
        max_epochs=trainer.max_epochs,
        start_step=trainer.global_step,
        checkpoint_every=checkpoint_every,
        where=where(trainer),
    )


def summary(trainer: pl.Trainer, plan: RunPlan | None, last_saved: Path | None, stopped: bool) -> list[str]:
    """The lines a run ends with: steps and time, the last loss, peak GPU memory, the checkpoint. (Skipped files
    are summed up just before, by the folder data module's `teardown`.)"""
    steps = trainer.global_step - (plan.start_step if plan else 0)
    done = f"{'stopped' if stopped else 'done'}: step {trainer.global_step:,}"
    done += f" of {trainer.max_steps:,}" if trainer.max_steps > 0 else ""
    if plan is not None and plan.started is not None:
        done += f", {steps:,} steps in {duration(time.perf_counter() - plan.started)}"
    loss = trainer.callback_metrics.get("train/loss")
    done += f"; last loss {float(loss):.4g}" if loss is not None else ""
    if trainer.strategy.root_device.type == "cuda":
        done += f"; peak GPU memory {torch.cuda.max_memory_allocated(trainer.strategy.root_device) / 2**30:.2f} GiB"
    lines = [done]
    if last_saved is not None:
        lines.append(f"checkpoint: {last_saved}")
    return lines
