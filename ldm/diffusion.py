"""Diffusion training math as pure functions: DDPM (Ho et al. 2020) of `alphas_cumprod`, EDM (Karras et
al. 2022) of noise levels sigma, and flow matching (rectified flow, Esser et al. 2024).

The DDPM objective is chosen by data: the prediction type (epsilon | v_prediction) and the loss weighting
(`snr_gamma`: Min-SNR, or plain MSE); `ddpm_loss` is one training step's loss for any denoiser. Those
functions work for any noise schedule, need no scheduler object, and are tested against diffusers'
`add_noise`, `get_velocity` and `training_utils.compute_snr`.

`edm_loss` is one EDM training step: log-normal noise levels, the preconditioning of Karras et al. table 1,
their loss weighting, and optionally the loss over the patches a masked denoiser kept (MicroDiT, Sehwag et
al. 2024), each patch the mean of its pixels' losses.

`flow_loss` is one flow-matching step (Esser et al. 2024, "Scaling Rectified Flow Transformers"): the noisy
input (1 - sigma) x + sigma noise, the velocity noise - x as the target, sigma drawn logit-normal, by the paper's
"mode" density or uniformly, then shifted (a static shift, the paper's 3.0, or `resolution_shift` of the image's
token count), and the loss weighted by none, `sigma_sqrt` or `cosmap`. These are checked against
diffusers' `training_utils.compute_density_for_timestep_sampling` / `compute_loss_weighting_for_sd3` and
`FlowMatchEulerDiscreteScheduler`. One difference of orientation: the draw is the noise level itself, as in the
paper and sd-scripts; diffusers' training script uses it as an index into its descending timestep table, which
turns a positive `logit_mean` (more noise here) into less noise (the default mean 0 draws the same either way).

Every random number of a step comes from a `Draws`: the global generator by default, or one generator per
sample keyed by (seed, step, sample id) (`sample_keys`), so that a sample's noise does not depend on which
process or batch it is trained in: the same global batch then trains the same at any number of processes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

PREDICTION_TYPES = ("epsilon", "v_prediction")
FLOW_SAMPLINGS = ("logit_normal", "mode", "uniform")  # how flow matching draws its noise levels
FLOW_WEIGHTINGS = ("none", "sigma_sqrt", "cosmap")  # how it weights each sample's loss
Denoiser = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], torch.Tensor]


class Draws:
    """Where one training step's random numbers come from. Without `keys`: the global generator, drawing as
    `torch.randn` / `rand` / `randint` do over the batch. With `keys` (one per sample, see `sample_keys`): each
    sample's numbers from its own generator seeded by its key, in the order the step asks for them, so a
    sample's draws do not depend on the batch, position or process it is trained in."""

    def __init__(self, keys: Sequence[int] | None = None) -> None:
        self.keys = None if keys is None else [int(key) for key in keys]
        self._generators: dict[torch.device, list[torch.Generator]] = {}

    def _per_sample(self, batch: int, device: torch.device | str | None) -> list[torch.Generator]:
        if len(self.keys) != batch:
            raise ValueError(f"Draws: {len(self.keys)} sample keys for a batch of {batch}")
        device = torch.device(device or "cpu")
        if device not in self._generators:
            self._generators[device] = [torch.Generator(device).manual_seed(key) for key in self.keys]
        return self._generators[device]

    def normal(
        self, batch: int, shape: Sequence[int] = (), device: torch.device | str | None = None, dtype=torch.float32
    ) -> torch.Tensor:
        """(batch, *shape) standard normal numbers."""
        if self.keys is None:
            return torch.randn(batch, *shape, device=device, dtype=dtype)
        return torch.stack(
            [
                torch.randn(tuple(shape), device=device, dtype=dtype, generator=g)
                for g in self._per_sample(batch, device)
            ]
        )

    def uniform(self, batch: int, shape: Sequence[int] = (), device: torch.device | str | None = None) -> torch.Tensor:
        """(batch, *shape) numbers uniform in [0, 1)."""
        if self.keys is None:
            return torch.rand(batch, *shape, device=device)
        generators = self._per_sample(batch, device)
        return torch.stack([torch.rand(tuple(shape), device=device, generator=g) for g in generators])

    def integers(self, high: int, batch: int, device: torch.device | str | None = None) -> torch.Tensor:
        """(batch,) integers uniform in [0, high)."""
        if self.keys is None:
            return torch.randint(0, high, (batch,), device=device)
        generators = self._per_sample(batch, device)
        return torch.cat([torch.randint(0, high, (1,), device=device, generator=g) for g in generators])


def sample_keys(seed: int, step: int, sample_ids: Sequence[int]) -> list[int]:
    """One generator seed per sample, a function of (seed, step, sample id) alone (numpy's `SeedSequence`
    mixes them): the keys of `Draws`."""
    return [int(np.random.SeedSequence([seed, step, int(i)]).generate_state(1, np.uint64)[0]) for i in sample_ids]


