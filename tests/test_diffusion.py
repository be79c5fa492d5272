"""The diffusion math in `ldm.diffusion` agrees with diffusers' own implementations."""

import math

import numpy as np
import pytest
import torch
from diffusers import DDPMScheduler
from diffusers.training_utils import compute_snr

from ldm import diffusion


@pytest.fixture
def scheduler():
    return DDPMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, num_train_timesteps=1000)


@pytest.fixture
def batch():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(6, 4, 8, 8, generator=g)
    noise = torch.randn(6, 4, 8, 8, generator=g)
    t = torch.tensor([0, 1, 250, 500, 998, 999])
    return x0, noise, t


def test_add_noise_matches_diffusers(scheduler, batch):
    x0, noise, t = batch
    ours = diffusion.add_noise(x0, noise, t, scheduler.alphas_cumprod)
    torch.testing.assert_close(ours, scheduler.add_noise(x0, noise, t), rtol=1e-5, atol=1e-6)


def test_velocity_matches_diffusers(scheduler, batch):
    x0, noise, t = batch
    ours = diffusion.velocity(x0, noise, t, scheduler.alphas_cumprod)
    torch.testing.assert_close(ours, scheduler.get_velocity(x0, noise, t), rtol=1e-5, atol=1e-6)


def test_snr_matches_diffusers(scheduler, batch):
    _, _, t = batch
    torch.testing.assert_close(diffusion.snr(t, scheduler.alphas_cumprod), compute_snr(scheduler, t), rtol=1e-5, atol=0)


@pytest.mark.parametrize("prediction_type", ["epsilon", "v_prediction"])
def test_min_snr_weights_match_diffusers_recipe(scheduler, batch, prediction_type):
    _, _, t = batch
    s = compute_snr(scheduler, t)
    expected = torch.stack([s, 5.0 * torch.ones_like(s)], dim=1).min(dim=1)[0]
    expected = expected / (s + 1) if prediction_type == "v_prediction" else expected / s
    ours = diffusion.min_snr_weights(t, scheduler.alphas_cumprod, 5.0, prediction_type)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=0)
    assert ours[0] < ours[-1] if prediction_type == "epsilon" else True


def test_training_target(scheduler, batch):
    x0, noise, t = batch
    a = scheduler.alphas_cumprod
    assert diffusion.training_target(x0, noise, t, a, "epsilon") is noise
    torch.testing.assert_close(
        diffusion.training_target(x0, noise, t, a, "v_prediction"), diffusion.velocity(x0, noise, t, a)
    )
    with pytest.raises(ValueError, match="sample"):
        diffusion.training_target(x0, noise, t, a, "sample")


def test_diffusion_loss_weights():
    pred, target = torch.zeros(2, 3), torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    assert diffusion.diffusion_loss(pred, target).item() == pytest.approx(2.5)
    assert diffusion.diffusion_loss(pred, target, torch.tensor([1.0, 0.0])).item() == pytest.approx(0.5)


def test_sample_posterior_draws_as_diffusers_does():
    from diffusers.models.autoencoders.vae import DiagonalGaussianDistribution

    g = torch.Generator().manual_seed(1)
    moments = torch.randn(3, 8, 4, 4, generator=g)  # mean and log-variance, as the VAE's encoder outputs them
    posterior = DiagonalGaussianDistribution(moments)
    torch.manual_seed(7)
    expected = posterior.sample()
    torch.manual_seed(7)
    drawn = diffusion.sample_posterior(posterior.mean, posterior.std)
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)
    assert not torch.equal(drawn, posterior.mean)
    torch.manual_seed(7)
    state = torch.get_rng_state()
    assert diffusion.sample_posterior(posterior.mean, None) is posterior.mean
    assert torch.equal(torch.get_rng_state(), state), "the mean alone draws nothing"


