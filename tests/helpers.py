"""Test helpers: main.py arguments for a tiny fine-tune, and plug-ins named by `target` in configs."""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

SD_FOLDER = Path(__file__).resolve().parents[1] / "configs" / "finetune" / "sd-folder.yaml"


def finetune_args(tiny_sd, images, logdir, *extra) -> list[str]:
    """main.py arguments for a 3-step fine-tune of the tiny SD on 16 px images; `extra` overrides win."""
    return [
        "-t", "-b", str(SD_FOLDER), "-l", str(logdir), "-n", "tiny", "-s", "1",
        f"model.params.pretrained={tiny_sd}", f"data.params.root={images}", "data.params.size=16",
        "data.params.batch_size=2", "data.params.num_workers=0", "lightning.trainer.max_steps=3",
        "lightning.trainer.accumulate_grad_batches=1", "lightning.trainer.log_every_n_steps=1",
        "model.params.learning_rate=1e-3",
        "lightning.callbacks.image_logger.params.every_n_steps=2",
        "lightning.callbacks.image_logger.params.num_inference_steps=2", *extra,
    ]  # fmt: skip


def train_once(argv: list[str], logdir: Path) -> Path:
    """Run main.py with `argv`, which must succeed, and return the one run folder it made in `logdir`."""
    from main import main

    assert main(argv) == 0
    (run_dir,) = logdir.iterdir()
    return run_dir


def run_script(name: str, *args) -> str:
    """Run `scripts/NAME` in this process with `args` as its command line; return what it printed.

    In-process, to spare each call the seconds of importing torch and diffusers again. A script
    that exits with an error message raises SystemExit carrying that message."""
    import contextlib
    import io
    import runpy
    import sys

    script = Path(__file__).resolve().parents[1] / "scripts" / name
    argv, sys.argv = sys.argv, [str(script), *map(str, args)]
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    return printed.getvalue()


class RecordCaptions(pl.Callback):
    """Append the captions of every training batch to a file, one JSON line per batch."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(batch["caption"]) + "\n")


class UserDataModule(pl.LightningDataModule):
    """What a user might write: their own LightningDataModule yielding pixel_values and captions."""

    def __init__(self, size: int = 16, count: int = 4, batch_size: int = 2) -> None:
        super().__init__()
        self.size, self.count, self.batch_size = size, count, batch_size

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        examples = [
            {"pixel_values": torch.rand(3, self.size, self.size, generator=g) * 2 - 1, "caption": f"user example {i}"}
            for i in range(self.count)
        ]
        return DataLoader(examples, batch_size=self.batch_size)


class RecordZeroBytes(pl.Callback):
    """At the end of a ZeRO run, write what its optimizer really holds for the UNet, in bytes (JSON)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        optimizer = trainer.strategy.optimizers[0]
        optimizer = getattr(optimizer, "_optimizer", optimizer)
        unet = list(pl_module.unet.parameters())
        masters = [optimizer.working_to_master_param[id(p)] for p in unet]
        moments = [t for m in masters for t in optimizer.optim.state[m].values() if torch.is_tensor(t) and t.dim()]
        record = {
            "working": sum(p.numel() * p.element_size() for p in unet),
            "master": sum(m.numel() * m.element_size() for m in masters),
            "moments": sum(t.numel() * t.element_size() for t in moments),
            "master_device": str(masters[0].device),
        }
        self.path.write_text(json.dumps(record))


class RecordLosses(pl.Callback):
    """Append `{"step", "loss"}` of every training batch to a JSON-lines file (loss null when skipped)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs["loss"].item() if outputs else None  # empty when training_step skipped the batch
        with self.path.open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "loss": loss}) + "\n")


class SendSignal(pl.Callback):
    """Send `signal` to this process at the end of step `step` (on rank `rank` only, or every rank when it is
    None: a lost node); each rank writes `RANK.done` into `done_dir` when its fit ends, so a test can see that
    every rank got out."""

    def __init__(self, step: int, signal: str, rank: int | None = 0, done_dir: str | None = None) -> None:
        self.step, self.signal, self.rank, self.done_dir = step, signal, rank, done_dir

    def on_train_batch_end(self, trainer, *args) -> None:
        import os
        import signal

        if trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), getattr(signal, self.signal))

    def teardown(self, trainer, pl_module, stage) -> None:
        if self.done_dir:
            (Path(self.done_dir) / f"{trainer.global_rank}.done").write_text(str(trainer.global_step))


class _KillWhenPickled:
    def __reduce__(self):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


class KillDuringSave(pl.Callback):
    """kill -9 this process while it writes the checkpoint of step `step`."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if trainer.global_step == self.step:
            checkpoint["kill"] = _KillWhenPickled()


class PoisonBatch(pl.Callback):
    """Make the batches of the given steps (1-based, as logged) NaN: a transient non-finite loss."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = set(steps)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 in self.steps:
            batch["pixel_values"].fill_(float("nan"))


class RecordSamples(pl.Callback):
    """Append `{"step", "keys", "dropped", "loss"}` of every training batch to `DIR/samples-RANK.jsonl`: which
    samples (`source/key`) the batch held and which had their caption dropped."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        row = {
            "step": trainer.global_step,
            "keys": [f"{s}/{k}" for s, k in zip(batch["source"], batch["key"])],
            "dropped": [caption == "" for caption in batch["caption"]],
            "loss": outputs["loss"].item() if outputs else None,
        }
        with (self.folder / f"samples-{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


class RecordShards(pl.Callback):
    """Write `{"local": N, "total": M}` to `DIR/shards-RANK.json` at the start of training: how many of the
    denoiser's parameter values this process holds (its shard, under FSDP) of how many in all."""

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_start(self, trainer, pl_module) -> None:
        params = list(getattr(pl_module, pl_module.denoiser_name).parameters())
        local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)
        row = {"local": local, "total": sum(p.numel() for p in params)}
        (self.folder / f"shards-{trainer.global_rank}.json").write_text(json.dumps(row))
