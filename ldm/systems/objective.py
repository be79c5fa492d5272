"""What a denoiser learns (`Objective`) and, for flow matching, the loss of one batch with its settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ldm import diffusion
from ldm.backbones import as_denoiser
from ldm.config import ConfigError

FLOW_SAMPLING = ("logit_normal", "mode", "uniform")
FLOW_WEIGHTING = ("none", "sigma_sqrt", "cosmap")


@dataclass
class Objective:
    """What the denoiser learns: DDPM (Ho et al. 2020; the scheduler's prediction type, Min-SNR weighting);
    EDM (Karras et al. 2022) with log-normal noise levels, optionally on a `mask_ratio` share of patches dropped
    after a patch mixer (MicroDiT, Sehwag et al. 2024; the denoiser then has `num_patches` and takes `keep`); or
    flow matching (Lipman et al. 2023; Esser et al. 2024), the denoiser predicting the velocity noise - x0,
    noise levels drawn by `sampling` and shifted by `shift` (None: the scheduler's; "resolution": by the image's
    token count), the loss weighted by `weighting` (`ldm.diffusion.flow_loss`)."""

    kind: str = "ddpm"  # ddpm | edm | flow
    p_mean: float = -0.6
    p_std: float = 1.2
    sigma_data: float = 0.9
    mask_ratio: float = 0.0
    zero_unconditional: bool = False  # a dropped caption's conditioning is zeros, not the empty caption's
    noise_offset: float = 0.0  # DDPM: offset noise (`ldm.diffusion.ddpm_loss`)
    sampling: str = "logit_normal"  # flow: how noise levels are drawn
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29
    shift: float | str | None = None
    weighting: str = "none"


def check_flow_settings(flow: dict, key: str = "model.params.flow") -> None:
    """Raise `ConfigError` naming the key of a flow-matching setting that cannot be."""
    if flow.get("sampling", "logit_normal") not in FLOW_SAMPLING:
        raise ConfigError(f"{key}.sampling: got {flow['sampling']!r}; valid: {', '.join(FLOW_SAMPLING)}")
    if flow.get("weighting", "none") not in FLOW_WEIGHTING:
        raise ConfigError(f"{key}.weighting: got {flow['weighting']!r}; valid: {', '.join(FLOW_WEIGHTING)}")
    if flow.get("logit_std", 1.0) <= 0:
        raise ConfigError(f"{key}.logit_std: got {flow['logit_std']}; must be positive")
    shift = flow.get("shift")
    if shift is not None and shift != "resolution" and not (isinstance(shift, (int, float)) and shift > 0):
        raise ConfigError(f"{key}.shift: got {shift!r}; a positive number, 'resolution', or null (the scheduler's)")


def is_flow_scheduler(scheduler: Any) -> bool:
    """Whether `scheduler` samples a flow-matching model (diffusers' `FlowMatch*` schedulers)."""
    return type(scheduler).__name__.startswith("FlowMatch")


def flow_shift(objective: Objective, scheduler: Any, module: torch.nn.Module, latents: torch.Tensor) -> float:
    """The shift of this batch's noise levels: the objective's number; else by the image's token count (its
    latent cells per patch of the denoiser) where the objective says "resolution" or the scheduler shifts
    dynamically, on the scheduler's line (base and max token counts and shifts); else the scheduler's static one."""
    config = scheduler.config
    if isinstance(objective.shift, (int, float)):
        return float(objective.shift)
    if objective.shift == "resolution" or config.get("use_dynamic_shifting"):
        patch = int(getattr(getattr(module, "config", None), "patch_size", None) or 1)
        tokens = (latents.shape[-2] // patch) * (latents.shape[-1] // patch)
        return diffusion.resolution_shift(
            tokens,
            config.get("base_image_seq_len", 256),
            config.get("max_image_seq_len", 4096),
            config.get("base_shift", 0.5),
            config.get("max_shift", 1.15),
        )
    return float(config.get("shift", 1.0))


def flow_loss(
    objective: Objective,
    scheduler: Any,
    module: torch.nn.Module,
    latents: torch.Tensor,
    cond: dict,
    draws: diffusion.Draws,
) -> torch.Tensor:
    """The flow-matching loss of one batch (`ldm.diffusion.flow_loss`) with the objective's settings."""
    return diffusion.flow_loss(
        as_denoiser(module),
        latents,
        cond,
        objective.sampling,
        objective.logit_mean,
        objective.logit_std,
        objective.mode_scale,
        flow_shift(objective, scheduler, module, latents),
        objective.weighting,
        int(scheduler.config.get("num_train_timesteps", 1000)),
        draws,
    )
