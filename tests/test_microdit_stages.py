"""MicroDiT's four training stages as configs: each passes the config check as shipped, and a tiny CPU twin of
the chain (256 px masked -> 256 px unmasked -> 512 px masked -> 512 px unmasked, here 16 px and 32 px) runs,
each stage starting from the one before, and exports a pipeline that samples."""

import pytest
import torch

from ldm.config import ConfigError, load_config
from ldm.systems.latent_diffusion import WarmupDecay
from ldm.training.checks import check_config
from ldm.weights.checkpoint import load_checkpoint
from main import main
from tests.conftest import REPO

STAGES = ["microdit-1-256-masked", "microdit-2-256", "microdit-3-512-masked", "microdit-4-512"]
CONFIGS = {stage: REPO / "configs" / "pretrain" / f"{stage}.yaml" for stage in STAGES}
# MicroDiT_XL_2's recipe at toy size: 8x8 latents of 16 px images (the twin's "256 px"), patch 2
TINY_MICRODIT = {"width": 32, "depth": 2, "head_dim": 16, "multiple_of": 16, "caption_channels": 32,
                 "timestep_channels": 32, "sample_size": 8, "patch_mixer_depth": 1, "patch_mixer_dim": 32,
                 "num_experts": 2}  # fmt: skip


def test_warmup_then_cosine_to_the_floor():
    decay = WarmupDecay(warmup=10, total=110, floor=1 / 3, shape="cosine")
    assert [decay(0), decay(5), decay(10)] == [0.0, 0.5, 1.0]
    assert decay(60) == pytest.approx(1 / 3 + (2 / 3) * 0.5)
    assert decay(110) == pytest.approx(1 / 3) and decay(500) == pytest.approx(1 / 3)
    assert WarmupDecay(0, 100, 0.2, "linear")(50) == pytest.approx(0.6)


@pytest.mark.parametrize("stage", STAGES)
def test_each_stage_passes_the_config_check_as_shipped(stage, tiny_sd, shards):
    cfg, sources = load_config([CONFIGS[stage]], [f"model.params.pretrained={tiny_sd}",
                                                  f"data.params.sources=[{{path: {shards['a']}}}]"])  # fmt: skip
    check_config(cfg, sources)
    trainer = cfg.lightning.trainer
    assert cfg.data.params.batch_size * 8 == 2048 and trainer.precision == "bf16-mixed"
    assert cfg.model.params.optimizer.params.weight_decay == 0.1 and list(cfg.model.params.optimizer.params.betas) == [
        0.9,
        0.999,
    ]
    assert cfg.model.params.mask_ratio == (0.75 if "masked" in stage else 0.0)


def test_a_twice_larger_latent_interpolates_the_position_embeddings():
    """Stage 3 trains stage 2's network on 2x larger latents: its grid spans the one it was built for, so every
    second position is one the network learned at the smaller size (micro_diffusion's pos_interp_scale 2)."""
    from ldm.backbones.microdit import MicroDiT

    model = MicroDiT(**{**TINY_MICRODIT, "in_channels": 4, "patch_size": 2})
    small, large = model.position_embedding(4, 4), model.position_embedding(8, 8)
    torch.testing.assert_close(large.reshape(8, 8, -1)[::2, ::2], small.reshape(4, 4, -1))


def test_lr_min_needs_a_schedule_that_ends_somewhere(tiny_sd):
    from ldm.training.model import latent_diffusion

    with pytest.raises(ConfigError, match="model.params.lr_min: got 1e-05 with lr_schedule: constant"):
        latent_diffusion(pretrained=str(tiny_sd), lr_min=1e-5)


def run_stage(stage: str, pretrained, shards, logs, *extra: str):
    argv = ["-t", "-b", str(CONFIGS[stage]), "-l", str(logs), "-n", stage, "-s", "3",
            f"model.params.pretrained={pretrained}", f"data.params.sources=[{{path: {shards}}}]",
            "data.params.batch_size=4", "data.params.num_workers=0", "lightning.trainer.max_steps=3",
            "lightning.trainer.strategy=auto", "lightning.trainer.accelerator=cpu",
            "lightning.trainer.precision=32-true", "lightning.trainer.log_every_n_steps=1",
            "lightning.modelcheckpoint.params.every_n_train_steps=3", "lightning.callbacks.image_logger=null",
            "lightning.callbacks.start.target=tests.helpers.SaveStartWeights",
            f"lightning.callbacks.start.params.path={logs / f'{stage}-start.pt'}", *extra]  # fmt: skip
    assert main(argv) == 0
    (run,) = logs.glob(f"*_{stage}")
    return run / "checkpoints" / "last.ckpt"


def unet_state(ckpt) -> dict[str, torch.Tensor]:
    state = load_checkpoint(ckpt)["state_dict"]
    return {k.removeprefix("unet."): v for k, v in state.items() if k.startswith("unet.")}


@pytest.mark.exclusive
def test_the_four_stages_chain_on_a_cpu_twin_and_export(tiny_sd, shards, shards_512, tmp_path):
    from ldm.export import export_pipeline

    logs = tmp_path / "logs"
    tiny = [f"model.params.unet.config.{k}={v}" for k, v in TINY_MICRODIT.items()]
    ckpt = run_stage(STAGES[0], tiny_sd, shards["a"], logs, *tiny, "model.params.lr_warmup_steps=1")
    first = load_checkpoint(ckpt)
    # cosine from 2.4e-4 after 1 warm-up step, down to lr_min 8e-5 at the last step
    assert first["lr_schedulers"][0]["_last_lr"][0] == pytest.approx(8e-5)
    ema = "lightning.callbacks.ema.params.start_step=1"
    for stage, data, extra in ((STAGES[1], shards["a"], []), (STAGES[2], shards_512, [ema]),
                               (STAGES[3], shards_512, [ema])):  # fmt: skip
        previous = ckpt
        ckpt = run_stage(stage, previous, data, logs, *extra)
        start = torch.load(logs / f"{stage}-start.pt", weights_only=True)
        before = unet_state(previous)
        assert start.keys() == before.keys() and all(torch.equal(start[k], before[k]) for k in start), (
            f"{stage} starts from the weights the stage before ended with"
        )
        saved = load_checkpoint(ckpt)
        description = saved["ldm"]["parts"]["unet"]
        assert description["config"]["width"] == 32, "the same tiny MicroDiT all along"
        assert saved["global_step"] == 3 and bool(saved.get("ema_state_dict")) == (stage != STAGES[1])
    pipe = export_pipeline(ckpt, tmp_path / "pipe", ema=True)
    from ldm.export import load_pipeline

    pipeline = load_pipeline(pipe)
    image = pipeline("a photo", num_inference_steps=2, height=32, width=32, output_type="np").images[0]
    assert image.shape == (32, 32, 3)
