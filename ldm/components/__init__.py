"""The parts of a latent text-to-image model: how they are built, described, tokenized, adapted, laid out."""

from __future__ import annotations

from typing import Any

import torch


class Parts(dict):
    """A model's parts by name, as a diffusers pipeline names its components (`unet`, `vae`,
    `text_encoder`, `tokenizer`, `scheduler`; a second text encoder would be `text_encoder_2`).

    A dict, so a family can have parts another lacks; `parts.unet` reads `parts["unet"]`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"these parts have no {name!r}; they have {', '.join(self)}") from None

    def __setattr__(self, name: str, value: Any) -> None:
        self[name] = value

    @property
    def networks(self) -> dict[str, torch.nn.Module]:
        """The parts that are networks (have weights), in order."""
        return {name: part for name, part in self.items() if isinstance(part, torch.nn.Module)}


def vae_downscale(vae_config: Any) -> int:
    """How many pixels a latent cell spans along each side: 2 to the power of the VAE's downsampling stages (its
    blocks less one), the `vae_scale_factor` diffusers' pipelines compute. The one place ldm computes it."""
    return 2 ** (len(vae_config.block_out_channels) - 1)
