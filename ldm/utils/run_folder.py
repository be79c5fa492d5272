"""The run folder of the current run, as every process of it (ranks, data workers) finds it."""

from __future__ import annotations

import os
from pathlib import Path

# Set by the training run for itself and inherited by every process it starts; set it by hand to give
# the ranks of an external launcher one folder.
RUN_DIR_ENV = "LDM_RUN_DIR"


def current_run_dir() -> Path | None:
    """The folder of the run this process belongs to, or None outside a run."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None
