"""How the Trainer writes checkpoint files: streamed to disk and synced, failures kept for all ranks to see."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ldm.utils.atomic import remove_path


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or what is on disk is not what was written."""


class StreamingCheckpointIO(TorchCheckpointIO):
    """Write checkpoint files straight to disk and sync them (Lightning's default first builds the
    whole file in memory, doubling the host memory a save needs).

    With `collect_failures` set, a failed write is kept in `failure` instead of raised, so that the
    saving rank does not leave the others waiting at the barrier that follows every save."""

    def __init__(self) -> None:
        self.collect_failures, self.failure = False, None

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as err:
            remove_path(path)
            if not self.collect_failures:
                raise
            self.failure = err
