"""MosaicML's SD2-base recipe as two stage configs: each passes the config check as shipped with their settings,
and the CPU twins chain (256 px -> 512 px, here 16 px -> 32 px shards): stage 2 starts from stage 1's weights with
a fresh optimizer and schedule, keeps an EMA from its start step, and exports a pipeline that samples."""

import pytest
import torch
from safetensors.torch import load_file

from ldm.config import load_config
from ldm.training.checks import check_config
from ldm.weights.checkpoint import load_checkpoint
from main import main
from tests.conftest import REPO

CONFIGS = REPO / "configs" / "pretrain"
STAGES = {"sd2-base-256": 550_000, "sd2-base-512": 850_000}  # steps


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_passes_the_config_check_with_mosaicmls_settings(stage, tiny_sd, shards):
    overrides = [f"model.params.pretrained={tiny_sd}", f"data.params.sources=[{{path: {shards['a']}}}]"]
    cfg, sources = load_config([CONFIGS / f"{stage}.yaml"], overrides)
    check_config(cfg, sources)
    trainer, params = cfg.lightning.trainer, cfg.model.params
    assert cfg.data.params.batch_size * trainer.devices * trainer.num_nodes == 2048
    assert trainer.max_steps == STAGES[stage] and params.learning_rate == 1e-4 and params.lr_warmup_steps == 10_000
    assert params.optimizer.target == "torch.optim.AdamW" and params.optimizer.params.weight_decay == 0.01
    assert cfg.data.params.caption_dropout == 0.1
    callbacks = cfg.lightning.callbacks
    if stage == "sd2-base-256":
        assert "ema" not in callbacks and list(params.unet.config.block_out_channels) == [320, 640, 1280, 1280]
    else:
        assert "unet" not in params, "stage 2 takes its UNet from stage 1's checkpoint"
        assert dict(callbacks.ema.params) == {"decay": 0.9999, "start_step": 800_000}


def run_twin(stage: str, pretrained, shards, logs):
    argv = ["-t", "-b", str(CONFIGS / f"{stage}.yaml"), "-b", str(CONFIGS / f"{stage}-cpu.yaml"), "-l", str(logs),
            "-n", stage, f"model.params.pretrained={pretrained}", f"data.params.sources=[{{path: {shards}}}]",
            "lightning.callbacks.start.target=tests.helpers.SaveStartWeights",
            f"lightning.callbacks.start.params.path={logs / f'{stage}-start.pt'}"]  # fmt: skip
    assert main(argv) == 0
    (run,) = logs.glob(f"*_{stage}")
    return run


def unet_state(state: dict) -> dict[str, torch.Tensor]:
    return {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}


@pytest.mark.exclusive
def test_the_two_stages_chain_on_their_cpu_twins_and_export_the_ema(tiny_sd, shards, shards_512, tmp_path):
    from ldm.export import export_pipeline, load_pipeline

    logs = tmp_path / "logs"
    first_run = run_twin("sd2-base-256", tiny_sd, shards["a"], logs)
    first = load_checkpoint(first_run / "checkpoints" / "last.ckpt")
    start = torch.load(logs / "sd2-base-256-start.pt", weights_only=True)
    folder_unet = load_file(tiny_sd / "unet" / "diffusion_pytorch_model.safetensors")
    differ = [k for k in start if start[k].shape != folder_unet[k].shape or not torch.equal(start[k], folder_unet[k])]
    assert start.keys() == folder_unet.keys() and len(differ) > len(start) // 2, (
        "stage 1 trains its UNet from scratch, not the folder's"
    )
    assert first["global_step"] == 6 and first["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(1e-3)
    assert not first.get("ema_state_dict")
    assert (first_run / "images" / "step_000003.png").is_file()

    second_run = run_twin("sd2-base-512", first_run / "checkpoints" / "last.ckpt", shards_512, logs)
    second = load_checkpoint(second_run / "checkpoints" / "last.ckpt")
    start = torch.load(logs / "sd2-base-512-start.pt", weights_only=True)
    ended = unet_state(first["state_dict"])
    assert start.keys() == ended.keys() and all(torch.equal(start[k], ended[k]) for k in start), (
        "stage 2 starts from the weights stage 1 ended with"
    )
    assert second["global_step"] == 6, "a fresh step count"
    adam = second["optimizer_states"][0]["state"]
    assert {int(s["step"]) for s in adam.values()} == {6}, "a fresh optimizer: 6 Adam steps, not 12"
    assert second["ema_updates"] == 3, "EMA from step 4 of 6"
    trained, averaged = unet_state(second["state_dict"]), unet_state(second["ema_state_dict"])
    assert averaged.keys() == trained.keys() and any(not torch.equal(averaged[k], trained[k]) for k in trained)

    pipeline = load_pipeline(export_pipeline(second_run / "checkpoints" / "last.ckpt", tmp_path / "pipe", ema=True))
    exported = pipeline.unet.state_dict()
    assert all(torch.equal(exported[k], averaged[k]) for k in averaged), "the export holds the EMA weights"
    image = pipeline("a photo", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
