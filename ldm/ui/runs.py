"""What `ldm-ui` does, without the UI: keep every path the browser sends inside the folders the user chose,
build `main.py`'s arguments from the Train tab, start it as a child process, follow its output, stop it (a
SIGTERM, so it saves a checkpoint) and resume it, and list and read run folders.

The child's output is not a terminal, so it prints a progress line at each tenth of the run
(`step 40/400 (10 %): loss ...`), which is what the app shows.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ldm.utils.run_folder import STARTED, started_order

REPO = Path(__file__).resolve().parents[2]
MAIN = REPO / "main.py"
CONFIGS = REPO / "configs"
PRESET_FOLDERS = ("finetune", "quickstart", "pretrain")  # what the Train tab offers, in this order

STEP = re.compile(r"^step ([\d,]+)(?:/([\d,]+))?")
RUN_FOLDER = re.compile(r"^run folder: (.+)$")
OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=.*$")


class Roots:
    """The folders the app may read and write; a path outside them (after resolving links) is refused."""

    def __init__(self, folders: list[str | Path]) -> None:
        self.folders = [Path(folder).expanduser().resolve() for folder in folders]

    def check(self, text: str | None, what: str, must_exist: bool = True) -> Path:
        """`text` as a resolved path inside a root, or `ValueError` naming the field (`what`) and the path."""
        if not text or not str(text).strip():
            raise ValueError(f"{what}: give a path")
        path = Path(str(text).strip()).expanduser().resolve()
        if not any(path == root or path.is_relative_to(root) for root in self.folders):
            allowed = ", ".join(str(root) for root in self.folders)
            raise ValueError(f"{what}: {path} is outside the folders this app may use ({allowed}); start ldm-ui "
                             "with --root FOLDER to allow another")  # fmt: skip
        if must_exist and not path.exists():
            raise ValueError(f"{what}: {path} does not exist")
        return path


def presets() -> list[str]:
    """The configs the Train tab offers, as paths under configs/: the fine-tuning presets, then the quickstart's
    and the pretraining recipes."""
    return [f"{folder}/{path.name}" for folder in PRESET_FOLDERS for path in sorted((CONFIGS / folder).glob("*.yaml"))]


def train_args(
    preset: str, weights: Path | None, images: Path | None, name: str, steps: int | None, overrides: str, logdir: Path
) -> list[str]:
    """`main.py` arguments for the Train tab's fields; `overrides` is one `key.path=value` per line."""
    if preset not in presets():
        raise ValueError(f"preset: {preset!r} is not one of {', '.join(presets())}")
    if not re.fullmatch(r"[\w.-]+", name or ""):
        raise ValueError(f"run name: {name!r}; use letters, digits, '.', '_' and '-'")
    args = ["-t", "-b", str(CONFIGS / preset), "-l", str(logdir), "-n", name]
    args += [f"model.params.pretrained={weights}"] if weights else []
    args += [f"data.params.root={images}"] if images else []
    args += [f"lightning.trainer.max_steps={int(steps)}"] if steps else []
    for line in (overrides or "").splitlines():
        if line.strip():
            if not OVERRIDE.match(line.strip()):
                raise ValueError(f"overrides: {line.strip()!r} is not key.path=value")
            args.append(line.strip())
    return args


@dataclass
class Job:
    """One `main.py` child process and the file its output goes to."""

    process: subprocess.Popen
    output: Path

    def lines(self) -> list[str]:
        return self.output.read_text(encoding="utf-8", errors="replace").splitlines() if self.output.exists() else []

    @property
    def running(self) -> bool:
        return self.process.poll() is None

    def run_dir(self) -> Path | None:
        """The run folder, once the child has said it."""
        found = [match[1] for match in map(RUN_FOLDER.match, self.lines()) if match]
        return Path(found[-1]) if found else None

    def status(self) -> str:
        """The newest progress line and, once it has ended, how."""
        lines = self.lines()
        progress = [line for line in lines if STEP.match(line)]
        said = progress[-1] if progress else (lines[-1] if lines else "starting")
        if self.running:
            return said
        ending = [line for line in lines if line.startswith(("done: ", "stopped", "config error", "checkpoint error"))]
        code = self.process.returncode
        return f"{said}\n{ending[-1] if ending else ''}\nexited with status {code}".replace("\n\n", "\n")

    def stop(self) -> None:
        """SIGTERM: main.py saves a checkpoint at the next step and exits."""
        if self.running:
            os.killpg(self.process.pid, signal.SIGTERM)


def launch(args: list[str], logdir: Path) -> Job:
    """Start `main.py args` in its own process group; its output goes to `logdir/.ui/<time>.log`."""
    folder = logdir / ".ui"
    folder.mkdir(parents=True, exist_ok=True)
    output = folder / f"{time.strftime(STARTED)}-{os.getpid()}-{time.monotonic_ns()}.log"
    with open(output, "w", encoding="utf-8") as sink:
        process = subprocess.Popen(  # noqa: S603 - our own main.py, with arguments checked above
            [sys.executable, str(MAIN), *args],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return Job(process, output)


def dry_run(args: list[str], timeout: float = 600) -> str:
    """`main.py --dry-run` with the same arguments: its plan, or its error."""
    done = subprocess.run(  # noqa: S603
        [sys.executable, str(MAIN), "--dry-run", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    return done.stdout.strip() if done.returncode == 0 else done.stderr.strip()


def list_runs(logdir: Path) -> list[Path]:
    """The run folders in `logdir`, newest first."""
    if not logdir.is_dir():
        return []
    runs = [path for path in logdir.iterdir() if (path / "configs" / "project.yaml").is_file()]
    return sorted(runs, key=started_order, reverse=True)


def newest_grid(run_dir: Path | None) -> Path | None:
    grids = sorted((run_dir / "images").glob("step_*.png")) if run_dir else []
    return grids[-1] if grids else None
