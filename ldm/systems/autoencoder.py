"""`AutoencoderTraining`: train a diffusers `AutoencoderKL` from scratch (the first stage of an LDM).

Loss: pixel MSE plus a small KL term towards N(0, I) (Rombach et al. 2022, sec. 3.1, without
the perceptual and adversarial terms, which small images do not need).
"""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from ldm.components.build import PartSpec, build_part
from ldm.utils.atomic import honour_umask


class AutoencoderTraining(pl.LightningModule):
    """Reconstruct images through the KL-regularised latent bottleneck."""

    def __init__(self, vae: PartSpec | torch.nn.Module, learning_rate: float = 1e-3, kl_weight: float = 1e-6) -> None:
        super().__init__()
        self.vae = build_part("vae", vae, "model.params.vae") if isinstance(vae, dict) else vae
        self.learning_rate, self.kl_weight = learning_rate, kl_weight
        self.run_config: dict | None = None

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        images = batch["pixel_values"]
        posterior = self.vae.encode(images).latent_dist
        reconstruction = self.vae.decode(posterior.sample()).sample
        mse = F.mse_loss(reconstruction, images)
        kl = posterior.kl().mean() / images[0].numel()
        loss = mse + self.kl_weight * kl
        self.log_dict({"train/loss": loss, "train/mse": mse}, prog_bar=True, batch_size=images.shape[0])
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.vae.parameters(), lr=self.learning_rate)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["ldm"] = {"config": self.run_config, "parts": {"vae": {"config": dict(self.vae.config)}}}


@torch.no_grad()
def save_calibrated_vae(vae: torch.nn.Module, images: torch.Tensor, out_dir: str | Path) -> float:
    """Set `scaling_factor` to 1 / std of the latents of `images` (Rombach et al. 2022, sec. 4.3.2), save.

    Returns the factor. The diffusion model then sees latents of unit variance.
    """
    vae.eval()
    latents = torch.cat([vae.encode(chunk).latent_dist.mean for chunk in images.split(256)])
    factor = float(1.0 / latents.std())
    vae.register_to_config(scaling_factor=factor)
    vae.save_pretrained(out_dir, safe_serialization=True)
    honour_umask(out_dir)
    return factor
