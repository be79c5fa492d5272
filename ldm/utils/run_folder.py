"""The run folder of the current run, as every process of it (ranks, data workers) finds it."""

from __future__ import annotations

import os
import time
from itertools import count
from pathlib import Path

# Set by the training run for itself and inherited by every process it starts; set it by hand to give
# the ranks of an external launcher one folder.
RUN_DIR_ENV = "LDM_RUN_DIR"
STARTED = "%Y-%m-%dT%H-%M-%S"  # a run folder's name: when it started, then `_NAME`


def current_run_dir() -> Path | None:
    """The folder of the run this process belongs to, or None outside a run."""
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None


def make_run_dir(logdir: Path, name: str) -> Path:
    """Create a new run folder `LOGDIR/<started>_<name>` and return it. Another run of that name started in the
    same second gets `<started>.2_<name>` (then `.3`, ...): each folder is created exclusively, so two runs never
    share one."""
    logdir.mkdir(parents=True, exist_ok=True)
    started = time.strftime(STARTED)
    for n in count(1):
        run_dir = logdir / (f"{started}_{name}" if n == 1 else f"{started}.{n}_{name}")
        try:
            run_dir.mkdir()
        except FileExistsError:
            continue
        return run_dir


def runs_named(logdir: Path, name: str) -> list[Path]:
    """The run folders in `logdir` of the run name `name`, newest first: `<started>_<name>` exactly, not a run
    whose own name only ends in `_<name>` (`my_tiny` is not a run of `tiny`)."""
    if not logdir.is_dir():
        return []
    runs = [path for path in logdir.iterdir() if path.is_dir() and path.name.partition("_")[2] == name]
    return sorted(runs, key=started_order, reverse=True)


def started_order(run_dir: Path) -> tuple[str, int]:
    """Sort key of run folders in the order they started: the second, then the count within it (1 if none)."""
    started = run_dir.name.partition("_")[0]
    second, _, n = started.partition(".")
    return second, int(n) if n.isdigit() else 1
