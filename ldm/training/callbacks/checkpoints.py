"""Resumable checkpoints that survive crashes, full disks and pre-emption.

Every `every_n_train_steps` steps, when training ends, and when the run is asked to stop (SIGTERM,
SIGINT, SIGUSR1, or anything that sets `trainer.should_stop`), the run writes

    checkpoints/step-000500.ckpt          a file, or a folder under ColossalAIStrategy
    checkpoints/step-000500.ckpt.sha256   its checksum (`sha256sum -c` reads it)
    checkpoints/last.ckpt -> step-000500.ckpt

at a batch end, so a resume continues mid-epoch exactly; the newest `keep` are kept. A save is
published only once complete (`ldm.utils.atomic.publish`). The global random state is
saved too and restored right before the first resumed step, so the resumed losses are the ones
an unbroken run computes.

A stop signal only sets a flag; at the next batch end every rank agrees to stop (one all-reduce),
saves together and leaves the fit loop, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import random
import re
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Checkpoint

from ldm.config import ConfigError
from ldm.training.checkpoint_io import CheckpointError, StreamingCheckpointIO
from ldm.utils.atomic import CHECKSUM_SUFFIX, PARTIAL_SUFFIX, publish, remove_path

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
LAST = "last.ckpt"
STEP_FILE = re.compile(r"step-(\d+)\.ckpt$")


def step_path(folder: Path, step: int) -> Path:
    return folder / f"step-{step:06d}.ckpt"


def saved_steps(folder: Path) -> list[tuple[int, Path]]:
    """The step checkpoints in `folder`, newest first."""
    found = [(int(m[1]), p) for p in folder.glob("step-*.ckpt") if (m := STEP_FILE.match(p.name))]
    return sorted(found, reverse=True)


class Checkpoints(Checkpoint):
    """Save `step-N.ckpt` every `every_n_train_steps` steps and when training stops; keep the newest `keep`."""

    def __init__(self, dirpath: str | Path, every_n_train_steps: int = 500, keep: int = 2) -> None:
        if every_n_train_steps < 1:
            raise ConfigError(
                f"lightning.modelcheckpoint.params.every_n_train_steps: got {every_n_train_steps}; must be at least 1"
            )
        if keep < 1:
            raise ConfigError(f"lightning.modelcheckpoint.params.keep: got {keep}; must be at least 1")
        self.dirpath, self.every_n_train_steps, self.keep = Path(dirpath), every_n_train_steps, keep
        self.signal: int | None = None  # the stop signal received, if any
        self.stopped_by: str | None = None  # why the run stopped early, once it has
        self.last_saved: Path | None = None
        self._saved_step = -1
        self._step_seen = -1
        self._pending_rng: dict | None = None
        self._original_handlers: dict[int, Any] = {}

    # -- stop signals -------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.signal, self._original_handlers = None, {}
        if stage == "fit" and threading.current_thread() is threading.main_thread():
            self._original_handlers = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take over the stop signals from Lightning (registered just before this hook), whose SIGTERM
        handler runs a collective inside the handler and exits without saving."""
        self._step_seen = trainer.global_step  # 0, or the step a resumed run continues from
        for signum in self._original_handlers:
            signal.signal(signum, self._on_signal)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for signum, handler in self._original_handlers.items():
            signal.signal(signum, handler)
        self._original_handlers = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:  # a second Ctrl-C: stop now, without saving
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        self.signal = signum
        os.write(2, f"\n{signal.Signals(signum).name}: saving a checkpoint at the next step, then stopping\n".encode())

    # -- when to save -------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._pending_rng is not None:  # after the data loaders drew their seeds, as in an unbroken run
            set_rng_states(self._pending_rng)
            self._pending_rng = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        step = trainer.global_step
        self.signal = self._agreed_signal(trainer)
        stop = trainer.strategy.reduce_boolean_decision(trainer.should_stop or self.signal is not None, all=False)
        stepped, self._step_seen = step != self._step_seen, step
        if not stepped:  # mid-way through gradient accumulation: save and stop at the optimizer step
            return
        due = step % self.every_n_train_steps == 0 or 0 < trainer.max_steps <= step
        if (due or stop) and step != self._saved_step:
            if self._weights_finite(trainer, pl_module):
                self.save(trainer)
            else:  # an earlier update already broke them: keep the last checkpoint as the last finite state
                log.error(
                    "step %d: the weights are not finite; not saving them (the last finite checkpoint is %s)",
                    step,
                    self.last_saved or (self.dirpath / LAST).resolve(),
                )
                stop, self._saved_step = True, step  # nor at train end
        if stop:
            trainer.should_stop = True
            if self.signal is not None:
                self.stopped_by = signal.Signals(self.signal).name
            else:  # the model's guard names its reason; any other callback is a plain early stop
                self.stopped_by = getattr(pl_module, "stop_reason", None) or "trainer.should_stop"
            log.info("stopping at step %d (%s); checkpoint %s", step, self.stopped_by, self.last_saved)

    def _agreed_signal(self, trainer: pl.Trainer) -> int | None:
        """The stop signal any rank got (one all-reduce), so that every rank stops and reports the same."""
        if trainer.world_size == 1:
            return self.signal
        mine = torch.tensor(self.signal or 0, device=trainer.strategy.root_device)
        agreed = int(trainer.strategy.reduce(mine, reduce_op="max"))
        return agreed or None

    @staticmethod
    def _weights_finite(trainer: pl.Trainer, pl_module: pl.LightningModule) -> bool:
        if getattr(pl_module, "stop_reason", None) is None:  # checked only when the loss guard stops the run
            return True
        finite = all(bool(torch.isfinite(p).all()) for p in pl_module.parameters() if p.requires_grad)
        return trainer.strategy.reduce_boolean_decision(finite, all=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step != self._saved_step:  # training ended with an epoch, not at a step count
            self.save(trainer)

    # -- saving -------------------------------------------------------------------------------------

    def save(self, trainer: pl.Trainer) -> Path:
        """Write `step-N.ckpt` for the current step on every rank, publish it, point `last.ckpt` at it."""
        step = trainer.global_step
        final = step_path(self.dirpath, step)
        partial = final.with_name(final.name + PARTIAL_SUFFIX)
        if trainer.is_global_zero:  # make room first: at most max(keep, 2) checkpoints are ever on disk
            self._prune(step, max(self.keep - 1, 1), leftovers=False)
        io = trainer.strategy.checkpoint_io
        streaming = isinstance(io, StreamingCheckpointIO)
        if streaming:
            io.collect_failures, io.failure = True, None
        try:
            trainer.save_checkpoint(partial, weights_only=False)  # the whole state: optimizer, loops, callbacks
        except (OSError, RuntimeError) as err:
            self._fail(trainer, partial, err)
        finally:
            if streaming:
                io.collect_failures = False
        failed = trainer.strategy.reduce_boolean_decision(streaming and io.failure is not None, all=False)
        if failed:
            self._fail(trainer, partial, io.failure if streaming else None)
        if trainer.is_global_zero:
            try:
                publish(partial, final)
                self._point_last_at(final)
            except OSError as err:
                self._fail(trainer, partial, err)
            self._prune(step)
        trainer.strategy.barrier("ldm_checkpoint_published")
        self._saved_step, self.last_saved = step, final
        log.info("saved %s", final)
        return final

    def _fail(self, trainer: pl.Trainer, partial: Path, err: BaseException | None) -> None:
        if trainer.is_global_zero:
            remove_path(partial)
        free = shutil.disk_usage(self.dirpath).free / 2**30 if self.dirpath.exists() else float("nan")
        good = self.dirpath / LAST
        kept = (
            f"the last good checkpoint, {good.resolve().name}, is intact" if good.exists() else "no earlier checkpoint"
        )
        reason = " ".join(str(err).split()) if err is not None else "it failed on another rank"
        raise CheckpointError(
            f"could not write the step {trainer.global_step} checkpoint in {self.dirpath} ({free:.1f} GiB free there): "
            f"{reason}. Training stopped; {kept}. Free space (or lower lightning.modelcheckpoint.params.keep), "
            "then continue with -r auto"
        ) from err

    def _point_last_at(self, final: Path) -> None:
        last = self.dirpath / LAST
        link = last.with_name(last.name + ".link")
        remove_path(link)
        os.symlink(final.name, link)
        if last.is_dir() and not last.is_symlink():  # a folder written before step checkpoints existed
            remove_path(last)
        os.replace(link, last)

    def _prune(self, step: int, keep: int | None = None, leftovers: bool = True) -> None:
        """Keep the newest `keep` checkpoints up to `step`; later ones belong to a run that was resumed
        from before them. `leftovers`: also remove what interrupted saves left."""
        kept, keep = 0, self.keep if keep is None else keep
        for saved, path in saved_steps(self.dirpath):
            if saved <= step and kept < keep:
                kept += 1
                continue
            remove_path(path)
            remove_path(path.with_name(path.name + CHECKSUM_SUFFIX))
        for leftover in self.dirpath.glob(f"*{PARTIAL_SUFFIX}") if leftovers else ():
            remove_path(leftover)

    # -- state --------------------------------------------------------------------------------------

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        checkpoint["rng_states"] = rng_states()

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        """Take the random states to restore; a resume under another `-s` than the run's (which the system records)
        goes on and says so in one line: the seed keys every sample's noise and timestep."""
        self._pending_rng = checkpoint.get("rng_states")
        saved, seed = checkpoint.get("ldm", {}).get("seed"), getattr(pl_module, "seed", None)
        if saved is not None and saved != seed and trainer.is_global_zero:
            log.warning("resume is not exact: -s %s -> %s (the seed keys each sample's noise and timestep); going on "
                        "with -s %s", saved, seed, seed)  # fmt: skip


def rng_states() -> dict:
    """The global random states (torch, CUDA, NumPy, Python) as tensors and plain types, so the
    checkpoint still loads with `weights_only=True`."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    states = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    kind, keys, pos, has_gauss, gauss = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = states["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
