"""`model.params.objective: flow`: a system's loss is `ldm.diffusion.flow_loss` with its settings; configs that
cannot train say which key is wrong; a run trains and resumes like the others."""

import pytest
import torch

from ldm import diffusion
from ldm.backbones import as_denoiser
from ldm.config import ConfigError
from ldm.sampling import inference_scheduler
from ldm.training.model import latent_diffusion
from tests.helpers import finetune_args, train_once

FLOW_SCHEDULER = {"target": "diffusers.FlowMatchEulerDiscreteScheduler", "config": {"shift": 3.0}}


def _system(tiny_sd, **params):
    system = latent_diffusion(pretrained=str(tiny_sd), scheduler=FLOW_SCHEDULER, objective="flow", **params)
    system.configure_model()
    return system


def _batch():
    generator = torch.Generator().manual_seed(0)
    return {
        "pixel_values": torch.rand(2, 3, 16, 16, generator=generator) * 2 - 1,
        "caption": ["a cat", "a dog"],
        "sample_id": torch.tensor([3, 7]),
    }


@pytest.mark.parametrize(
    ("flow", "shift"),
    [
        ({}, 3.0),  # the scheduler's static shift, logit-normal levels
        ({"sampling": "mode", "weighting": "cosmap", "shift": 1.5}, 1.5),
        ({"sampling": "uniform", "weighting": "sigma_sqrt", "shift": "resolution"}, diffusion.resolution_shift(64)),
    ],
)
def test_the_loss_is_flow_matching_with_the_settings(tiny_sd, flow, shift):
    """The system's loss equals `flow_loss` called by hand with the same draws (keyed per sample), the shift
    resolved as the settings say: the scheduler's 3.0, a number, or by the 8 x 8 latent's 64 tokens."""
    system = _system(tiny_sd, flow=flow)
    batch = _batch()
    with torch.no_grad():
        loss = system.loss(batch)
        draws = system.draws(batch)
        mean, std = system.encode_posterior(batch["pixel_values"])
        latents = diffusion.sample_posterior(mean, std, draws)
        cond = system.encode_text(batch["caption"])
        settings = {"sampling": "logit_normal", "weighting": "none", **flow}
        expected = diffusion.flow_loss(
            as_denoiser(system.unet), latents, cond, settings["sampling"], 0.0, 1.0, 1.29, shift,
            settings["weighting"], 1000, draws,
        )  # fmt: skip
    assert torch.isfinite(loss) and torch.equal(loss, expected)


def test_without_an_objective_the_scheduler_decides(tiny_sd, caplog):
    """A config naming no objective trains as its scheduler (the config's, else the weights') does: flow matching
    with a `FlowMatch*` one, leaving out a preset's Min-SNR (said in the log); else DDPM."""
    assert latent_diffusion(pretrained=str(tiny_sd)).objective.kind == "ddpm"
    with caplog.at_level("INFO", logger="ldm.training.model"):
        system = latent_diffusion(pretrained=str(tiny_sd), scheduler=FLOW_SCHEDULER, snr_gamma=5.0)
    assert (system.objective.kind, system.snr_gamma) == ("flow", None)
    assert "model.params.snr_gamma: 5.0 left out: these weights train by flow matching" in caplog.text


def test_flow_settings_and_schedulers_that_cannot_train_are_refused(tiny_sd):
    with pytest.raises(
        ConfigError, match=r"model.params.objective: ddpm cannot train .*FlowMatchEuler.*objective: flow"
    ):
        latent_diffusion(pretrained=str(tiny_sd), scheduler=FLOW_SCHEDULER, objective="ddpm").configure_model()
    with pytest.raises(ConfigError, match=r"model.params.objective: flow cannot train .*DDPMScheduler.*FlowMatch"):
        latent_diffusion(pretrained=str(tiny_sd), objective="flow").configure_model()
    with pytest.raises(ConfigError, match=r"model.params.flow: applies to objective: flow"):
        latent_diffusion(pretrained=str(tiny_sd), flow={"shift": 2.0})
    with pytest.raises(ConfigError, match=r"model.params.flow.sampling: got 'normal'; valid: logit_normal"):
        latent_diffusion(pretrained=str(tiny_sd), objective="flow", flow={"sampling": "normal"})
    with pytest.raises(ConfigError, match=r"model.params.flow.shift: got -1"):
        latent_diffusion(pretrained=str(tiny_sd), objective="flow", flow={"shift": -1})
    with pytest.raises(ConfigError, match=r"model.params.snr_gamma: .* flow weights its own"):
        latent_diffusion(pretrained=str(tiny_sd), objective="flow", snr_gamma=5.0)


def test_a_flow_model_samples_with_flow_schedulers(tiny_sd):
    system = _system(tiny_sd)
    scheduler = inference_scheduler(system.parts.scheduler, "euler")
    assert type(scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and scheduler.config.shift == 3.0
    with pytest.raises(ValueError, match="a flow-matching model samples with euler, ddim, heun; got 'pndm'"):
        inference_scheduler(system.parts.scheduler, "pndm")


def test_a_flow_run_trains_and_a_unet_says_it_cannot_sample(tiny_sd, image_folder, tmp_path, capsys):
    """Through main.py: the UNet trains by flow matching for 3 steps; the image logger, which a UNet's pipeline
    cannot serve with a flow scheduler, must be switched off, and says so before the first step."""
    from main import main

    flow = ["model.params.objective=flow", "model.params.scheduler.target=diffusers.FlowMatchEulerDiscreteScheduler",
            "model.params.scheduler.config.shift=3.0", "model.params.flow.weighting=cosmap",
            "model.params.snr_gamma=null"]  # fmt: skip
    assert main(finetune_args(tiny_sd, image_folder, tmp_path / "a", *flow)) != 0
    assert "ImageLogger: a UNet trained by flow matching cannot sample yet" in capsys.readouterr().err
    run = train_once(
        finetune_args(tiny_sd, image_folder, tmp_path / "b", *flow, "lightning.callbacks.image_logger=null"),
        tmp_path / "b",
    )
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert ckpt["global_step"] == 3
    assert ckpt["ldm"]["config"]["model"]["params"]["objective"] == "flow"
