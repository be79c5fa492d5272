"""Sample from parts through a diffusers pipeline (the family's for a UNet, `ldm.families`; our `MicroDiTPipeline`
for a MicroDiT), and lay images out in grids."""

from __future__ import annotations

from collections.abc import Callable

import torch
from diffusers import DiffusionPipeline, UNet2DConditionModel
from PIL import Image, ImageDraw

from ldm.backbones.microdit import MicroDiT
from ldm.components import Parts
from ldm.families import architecture_of
from ldm.pipelines.microdit import MicroDiTPipeline
from ldm.systems.objective import is_flow_scheduler

SAMPLERS = {
    "ddim": "DDIMScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "pndm": "PNDMScheduler",
    "ddpm": "DDPMScheduler",
}


# A MicroDiT trains with EDM: it samples with diffusers' EDM schedulers, which precondition as it trained.
EDM_SAMPLERS = {"euler": "EDMEulerScheduler", "ddim": "EDMEulerScheduler", "dpm++": "EDMDPMSolverMultistepScheduler"}
# A flow-matching model samples with diffusers' flow-matching schedulers, which step along its velocity.
FLOW_SAMPLERS = {"euler": "FlowMatchEulerDiscreteScheduler", "ddim": "FlowMatchEulerDiscreteScheduler",
                 "heun": "FlowMatchHeunDiscreteScheduler"}  # fmt: skip
SAMPLER_NAMES = tuple(dict.fromkeys([*SAMPLERS, *FLOW_SAMPLERS]))  # what `--sampler` takes: each model checks its own


class SamplingStopped(Exception):
    """`sample` stopped between denoising steps because its `stop()` said so."""


def inference_scheduler(training_scheduler, sampler: str = "ddim"):
    """A sampling scheduler sharing the training noise schedule and prediction type."""
    import diffusers

    config = {k: v for k, v in training_scheduler.config.items() if k != "_use_default_values"}
    if "sigma_data" in config:  # an EDM model
        if sampler not in EDM_SAMPLERS:
            raise ValueError(f"sampler: an EDM model samples with {', '.join(EDM_SAMPLERS)}; got {sampler!r}")
        return getattr(diffusers, EDM_SAMPLERS[sampler]).from_config(config)
    if is_flow_scheduler(training_scheduler):
        if sampler not in FLOW_SAMPLERS:
            raise ValueError(f"sampler: a flow-matching model samples with {', '.join(FLOW_SAMPLERS)}; got {sampler!r}")
        return getattr(diffusers, FLOW_SAMPLERS[sampler]).from_config(config)
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    config["clip_sample"] = False  # latents are not bounded in [-1, 1]
    return getattr(diffusers, SAMPLERS[sampler]).from_config(config)


def check_samplable(parts: Parts) -> None:
    """Raise `ValueError` unless `parts` have a pipeline: the denoiser must be a MicroDiT or one its family's
    pipeline takes, and a UNet's scheduler one its pipeline samples with (not a flow-matching one)."""
    if isinstance(parts.unet, MicroDiT):
        return
    if isinstance(parts.unet, UNet2DConditionModel) and is_flow_scheduler(parts.scheduler):
        raise ValueError(
            f"a UNet trained by flow matching cannot sample yet: diffusers' UNet pipelines cannot use the "
            f"{type(parts.scheduler).__name__}; it trains and checkpoints"
        )
    architecture = architecture_of(parts)
    if type(parts.unet).__name__ not in architecture.denoiser_classes:
        raise ValueError(
            f"sampling and export go through diffusers' {architecture.pipeline_class} (a "
            f"{' or '.join(architecture.denoiser_classes)}) or ldm's MicroDiTPipeline; this denoiser is a "
            f"{type(parts.unet).__name__}, which trains and checkpoints but cannot sample yet"
        )


def build_pipeline(parts: Parts, sampler: str = "ddim") -> DiffusionPipeline:
    """The pipeline of `parts` (shared, not copied): a UNet's family's diffusers pipeline (without a safety
    checker or watermarker), or a `MicroDiTPipeline` with an EDM scheduler."""
    check_samplable(parts)
    scheduler = inference_scheduler(parts.scheduler, sampler)
    if isinstance(parts.unet, MicroDiT):
        return MicroDiTPipeline(transformer=parts.unet, vae=parts.vae, text_encoder=parts.text_encoder,
                                tokenizer=parts.tokenizer, scheduler=scheduler)  # fmt: skip
    return architecture_of(parts).pipeline(parts, scheduler)


def image_grid(images: list[Image.Image], rows: int, labels: list[str] | None = None) -> Image.Image:
    """Images in a grid of `rows` rows, with an optional text label to the left of each row."""
    cols = -(-len(images) // rows)
    w, h = images[0].size
    label_w = 0
    if labels:
        probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
        label_w = max(int(probe.textlength(label)) for label in labels) + 8
    grid = Image.new("RGB", (label_w + cols * w, rows * h), "white")
    draw = ImageDraw.Draw(grid)
    for i, image in enumerate(images):
        r, c = divmod(i, cols)
        grid.paste(image.convert("RGB"), (label_w + c * w, r * h))
    for r, label in enumerate(labels or []):
        draw.text((4, r * h + h // 2 - 5), label, fill="black")
    return grid


@torch.no_grad()
def sample(
    pipe: DiffusionPipeline,
    prompts: list[str],
    num_per_prompt: int = 1,
    steps: int = 25,
    guidance_scale: float = 5.0,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
    stop: Callable[[], bool] | None = None,
    options: dict | None = None,
) -> list[Image.Image]:
    """Generate `num_per_prompt` images for each prompt, prompt-major, reproducibly from `seed`.

    `stop` is asked after every denoising step; when it returns True, `SamplingStopped` is raised. `options` go to
    the pipeline's call as they are (the caption encoding's, as trained: `max_sequence_length`, say)."""

    def check_stop(pipe: DiffusionPipeline, step: int, timestep: int, tensors: dict) -> dict:
        if stop is not None and stop():
            raise SamplingStopped(f"stopped at denoising step {step + 1} of {steps}")
        return tensors

    images = []
    for i, prompt in enumerate(prompts):
        generator = torch.Generator(device="cpu").manual_seed(seed + i)
        out = pipe(
            prompt,
            num_images_per_prompt=num_per_prompt,
            num_inference_steps=steps,
            guidance_scale=guidance_scale,
            generator=generator,
            height=height,
            width=width,
            callback_on_step_end=check_stop,
            **(options or {}),
        )
        images.extend(out.images)
    return images
