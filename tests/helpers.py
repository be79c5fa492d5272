"""Test-only plug-ins named by `target` in configs: a caption recorder and a user's own DataModule."""

import json
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader


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
