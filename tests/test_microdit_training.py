"""MicroDiT trained through main.py: EDM on the patches kept after the mixer, EMA, exact resume after kill -9,
unmasked fine-tuning from the same checkpoint, the experts' own LR, and config errors naming the key."""

import json
import signal
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from omegaconf import OmegaConf

from ldm import diffusion
from ldm.backbones.microdit import MicroDiT
from ldm.backbones.microdit_layers import ExpertChoiceFeedForward
from ldm.config import instantiate
from ldm.training.run import prepare_config
from main import main
from tests.helpers import run_main, run_script
from tests.test_faults import losses, record

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "quickstart" / "digits-microdit.yaml"


@pytest.fixture(scope="module")
def digits_vae(tmp_path_factory) -> Path:
    """The quickstart's autoencoder architecture with random weights (training it takes minutes)."""
    config = OmegaConf.to_container(OmegaConf.load(REPO / "configs/quickstart/digits-autoencoder.yaml"))
    folder = tmp_path_factory.mktemp("vae") / "vae"
    torch.manual_seed(0)
    AutoencoderKL(**config["model"]["params"]["vae"]["config"]).save_pretrained(folder)
    return folder


def args(vae: Path, logdir: Path, *extra: str) -> list[str]:
    return [
        "-t", "-b", str(CONFIG), "-l", str(logdir), "-n", "microdit", "-s", "3",
        f"model.params.vae.pretrained={vae}", "data.params.batch_size=16", "data.params.dataset.params.size=32",
        "lightning.trainer.max_steps=6", "lightning.modelcheckpoint.params.every_n_train_steps=2",
        "lightning.callbacks.ema.target=ldm.training.callbacks.ema.EMA", "lightning.callbacks.ema.params.decay=0.9",
        *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def unbroken(digits_vae, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("unbroken")
    assert main(args(digits_vae, tmp / "logs", *record(tmp / "losses"))) == 0
    (run_dir,) = (tmp / "logs").iterdir()
    return run_dir, losses(tmp / "losses")


def test_trains_masked_with_edm_and_keeps_an_ema(unbroken):
    run_dir, steps = unbroken
    assert sorted(steps) == list(range(1, 7)) and all(loss > 0 for loss in steps.values())
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    shadow = ckpt["ema_state_dict"]
    assert any(name.startswith("unet.blocks.") for name in shadow), "the EMA covers the MicroDiT"
    trained = ckpt["state_dict"]
    assert any(not torch.equal(shadow[n], trained[n].float()) for n in shadow), "EMA differs from the weights"


def test_the_loss_is_over_a_quarter_of_the_patches(digits_vae, tmp_path, monkeypatch):
    seen = []
    edm_loss = diffusion.edm_loss

    def spy(denoiser, x0, cond, *rest, **kwargs):
        seen.append((x0.shape, rest[3] if len(rest) > 3 else kwargs.get("keep")))
        return edm_loss(denoiser, x0, cond, *rest, **kwargs)

    monkeypatch.setattr(diffusion, "edm_loss", spy)
    assert main(args(digits_vae, tmp_path / "logs", "lightning.trainer.max_steps=1")) == 0
    ((shape, keep),) = seen
    assert shape == (16, 4, 8, 8) and keep.shape == (16, 16), "64 patches of 4x8x8 latents, 16 kept"


def test_killed_with_kill_9_resumes_with_the_unbroken_losses(digits_vae, unbroken, tmp_path):
    _, reference = unbroken
    rec = tmp_path / "losses"
    base = args(digits_vae, tmp_path / "logs", *record(rec))
    killed = ["lightning.callbacks.kill.target=tests.helpers.SendSignal", "lightning.callbacks.kill.params.step=5",
              "lightning.callbacks.kill.params.signal=SIGKILL"]  # fmt: skip
    done = run_main(*base, *killed)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert main([*base, "-r", "auto"]) == 0  # from step 4's checkpoint
    assert losses(rec) == reference, "steps 5 and 6 again, with the masks and noise of the unbroken run"


def test_a_mask_ratio_of_0_fine_tunes_the_same_model_unmasked(digits_vae, unbroken, tmp_path, monkeypatch):
    run_dir, _ = unbroken

    def refuse(*args, **kwargs):
        raise AssertionError("drew a mask at mask_ratio 0")

    monkeypatch.setattr(diffusion, "random_keep", refuse)
    first_stage = f"model.params.pretrained={run_dir / 'checkpoints' / 'last.ckpt'}"
    argv = args(digits_vae, tmp_path / "logs", "model.params.mask_ratio=0", "lightning.trainer.max_steps=2",
                first_stage, "model.params.unet=null")  # fmt: skip
    assert main(argv) == 0
    (run,) = (tmp_path / "logs").iterdir()
    state = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    first = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    unet = [name for name in first if name.startswith("unet.")]
    assert unet and all(state[n].shape == first[n].shape for n in unet), "the same MicroDiT"


def test_the_experts_train_at_their_own_learning_rate(digits_vae):
    cfg, _ = prepare_config([str(CONFIG)], [f"model.params.vae.pretrained={digits_vae}"], None)
    model = instantiate(cfg.model, "model")
    model.configure_model()
    optimizer = model.configure_optimizers()["optimizer"]
    rest, experts = optimizer.param_groups
    assert (rest["initial_lr"], experts["initial_lr"]) == (1e-3, 5e-4)  # learning_rate, times 0.5
    moe = {id(p) for m in model.unet.modules() if isinstance(m, ExpertChoiceFeedForward) for p in m.parameters()}
    assert {id(p) for p in experts["params"]} == moe and moe.isdisjoint(id(p) for p in rest["params"])
    assert isinstance(model.unet, MicroDiT)


def test_a_dropped_caption_is_an_all_zero_embedding(digits_vae, monkeypatch):
    cfg, _ = prepare_config([str(CONFIG)], [f"model.params.vae.pretrained={digits_vae}"], None)
    model = instantiate(cfg.model, "model")
    model.configure_model()
    seen = []
    monkeypatch.setattr(diffusion, "edm_loss", lambda denoiser, x0, cond, *rest: seen.append(cond) or x0.sum())
    captions = ["a handwritten digit 3", ""]
    model.loss({"latents": torch.zeros(2, 4, 8, 8), "caption": captions})
    hidden = seen[0]["encoder_hidden_states"]
    assert hidden[0].abs().sum() > 0 and not hidden[1].any()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.params.objective=ddpm", "model.params.mask_ratio=0.5", "model.params.edm=null"],
         "model.params.mask_ratio: applies to objective: edm"),
        (["model.params.snr_gamma=5"], "model.params.snr_gamma: Min-SNR weights DDPM's loss"),
        (["model.params.mask_ratio=1.0"], "model.params.mask_ratio: got 1.0; must be in [0, 1)"),
        (["model.params.expert_lr_multiplier=0"], "model.params.expert_lr_multiplier: got 0"),
        (["model.params.scheduler.config.sigma_data=0.5"],
         "model.params.scheduler: objective edm trains with sigma_data 0.9, but the scheduler EDMEulerScheduler has"),
    ],
)  # fmt: skip
def test_mistakes_are_one_line_naming_the_key(digits_vae, tmp_path, capsys, overrides, message):
    assert main(args(digits_vae, tmp_path / "logs", *overrides)) == 2
    assert message in capsys.readouterr().err


