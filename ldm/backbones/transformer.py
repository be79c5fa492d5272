"""A diffusers transformer as a denoiser: its `forward` takes the noisy latents as `hidden_states`, the `timestep`,
and the conditioning by name (`encoder_hidden_states`, `pooled_projections`, ...), as a family's conditioning
makes it (`ldm.families`)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from dataclasses import dataclass

import torch


def is_diffusers_transformer(module: torch.nn.Module) -> bool:
    """Whether `module`'s forward is a diffusers transformer's: `hidden_states` and `timestep` by name."""
    return _takes_hidden_states(type(module))


@functools.cache
def _takes_hidden_states(cls: type) -> bool:
    """Per class, once: `as_denoiser` asks at every training step."""
    parameters = inspect.signature(cls.forward).parameters
    return "hidden_states" in parameters and "timestep" in parameters


@dataclass(frozen=True)
class TransformerDenoiser:
    """Call a diffusers transformer as `denoiser(noisy, t, cond) -> prediction`; it stays the trained module."""

    transformer: torch.nn.Module

    def __call__(self, noisy: torch.Tensor, t: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.transformer(hidden_states=noisy, timestep=t, **cond, return_dict=False)[0]
