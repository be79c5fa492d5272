"""A test-only callback that records the captions of every training batch, one JSON line per batch."""

import json
from pathlib import Path

import lightning.pytorch as pl


class RecordCaptions(pl.Callback):
    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(batch["caption"]) + "\n")