@pytest.mark.parametrize(("prediction_type", "snr_gamma"), [("epsilon", None), ("v_prediction", 5.0)])
def test_ddpm_loss_is_the_diffusers_recipe_for_any_denoiser(scheduler, prediction_type, snr_gamma):
    """One step's loss for a denoiser behind the call `(noisy, t, cond) -> prediction`, as diffusers'
    train_text_to_image.py computes it from the same noise and timesteps."""
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    cond = {"encoder_hidden_states": torch.randn(4, 7, 4, generator=torch.Generator().manual_seed(2))}
    seen = {}

    def denoiser(noisy, t, c):
        seen.update(noisy=noisy, t=t, cond=c)
        return noisy * 0.5 + c["encoder_hidden_states"].mean((1, 2))[:, None, None, None]

    torch.manual_seed(3)
    loss = diffusion.ddpm_loss(denoiser, x0, cond, scheduler.alphas_cumprod, prediction_type, snr_gamma)
    torch.manual_seed(3)
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (4,))
    assert torch.equal(seen["t"], t) and seen["cond"] is cond
    torch.testing.assert_close(seen["noisy"], scheduler.add_noise(x0, noise, t))
    scheduler.register_to_config(prediction_type=prediction_type)
    target = noise if prediction_type == "epsilon" else scheduler.get_velocity(x0, noise, t)
    per_sample = ((denoiser(seen["noisy"], t, cond) - target) ** 2).mean((1, 2, 3))
    if snr_gamma is not None:  # diffusers: min(snr, gamma) / (snr + 1) for v-prediction
        snr = compute_snr(scheduler, t)
        per_sample = per_sample * torch.minimum(snr, torch.full_like(snr, snr_gamma)) / (snr + 1)
    torch.testing.assert_close(loss, per_sample.mean(), rtol=1e-5, atol=1e-6)


def test_edm_scalings_are_those_diffusers_edm_euler_samples_with():
    """diffusers' EDMEulerScheduler (epsilon: EDM's F-prediction) preconditions exactly as we train."""
    from diffusers import EDMEulerScheduler

    scheduler = EDMEulerScheduler(sigma_data=0.9, prediction_type="epsilon")
    sigma = torch.tensor([0.002, 0.3, 1.0, 7.5, 80.0], dtype=torch.float64)
    x = torch.randn(5, 4, 2, 2, dtype=torch.float64)
    out = torch.randn_like(x)
    c_skip, c_out, c_in, c_noise = (c.reshape(-1, 1, 1, 1) for c in diffusion.edm_scalings(sigma, 0.9))
    torch.testing.assert_close(c_in * x, scheduler.precondition_inputs(x, sigma.reshape(-1, 1, 1, 1)))
    torch.testing.assert_close(c_noise.reshape(-1), scheduler.precondition_noise(sigma))
    expected = scheduler.precondition_outputs(x, out, sigma.reshape(-1, 1, 1, 1))
    torch.testing.assert_close(c_skip * x + c_out * out, expected)


class RecordingNetwork:
    """A fixed nonlinear F that records what the loss called it with."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, x, c_noise, cond, **kwargs):
        self.calls.append((x.clone(), c_noise.clone(), kwargs))
        return torch.tanh(x) * 0.5 + cond["encoder_hidden_states"].mean() + c_noise.reshape(-1, 1, 1, 1)


def independent_edm_loss(x0, sigma, noise, network, sigma_data, keep=None, patch=1):
    """EDM's loss from its formulas, in float64 numpy, patch by patch in loops."""
    import numpy as np

    x0, noise, sigma = (np.asarray(a, np.float64) for a in (x0, noise, sigma))
    losses = []
    for b in range(x0.shape[0]):
        s = sigma[b]
        noisy = x0[b] + s * noise[b]
        c_in = 1 / np.sqrt(s**2 + sigma_data**2)
        out = network(torch.from_numpy(c_in * noisy)[None], torch.tensor([np.log(s) / 4]))[0].numpy()
        denoised = sigma_data**2 / (s**2 + sigma_data**2) * noisy + s * sigma_data / np.sqrt(s**2 + sigma_data**2) * out
        per_pixel = (s**2 + sigma_data**2) / (s * sigma_data) ** 2 * (denoised - x0[b]) ** 2
        if keep is None:
            losses.append(per_pixel.mean())
            continue
        columns = x0.shape[-1] // patch
        for index in keep[b].tolist():
            r, c = divmod(index, columns)
            losses.append(per_pixel[:, r * patch : (r + 1) * patch, c * patch : (c + 1) * patch].mean())
    return float(np.mean(losses))


