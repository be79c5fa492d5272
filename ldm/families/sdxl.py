"""Stable Diffusion XL (Podell et al. 2023): a UNet conditioned on two text encoders and on each image's size.

The two encoders (OpenAI CLIP ViT-L, OpenCLIP bigG as `CLIPTextModelWithProjection`) give their penultimate
hidden states side by side and the second's pooled, projected embedding; the UNet also takes each image's
original size, crop and trained size (`time_ids`). Single files hold the encoders under `conditioner.embedders.0.`
(CLIP) and `.1.` (OpenCLIP), and say v-prediction and zero terminal SNR by empty `v_pred` / `ztsnr` tensors.
kohya names the encoders `lora_te1_` / `lora_te2_` and the UNet's modules by their original paths.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ldm.families.base import NETWORK_PARTS, UNET, Architecture, Conditioning, Family, FileLayout, PartsLike
from ldm.utils import stacked_pairs

SDXL_CLIP, SDXL_OPEN_CLIP = "conditioner.embedders.0.transformer.text_model.", "conditioner.embedders.1.model."
KOHYA_PREFIXES = {"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"}
# Empty tensors by which SDXL files say they are v-prediction and zero terminal SNR (ComfyUI reads them).
MARKERS = {"v_pred": ("prediction_type", "v_prediction"), "ztsnr": ("rescale_betas_zero_snr", True)}


def sdxl_text(parts: PartsLike, captions: Sequence[str], device: torch.device) -> dict:
    """SDXL (Podell et al. 2023, sec. 2.1): both text encoders' penultimate hidden states side by side (768 + 1280
    = 2048 features a token), and the second's pooled, projected embedding as `text_embeds`."""
    states = []
    for tokenizer, encoder in (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2")):
        tok = parts[tokenizer]
        padded = {"padding": "max_length", "max_length": tok.model_max_length, "truncation": True}
        ids = tok(list(captions), return_tensors="pt", **padded).input_ids.to(device)
        out = parts[encoder](ids, output_hidden_states=True)
        states.append(out.hidden_states[-2])
    return {"encoder_hidden_states": torch.cat(states, dim=-1), "text_embeds": out.text_embeds}


def sdxl_time_ids(batch: Mapping[str, object], size: tuple[int, int], device: torch.device) -> dict:
    """SDXL's size and crop conditioning (Podell et al. 2023, sec. 2.2): each image's (height, width) before it
    was resized, the (top, left) of its crop and the (height, width) trained at, as `time_ids` (batch, 6). Data
    that does not record them (a custom dataset) counts as uncropped images of the trained size."""
    trained = torch.tensor(size, dtype=torch.long).expand(len(batch["caption"]), 2)
    original, crop = (batch.get(key) for key in ("original_size", "crop_top_left"))
    original = trained if original is None else stacked_pairs(original).cpu()
    crop = torch.zeros_like(trained) if crop is None else stacked_pairs(crop).cpu()
    return {"time_ids": torch.cat([original, crop, trained], dim=1).to(device, torch.float32)}


def _pick(candidates: Sequence[Family], state: Mapping[str, Any], global_step: Any, where: str) -> tuple[Family, str]:
    if "v_pred" in state:
        return next(f for f in candidates if f.name == "sdxl-v"), "from its SDXL text encoders and its v_pred key"
    return next(f for f in candidates if f.name == "sdxl"), "from its SDXL text encoders (no v_pred key: epsilon)"


def _refuse(state: Mapping[str, Any]) -> str | None:
    """SDXL's refiner (one OpenCLIP text encoder) and inpainting models, which ldm does not train."""
    if not any(k.startswith("conditioner.embedders.") for k in state):
        return None
    conv_in = state.get(UNET + "input_blocks.0.0.weight")
    if not any(k.startswith("conditioner.embedders.1.") for k in state):
        return "the SDXL refiner (one OpenCLIP text encoder, image to image)"
    if conv_in is not None and conv_in.shape[1] != 4:
        return f"an SDXL inpainting model ({conv_in.shape[1]} input channels)"
    return None


def _pipeline(parts: PartsLike, scheduler: Any) -> Any:
    from diffusers import StableDiffusionXLPipeline

    names = ("unet", "vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    return StableDiffusionXLPipeline(**{name: parts[name] for name in names}, scheduler=scheduler,
                                     add_watermarker=False)  # fmt: skip


LAYOUT = FileLayout(
    "sdxl",
    (("text_encoder", SDXL_CLIP, "clip"), ("text_encoder_2", SDXL_OPEN_CLIP, "open_clip")),
    SDXL_OPEN_CLIP + "token_embedding.weight",
    _pick,
    markers=MARKERS,
)

ARCHITECTURE = Architecture(
    name="sdxl",
    title="SDXL base",
    conditioning_name="sdxl",
    conditioning=Conditioning(("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"), sdxl_text, sdxl_time_ids),
    layouts=(LAYOUT,),
    kohya_prefixes=KOHYA_PREFIXES,
    kohya_original_unet=True,
    pipeline_class="StableDiffusionXLPipeline",
    pipeline=_pipeline,
    pipeline_options={"add_watermarker": False},
    refuse_file=_refuse,
    refused_pipelines={
        "StableDiffusionXLImg2ImgPipeline": "the SDXL refiner (an image-to-image model)",
        "StableDiffusionXLInpaintPipeline": "an SDXL inpainting model",
    },
)

NETWORKS = (*NETWORK_PARTS, "text_encoder_2")
FAMILIES = (
    Family("sdxl", "Stable Diffusion XL 1.0 base", "sdxl", "sdxl", "<|endoftext|>", None,
           "stable-diffusion-xl-v1-base", "sdxl_base_v1-0", NETWORKS, "!"),
    Family("sdxl-v", "SDXL, v-prediction with zero terminal SNR (NoobAI-XL v-pred and the like)", "sdxl", "sdxl",
           "<|endoftext|>", None, "stable-diffusion-xl-v1-base", "sdxl_base_v1-0", NETWORKS, "!",
           networks_from="sdxl"),  # modelspec.prediction_type says v
)  # fmt: skip
