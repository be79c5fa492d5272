"""Assemble and run training from a config: the run folder, model, data, callbacks, loggers, Trainer."""

from __future__ import annotations

import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig, OmegaConf

from ldm.callbacks.throughput import Throughput
from ldm.checkpoint import COLOSSAL_FILES
from ldm.config import ConfigError, Sources, check_config, instantiate, load_config, to_plain

log = logging.getLogger("ldm")

# Every rank of one run writes to one folder: the first names it, the ranks it launches read it here.
# With an external launcher (torchrun, SLURM) set it yourself to give all ranks the same folder.
RUN_DIR_ENV = "LDM_RUN_DIR"

# ModelCheckpoint writes `last.ckpt` every N steps, at a batch end, so a resume continues mid-epoch
# exactly; FinalCheckpoint writes it when training stops. Lightning's own `save_last` would also save at
# train end, after the loops have closed an epoch cut short by max_steps; resuming from that state
# skips the rest of the epoch, so it is off.
DEFAULT_CHECKPOINT = {
    "filename": "last",
    "save_top_k": 1,
    "every_n_train_steps": 500,
    "save_last": False,
    "save_on_train_epoch_end": False,
    "enable_version_counter": False,
}


@dataclass
class Resume:
    """Where a resumed run lives and which checkpoint it continues from."""

    run_dir: Path
    ckpt: Path


def find_resume(resume: str, logdir: Path, name: str | None) -> Resume | None:
    """Resolve `-r PATH|auto`: a checkpoint file, a run folder, or the newest run named `name`."""
    if resume == "auto":
        if not name:
            raise ConfigError("-r auto needs -n NAME to know which run to continue")
        runs = sorted(p for p in logdir.glob(f"*_{name}") if (p / "checkpoints" / "last.ckpt").exists())
        if not runs:
            log.info("-r auto: no run named %r with a checkpoint in %s; starting fresh", name, logdir)
            return None
        log.info("-r auto: resuming %s", runs[-1] / "checkpoints" / "last.ckpt")
        return Resume(runs[-1], runs[-1] / "checkpoints" / "last.ckpt")
    path = Path(resume)
    if path.is_file() or (path / COLOSSAL_FILES["trainer"]).is_file():  # a file, or a ColossalAIStrategy folder
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return Resume(run_dir, path)
    if path.is_dir() and (path / "checkpoints" / "last.ckpt").exists():
        return Resume(path, path / "checkpoints" / "last.ckpt")
    raise ConfigError(f"-r {resume}: neither a checkpoint file nor a run folder with checkpoints/last.ckpt")


def prepare_config(bases: list[str], overrides: list[str], resume: Resume | None) -> tuple[DictConfig, Sources]:
    """Load and check the config: `-b` files (or the resumed run's saved config), then overrides."""
    if not bases:
        if resume is None:
            raise ConfigError("no config: pass -b CONFIG.yaml (or -r to continue a run)")
        bases = [str(resume.run_dir / "configs" / "project.yaml")]
    cfg, sources = load_config(bases, overrides)
    check_config(cfg, sources)
    return cfg, sources


class FinalCheckpoint(pl.Callback):
    """Save `last.ckpt` when training ends: at the last step's batch end, so a resume with a
    larger `max_steps` continues mid-epoch exactly; or at the end of the last epoch."""

    def __init__(self, path: Path) -> None:
        self.path, self._saved_step = path, -1

    def on_train_batch_end(self, trainer: pl.Trainer, *args) -> None:
        if 0 < trainer.max_steps <= trainer.global_step and self._saved_step != trainer.global_step:
            trainer.save_checkpoint(self.path)
            self._saved_step = trainer.global_step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._saved_step != trainer.global_step:
            trainer.save_checkpoint(self.path)


