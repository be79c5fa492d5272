"""Stable Diffusion 3.5 (Esser et al. 2024; Medium 2.2 B and Large 8.1 B transformer parameters): an MMDiT trained by
flow matching, conditioned on three text encoders.

The denoiser is diffusers' `SD3Transformer2DModel` (our part `unet`, the denoiser whatever its architecture; a
diffusers folder calls it `transformer`): joint attention over image patches and caption tokens, RMS QK-norm, and in
Medium a second self-attention over the image tokens in its first 13 blocks (MMDiT-X). The captions are encoded
as `StableDiffusion3Pipeline.encode_prompt` encodes them (`sd35_text`): CLIP ViT-L and OpenCLIP bigG (both
`CLIPTextModelWithProjection`) give their penultimate hidden states side by side, zero-padded to T5's width,
followed along the sequence by T5-XXL's last hidden states (zeros where the model has no T5); their pooled,
projected embeddings side by side are `pooled_projections`. The VAE has 16 latent channels, a scaling and a shift
factor; the scheduler is `FlowMatchEulerDiscreteScheduler` with SD3's static shift 3.0.

It trains with `model.params.objective: flow`; its single files are not read yet (issue 42, part 4).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ldm.families.base import NETWORK_PARTS, Architecture, Conditioning, Family, PartsLike

T5_LENGTH = 256  # T5 tokens a caption is padded or cut to, as `StableDiffusion3Pipeline` (max_sequence_length)
CLIP_PARTS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
T5_PARTS = ("tokenizer_3", "text_encoder_3")


def _ids(tokenizer: Any, captions: Sequence[str], length: int, device: torch.device) -> torch.Tensor:
    padded = {"padding": "max_length", "max_length": length, "truncation": True}
    return tokenizer(list(captions), return_tensors="pt", **padded).input_ids.to(device)


def sd35_text(parts: PartsLike, captions: Sequence[str], device: torch.device, t5_length: int = T5_LENGTH) -> dict:
    """The captions' `encoder_hidden_states` (77 CLIP tokens, then `t5_length` T5 tokens, each T5's width) and
    `pooled_projections` (CLIP-L's and CLIP-G's projected pooled embeddings side by side), as
    `StableDiffusion3Pipeline.encode_prompt` makes them without classifier-free guidance. Without a
    `text_encoder_3` the T5 tokens are zeros of the transformer's `joint_attention_dim`."""
    states, pooled = [], []
    length = parts["tokenizer"].model_max_length  # both CLIPs are cut to the first one's length, as diffusers does
    for tokenizer, encoder in CLIP_PARTS:
        out = parts[encoder](_ids(parts[tokenizer], captions, length, device), output_hidden_states=True)
        states.append(out.hidden_states[-2])
        pooled.append(out[0])
    clip = torch.cat(states, dim=-1)
    if parts.get(T5_PARTS[1]) is not None:
        t5 = parts[T5_PARTS[1]](_ids(parts[T5_PARTS[0]], captions, t5_length, device))[0]
    else:
        width = parts["unet"].config.joint_attention_dim
        t5 = torch.zeros(len(captions), t5_length, width, device=device, dtype=clip.dtype)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {"encoder_hidden_states": torch.cat([clip, t5], dim=-2), "pooled_projections": torch.cat(pooled, dim=-1)}


def _pipeline(parts: PartsLike, scheduler: Any) -> Any:
    from diffusers import StableDiffusion3Pipeline

    names = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    t5 = {name: parts.get(name) for name in T5_PARTS}
    return StableDiffusion3Pipeline(
        transformer=parts["unet"], scheduler=scheduler, **{n: parts[n] for n in names}, **t5
    )


ARCHITECTURE = Architecture(
    name="sd35",
    title="Stable Diffusion 3.5",
    conditioning_name="sd35",
    conditioning=Conditioning(tuple(p for pair in CLIP_PARTS for p in pair), sd35_text),
    layouts=(),
    kohya_prefixes={"unet": "lora_unet_", "text_encoder": "lora_te1_", "text_encoder_2": "lora_te2_"},
    pipeline_class="StableDiffusion3Pipeline",
    pipeline=_pipeline,
    denoiser_classes=("SD3Transformer2DModel",),
    part_classes={
        "unet": "diffusers.SD3Transformer2DModel",
        "text_encoder": "transformers.CLIPTextModelWithProjection",
        "scheduler": "diffusers.FlowMatchEulerDiscreteScheduler",
    },
    folders={"unet": "transformer"},
    lora_files=False,  # its kohya names (fused q/k/v) and diffusers' `transformer.` prefix are not mapped yet
)

NETWORKS = (*NETWORK_PARTS, "text_encoder_2", "text_encoder_3")
FAMILIES = (
    Family("sd35-medium", "Stable Diffusion 3.5 Medium", "sd35", None, "<|endoftext|>", None,
           "stable-diffusion-v3.5-medium", "", NETWORKS, "!"),
    Family("sd35-large", "Stable Diffusion 3.5 Large", "sd35", None, "<|endoftext|>", None,
           "stable-diffusion-v3.5-large", "", NETWORKS, "!"),
)  # fmt: skip
