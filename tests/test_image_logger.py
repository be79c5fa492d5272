"""Sample grids during training: at the size the model trains at, and stopped by a stop signal."""

import os
import signal

import pytest
from omegaconf import OmegaConf
from PIL import Image

import ldm.training.callbacks.image_logger as image_logger
from ldm.sampling import image_grid
from main import main
from tests.helpers import SD_FOLDER, finetune_args, train_once

CONFIG = OmegaConf.load(SD_FOLDER).lightning.callbacks.image_logger.params
PROMPTS, PER_PROMPT = list(CONFIG.prompts), 4  # one row per prompt; ImageLogger's default num_per_prompt


@pytest.mark.parametrize(
    ("extra", "side"),
    [
        ((), 32),  # the tiny SD's pipeline default is 16 px (UNet sample_size 8, VAE factor 2)
        (("lightning.callbacks.image_logger.params.height=24", "lightning.callbacks.image_logger.params.width=40"), 24),
    ],
)
def test_grids_are_sampled_at_the_training_size_unless_the_config_says(tiny_sd, image_folder, tmp_path, extra, side):
    logdir = tmp_path / "logs"
    run = train_once(finetune_args(tiny_sd, image_folder, logdir, "data.params.size=32", *extra), logdir)
    grid = Image.open(run / "images" / "step_000002.png")
    assert grid.height == len(PROMPTS) * side
    labels = image_grid([Image.new("RGB", (0, 1))] * len(PROMPTS), rows=len(PROMPTS), labels=PROMPTS).width
    assert grid.width == labels + PER_PROMPT * (40 if extra else side)


def test_a_stop_signal_ends_the_final_samples_and_the_checkpoint_is_kept(tiny_sd, image_folder, tmp_path, monkeypatch):
    steps = []
    build = image_logger.build_pipeline

    def build_and_signal(*args, **kwargs):  # SIGTERM arrives during the first denoising step of the final grid
        pipe = build(*args, **kwargs)
        step = pipe.scheduler.step

        def step_and_signal(*a, **k):
            steps.append(1)
            if len(steps) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
            return step(*a, **k)

        pipe.scheduler.step = step_and_signal
        return pipe

    monkeypatch.setattr(image_logger, "build_pipeline", build_and_signal)
    logdir = tmp_path / "logs"
    argv = finetune_args(
        tiny_sd, image_folder, logdir, "lightning.trainer.max_steps=2",
        "lightning.callbacks.image_logger.params.every_n_steps=100",
        "lightning.callbacks.image_logger.params.num_inference_steps=25",
    )  # fmt: skip
    assert main(argv) == 128 + signal.SIGTERM
    (run,) = logdir.iterdir()
    assert len(steps) == 1, "sampling stopped after the step the signal arrived in (not 2 prompts x 25 steps)"
    assert not (run / "images").exists()
    assert (run / "checkpoints" / "last.ckpt").resolve().name == "step-000002.ckpt"
