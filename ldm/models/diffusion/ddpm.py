"""The config path users' configs carry, `target: ldm.models.diffusion.ddpm.LatentDiffusion` (as in the
CompVis and Colossal-AI Stable Diffusion configs): it names the factory in `ldm.training.model`,
which builds the system `ldm.systems.latent_diffusion.LatentDiffusion` from `model.params`."""

from ldm.training.model import latent_diffusion as LatentDiffusion  # noqa: N812

__all__ = ["LatentDiffusion"]
