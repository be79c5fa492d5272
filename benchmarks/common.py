"""What every benchmark shares: repeats and medians, peak memory, and the printed report."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import re
import resource
import statistics
import subprocess
import sys
import warnings
from datetime import date
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
# --smoke trains on the 180 test digits, not all 1,797: it checks that the code runs, not what it learns, and
# encoding every digit's latent again for each run was most of a smoke run's training time.
SMOKE_DIGITS = "data.params.dataset.params.split=test"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark takes."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="a few seconds on the tiniest settings: checks it runs")
    p.add_argument("--json", type=Path, help="also write the JSON result to this file")
    return p


def quiet() -> None:
    """Keep the output to the benchmark's own lines: no Lightning hints about tiny runs, no INFO logs."""
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "ldm"):
        logging.getLogger(name).setLevel(logging.WARNING)


def peak_rss_bytes() -> int:
    """The peak resident memory of this process so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (`VmRSS`) or its peak since the last `reset_peak()` (`VmHWM`), from
    Linux's /proc/self/status."""
    return int(re.search(rf"{field}:\s+(\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024


def reset_peak() -> None:
    """Start measuring the peak afresh (Linux: writing 5 to clear_refs resets VmHWM and ru_maxrss)."""
    Path("/proc/self/clear_refs").write_text("5")


def median(values: list[float]) -> float:
    return statistics.median(values)


def machine() -> str:
    """One line naming what the numbers were measured on."""
    cpu = platform.processor() or platform.machine()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{torch.get_num_threads()} CPU threads ({cpu}), {gpu}, torch {torch.__version__}, {date.today()}"


def report(name: str, table: list[str], result: dict, headline: str, json_path: Path | None = None) -> None:
    """Print the table, one JSON line (`{"benchmark": name, ...}`), and the headline as the last line."""
    result = {"benchmark": name, "machine": machine(), **result}
    line = json.dumps(result, sort_keys=False)
    print("\n".join(table))
    print(line)
    if json_path is not None:
        json_path.write_text(line + "\n")
    print(headline)
    sys.stdout.flush()


def run_child(command: list[str], variant: str, batch: int, timeout: float | None = None) -> dict:
    """Run one measuring child process: the last `{"child": ...}` JSON line it printed, or why it failed (out of
    memory, or its stderr's last line)."""
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"child"')]
    if lines:
        return json.loads(lines[-1])
    tail = [line for line in done.stderr.strip().splitlines() if line.strip()] or ["(no output)"]
    oom = "OutOfMemoryError" in done.stderr or "out of memory" in done.stderr
    return {"child": variant, "batch": batch, "error": "out of memory" if oom else tail[-1][:300]}
