"""What the command-line tools print: our log lines above the progress bar, other libraries' noise hidden.

`setup(verbose)` is the one call a tool makes before it works: INFO lines print as plain sentences
(warnings and errors keep their level and logger), through tqdm so that a line never lands in the middle
of a progress bar, and `ldm.cli.noise.quiet` hides the listed third-party messages unless `verbose`.
"""

from __future__ import annotations

import logging
import sys

from tqdm import tqdm

from ldm.cli.noise import quiet


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.levelno == logging.INFO:
            return record.getMessage()
        return f"{record.levelname} {record.name}: {super().format(record)}"


class _AboveTheBar(logging.StreamHandler):
    """Writes each line with `tqdm.write`: an open bar is cleared, the line printed, the bar drawn again."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 - logging's own policy: report and go on
            self.handleError(record)


def setup(verbose: bool = False) -> None:
    """Print INFO and above to stderr unless the root logger already has handlers (as `logging.basicConfig`:
    under pytest, or in a program that configured logging itself), and hide other libraries' noise."""
    root = logging.getLogger()
    if not root.handlers:
        handler = _AboveTheBar(sys.stderr)
        handler.setFormatter(_Format("%(message)s"))
        root.addHandler(handler)
        root.setLevel(logging.INFO)
    quiet(verbose)