def test_a_unet_cannot_be_trained_masked(tiny_sd, tmp_path, capsys):
    from tests.conftest import write_images
    from tests.helpers import finetune_args

    images = write_images(tmp_path / "images", n=2)
    edm = [
        "model.params.objective=edm",
        "model.params.mask_ratio=0.5",
        "model.params.snr_gamma=null",
        "model.params.scheduler.target=diffusers.EDMEulerScheduler",
        "model.params.scheduler.config={sigma_data: 0.9}",
    ]
    argv = finetune_args(tiny_sd, images, tmp_path / "logs", *edm)
    assert main(argv) == 2
    assert "model.params.mask_ratio: 0.5, but the unet (UNet2DConditionModel) does not mask patches" in (
        capsys.readouterr().err
    )


@pytest.fixture(scope="module")
def exported(unbroken, tmp_path_factory) -> Path:
    run_dir, _ = unbroken
    out = tmp_path_factory.mktemp("pipe") / "microdit"
    run_script("export_diffusers.py", "--ckpt", run_dir / "checkpoints" / "last.ckpt", "--out", out)
    return out


def draw(pipe, **kwargs):
    settings = dict(num_inference_steps=3, num_images_per_prompt=2, output_type="pt", guidance_scale=2.0)
    return pipe("a handwritten digit 3", generator=torch.Generator().manual_seed(0), **{**settings, **kwargs}).images


