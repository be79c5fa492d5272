"""The quickstart: a tiny autoencoder, then a tiny text-to-image LDM, trained on handwritten digits on a CPU."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from PIL import Image

from examples.digits.data import DigitsDataset, digit_prompts
from ldm.export import export_pipeline, load_pipeline
from ldm.sampling import image_grid
from ldm.training.run import train
from ldm.weights.checkpoint import load_checkpoint

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "quickstart"


def load_trained_vae(ckpt_path: Path) -> torch.nn.Module:
    """The autoencoder from a stage-1 checkpoint."""
    from diffusers import AutoencoderKL

    ckpt = load_checkpoint(ckpt_path)
    vae = AutoencoderKL.from_config(ckpt["ldm"]["parts"]["vae"]["config"])
    vae.load_state_dict({k.removeprefix("vae."): v for k, v in ckpt["state_dict"].items()})
    return vae


def train_autoencoder(out: Path, steps: int | None = None) -> float:
    """Stage 1: train the digits autoencoder, save it calibrated to `out/vae`; returns its latent scale."""
    from ldm.systems.autoencoder import save_calibrated_vae

    overrides = [f"lightning.trainer.max_steps={steps}"] if steps else []
    run = train([str(CONFIGS / "digits-autoencoder.yaml")], overrides, out / "logs", "digits-autoencoder", seed=0)
    vae = load_trained_vae(run / "checkpoints" / "last.ckpt")
    return save_calibrated_vae(vae, DigitsDataset().images, out / "vae")


def run_quickstart(
    out: Path, autoencoder_steps: int | None = None, ldm_steps: int | None = None, samples_per_digit: int = 10
) -> dict:
    """Train both stages, export the pipeline, draw `samples.png` and score it; returns the report."""
    from examples.digits.judge import evaluate_pipeline

    out.mkdir(parents=True, exist_ok=True)
    report: dict = {}
    start = time.perf_counter()
    report["latent_scaling_factor"] = train_autoencoder(out, autoencoder_steps)
    report["autoencoder_seconds"] = round(time.perf_counter() - start, 1)

    overrides = [f"model.params.vae.pretrained={out / 'vae'}"]
    overrides += [f"lightning.trainer.max_steps={ldm_steps}"] if ldm_steps else []
    run = train([str(CONFIGS / "digits-ldm.yaml")], overrides, out / "logs", "digits-ldm", seed=0)
    export_pipeline(run / "checkpoints" / "last.ckpt", out / "pipeline")
    report["train_seconds"] = round(time.perf_counter() - start, 1)

    pipe = load_pipeline(out / "pipeline")
    pipe.set_progress_bar_config(disable=True)
    result = evaluate_pipeline(pipe, samples_per_digit=samples_per_digit, num_inference_steps=25, guidance_scale=5.0)
    samples = ((result.pop("samples").clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    images = [Image.fromarray(s[0].numpy(), mode="L") for s in samples]
    image_grid(images, rows=10, labels=digit_prompts()).save(out / "samples.png")
    report.update(prompt_accuracy=result["accuracy"], per_digit=result["per_digit"])
    report["total_seconds"] = round(time.perf_counter() - start, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    return report