GLOBAL_DRAWS = Draws()


def _gather(alphas_cumprod: torch.Tensor, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    a = alphas_cumprod.to(device=like.device, dtype=torch.float32)[timesteps.to(like.device)]
    return a.reshape(-1, *([1] * (like.ndim - 1)))


def sample_posterior(mean: torch.Tensor, std: torch.Tensor | None, draws: Draws = GLOBAL_DRAWS) -> torch.Tensor:
    """A latent drawn from the VAE's diagonal Gaussian posterior, mean + std * N(0, 1), as diffusers'
    `latent_dist.sample()` and CompVis' `encode_first_stage` draw it; the mean itself when `std` is None.
    The normal draw is in logical order, so a channels-last `mean` gets the same draw as a contiguous one."""
    if std is None:
        return mean
    return mean + std * draws.normal(mean.shape[0], mean.shape[1:], mean.device, mean.dtype)


def add_noise(
    x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor
) -> torch.Tensor:
    """Sample q(x_t | x_0) = sqrt(a_t) x_0 + sqrt(1 - a_t) noise (DDPM eq. 4)."""
    a = _gather(alphas_cumprod, timesteps, x0)
    return (a.sqrt() * x0.float() + (1 - a).sqrt() * noise.float()).to(x0.dtype)


def velocity(
    x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor
) -> torch.Tensor:
    """The v-prediction target v = sqrt(a_t) noise - sqrt(1 - a_t) x_0 (Salimans & Ho 2022, sec. 4)."""
    a = _gather(alphas_cumprod, timesteps, x0)
    return (a.sqrt() * noise.float() - (1 - a).sqrt() * x0.float()).to(x0.dtype)


def training_target(
    x0: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, prediction_type: str
) -> torch.Tensor:
    """What the denoiser should output for `prediction_type`: the noise, or the velocity."""
    if prediction_type == "epsilon":
        return noise
    if prediction_type == "v_prediction":
        return velocity(x0, noise, timesteps, alphas_cumprod)
    raise ValueError(f"prediction_type must be one of {PREDICTION_TYPES}, got {prediction_type!r}")


def snr(timesteps: torch.Tensor, alphas_cumprod: torch.Tensor) -> torch.Tensor:
    """Signal-to-noise ratio a_t / (1 - a_t) of each timestep."""
    a = alphas_cumprod.to(torch.float32)[timesteps.to(alphas_cumprod.device)]
    return a / (1 - a)


def min_snr_weights(
    timesteps: torch.Tensor, alphas_cumprod: torch.Tensor, gamma: float, prediction_type: str
) -> torch.Tensor:
    """Per-sample loss weights of Min-SNR-gamma (Hang et al. 2023, eq. 9) for the given target."""
    s = snr(timesteps, alphas_cumprod)
    clipped = torch.minimum(s, torch.full_like(s, gamma))
    return clipped / (s + 1) if prediction_type == "v_prediction" else clipped / s


def diffusion_loss(prediction: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error per sample, optionally weighted per sample, averaged over the batch."""
    per_sample = F.mse_loss(prediction.float(), target.float(), reduction="none").flatten(1).mean(1)
    if weights is not None:
        per_sample = per_sample * weights.to(per_sample)
    return per_sample.mean()


def ddpm_loss(
    denoiser: Denoiser,
    x0: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    alphas_cumprod: torch.Tensor,
    prediction_type: str,
    snr_gamma: float | None = None,
    draws: Draws = GLOBAL_DRAWS,
    noise_offset: float = 0.0,
) -> torch.Tensor:
    """The DDPM training loss of `denoiser(noisy, t, cond) -> prediction` on clean latents `x0`
    (Ho et al. 2020, algorithm 1): a uniform timestep and Gaussian noise per sample, the target of
    `prediction_type`, Min-SNR-gamma weights when `snr_gamma` is set. `noise_offset` adds that much of one
    Gaussian number per sample and channel to the noise (offset noise, Guttenberg 2023), so that the model
    learns to move an image's mean, which plain noise hardly changes: very dark or bright images.

    The noise is drawn in logical order whatever `x0`'s memory layout (VAE outputs can be channels-last),
    so cached and freshly encoded latents get the same noise."""
    noise = draws.normal(x0.shape[0], x0.shape[1:], x0.device, x0.dtype)
    if noise_offset:
        noise = noise + noise_offset * draws.normal(x0.shape[0], (x0.shape[1], 1, 1), x0.device, x0.dtype)
    t = draws.integers(len(alphas_cumprod), x0.shape[0], x0.device)
    prediction = denoiser(add_noise(x0, noise, t, alphas_cumprod), t, cond)
    target = training_target(x0, noise, t, alphas_cumprod, prediction_type)
    weights = None if snr_gamma is None else min_snr_weights(t, alphas_cumprod, snr_gamma, prediction_type)
    return diffusion_loss(prediction, target, weights)


def edm_sigmas(z: torch.Tensor, p_mean: float, p_std: float) -> torch.Tensor:
    """Training noise levels, log-normal: ln sigma = p_mean + p_std z for standard normal z, so ln sigma ~
    N(p_mean, p_std^2) (Karras et al. 2022, table 1)."""
    return (z * p_std + p_mean).exp()


def edm_scalings(sigma: torch.Tensor, sigma_data: float) -> tuple[torch.Tensor, ...]:
    """EDM's preconditioning of a network F (Karras et al. 2022, table 1 and eq. 7): the denoised estimate is
    `c_skip * x + c_out * F(c_in * x, c_noise)`. Returns (c_skip, c_out, c_in, c_noise), each shaped like
    `sigma`; c_noise = ln(sigma) / 4."""
    total = sigma**2 + sigma_data**2
    return sigma_data**2 / total, sigma * sigma_data / total.sqrt(), 1 / total.sqrt(), sigma.log() / 4


def edm_weight(sigma: torch.Tensor, sigma_data: float) -> torch.Tensor:
    """EDM's loss weighting lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 (Karras et al.
    2022, table 1): the denoiser's error scaled to unit variance at every noise level."""
    return (sigma**2 + sigma_data**2) / (sigma * sigma_data) ** 2


def random_keep(
    batch: int,
    num_patches: int,
    mask_ratio: float,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    draws: Draws | None = None,
) -> torch.Tensor:
    """A uniformly random subset of `round((1 - mask_ratio) * num_patches)` patch indices per sample, sorted,
    as a LongTensor (batch, K): the patches deferred masking keeps (Sehwag et al. 2024, section 3). The scores
    come from `generator`, or `draws`, or the global generator."""
    if not 0 <= mask_ratio < 1:
        raise ValueError(f"random_keep: mask_ratio={mask_ratio}; it must be in [0, 1)")
    kept = round((1 - mask_ratio) * num_patches)
    if kept < 1:
        raise ValueError(f"random_keep: mask_ratio={mask_ratio} of {num_patches} patches keeps none; lower it")
    if generator is not None:
        scores = torch.rand(batch, num_patches, generator=generator, device=generator.device)
    else:
        scores = (draws or GLOBAL_DRAWS).uniform(batch, (num_patches,), device)
    return scores.argsort(dim=1)[:, :kept].sort(dim=1).values


def patch_means(per_pixel: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) values as the mean over each `patch_size` x `patch_size` patch and its channels: (B, N),
    patches row by row, the order a patch embedding flattens them in."""
    batch, channels, height, width = per_pixel.shape
    p = patch_size
    patches = per_pixel.reshape(batch, channels, height // p, p, width // p, p)
    return patches.mean(dim=(1, 3, 5)).flatten(1)


def edm_loss(
    denoiser: Callable[..., torch.Tensor],
    x0: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    p_mean: float,
    p_std: float,
    sigma_data: float,
    keep: torch.Tensor | None = None,
    patch_size: int = 1,
    draws: Draws = GLOBAL_DRAWS,
) -> torch.Tensor:
    """The EDM training loss (Karras et al. 2022, eq. 2 with table 1's choices) of a network
    `denoiser(c_in * noisy, c_noise, cond) -> F` on clean latents `x0`: sigma log-normal per sample, the
    preconditioned estimate `c_skip * noisy + c_out * F` against `x0`, weighted by `edm_weight`.

    With `keep` (B, K), the patch indices a masked denoiser keeps (it is called with `keep=`), the loss is
    over those patches only: each the mean of its pixels' weighted squared errors, averaged over the kept
    patches and the batch (deferred masking, Sehwag et al. 2024). Without, over every pixel."""
    sigma = edm_sigmas(draws.normal(x0.shape[0], (), x0.device), p_mean, p_std)
    noise = draws.normal(x0.shape[0], x0.shape[1:], x0.device, x0.dtype)
    shaped = sigma.reshape(-1, *([1] * (x0.ndim - 1)))
    noisy = x0.float() + shaped * noise.float()
    c_skip, c_out, c_in, c_noise = edm_scalings(shaped, sigma_data)
    masked = {} if keep is None else {"keep": keep}
    out = denoiser((c_in * noisy).to(x0.dtype), c_noise.reshape(-1), cond, **masked)
    denoised = c_skip * noisy + c_out * out.float()
    per_pixel = edm_weight(shaped, sigma_data) * (denoised - x0.float()) ** 2
    if keep is None:
        return per_pixel.mean()
    return torch.gather(patch_means(per_pixel, patch_size), 1, keep).mean()


# ----------------------------------------------------------------------------------------------- flow matching


def flow_noisy(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """The flow-matching input at noise level `sigma` (one per sample): (1 - sigma) x0 + sigma noise, the straight
    path from the data (sigma 0) to pure noise (sigma 1); diffusers' `FlowMatchEulerDiscreteScheduler.scale_noise`."""
    shaped = sigma.reshape(-1, *([1] * (x0.ndim - 1))).float()
    return ((1 - shaped) * x0.float() + shaped * noise.float()).to(x0.dtype)


def flow_velocity(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """The flow-matching target, the velocity d(noisy)/d(sigma) = noise - x0, which the model predicts."""
    return (noise.float() - x0.float()).to(x0.dtype)


def flow_levels(
    sampling: str,
    batch: int,
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    draws: Draws = GLOBAL_DRAWS,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(batch,) noise levels in (0, 1) before any shift (Esser et al. 2024, section 3.1):
    `logit_normal`, sigmoid of N(logit_mean, logit_std^2) (the paper's: 0, 1); `mode`, u uniform mapped by
    1 - u - mode_scale (cos^2(pi u / 2) - 1 + u), which favours the middle for a positive scale (the paper's: 1.29);
    `uniform`. The numbers of diffusers' `compute_density_for_timestep_sampling` for the same draws."""
    if sampling == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * draws.normal(batch, (), device))
    if sampling not in FLOW_SAMPLINGS:
        raise ValueError(f"flow sampling must be one of {FLOW_SAMPLINGS}, got {sampling!r}")
    u = draws.uniform(batch, (), device)
    if sampling == "mode":
        return 1 - u - mode_scale * (torch.cos(torch.pi * u / 2) ** 2 - 1 + u)
    return u


def shift_sigmas(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """Noise levels moved towards 1 by `shift` (the paper's 3.0; 1 leaves them): shift sigma / (1 + (shift - 1) sigma),
    the sigmas of diffusers' `FlowMatchEulerDiscreteScheduler(shift=...)`. Higher resolutions need more noise to
    hide the same image (Esser et al. 2024, section 5.3.2)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def resolution_shift(
    tokens: int, base_tokens: int = 256, max_tokens: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15
) -> float:
    """The shift that follows an image's token count: mu on the line through (base_tokens,
    base_shift) and (max_tokens, max_shift) (diffusers' `calculate_shift`), and exp(mu) as `shift_sigmas`' shift,
    which equals the scheduler's exponential `time_shift(mu, 1, sigma)`."""
    slope = (max_shift - base_shift) / (max_tokens - base_tokens)
    return math.exp(base_shift + slope * (tokens - base_tokens))


def flow_weight(sigma: torch.Tensor, weighting: str) -> torch.Tensor:
    """Per-sample loss weights of diffusers' `compute_loss_weighting_for_sd3`: `none` 1, `sigma_sqrt` 1 / sigma^2,
    `cosmap` 2 / (pi (1 - 2 sigma + 2 sigma^2))."""
    if weighting == "none":
        return torch.ones_like(sigma)
    if weighting == "sigma_sqrt":
        return sigma.float() ** -2
    if weighting == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma.float() + 2 * sigma.float() ** 2))
    raise ValueError(f"flow weighting must be one of {FLOW_WEIGHTINGS}, got {weighting!r}")


def flow_loss(
    denoiser: Denoiser,
    x0: torch.Tensor,
    cond: Mapping[str, torch.Tensor],
    sampling: str = "logit_normal",
    logit_mean: float = 0.0,
    logit_std: float = 1.0,
    mode_scale: float = 1.29,
    shift: float = 1.0,
    weighting: str = "none",
    num_train_timesteps: int = 1000,
    draws: Draws = GLOBAL_DRAWS,
) -> torch.Tensor:
    """The flow-matching training loss of `denoiser(noisy, t, cond) -> velocity` on clean latents `x0`: a noise
    level per sample (`flow_levels`, then `shift_sigmas`), Gaussian noise, the timestep t = sigma *
    `num_train_timesteps` (the scale diffusers' flow-matching transformers take), and the squared error against
    `flow_velocity`, weighted per sample by `flow_weight`. The noise level is drawn before the noise."""
    sigma = shift_sigmas(flow_levels(sampling, x0.shape[0], logit_mean, logit_std, mode_scale, draws, x0.device), shift)
    noise = draws.normal(x0.shape[0], x0.shape[1:], x0.device, x0.dtype)
    prediction = denoiser(flow_noisy(x0, noise, sigma), sigma * num_train_timesteps, cond)
    return diffusion_loss(prediction, flow_velocity(x0.float(), noise.float()), flow_weight(sigma, weighting))
