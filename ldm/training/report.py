"""A run's report, `RUN/report.html`: one self-contained page (plots as inline SVG, sample grids as inlined
PNGs, nothing fetched from the network) built from the run folder alone.

It shows the plan and the summary the run printed (from `train.log`); the loss (raw and smoothed), learning
rate, images/s and, on a GPU, peak memory against step (from every launch's `csv/*/metrics.csv`); the sample
grids over time with their prompts; the skipped files (`bad_samples.tsv`); the checkpoints, with the commands to
resume and to export; and the config. `main.py` writes it after each checkpoint and at the end;
`python scripts/report.py RUN` writes it again.
"""

from __future__ import annotations

import base64
import csv
import html
import os
import re
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import yaml

REPORT = "report.html"
MAX_GRIDS = 12  # evenly spaced over the run, the newest always among them
Series = list[tuple[int, float]]

_LOGGED = re.compile(r"^\S+ \S+ (INFO|WARNING|ERROR) ldm[\w.]*: (.*)$")


def read_metrics(run_dir: Path) -> dict[str, Series]:
    """Every logged metric as (step, value) pairs, over all launches (a resumed launch's values win)."""
    series: dict[str, dict[int, float]] = defaultdict(dict)
    for path in sorted((run_dir / "csv").glob("*/metrics.csv")):  # launch folders are named by start time
        with open(path, newline="", encoding="utf-8") as rows:
            for row in csv.DictReader(rows):
                if not row.get("step"):
                    continue
                step = int(float(row["step"]))
                for key, value in row.items():
                    if key in ("step", "epoch") or not value:
                        continue
                    try:
                        series[key][step] = float(value)
                    except ValueError:
                        continue
    return {key: sorted(values.items()) for key, values in series.items()}


def smoothed(points: Series, weight: float = 0.9) -> Series:
    """TensorBoard's smoothing: an exponential moving average, debiased at the start."""
    out, average = [], 0.0
    for n, (step, value) in enumerate(points, 1):
        average = weight * average + (1 - weight) * value
        out.append((step, average / (1 - weight**n)))
    return out


def svg_plot(title: str, lines: list[tuple[str, Series, str]], width: int = 540, height: int = 200) -> str:
    """A line plot as inline SVG: `lines` are (label, points, colour); axes labelled at their ends and middle."""
    points = [p for _, series, _ in lines for p in series]
    if not points:
        return ""
    left, right, top, bottom = 64, 12, 24, 28
    x0, x1 = min(s for s, _ in points), max(s for s, _ in points)
    y0, y1 = min(v for _, v in points), max(v for _, v in points)
    x1, y1 = (x1 if x1 > x0 else x0 + 1), (y1 if y1 > y0 else y0 + abs(y0) * 0.1 + 1e-12)

    def xy(step: float, value: float) -> str:
        x = left + (step - x0) / (x1 - x0) * (width - left - right)
        y = top + (y1 - value) / (y1 - y0) * (height - top - bottom)
        return f"{x:.1f},{y:.1f}"

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">',
        f'<text x="{left}" y="15" class="title">{html.escape(title)}</text>',
        f'<rect x="{left}" y="{top}" width="{width - left - right}" height="{height - top - bottom}" class="frame"/>',
    ]
    for fraction in (0.0, 0.5, 1.0):
        value, step = y0 + fraction * (y1 - y0), x0 + fraction * (x1 - x0)
        y = top + (1 - fraction) * (height - top - bottom)
        x = left + fraction * (width - left - right)
        parts.append(f'<text x="{left - 4}" y="{y + 4:.1f}" class="tick" text-anchor="end">{value:.3g}</text>')
        anchor = ("start", "middle", "end")[int(fraction * 2)]
        parts.append(f'<text x="{x:.1f}" y="{height - 10}" class="tick" text-anchor="{anchor}">{step:,.0f}</text>')
    for n, (label, series, colour) in enumerate(lines):
        if series:
            path = " ".join(xy(s, v) for s, v in series)
            parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
            parts.append(
                f'<text x="{width - right - 4}" y="{top + 14 + 14 * n}" class="tick" text-anchor="end" '
                f'style="fill:{colour}">{html.escape(label)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def _plots(metrics: dict[str, Series]) -> list[str]:
    plots = []
    loss = metrics.get("train/loss", [])
    plots.append(svg_plot("loss", [("raw", loss, "#9ecae1"), ("smoothed", smoothed(loss), "#08519c")]))
    rates = [(key.removeprefix("lr-"), metrics[key], "#31a354") for key in sorted(metrics) if key.startswith("lr-")]
    plots.append(svg_plot("learning rate", rates))
    plots.append(svg_plot("images/s", [("all processes", metrics.get("perf/images_per_s", []), "#e6550d")]))
    plots.append(svg_plot("peak GPU memory (GiB)", [("allocated", metrics.get("perf/max_memory_gib", []), "#756bb1")]))
    return [plot for plot in plots if plot]


def _said(run_dir: Path) -> tuple[list[str], list[str]]:
    """The newest plan block and end summary in `train.log`."""
    plan: list[str] = []
    end: list[str] = []
    log = run_dir / "train.log"
    lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    messages = [match[2] for match in map(_LOGGED.match, lines) if match]
    for n, message in enumerate(messages):
        if message == "plan:":
            plan = [message]
            plan += [m for m in messages[n + 1 : n + 8] if m.startswith("  ")][:7]
        elif message.startswith(("done: ", "stopped: ", "throughput: ")):
            end = [*end[-1:], message] if message.startswith(("done: ", "stopped: ")) else [message]
    return plan, end


def _grids(run_dir: Path) -> list[tuple[int, Path]]:
    grids = sorted((int(p.stem.removeprefix("step_")), p) for p in (run_dir / "images").glob("step_*.png"))
    if len(grids) <= MAX_GRIDS:
        return grids
    picked = {round(i * (len(grids) - 1) / (MAX_GRIDS - 1)) for i in range(MAX_GRIDS)}
    return [grids[i] for i in sorted(picked)]


def _checkpoints(run_dir: Path, config: dict) -> str:
    folder = run_dir / "checkpoints"
    saved = sorted(p for p in folder.glob("step-*") if not p.name.endswith(".sha256")) if folder.is_dir() else []
    if not saved:
        return "<p>No checkpoint yet.</p>"
    rows = "".join(
        f"<tr><td>{html.escape(str(p))}</td><td>{_size(p) / 2**20:,.1f} MiB</td></tr>" for p in reversed(saved)
    )
    newest = saved[-1]
    lora = ((config.get("model") or {}).get("params") or {}).get("lora") is not None
    export = (
        f"python scripts/export_lora.py --ckpt {newest} --out {run_dir / 'lora.safetensors'}"
        if lora
        else f"python scripts/export_diffusers.py --ckpt {newest} --out {run_dir / 'pipeline'}\n"
        f"python scripts/export_single_file.py --ckpt {newest} --out {run_dir / 'model.safetensors'}"
    )
    again = (
        f"python main.py -t -r {run_dir}   # continue from its newest intact checkpoint (a finished run: with a "
        "higher lightning.trainer.max_steps=N)"
    )
    commands = f"{again}\n{export}"
    return f"<table>{rows}</table><pre>{html.escape(commands)}</pre>"


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def _bad_samples(run_dir: Path) -> str:
    listing = run_dir / "bad_samples.tsv"
    rows = listing.read_text(encoding="utf-8").splitlines() if listing.is_file() else []
    if not rows:
        return "<p>None.</p>"
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row.split("\t", 1)) + "</tr>" for row in rows[:200]
    )
    more = f"<p>... and {len(rows) - 200} more in {html.escape(str(listing))}</p>" if len(rows) > 200 else ""
    return f"<p>{len(rows)} file(s), each replaced by the next image:</p><table>{cells}</table>{more}"


