"""Sample fixed prompts every N steps; write PNG grids to the run folder and to TensorBoard."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_only

from ldm.config import ConfigError
from ldm.sampling import SamplingStopped, build_pipeline, check_samplable, image_grid, sample

log = logging.getLogger(__name__)


class ImageLogger(pl.Callback):
    """Generate `prompts` with the model being trained every `every_n_steps` optimizer steps.

    Images are `height` x `width` pixels, by default the size of the latest training batch. A stop signal
    (see `Checkpoints`) ends sampling between two denoising steps; that grid is not written."""

    def __init__(
        self,
        prompts: list[str],
        every_n_steps: int = 500,
        num_per_prompt: int = 4,
        num_inference_steps: int = 25,
        guidance_scale: float = 5.0,
        sampler: str = "ddim",
        seed: int = 0,
        at_end: bool = True,
        height: int | None = None,
        width: int | None = None,
    ) -> None:
        if not prompts:
            raise ValueError("prompts: must list at least one prompt")
        self.prompts, self.every_n_steps, self.num_per_prompt = list(prompts), every_n_steps, num_per_prompt
        self.num_inference_steps, self.guidance_scale = num_inference_steps, guidance_scale
        self.sampler, self.seed, self.at_end = sampler, seed, at_end
        self.height, self.width = height, width
        self._last_step = -1
        self._trained: tuple[str, tuple[int, int]] | None = None  # the latest batch's key and (height, width)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Fail before the first step, not at the first grid, when the model cannot be sampled."""
        try:
            check_samplable(pl_module.parts)
        except ValueError as err:
            raise ConfigError(f"lightning.callbacks: ImageLogger: {err}; switch it off (callbacks.NAME=null)") from None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, *args) -> None:
        key = next((k for k in ("pixel_values", "latents") if k in batch), None)
        if key is not None:
            self._trained = key, tuple(batch[key].shape[-2:])
        step = trainer.global_step
        if step and step != self._last_step and step % self.every_n_steps == 0:
            self._last_step = step
            self.log_samples(trainer, pl_module)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.at_end and trainer.global_step != self._last_step:
            self.log_samples(trainer, pl_module)

    def _trained_size(self, pipe) -> tuple[int | None, int | None]:
        """(height, width) in pixels of the latest training batch: its images', or its latents' times the VAE's
        factor; (None, None), the pipeline's default, before the first batch."""
        if self._trained is None:
            return None, None
        key, (height, width) = self._trained
        factor = pipe.vae_scale_factor if key == "latents" else 1
        return height * factor, width * factor

    @rank_zero_only
    @torch.no_grad()
    def log_samples(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Path | None:
        """Sample the prompts, save `images/step_NNNNNN.png`, and add the grid to TensorBoard; None if a stop
        signal ended sampling."""
        was_training = pl_module.training
        pl_module.eval()
        try:
            with pl_module.frozen_parts_on_device():  # networks kept on the CPU (frozen_device) join the UNet
                pipe = build_pipeline(pl_module.parts, self.sampler)
                pipe.set_progress_bar_config(disable=True)
                height, width = self._trained_size(pipe)
                images = sample(
                    pipe, self.prompts, self.num_per_prompt, self.num_inference_steps, self.guidance_scale, self.seed,
                    self.height or height, self.width or width,
                    stop=lambda: getattr(trainer.checkpoint_callback, "signal", None) is not None,
                    options=getattr(getattr(pl_module, "text", None), "options", None),  # as captions are encoded
                )  # fmt: skip
        except SamplingStopped as err:
            log.info("samples of step %d: %s by a stop signal; no grid written", trainer.global_step, err)
            return None
        finally:
            pl_module.train(was_training)
        grid = image_grid(images, rows=len(self.prompts), labels=self.prompts)
        path = Path(trainer.default_root_dir) / "images" / f"step_{trainer.global_step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("samples", np.asarray(grid), trainer.global_step, dataformats="HWC")
        return path