@pytest.mark.parametrize("masked", [False, True])
def test_edm_loss_is_its_formulas_computed_independently(masked):
    x0 = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    cond = {"encoder_hidden_states": torch.full((3, 5, 2), 0.25, dtype=torch.float64)}
    keep = torch.tensor([[0, 3, 5, 15], [1, 2, 8, 9], [4, 6, 7, 12]]) if masked else None
    network = RecordingNetwork()
    torch.manual_seed(11)
    loss = diffusion.edm_loss(network, x0, cond, p_mean=-0.6, p_std=1.2, sigma_data=0.9, keep=keep, patch_size=2)
    torch.manual_seed(11)  # the same draws: sigma (B,), then the noise
    sigma = (torch.randn(3) * 1.2 - 0.6).exp()
    noise = torch.randn_like(x0)
    expected = independent_edm_loss(x0, sigma, noise, lambda x, c: network(x, c, cond), 0.9, keep, patch=2)
    assert float(loss) == pytest.approx(expected, rel=1e-6)  # the loss is computed in float32
    ((_, c_noise, kwargs),) = network.calls[:1]
    torch.testing.assert_close(c_noise, sigma.log() / 4)
    assert ("keep" in kwargs) == masked


def test_an_edm_loss_keeping_every_patch_is_the_unmasked_loss():
    x0 = torch.randn(2, 4, 4, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    cond = {"encoder_hidden_states": torch.zeros(2, 3, 2, dtype=torch.float64)}
    network = RecordingNetwork()
    everything = torch.arange(4).expand(2, 4)
    losses = []
    for keep in (None, everything):
        torch.manual_seed(5)
        losses.append(diffusion.edm_loss(network, x0, cond, -0.6, 1.2, 0.9, keep=keep, patch_size=2))
    torch.testing.assert_close(losses[0], losses[1])


def test_edm_sigmas_are_log_normal():
    z = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    sigma = diffusion.edm_sigmas(z, p_mean=-0.6, p_std=1.2)
    assert float(sigma.log().mean()) == pytest.approx(-0.6, abs=0.01)
    assert float(sigma.log().std()) == pytest.approx(1.2, abs=0.01)


def test_keyed_draws_follow_the_sample_not_its_batch_or_position():
    keys = diffusion.sample_keys(seed=3, step=7, sample_ids=[10, 11, 12, 13])
    assert len(set(keys)) == 4
    assert keys[:2] == diffusion.sample_keys(3, 7, [10, 11]), "a function of (seed, step, id) alone"
    assert keys[0] not in diffusion.sample_keys(4, 7, [10]) + diffusion.sample_keys(3, 8, [10])
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    alphas = torch.linspace(0.99, 0.01, 1000)
    seen = []

    def record(noisy, t, cond):
        seen.append((noisy, t))
        return noisy

    diffusion.ddpm_loss(record, x0, {}, alphas, "epsilon", draws=diffusion.Draws(keys))
    order = [2, 0]  # two of the samples, in another batch and order
    diffusion.ddpm_loss(record, x0[order], {}, alphas, "epsilon", draws=diffusion.Draws([keys[i] for i in order]))
    (whole, t_whole), (part, t_part) = seen
    torch.testing.assert_close(part, whole[order], rtol=0, atol=0)
    assert torch.equal(t_part, t_whole[order])
    draws = diffusion.Draws(keys)
    assert not torch.equal(draws.normal(4, (3,)), draws.normal(4, (3,))), "each call draws anew"
    with pytest.raises(ValueError, match="4 sample keys for a batch of 2"):
        diffusion.Draws(keys).normal(2)


def test_keyed_draws_of_one_number_per_sample_drive_edm_with_masks():
    """EDM draws one noise level per sample (shape ()), and the masks per sample: both from the keys."""
    keys = diffusion.sample_keys(seed=3, step=7, sample_ids=[10, 11, 12])
    assert diffusion.Draws(keys).normal(3).shape == (3,) and diffusion.Draws(keys).uniform(3).shape == (3,)
    x0 = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    seen = []

    def record(noisy, sigma, cond, keep=None):
        seen.append(sigma)
        return noisy

    for _ in range(2):
        draws = diffusion.Draws(keys)
        keep = diffusion.random_keep(3, 16, 0.75, draws=draws)
        assert keep.shape == (3, 4)
        loss = diffusion.edm_loss(record, x0, {}, -0.6, 1.2, 0.9, keep, 2, draws)
        assert torch.isfinite(loss)
    assert torch.equal(seen[0], seen[1]), "the same keys draw the same noise levels"


def test_the_global_draws_are_torchs_own():
    torch.manual_seed(1)
    expected = torch.randn(3, 2, dtype=torch.float64), torch.rand(3, 5), torch.randint(0, 9, (3,))
    torch.manual_seed(1)
    drawn = (diffusion.GLOBAL_DRAWS.normal(3, (2,), dtype=torch.float64), diffusion.GLOBAL_DRAWS.uniform(3, (5,)),
             diffusion.GLOBAL_DRAWS.integers(9, 3))  # fmt: skip
    for a, b in zip(drawn, expected):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------- flow matching


def _diffusers_training_utils():
    """diffusers' SD3 training helpers (0.30 and later; the compat stack's 0.29 has none)."""
    from diffusers import training_utils

    if not hasattr(training_utils, "compute_density_for_timestep_sampling"):
        pytest.skip(f"diffusers {diffusers_version()} has no compute_density_for_timestep_sampling")
    return training_utils


def diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


@pytest.mark.parametrize("sampling", ["logit_normal", "mode", "uniform"])
def test_flow_levels_are_diffusers_densities_for_the_same_draws(sampling):
    utils = _diffusers_training_utils()
    theirs = utils.compute_density_for_timestep_sampling(
        sampling, 4096, logit_mean=0.3, logit_std=0.8, mode_scale=1.29, generator=torch.Generator().manual_seed(5)
    )
    torch.manual_seed(5)
    ours = diffusion.flow_levels(sampling, 4096, logit_mean=0.3, logit_std=0.8, mode_scale=1.29)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert 0 < float(ours.min()) and float(ours.max()) < 1
    if sampling == "logit_normal":  # the logit is N(mean, std^2)
        logit = (ours / (1 - ours)).log()
        assert float(logit.mean()) == pytest.approx(0.3, abs=0.05) and float(logit.std()) == pytest.approx(
            0.8, abs=0.05
        )
    if sampling == "mode":  # a positive scale favours the middle; the density is symmetric about 1/2
        assert float(((ours - 0.5).abs() < 0.25).float().mean()) > 0.6
        assert float(ours.mean()) == pytest.approx(0.5, abs=0.02)
    with pytest.raises(ValueError, match="flow sampling must be one of"):
        diffusion.flow_levels("lognormal", 2)


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_flow_weights_are_diffusers_sd3_weights(weighting):
    utils = _diffusers_training_utils()
    sigma = torch.tensor([0.02, 0.25, 0.5, 0.75, 0.999])
    theirs = utils.compute_loss_weighting_for_sd3(weighting, sigma)
    torch.testing.assert_close(diffusion.flow_weight(sigma, weighting), theirs.float(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="flow weighting must be one of"):
        diffusion.flow_weight(sigma, "snr")


def test_shifted_sigmas_and_noisy_inputs_are_the_flow_schedulers():
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)  # SD3.5's training schedule
    plain = torch.linspace(1, 1000, 1000).flip(0) / 1000
    torch.testing.assert_close(
        diffusion.shift_sigmas(plain, 3.0), scheduler.sigmas[:1000].float(), rtol=1e-6, atol=1e-7
    )
    assert torch.equal(diffusion.shift_sigmas(plain, 1.0), plain)

    g = torch.Generator().manual_seed(0)
    x0, noise = torch.randn(3, 16, 8, 8, generator=g), torch.randn(3, 16, 8, 8, generator=g)
    index = torch.tensor([0, 400, 999])
    # a sample at a time, each by a fresh scheduler: diffusers 0.29's scale_noise takes one timestep for the batch
    # and keeps the step index of its first call
    fresh = [FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0) for _ in index]
    theirs = torch.cat([one.scale_noise(x0[i : i + 1], scheduler.timesteps[[j]], noise[i : i + 1])
                        for i, (one, j) in enumerate(zip(fresh, index.tolist()))])  # fmt: skip
    ours = diffusion.flow_noisy(x0, noise, scheduler.sigmas[index])
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(diffusion.flow_velocity(x0, noise), noise - x0)


