"""LoRA fine-tuning: adapters only in checkpoints, exported for diffusers' `load_lora_weights` and merged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from diffusers import StableDiffusionPipeline

from ldm.config import ConfigError
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.lora_file import LORA_FILE
from ldm.weights.read import parts_from_checkpoint
from ldm.weights.single_file import load_single_file
from main import main
from tests.helpers import SD_FOLDER, finetune_args, run_script, train_once

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "configs" / "finetune" / "sd15-lora.yaml"
LORA = [
    "model.params.lora.rank=4",
    "model.params.lora.alpha=2",  # scale 0.5: the export must carry it
    "model.params.trainable=[unet,text_encoder]",
    "model.params.learning_rate=1e-2",
    "model.params.lr_warmup_steps=0",
    "lightning.trainer.precision=bf16-mixed",  # the preset's fp16, as a CPU runs it
    "model.params.frozen_dtype=bfloat16",
]


def lora_args(tiny_sd, images, logdir, *extra) -> list[str]:
    """The tiny fine-tune's arguments on the LoRA preset."""
    argv = finetune_args(tiny_sd, images, logdir, *LORA, *extra)
    argv[argv.index(str(SD_FOLDER))] = str(PRESET)
    return argv


@pytest.fixture(scope="module")
def lora_run(tiny_sd, image_folder, tmp_path_factory):
    logdir = tmp_path_factory.mktemp("lora-logs")
    return train_once(lora_args(tiny_sd, image_folder, logdir), logdir)


def outputs(unet, text_encoder, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """The text encoder's hidden states for a prompt, and the UNet's prediction given them."""
    ids = tokenizer(["a photo of a cat"], padding="max_length", max_length=77, return_tensors="pt").input_ids
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, 4, 8, 8, generator=generator)
    with torch.no_grad():
        hidden = text_encoder(ids)[0]
        return hidden, unet(latents, torch.tensor([500]), encoder_hidden_states=hidden).sample


def test_checkpoint_holds_only_the_adapters(lora_run, tiny_sd):
    ckpt = load_checkpoint(lora_run / "checkpoints" / "last.ckpt")
    spec = {"rank": 4, "alpha": 2, "dropout": 0.0, "target_modules": ["to_q", "to_k", "to_v", "to_out.0"]}
    assert ckpt["ldm"]["lora"] == {"spec": spec, "trainable": ["unet", "text_encoder"]}
    keys = set(ckpt["state_dict"])
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder"}
    assert set(ckpt["ema_state_dict"]) == keys
    assert any(v.abs().sum() > 0 for k, v in ckpt["state_dict"].items() if ".lora_B." in k), "adapters trained"


def test_diffusers_load_lora_weights_reproduces_our_model(lora_run, tiny_sd, tmp_path):
    ckpt = load_checkpoint(lora_run / "checkpoints" / "last.ckpt")
    ours = parts_from_checkpoint(ckpt, merge=False)
    expected = outputs(ours.unet, ours.text_encoder, ours.tokenizer)
    base = StableDiffusionPipeline.from_pretrained(tiny_sd, local_files_only=True, safety_checker=None)
    untouched = outputs(base.unet, base.text_encoder, base.tokenizer)
    out = tmp_path / "lora"
    ckpt_arg = ["--ckpt", lora_run / "checkpoints" / "last.ckpt"]
    run_script("export_lora.py", *ckpt_arg, "--out", out, "--format", "diffusers")
    base.load_lora_weights(out, weight_name=LORA_FILE)  # diffusers 0.29 offline needs the name
    loaded = outputs(base.unet, base.text_encoder, base.tokenizer)
    for mine, theirs, before in zip(expected, loaded, untouched):
        assert not torch.allclose(mine, before, atol=1e-4), "the LoRA changes the outputs"
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)

    merged_dir = tmp_path / "merged"
    run_script("export_lora.py", *ckpt_arg, "--out", merged_dir, "--merge")
    merged = StableDiffusionPipeline.from_pretrained(merged_dir, local_files_only=True, safety_checker=None)
    for mine, theirs in zip(expected, outputs(merged.unet, merged.text_encoder, merged.tokenizer)):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in merged.unet.state_dict())

    run_script("export_single_file.py", *ckpt_arg, "--out", tmp_path / "merged.safetensors")
    single, _ = load_single_file(tmp_path / "merged.safetensors")
    for mine, theirs in zip(expected, outputs(single.unet, single.text_encoder, single.tokenizer)):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)


def test_lora_run_resumes(lora_run, tiny_sd, image_folder):
    logdir = lora_run.parent
    assert main(lora_args(tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=4", "-r", "auto")) == 0
    assert load_checkpoint(lora_run / "checkpoints" / "last.ckpt")["global_step"] == 4


def test_lora_config_errors(tiny_sd):
    from ldm.models.diffusion.ddpm import LatentDiffusion

    with pytest.raises(ConfigError, match="model.params.lora.target_modules: .*nonexistent"):
        LatentDiffusion(pretrained=str(tiny_sd), lora={"target_modules": ["nonexistent"]}).configure_model()
    with pytest.raises(ConfigError, match="model.params.lora.rank: got 0"):
        LatentDiffusion(pretrained=str(tiny_sd), lora={"rank": 0}).configure_model()
