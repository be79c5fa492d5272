"""Stable Diffusion 1.x and 2.x: a UNet conditioned on one CLIP text encoder's hidden states.

SD 1.x conditions on OpenAI CLIP ViT-L's last layer; SD 2.x on OpenCLIP ViT-H's penultimate one (its
`CLIPTextModel` is built one layer short, the last kept as an extra of its single files). Single files (the
CompVis layout) hold the text encoder under `cond_stage_model.`: CLIP's names as transformers has them, OpenCLIP's
with fused q/k/v. SD 2.x's 512-base (epsilon) and 768-v (v-prediction) weights look alike, so their files carry
the original YAML beside them, and a file without one is told apart by its global step or by the user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ldm.families.base import Architecture, Conditioning, Family, FileLayout, PartsLike, SingleFileError

CLIP, OPEN_CLIP = "cond_stage_model.transformer.text_model.", "cond_stage_model.model."
KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te_"}
# The global step of Stability's 512-base-ema.ckpt; diffusers keys SD 2 base off the same number.
SD2_BASE_GLOBAL_STEP = 875000


def clip_last_hidden_state(parts: PartsLike, captions: Sequence[str], device: torch.device) -> dict:
    """One text encoder's last hidden states of the captions, padded to the tokenizer's length."""
    tokenizer = parts["tokenizer"]
    padded = {"padding": "max_length", "max_length": tokenizer.model_max_length, "truncation": True}
    ids = tokenizer(list(captions), return_tensors="pt", **padded).input_ids.to(device)
    return {"encoder_hidden_states": parts["text_encoder"](ids)[0]}


def _pick(candidates: Sequence[Family], state: Mapping[str, Any], global_step: Any, where: str) -> tuple[Family, str]:
    """SD 1.x has one family; SD 2.x's two are told apart by Stability's base global step, else by the user."""
    layout = candidates[0].text_layout
    if len(candidates) == 1:
        return candidates[0], f"from its {layout} text encoder"
    if global_step == SD2_BASE_GLOBAL_STEP:
        return next(f for f in candidates if f.name == "sd2-base"), (
            f"from its OpenCLIP text encoder and global_step {global_step}"
        )
    raise SingleFileError(
        f"{where}: Stable Diffusion 2.x weights, but the weights cannot tell 512-base (epsilon) from 768-v "
        "(v-prediction); say which: model.params.pretrained_family: sd2-base or sd2-768-v (convert.py: --family)"
    )


def _open_clip_projection(parts: PartsLike, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """OpenCLIP's output projection, unused by SD 2.x (it conditions on hidden states) and so absent from
    `CLIPTextModel`; readers size the encoder from it, so it is written as the identity (a placeholder: the real
    one is written where the parts' source file gave it)."""
    width = parts["text_encoder"].config.hidden_size
    return {OPEN_CLIP + "text_projection": torch.eye(width, dtype=state[OPEN_CLIP + "ln_final.weight"].dtype)}


CLIP_LAYOUT = FileLayout("clip", (("text_encoder", CLIP, "clip"),), CLIP + "embeddings.token_embedding.weight", _pick)
OPEN_CLIP_LAYOUT = FileLayout(
    "open_clip",
    (("text_encoder", OPEN_CLIP, "open_clip"),),
    OPEN_CLIP + "token_embedding.weight",
    _pick,
    placeholder_keys=(OPEN_CLIP + "text_projection",),
    placeholders=_open_clip_projection,
)


def _pipeline(parts: PartsLike, scheduler: Any) -> Any:
    from diffusers import StableDiffusionPipeline

    names = ("unet", "vae", "text_encoder", "tokenizer")
    options = {"safety_checker": None, "feature_extractor": None, "requires_safety_checker": False}
    return StableDiffusionPipeline(**{name: parts[name] for name in names}, scheduler=scheduler, **options)


ARCHITECTURE = Architecture(
    name="sd",
    title="Stable Diffusion 1.x, 2.x",
    conditioning_name="clip",
    conditioning=Conditioning(("tokenizer", "text_encoder"), clip_last_hidden_state),
    layouts=(CLIP_LAYOUT, OPEN_CLIP_LAYOUT),
    kohya_prefixes=KOHYA_PREFIXES,
    pipeline_class="StableDiffusionPipeline",
    pipeline=_pipeline,
    pipeline_options={"safety_checker": None},
    refused_pipelines={"StableDiffusionInpaintPipeline": "an inpainting model"},
    compvis_text_encoders={
        "ldm.modules.encoders.modules.FrozenCLIPEmbedder": ("sd15", "last"),
        "ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder": ("sd2-base", "penultimate"),
    },
)

FAMILIES = (
    Family("sd15", "Stable Diffusion 1.x", "sd", "clip", "<|endoftext|>", "v1-inference.yaml",
           "stable-diffusion-v1", "sd_v1"),
    Family("sd2-base", "Stable Diffusion 2.x 512-base", "sd", "open_clip", "!", "v2-inference.yaml",
           "stable-diffusion-v2-512", "sd_v2", kohya_v2=True),
    Family("sd2-768-v", "Stable Diffusion 2.x 768-v", "sd", "open_clip", "!", "v2-inference-v.yaml",
           "stable-diffusion-v2-768-v", "sd_v2_v", kohya_v2=True),
)  # fmt: skip
