"""Assemble and run training from a config: the run folder, model, data, callbacks, loggers, Trainer."""

from __future__ import annotations

import logging
import os
import pickle
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.callbacks import LearningRateMonitor, ProgressBar
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import ModelParallelStrategy
from omegaconf import DictConfig, OmegaConf

from ldm.config import ConfigError, Sources, instantiate, load_config, rejected, to_plain
from ldm.data import DataModule
from ldm.training.callbacks.checkpoints import LAST, Checkpoints, saved_steps
from ldm.training.callbacks.plan import RunPlan, plan_of, summary
from ldm.training.callbacks.progress import StepProgressBar
from ldm.training.callbacks.throughput import Throughput
from ldm.training.checkpoint_io import CheckpointError, StreamingCheckpointIO
from ldm.training.checks import check_config
from ldm.training.launch import agree_on_run_dir
from ldm.training.report import Report, write_report
from ldm.utils.atomic import verify
from ldm.utils.run_folder import RUN_DIR_ENV, STARTED, make_run_dir, runs_named
from ldm.weights.checkpoint import unpickled_object
from ldm.weights.formats import CHECKPOINTS, Format, detect

log = logging.getLogger("ldm")

# What code built from a config raises for a value it rejects: each becomes a one-line config error.
REJECTIONS = (ValueError, MisconfigurationException)


class RunStopped(Exception):
    """Training stopped early, by a stop signal or the non-finite loss guard, after saving a checkpoint."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Resume:
    """Where a resumed run lives and which checkpoint it continues from."""

    run_dir: Path
    ckpt: Path


def find_resume(resume: str, logdir: Path, name: str | None) -> Resume | None:
    """Resolve `-r PATH|auto`: a checkpoint, a run folder (its newest intact checkpoint), or, for `auto`,
    the newest intact checkpoint of the newest run named `name` in `logdir` that has one."""
    if resume == "auto":
        if not name:
            raise ConfigError("-r auto needs -n NAME to know which run to continue")
        for run_dir in runs_named(logdir, name):
            found = _newest_intact(run_dir, "-r auto")
            if found is not None:
                return found
        log.info("-r auto: no run named %r with an intact checkpoint in %s; starting a new run", name, logdir)
        return None
    path = Path(resume)
    if detect(path) in CHECKPOINTS:
        problem = verify(path)
        if problem:
            raise ConfigError(f"-r {resume}: {problem}; -r auto -n NAME picks the newest intact checkpoint instead")
        run_dir = path.parent.parent if path.parent.name == "checkpoints" else path.parent
        return Resume(run_dir, path)
    if path.is_dir() and (path / "checkpoints").is_dir():
        found = _newest_intact(path, f"-r {resume}")
        if found is not None:
            return found
    raise ConfigError(f"-r {resume}: neither a checkpoint nor a run folder with an intact checkpoint in checkpoints/")


def _newest_intact(run_dir: Path, flag: str) -> Resume | None:
    """The newest step checkpoint of a run whose checksum holds (skipping, and saying so, any that
    do not), or the `last.ckpt` of a run written before step checkpoints existed."""
    folder = run_dir / "checkpoints"
    candidates = [path for _, path in saved_steps(folder)]
    legacy = folder / LAST
    if legacy.exists() and not legacy.is_symlink():
        candidates.append(legacy)
    for ckpt in candidates:
        problem = verify(ckpt)
        if problem:
            log.warning("%s: skipping %s: %s", flag, ckpt, problem)
            continue
        log.info("%s: resuming %s", flag, ckpt)
        return Resume(run_dir, ckpt)
    return None


def prepare_config(
    bases: list[str], overrides: list[str], resume: Resume | None, scale_lr: bool = True
) -> tuple[DictConfig, Sources]:
    """Load and check the config: `-b` files (or the resumed run's saved config), then overrides."""
    if not bases:
        if resume is None:
            raise ConfigError("no config: pass -b CONFIG.yaml (or -r to continue a run)")
        bases = [str(resume.run_dir / "configs" / "project.yaml")]
    cfg, sources = load_config(bases, overrides)
    check_config(cfg, sources, scale_lr)
    return cfg, sources


def auto_precision() -> str:
    """Mixed precision where the hardware has it: bf16 or fp16 on CUDA, full precision on a CPU."""
    if torch.cuda.is_available():
        return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    return "32-true"


def build_trainer(cfg: DictConfig, run_dir: Path, uses_our_sampler: bool) -> pl.Trainer:
    """A Trainer with checkpoints, TensorBoard + CSV logs and the configured callbacks."""
    lightning_cfg = cfg.get("lightning") or OmegaConf.create()
    trainer_kwargs = to_plain(lightning_cfg.get("trainer") or {})
    if "strategy" in trainer_kwargs and trainer_kwargs["strategy"] is None:  # `strategy=null`: Lightning's default
        del trainer_kwargs["strategy"]
    strategy = trainer_kwargs.get("strategy")
    if isinstance(strategy, dict):
        trainer_kwargs["strategy"] = instantiate(strategy, "lightning.trainer.strategy", REJECTIONS)
    elif strategy == "fsdp":  # FSDP2 through ModelParallelStrategy, which also runs on CPUs (Lightning's fsdp does not)
        from ldm.training.strategies.fsdp import FSDPStrategy

        trainer_kwargs["strategy"] = FSDPStrategy()
    trainer_kwargs.setdefault("precision", auto_precision())
    trainer_kwargs.setdefault("use_distributed_sampler", not uses_our_sampler)
    trainer_kwargs.setdefault("enable_model_summary", False)  # RunPlan says what the run trains, in one block
    checkpoint_params = to_plain((lightning_cfg.get("modelcheckpoint") or {}).get("params") or {})
    checkpoints = Checkpoints(run_dir / "checkpoints", **checkpoint_params)
    callbacks = [
        RunPlan(checkpoints.every_n_train_steps),
        Report(run_dir),
        Throughput(),
        checkpoints,
        LearningRateMonitor(logging_interval="step"),
    ]
    for name, node in (lightning_cfg.get("callbacks") or {}).items():
        if node is not None:
            callbacks.append(instantiate(node, f"lightning.callbacks.{name}", REJECTIONS))
    if trainer_kwargs.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StepProgressBar())
    loggers = [
        TensorBoardLogger(run_dir, name="", version="tensorboard"),
        CSVLogger(run_dir, name="csv", version=launch_name(run_dir / "csv")),  # one file per launch
    ]
    plugins = [*(trainer_kwargs.pop("plugins", None) or []), StreamingCheckpointIO()]
    try:
        return pl.Trainer(
            default_root_dir=run_dir, callbacks=callbacks, logger=loggers, plugins=plugins, **trainer_kwargs
        )
    except REJECTIONS as err:  # e.g. an unknown strategy name, no GPU for gpu
        raise rejected("lightning.trainer", err) from None