def test_the_resolution_shift_is_fluxs_mu_and_the_schedulers_time_shift():
    pytest.importorskip("diffusers.pipelines.flux.pipeline_flux", reason="FLUX.1 arrived in diffusers 0.30")
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for tokens in (256, 1024, 4096, 6000):
        mu = calculate_shift(tokens)
        assert diffusion.resolution_shift(tokens) == pytest.approx(math.exp(mu), rel=1e-12)
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        plain = np.linspace(1.0, 1 / 28, 28)
        scheduler.set_timesteps(sigmas=plain, mu=mu)
        ours = diffusion.shift_sigmas(torch.tensor(plain, dtype=torch.float64), diffusion.resolution_shift(tokens))
        torch.testing.assert_close(ours.float(), scheduler.sigmas[:28].float(), rtol=1e-5, atol=1e-6)
    assert diffusion.resolution_shift(256) == pytest.approx(math.exp(0.5)) and diffusion.resolution_shift(
        4096
    ) == pytest.approx(math.exp(1.15))


@pytest.mark.parametrize(
    "sampling,weighting", [("logit_normal", "none"), ("mode", "cosmap"), ("uniform", "sigma_sqrt")]
)
def test_flow_loss_is_its_formulas_computed_independently(sampling, weighting):
    """The loss against the SD3 recipe written out in float64 from the same draws."""
    x0 = torch.randn(5, 4, 6, 6, generator=torch.Generator().manual_seed(1))
    seen = {}

    def denoiser(noisy, t, cond):
        seen["noisy"], seen["t"] = noisy, t
        return (noisy * 0.5 + cond["bias"]).float()

    cond = {"bias": torch.full((5, 4, 6, 6), 0.1)}
    torch.manual_seed(2)
    loss = diffusion.flow_loss(denoiser, x0, cond, sampling, 0.2, 1.1, 0.8, shift=3.0, weighting=weighting)

    torch.manual_seed(2)  # the same draws, in the same order: the noise level, then the noise
    if sampling == "logit_normal":
        u = torch.sigmoid(0.2 + 1.1 * torch.randn(5).double())
    else:
        u = torch.rand(5).double()
        if sampling == "mode":
            u = 1 - u - 0.8 * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)
    noise = torch.randn(5, 4, 6, 6).double()
    sigma = 3 * u / (1 + 2 * u)
    s = sigma.reshape(-1, 1, 1, 1)
    noisy = (1 - s) * x0.double() + s * noise
    weight = {"none": torch.ones_like(sigma), "sigma_sqrt": sigma**-2,
              "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))}[weighting]  # fmt: skip
    per_sample = ((noisy * 0.5 + 0.1 - (noise - x0.double())) ** 2).flatten(1).mean(1)
    expected = (weight * per_sample).mean()
    torch.testing.assert_close(seen["noisy"].double(), noisy, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(seen["t"].double(), sigma * 1000, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


def test_keyed_draws_give_a_flow_sample_its_own_noise_in_any_batch():
    keys = diffusion.sample_keys(seed=3, step=7, sample_ids=[10, 11, 12, 13])
    x0 = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    seen = []

    def record(noisy, t, cond):
        seen.append((noisy, t))
        return noisy

    diffusion.flow_loss(record, x0, {}, shift=3.0, draws=diffusion.Draws(keys))
    order = [3, 1]
    diffusion.flow_loss(record, x0[order], {}, shift=3.0, draws=diffusion.Draws([keys[i] for i in order]))
    (whole, t_whole), (part, t_part) = seen
    torch.testing.assert_close(part, whole[order], rtol=0, atol=0)
    assert torch.equal(t_part, t_whole[order])