STYLE = """body{font:14px system-ui,sans-serif;margin:24px;max-width:1200px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
pre{background:#f6f6f6;padding:8px;white-space:pre-wrap;overflow-wrap:anywhere}table{border-collapse:collapse}
td{padding:2px 10px 2px 0;vertical-align:top}.plots svg{margin:0 12px 12px 0}
.frame{fill:none;stroke:#bbb}.title{font-weight:600;font-size:13px}.tick{font-size:11px;fill:#555}
figure{display:inline-block;margin:0 16px 16px 0}
img{min-width:360px;image-rendering:pixelated}figcaption{font-size:12px;color:#555}"""


def write_report(run_dir: str | Path) -> Path:
    """Write `run_dir/report.html` (atomically: a reader never sees half a page) and return its path."""
    run_dir = Path(run_dir)
    config_path = run_dir / "configs" / "project.yaml"
    config_text = config_path.read_text(encoding="utf-8") if config_path.is_file() else ""
    config = yaml.safe_load(config_text) or {} if config_text else {}
    plan, end = _said(run_dir)
    logger = ((config.get("lightning") or {}).get("callbacks") or {}).get("image_logger") or {}
    prompts = (logger.get("params") or {}).get("prompts") or []
    figures = "".join(
        f'<figure><img alt="samples at step {step}" src="data:image/png;base64,'
        f'{base64.b64encode(path.read_bytes()).decode()}"><figcaption>step {step:,}</figcaption></figure>'
        for step, path in _grids(run_dir)
    )
    total = len(list((run_dir / "images").glob("step_*.png")))
    shown = f" ({MAX_GRIDS} of {total}, evenly spaced)" if total > MAX_GRIDS else ""
    body = [
        f"<h1>{html.escape(run_dir.name)}</h1>",
        f"<pre>{html.escape(chr(10).join(plan + end)) or 'no plan logged yet'}</pre>",
        f'<h2>Training</h2><div class="plots">{"".join(_plots(read_metrics(run_dir))) or "no metrics yet"}</div>',
        f"<h2>Samples{shown}</h2>",
        f"<p>Rows, top to bottom: {html.escape('; '.join(prompts))}</p>" if prompts else "",
        figures or "<p>No sample grids (lightning.callbacks.image_logger).</p>",
        f"<h2>Checkpoints</h2>{_checkpoints(run_dir, config)}",
        f"<h2>Skipped files</h2>{_bad_samples(run_dir)}",
        f"<h2>Config</h2><pre>{html.escape(config_text)}</pre>",
    ]
    page = (
        f'<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(run_dir.name)}</title>'
        f"<style>{STYLE}</style></head><body>{''.join(body)}</body></html>"
    )
    final = run_dir / REPORT
    partial = final.with_name(f".{REPORT}.{os.getpid()}-{threading.get_ident()}.partial")  # writers never share it
    partial.write_text(page, encoding="utf-8")
    os.replace(partial, final)
    return final


class Report(pl.Callback):
    """Write the report after each checkpoint (on global rank 0; the end of the run is `ldm.training.run`'s)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self._seen = Path(run_dir), None

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        saved = getattr(trainer.checkpoint_callback, "last_saved", None)
        if saved is None or saved == self._seen or not trainer.is_global_zero:
            return
        self._seen = saved
        for logger in trainer.loggers:
            logger.save()  # the metrics the CSV logger still buffers
        write_report(self.run_dir)
