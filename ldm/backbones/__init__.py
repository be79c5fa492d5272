"""Denoisers behind one call: `denoiser(noisy, t, cond) -> prediction`.

`cond` is a mapping of conditioning tensors: `encoder_hidden_states` (the caption tokens) and, for
models that take them, `text_embeds` (a pooled embedding) and `time_ids` (a family's size and
crop conditioning). A diffusers `UNet2DConditionModel` is adapted to the call by `ldm.backbones.unet`;
any other network is expected to take the call as its `forward(noisy, t, cond)`.
"""

from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel

from ldm.backbones.transformer import TransformerDenoiser, is_diffusers_transformer
from ldm.backbones.unet import UNetDenoiser
from ldm.diffusion import Denoiser


def as_denoiser(module: torch.nn.Module) -> Denoiser:
    """`module` as a callable `(noisy, t, cond) -> prediction`."""
    if isinstance(module, UNet2DConditionModel):
        return UNetDenoiser(module)
    if is_diffusers_transformer(module):
        return TransformerDenoiser(module)
    return module