def test_an_exported_folder_loads_and_samples_as_the_checkpoint_does(unbroken, exported):
    from diffusers import DiffusionPipeline

    from ldm.export import load_pipeline
    from ldm.pipelines.microdit import MicroDiTPipeline

    run_dir, _ = unbroken
    index = json.loads((exported / "model_index.json").read_text())
    assert index["_class_name"] == "MicroDiTPipeline" and index["transformer"] == ["ldm.backbones.microdit", "MicroDiT"]
    assert index["scheduler"] == ["diffusers", "EDMEulerScheduler"]
    folder = MicroDiTPipeline.from_pretrained(exported)
    images = draw(folder)
    assert images.shape == (2, 1, 32, 32) and 0 <= float(images.min()) and float(images.max()) <= 1
    assert torch.equal(draw(DiffusionPipeline.from_pretrained(exported)), images)
    torch.testing.assert_close(draw(load_pipeline(run_dir / "checkpoints" / "last.ckpt")), images)
    dpm = load_pipeline(exported, sampler="dpm++")
    assert type(dpm.scheduler).__name__ == "EDMDPMSolverMultistepScheduler" and draw(dpm).shape == images.shape


def test_guidance_takes_an_all_zero_caption_as_the_unconditional_branch(exported):
    from ldm.pipelines.microdit import MicroDiTPipeline

    pipe = MicroDiTPipeline.from_pretrained(exported)
    seen, forward = [], pipe.transformer.forward

    def spy(noisy, t, cond, **kwargs):
        seen.append(cond["encoder_hidden_states"])
        return forward(noisy, t, cond, **kwargs)

    pipe.transformer.forward = spy
    draw(pipe, num_inference_steps=1, guidance_scale=2.0)
    (hidden,) = seen
    assert hidden.shape[0] == 4 and not hidden[:2].any() and hidden[2:].abs().sum() > 0
    seen.clear()
    draw(pipe, num_inference_steps=1, guidance_scale=1.0)
    assert seen[0].shape[0] == 2, "no unconditional branch without guidance"


def test_an_edm_euler_step_is_the_preconditioned_denoiser(exported):
    """One step of the pipeline from sigma_max to 0 is the network's preconditioned estimate (Karras eq. 7)."""
    from ldm.pipelines.microdit import MicroDiTPipeline

    pipe = MicroDiTPipeline.from_pretrained(exported)
    pipe.scheduler.set_timesteps(1)
    sigma = pipe.scheduler.sigmas[0].double()
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * pipe.scheduler.init_noise_sigma
    cond = {"encoder_hidden_states": pipe.encode_prompt(["a handwritten digit 3"])}
    c_skip, c_out, c_in, c_noise = (float(c) for c in diffusion.edm_scalings(sigma, 0.9))
    with torch.no_grad():
        out = pipe.transformer(latents * c_in, torch.tensor([c_noise]), cond)
    expected = c_skip * latents + c_out * out
    stepped = pipe.scheduler.step(out, pipe.scheduler.timesteps[0], latents).prev_sample
    torch.testing.assert_close(stepped, expected, rtol=1e-3, atol=1e-4)  # the scheduler computes in float32


def test_the_image_logger_draws_microdit_grids_while_training(digits_vae, tmp_path):
    logger = ["lightning.callbacks.image_logger.target=ldm.training.callbacks.image_logger.ImageLogger",
              "lightning.callbacks.image_logger.params.prompts=[a handwritten digit 1]",
              "lightning.callbacks.image_logger.params.every_n_steps=2",
              "lightning.callbacks.image_logger.params.num_inference_steps=2"]  # fmt: skip
    assert main(args(digits_vae, tmp_path / "logs", "lightning.trainer.max_steps=2", *logger)) == 0
    (run,) = (tmp_path / "logs").iterdir()
    assert [p.name for p in (run / "images").iterdir()] == ["step_000002.png"]


def test_the_digits_judge_scores_an_exported_microdit(exported, tmp_path):
    from examples.digits.evaluate import main as evaluate

    result = evaluate([str(exported), "--samples-per-digit", "1", "--steps", "2", "--json", str(tmp_path / "s.json")])
    assert 0.0 <= result["accuracy"] <= 1.0 and len(result["per_digit"]) == 10


def test_ldm_sample_draws_a_grid_from_the_folder(exported, tmp_path):
    out = run_script("txt2img.py", "--model", exported, "--prompt", "a handwritten digit 7", "--n", "2",
                     "--steps", "2", "--outdir", tmp_path / "samples")  # fmt: skip
    assert "2 images in" in out and (tmp_path / "samples" / "grid.png").is_file()