def launch_name(folder: Path) -> str:
    """A name for this launch's logs in `folder`: its start time, with a count added if a launch that
    started in the same second (a fast resume) already took it."""
    stem = time.strftime(STARTED)
    taken = {path.name for path in folder.glob(f"{stem}*")} if folder.is_dir() else set()
    return next(name for name in (stem, *(f"{stem}-{n}" for n in range(2, len(taken) + 2))) if name not in taken)


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
    scale_lr: bool = True,
) -> Path:
    """Train from configs; returns the run folder, which holds `checkpoints/last.ckpt`.

    `scale_lr` applies to CompVis configs' `model.base_learning_rate` (see `ldm.training.compvis`)."""
    logdir = Path(logdir)
    resumed = find_resume(resume, logdir, name) if resume else None
    cfg, _ = prepare_config(list(bases), list(overrides), resumed, scale_lr)
    if resumed:
        run_dir = resumed.run_dir
    else:  # the first rank names the folder; the others (torchrun, SLURM, Lightning's launcher) receive it
        name = name or Path(bases[0]).stem
        run_dir = agree_on_run_dir(lambda: make_run_dir(logdir, name))
    (run_dir / "configs").mkdir(parents=True, exist_ok=True)
    handler = _log_to_file(run_dir)
    inherited = RUN_DIR_ENV in os.environ
    os.environ[RUN_DIR_ENV] = str(run_dir)  # the processes Lightning starts for the other ranks inherit it
    try:
        checkpoints = _fit(cfg, run_dir, seed, resumed)
    finally:  # a second run in the same process must not write into this run's folder or log
        if not inherited:
            del os.environ[RUN_DIR_ENV]
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(handler)
        handler.close()
    if checkpoints.signal is not None:
        raise RunStopped(
            f"stopped by {checkpoints.stopped_by}; saved {checkpoints.last_saved}; continue with -r auto",
            128 + checkpoints.signal,
        )
    if checkpoints.stopped_by not in (None, "trainer.should_stop"):
        raise RunStopped(f"stopped: {checkpoints.stopped_by}; saved {checkpoints.last_saved}", 1)
    return run_dir


