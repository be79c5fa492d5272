"""The quickstart's whole path, shortened: both stages, export, samples grid, scores."""

import json

from diffusers import StableDiffusionPipeline

from examples.digits.quickstart import run_quickstart


def test_quickstart_smoke(tmp_path):
    report = run_quickstart(tmp_path, autoencoder_steps=2, ldm_steps=2, samples_per_digit=1)
    assert json.loads((tmp_path / "report.json").read_text()) == report
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