def auto_precision() -> str:
    """Mixed precision where the hardware has it: bf16 or fp16 on CUDA, full precision on a CPU."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def build_trainer(cfg: DictConfig, run_dir: Path, uses_our_sampler: bool) -> pl.Trainer:
    """A Trainer with checkpoints, TensorBoard + CSV logs and the configured callbacks."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger

    lightning_cfg = cfg.get("lightning") or OmegaConf.create()
    trainer_kwargs = to_plain(lightning_cfg.get("trainer") or {})
    strategy = trainer_kwargs.get("strategy")
    if isinstance(strategy, dict):
        trainer_kwargs["strategy"] = instantiate(strategy, "lightning.trainer.strategy")
    trainer_kwargs.setdefault("precision", auto_precision())
    trainer_kwargs.setdefault("use_distributed_sampler", not uses_our_sampler)
    checkpoint_params = {
        **DEFAULT_CHECKPOINT,
        **to_plain((lightning_cfg.get("modelcheckpoint") or {}).get("params") or {}),
    }
    callbacks = [
        Throughput(),
        ModelCheckpoint(dirpath=run_dir / "checkpoints", **checkpoint_params),
        FinalCheckpoint(run_dir / "checkpoints" / "last.ckpt"),
        LearningRateMonitor(logging_interval="step"),
    ]
    for name, node in (lightning_cfg.get("callbacks") or {}).items():
        if node is not None:
            callbacks.append(instantiate(node, f"lightning.callbacks.{name}"))
    loggers = [
        TensorBoardLogger(run_dir, name="", version="tensorboard"),
        CSVLogger(run_dir, name="csv", version=time.strftime("%Y-%m-%dT%H-%M-%S")),  # one file per launch
    ]
    return pl.Trainer(default_root_dir=run_dir, callbacks=callbacks, logger=loggers, **trainer_kwargs)


LOGGERS = ("ldm", "lightning.pytorch")


def _log_to_file(run_dir: Path) -> logging.Handler:
    handler = logging.FileHandler(run_dir / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LOGGERS:
        logging.getLogger(name).addHandler(handler)
    if logging.getLogger("ldm").level == logging.NOTSET:
        logging.getLogger("ldm").setLevel(logging.INFO)  # the run log holds our INFO lines, as Lightning's
    return handler


def train(
    bases: list[str],
    overrides: list[str] = (),
    logdir: str | Path = "logs",
    name: str | None = None,
    seed: int = 23,
    resume: str | None = None,
) -> Path:
    """Train from configs; returns the run folder, which holds `checkpoints/last.ckpt`."""
    logdir = Path(logdir)
    resumed = find_resume(resume, logdir, name) if resume else None
    cfg, _ = prepare_config(list(bases), list(overrides), resumed)
    if resumed:
        run_dir = resumed.run_dir
    elif os.environ.get(RUN_DIR_ENV):  # another rank of a run whose first rank named the folder
        run_dir = Path(os.environ[RUN_DIR_ENV])
    else:
        name = name or Path(bases[0]).stem
        run_dir = logdir / f"{time.strftime('%Y-%m-%dT%H-%M-%S')}_{name}"
    (run_dir / "configs").mkdir(parents=True, exist_ok=True)
    handler = _log_to_file(run_dir)
    inherited = RUN_DIR_ENV in os.environ
    os.environ[RUN_DIR_ENV] = str(run_dir)  # the processes Lightning starts for the other ranks inherit it
    try:
        _fit(cfg, run_dir, seed, resumed)
    finally:  # a second run in the same process must not write into this run's folder or log
        if not inherited:
            del os.environ[RUN_DIR_ENV]
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        handler.close()
    return run_dir


def _fit(cfg: DictConfig, run_dir: Path, seed: int, resumed: Resume | None) -> None:
    from ldm.data import DataModule

    pl.seed_everything(seed, workers=True)
    model = instantiate(cfg.model, "model")
    model.run_config = to_plain(cfg)
    datamodule = instantiate(cfg.data, "data")
    trainer = build_trainer(cfg, run_dir, uses_our_sampler=isinstance(datamodule, DataModule))
    if resumed and resumed.ckpt.is_dir() and not hasattr(trainer.strategy, "booster"):
        raise ConfigError(
            f"-r {resumed.ckpt}: a ColossalAIStrategy checkpoint folder; resume it with that strategy "
            "(lightning.trainer.strategy), or export it with scripts/export_diffusers.py and fine-tune from there"
        )
    if trainer.is_global_zero:
        OmegaConf.save(cfg, run_dir / "configs" / "project.yaml")
        log.info("run folder: %s", run_dir)
    with warnings.catch_warnings():
        # Frozen parts (VAE, text encoder) are kept in eval mode on purpose; Lightning warns about it.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
        # weights_only: resuming never runs code from the checkpoint (ours hold tensors and plain types only)
        trainer.fit(model, datamodule=datamodule, ckpt_path=resumed.ckpt if resumed else None, weights_only=True)
