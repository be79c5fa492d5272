"""The diffusers `UNet2DConditionModel` (with its added conditioning, where a family has it) as a denoiser."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from diffusers import UNet2DConditionModel

ADDED = ("text_embeds", "time_ids")  # the UNet's `added_cond_kwargs`: a pooled text embedding, size / crop ids


@dataclass(frozen=True)
class UNetDenoiser:
    """Call a UNet as `denoiser(noisy, t, cond) -> prediction`; the UNet itself stays the trained module."""

    unet: UNet2DConditionModel

    def __call__(self, noisy: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        added = {k: cond[k] for k in ADDED if k in cond}
        return self.unet(
            noisy, t, encoder_hidden_states=cond["encoder_hidden_states"], added_cond_kwargs=added or None
        ).sample
