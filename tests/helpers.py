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
