"""Another denoiser than `UNet2DConditionModel` trains through main.py and a config, behind the denoiser call."""

import torch
from helpers import finetune_args, train_once

from ldm.backbones import as_denoiser
from ldm.backbones.unet import UNetDenoiser
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.read import parts_from_checkpoint
from tests.fixtures.denoisers import TinyDenoiser

DENOISER = "tests.fixtures.denoisers.TinyDenoiser"


def test_a_denoiser_of_another_class_trains_from_a_config(tiny_sd, image_folder, tmp_path):
    logdir = tmp_path / "logs"
    argv = finetune_args(
        tiny_sd,
        image_folder,
        logdir,
        f"model.params.unet={{target: {DENOISER}, config: {{channels: 4, width: 8, cond_dim: 32}}}}",
        "lightning.callbacks.image_logger=null",  # sampling goes through StableDiffusionPipeline, which needs a UNet
    )
    run = train_once(argv, logdir)
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt")
    assert ckpt["global_step"] == 3
    assert ckpt["ldm"]["parts"]["unet"]["class"] == DENOISER
    assert ckpt["ldm"]["parts"]["unet"]["config"]["width"] == 8
    state = ckpt["state_dict"]
    assert {k for k in state if k.startswith("unet.")} == {f"unet.{k}" for k in TinyDenoiser(width=8).state_dict()}

    parts = parts_from_checkpoint(ckpt)
    assert isinstance(parts.unet, TinyDenoiser)
    for key, value in parts.unet.state_dict().items():
        assert torch.equal(value, state[f"unet.{key}"]), key
    torch.manual_seed(0)
    fresh = TinyDenoiser(width=8)
    trained = sum((a - b).abs().sum() for a, b in zip(parts.unet.parameters(), fresh.parameters()))
    assert trained > 0  # not at its initialisation: the loss reached the denoiser
    losses = (run / "csv").rglob("metrics.csv")
    assert any("train/loss" in f.read_text() for f in losses)


def test_sampling_such_a_denoiser_is_refused_before_training(tiny_sd, image_folder, tmp_path, capsys):
    from main import main

    unet = f"model.params.unet={{target: {DENOISER}, config: {{channels: 4, width: 8, cond_dim: 32}}}}"
    assert main(finetune_args(tiny_sd, image_folder, tmp_path / "logs", unet)) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("lightning.callbacks: ImageLogger: sampling and export go through"), err
    assert "this denoiser is a TinyDenoiser" in err
    assert not list((tmp_path / "logs").glob("*/checkpoints/step-*")), "nothing trained"


def test_denoiser_call_of_a_unet_and_of_any_other_module(tiny_sd):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_sd / "unet")
    noisy, t = torch.randn(2, 4, 8, 8), torch.tensor([1, 500])
    cond = {"encoder_hidden_states": torch.randn(2, 77, 32)}
    call = as_denoiser(unet)
    assert isinstance(call, UNetDenoiser)
    assert torch.equal(call(noisy, t, cond), unet(noisy, t, encoder_hidden_states=cond["encoder_hidden_states"]).sample)
    other = TinyDenoiser()
    assert as_denoiser(other) is other
    assert other(noisy, t, cond).shape == noisy.shape


def test_the_system_receives_its_parts_built_and_pickles_before(tiny_sd):
    """The config factory hands the system a builder; the system builds once, then holds the parts by name."""
    import pickle

    from ldm.models.diffusion.ddpm import LatentDiffusion

    system = LatentDiffusion(pretrained=str(tiny_sd), frozen_dtype="bfloat16")
    again = pickle.loads(pickle.dumps(system))  # what ddp_spawn does before Lightning configures the model
    again.configure_model()
    assert list(again.parts) == ["unet", "vae", "text_encoder", "tokenizer", "scheduler"]
    assert again.vae.dtype == torch.bfloat16 and not any(p.requires_grad for p in again.vae.parameters())
    assert all(p.requires_grad for p in again.unet.parameters())
    assert {k.split(".")[0] for k in again.state_dict()} == {"unet", "vae", "text_encoder"}
