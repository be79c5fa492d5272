"""Write a run's report again: `RUN/report.html`, one self-contained page with its plots, sample grids,
checkpoints and config (`ldm.training.report`).

    python scripts/report.py logs/2026-12-05T10-00-00_my-run
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ldm.cli import console
from ldm.training.report import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a run folder written by main.py")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    if not (args.run / "configs" / "project.yaml").is_file():
        print(f"report: {args.run} is not a run folder (no configs/project.yaml)", file=sys.stderr)
        return 2
    print(write_report(args.run))
    return 0
