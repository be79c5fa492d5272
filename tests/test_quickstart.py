"""The quickstart's whole path, shortened: both stages, export, samples grid, scores, and what it prints."""

import json
import subprocess
import sys
from pathlib import Path

from diffusers import StableDiffusionPipeline

REPO = Path(__file__).resolve().parents[1]
# What other libraries print that the quickstart must not: warnings, Lightning's summary table and tip, the
# scheduler deprecation our own config once caused.
NOISE = ("Warning", "┏", "Trainable params", "Tip:", "steps_offset", "LeafSpec", "available:")


def test_quickstart_smoke(tmp_path):
    command = [sys.executable, "-m", "examples.digits", "--out", str(tmp_path), "--autoencoder-steps", "2",
               "--ldm-steps", "2", "--samples-per-digit", "1"]  # fmt: skip
    done = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    said = done.stdout
    assert done.returncode == 0, said[-3000:]
    lines = said.split("\n")  # a progress bar redraws its line with "\r": one line on a terminal
    assert len(lines) < 40, said
    assert [noise for noise in NOISE if noise in said] == [], said
    for story, times in (("run folder: ", 2), ("plan:", 2), ("done: step 2 of 2, 2 steps in", 2), ("checkpoint: ", 2),
                         ("throughput: ", 2), ("prompt accuracy ", 1)):  # fmt: skip
        assert sum(line.startswith(story) for line in lines) == times, (story, said)
    report = json.loads((tmp_path / "report.json").read_text())
    assert 0.0 <= report["prompt_accuracy"] <= 1.0 and len(report["per_digit"]) == 10
    assert report["latent_scaling_factor"] > 0
    from PIL import Image

    grid = Image.open(tmp_path / "samples.png")
    assert grid.height == 10 * 32 and grid.width > 32, "one 32 px row per digit, labels on the left"
    pipe = StableDiffusionPipeline.from_pretrained(tmp_path / "pipeline", local_files_only=True)
    assert pipe.vae.config.in_channels == 1
    assert pipe.vae.config.scaling_factor == report["latent_scaling_factor"]
    assert pipe.tokenizer.model_max_length == 16
    (autoencoder_log,) = (tmp_path / "logs").glob("*_digits-autoencoder/train.log")
    assert "throughput" in autoencoder_log.read_text() and "digits-ldm" not in autoencoder_log.read_text()