def dry_run(
    bases: list[str],
    overrides: list[str] = (),
    logdir: str | Path = "logs",
    name: str | None = None,
    resume: str | None = None,
    scale_lr: bool = True,
) -> list[str]:
    """Check the config, build the model, the data and the Trainer as `train` would, and return the run's plan
    (with the planned memory of one step where the planner knows the model), without training or writing a run.
    The examples are counted without encoding caches; a data module without a dataset (shards) streams."""
    import tempfile

    logdir = Path(logdir)
    resumed = find_resume(resume, logdir, name) if resume else None
    cfg, _ = prepare_config(list(bases), list(overrides), resumed, scale_lr)
    model = instantiate(cfg.model, "model", REJECTIONS)
    if hasattr(model, "configure_model"):
        model.configure_model()
    datamodule = instantiate(cfg.data, "data", REJECTIONS)
    with tempfile.TemporaryDirectory() as scratch:  # the loggers' folders, never written by a Trainer not fitting
        trainer = build_trainer(cfg, Path(scratch), uses_our_sampler=isinstance(datamodule, DataModule))
    examples = steps = resolution = None
    batch_size = getattr(datamodule, "batch_size", None)
    if isinstance(datamodule, DataModule):
        dataset = datamodule.build_dataset()
        examples, first = len(dataset), dataset[0]
        pixels = first.get("pixel_values") if isinstance(first, dict) else None
        if pixels is not None:  # the planner's image side: the data's own, not data.params.size's default
            resolution = int(pixels.shape[-1])
        per_step = batch_size * trainer.world_size
        batches = examples // per_step if datamodule.drop_last else -(-examples // per_step)
        steps = max(batches // trainer.accumulate_grad_batches, 1)
    checkpoints = trainer.checkpoint_callback
    plan = plan_of(trainer, model, examples, batch_size, steps, checkpoints.every_n_train_steps)
    plan.notes.append(("memory", _planned_memory(cfg, resolution, model)))
    if resumed:
        plan.notes.append(("resume", f"from {resumed.ckpt} (its step, optimizer and data position)"))
    where = resumed.run_dir if resumed else logdir / f"<time>_{name or Path(bases[0]).stem}"
    return [f"dry run: would train in {where}", *plan.lines()]


def _planned_memory(cfg: DictConfig, resolution: int | None, model: torch.nn.Module) -> str:
    from diffusers import UNet2DConditionModel

    from ldm.training.memory import GIB, plan_training_step

    denoiser = getattr(model, "unet", None)
    if not isinstance(denoiser, UNet2DConditionModel):
        what = type(denoiser).__name__ if denoiser is not None else type(model).__name__
        return f"not planned (the planner traces UNet latent diffusion, not {what})"
    try:
        memory = plan_training_step(cfg, resolution=resolution)
    except Exception as err:  # noqa: BLE001 - a plan the planner cannot make is said, not raised
        return f"not planned ({type(err).__name__}: {' '.join(str(err).split())[:160]})"
    return (
        f"one step peaks at {memory.peak / GIB:.2f} GiB (batch {memory.batch_size}, {memory.resolution} px, no "
        "offload; planned on fake tensors: scripts/plan_memory.py gives the table and any offload split)"
    )


def _fit(cfg: DictConfig, run_dir: Path, seed: int, resumed: Resume | None) -> Checkpoints:
    pl.seed_everything(seed, workers=True)
    model = instantiate(cfg.model, "model", REJECTIONS)
    model.run_config = to_plain(cfg)
    model.seed = seed
    datamodule = instantiate(cfg.data, "data", REJECTIONS)
    trainer = build_trainer(cfg, run_dir, uses_our_sampler=isinstance(datamodule, DataModule))
    if resumed and detect(resumed.ckpt) is Format.COLOSSAL and not hasattr(trainer.strategy, "booster"):
        raise ConfigError(
            f"-r {resumed.ckpt}: a ColossalAIStrategy checkpoint folder; resume it with that strategy "
            "(lightning.trainer.strategy), or export it with scripts/export_diffusers.py and fine-tune from there"
        )
    if resumed and detect(resumed.ckpt) is Format.SHARDED and not isinstance(trainer.strategy, ModelParallelStrategy):
        raise ConfigError(
            f"-r {resumed.ckpt}: a folder of FSDP shards; resume it with lightning.trainer.strategy: fsdp, or export "
            "it with scripts/export_diffusers.py and fine-tune from there"
        )
    if trainer.is_global_zero:
        OmegaConf.save(cfg, run_dir / "configs" / "project.yaml")
        log.info("run folder: %s", run_dir)
    with warnings.catch_warnings():
        # Frozen parts (VAE, text encoder) are kept in eval mode on purpose; Lightning warns about it.
        warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
        # The non-finite loss guard returns None on purpose, and logs the step itself.
        warnings.filterwarnings("ignore", message=r"`training_step` returned `None`")
        # Shards know their length per process and split it between workers themselves.
        warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
        # weights_only: resuming never runs code from the checkpoint (ours hold tensors and plain types only)
        try:
            trainer.fit(model, datamodule=datamodule, ckpt_path=resumed.ckpt if resumed else None, weights_only=True)
        except pickle.UnpicklingError as err:
            if resumed is None:
                raise
            raise CheckpointError(
                f"-r {resumed.ckpt}: refused: resuming would unpickle {unpickled_object(err)}, which can run code. "
                "main.py writes tensors and plain values only, so this checkpoint was changed after it was saved; "
                "resume from one you trust"
            ) from None
    checkpoints = trainer.checkpoint_callback
    if trainer.is_global_zero:
        plan = next((c for c in trainer.callbacks if isinstance(c, RunPlan)), None)
        stopped = checkpoints.stopped_by not in (None, "trainer.should_stop")
        for line in summary(trainer, plan, checkpoints.last_saved, stopped):
            log.info(line)
        try:
            log.info("report: %s", write_report(run_dir))
        except (OSError, ValueError) as err:  # the run and its checkpoints stand; say what failed
            log.warning("report: not written: %s", err)
    return checkpoints
