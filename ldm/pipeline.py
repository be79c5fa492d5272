"""Turn trained parts into a diffusers `StableDiffusionPipeline`: to sample, and to export."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from diffusers import StableDiffusionPipeline
from PIL import Image, ImageDraw

from ldm.checkpoint import load_checkpoint, parts_from_checkpoint
from ldm.models.parts import Parts
from ldm.tokenizers import write_both_tokenizer_forms

SAMPLERS = {
    "ddim": "DDIMScheduler",
    "dpm++": "DPMSolverMultistepScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_a": "EulerAncestralDiscreteScheduler",
    "pndm": "PNDMScheduler",
    "ddpm": "DDPMScheduler",
}


def inference_scheduler(training_scheduler, sampler: str = "ddim"):
    """A sampling scheduler sharing the training noise schedule and prediction type."""
    import diffusers

    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {', '.join(SAMPLERS)}, got {sampler!r}")
    config = {k: v for k, v in training_scheduler.config.items() if k != "_use_default_values"}
    config["clip_sample"] = False  # latents are not bounded in [-1, 1]
    return getattr(diffusers, SAMPLERS[sampler]).from_config(config)


def build_pipeline(parts: Parts, sampler: str = "ddim") -> StableDiffusionPipeline:
    """A `StableDiffusionPipeline` over `parts` (shared, not copied), without a safety checker."""
    return StableDiffusionPipeline(
        vae=parts.vae,
        text_encoder=parts.text_encoder,
        tokenizer=parts.tokenizer,
        unet=parts.unet,
        scheduler=inference_scheduler(parts.scheduler, sampler),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )


def load_pipeline(path: str | Path, sampler: str = "ddim", ema: bool = False) -> StableDiffusionPipeline:
    """A pipeline from one of our checkpoints, an original single file, or a diffusers folder."""
    path = Path(path)
    if (path / "model_index.json").is_file():
        if ema:
            raise ValueError("--ema applies to checkpoints; an exported folder holds one set of weights")
        pipe = StableDiffusionPipeline.from_pretrained(path, local_files_only=True, safety_checker=None)
        pipe.scheduler = inference_scheduler(pipe.scheduler, sampler)
        return pipe
    from ldm.export import read_parts

    return build_pipeline(read_parts(path, ema=ema), sampler)


def export_pipeline(ckpt_path: str | Path, out_dir: str | Path, ema: bool = False, sampler: str = "ddim") -> Path:
    """Write a checkpoint as a diffusers folder (safetensors weights, tokenizer, scheduler)."""
    ckpt = load_checkpoint(ckpt_path)
    out_dir = write_pipeline(parts_from_checkpoint(ckpt, ema=ema), out_dir, sampler)
    if ckpt["ldm"].get("config"):
        (out_dir / "ldm_config.json").write_text(json.dumps(ckpt["ldm"]["config"], indent=2))
    return out_dir


def write_pipeline(parts: Parts, out_dir: str | Path, sampler: str = "ddim", half: bool = False) -> Path:
    """Write parts as a diffusers `StableDiffusionPipeline` folder that loads under transformers 4.51 and 5."""
    pipe = build_pipeline(parts, sampler)
    if half:
        for module in (pipe.unet, pipe.vae, pipe.text_encoder):
            module.half()
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return make_portable(out_dir)


TEXT_MODEL_PREFIX = "text_model."


def make_portable(folder: str | Path) -> Path:
    """Make a diffusers SD folder load the same under transformers 4.51 and 5.

    transformers >= 5.6 writes the CLIP text encoder's weights without their `text_model.` prefix
    and the tokenizer as `tokenizer.json` only; transformers 4.51 then leaves the text encoder
    silently random and cannot build the tokenizer. Both versions read the older weight layout, so
    this restores the prefix; and it writes both tokenizer forms, each made from the other.
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    config = json.loads((folder / "text_encoder" / "config.json").read_text())
    for weights in sorted((folder / "text_encoder").glob("*.safetensors")):
        state = load_file(str(weights))
        if "CLIPTextModel" in config.get("architectures", []) and not all(
            k.startswith(TEXT_MODEL_PREFIX) for k in state
        ):
            state = {k if k.startswith(TEXT_MODEL_PREFIX) else TEXT_MODEL_PREFIX + k: v for k, v in state.items()}
            save_file(state, str(weights), metadata={"format": "pt"})
    write_both_tokenizer_forms(folder / "tokenizer")
    return folder


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
    pipe: StableDiffusionPipeline,
    prompts: list[str],
    num_per_prompt: int = 1,
    steps: int = 25,
    guidance_scale: float = 5.0,
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
) -> list[Image.Image]:
    """Generate `num_per_prompt` images for each prompt, prompt-major, reproducibly from `seed`."""
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
        )
        images.extend(out.images)
    return images
