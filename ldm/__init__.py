"""ldm: cheap fine-tuning and pretraining of latent text-to-image diffusion models."""

__version__ = "0.1.0"
