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

It trains with `model.params.objective: flow`. Its single files (`sd3.5_medium.safetensors`, as ComfyUI and
sd-scripts read them) hold the MMDiT under `model.diffusion_model.` with Stability's names (`ldm.families.mmdit_keys`),
the VAE under `first_stage_model.`, and, where they hold them, the text encoders with transformers' names under
`text_encoders.clip_l.transformer.`, `.clip_g.` and `.t5xxl.`; CLIP-L's projection is the identity there, as
diffusers reads such a file. Stability's own files hold no text encoder: those come from ComfyUI's files of their
own (`clip_l.safetensors`, `clip_g.safetensors`, `t5xxl_fp16.safetensors`). Medium's first blocks have a second
image self-attention (`x_block.attn2`), which tells it from Large.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ldm.families.base import NETWORK_PARTS, UNET, Architecture, Conditioning, Family, FileLayout, PartsLike
from ldm.families.mmdit_keys import mmdit_module_name, mmdit_name

T5_LENGTH = 256  # T5 tokens a caption is padded or cut to, as `StableDiffusion3Pipeline` (max_sequence_length)
CLIP_PARTS = (("tokenizer", "text_encoder"), ("tokenizer_2", "text_encoder_2"))
T5_PARTS = ("tokenizer_3", "text_encoder_3")


def _ids(tokenizer: Any, captions: Sequence[str], length: int, device: torch.device) -> torch.Tensor:
    padded = {"padding": "max_length", "max_length": length, "truncation": True}
    return tokenizer(list(captions), return_tensors="pt", **padded).input_ids.to(device)


def sd35_text(
    parts: PartsLike, captions: Sequence[str], device: torch.device, max_sequence_length: int = T5_LENGTH
) -> dict:
    """The captions' `encoder_hidden_states` (77 CLIP tokens, then `max_sequence_length` T5 tokens, each T5's
    width) and `pooled_projections` (CLIP-L's and CLIP-G's projected pooled embeddings side by side), as
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
        if parts.get(T5_PARTS[0]) is None:
            raise ValueError(
                "T5 (text_encoder_3) has no tokenizer, and single files hold none: give model.params.tokenizer_3 "
                "= {pretrained: FOLDER} (an SD3.5 diffusers folder's tokenizer_3/, or google/t5-v1_1-xxl's files)"
            )
        t5_encoder = parts[T5_PARTS[1]]  # it runs where it is: a cache may encode with the CLIPs only moved over
        where = next(t5_encoder.parameters()).device
        t5 = t5_encoder(_ids(parts[T5_PARTS[0]], captions, max_sequence_length, where))[0].to(device)
    else:
        width = parts["unet"].config.joint_attention_dim
        t5 = torch.zeros(len(captions), max_sequence_length, width, device=device, dtype=clip.dtype)
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {"encoder_hidden_states": torch.cat([clip, t5], dim=-2), "pooled_projections": torch.cat(pooled, dim=-1)}


def _drop(parts: PartsLike, cond: dict, dropped: Mapping[str, torch.Tensor]) -> dict:
    """`cond` with the share of each text encoder in `dropped` zeroed for the samples marked: CLIP-L's and CLIP-G's
    features of the CLIP tokens and their pooled embeddings, T5's tokens (as the pipeline has them without T5)."""
    states, pooled = cond["encoder_hidden_states"], cond["pooled_projections"]
    keep, keep_pooled = torch.ones_like(states, dtype=torch.bool), torch.ones_like(pooled, dtype=torch.bool)
    clip_tokens, start, start_pooled = parts["tokenizer"].model_max_length, 0, 0
    for _, encoder in CLIP_PARTS:
        config = parts[encoder].config
        end, end_pooled = start + config.hidden_size, start_pooled + config.projection_dim
        if encoder in dropped:
            keep[:, :clip_tokens, start:end] &= ~dropped[encoder][:, None, None]
            keep_pooled[:, start_pooled:end_pooled] &= ~dropped[encoder][:, None]
        start, start_pooled = end, end_pooled
    if T5_PARTS[1] in dropped:
        keep[:, clip_tokens:] &= ~dropped[T5_PARTS[1]][:, None, None]
    return {**cond, "encoder_hidden_states": states * keep, "pooled_projections": pooled * keep_pooled}


def _pipeline(parts: PartsLike, scheduler: Any) -> Any:
    from diffusers import StableDiffusion3Pipeline

    names = ("vae", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")
    t5 = {name: parts.get(name) for name in T5_PARTS}
    return StableDiffusion3Pipeline(
        transformer=parts["unet"], scheduler=scheduler, **{n: parts[n] for n in names}, **t5
    )


def _pick(candidates: Sequence[Family], state: Any, global_step: Any, where: str) -> tuple[Family, str]:
    by_name = {f.name: f for f in candidates}
    if UNET + "joint_blocks.0.x_block.attn2.qkv.weight" in state:
        return by_name["sd35-medium"], "from its MMDiT-X blocks (a second self-attention: x_block.attn2)"
    return by_name["sd35-large"], "from its MMDiT blocks (no x_block.attn2: Large)"


def _identity(shape: Any) -> torch.Tensor:
    return torch.eye(shape[0], shape[1])


LAYOUT = FileLayout(
    "sd3",
    (
        ("text_encoder", "text_encoders.clip_l.transformer.", "hf"),
        ("text_encoder_2", "text_encoders.clip_g.transformer.", "hf"),
        ("text_encoder_3", "text_encoders.t5xxl.transformer.", "hf"),
    ),
    UNET + "joint_blocks.0.context_block.attn.qkv.weight",
    _pick,
    denoiser=mmdit_name,
    implied={"text_encoder.text_projection.weight": _identity},
    optional=("text_encoder", "text_encoder_2", "text_encoder_3"),
)

ARCHITECTURE = Architecture(
    name="sd35",
    title="Stable Diffusion 3.5",
    conditioning_name="sd35",
    conditioning=Conditioning(
        tuple(p for pair in CLIP_PARTS for p in pair),
        sd35_text,
        options=("max_sequence_length",),
        droppable=(CLIP_PARTS[0][1], CLIP_PARTS[1][1], T5_PARTS[1]),
        drop=_drop,
    ),
    layouts=(LAYOUT,),
    kohya_prefixes={
        "unet": "lora_unet_",
        "text_encoder": "lora_te1_",
        "text_encoder_2": "lora_te2_",
        "text_encoder_3": "lora_te3_",
    },  # sd-scripts' `networks/lora_sd3.py`
    kohya_denoiser=mmdit_module_name,
    pipeline_class="StableDiffusion3Pipeline",
    pipeline=_pipeline,
    denoiser_classes=("SD3Transformer2DModel",),
    part_classes={
        "unet": "diffusers.SD3Transformer2DModel",
        "text_encoder": "transformers.CLIPTextModelWithProjection",
        "scheduler": "diffusers.FlowMatchEulerDiscreteScheduler",
    },
    folders={"unet": "transformer"},
)

NETWORKS = (*NETWORK_PARTS, "text_encoder_2", "text_encoder_3")
FAMILIES = (
    Family("sd35-medium", "Stable Diffusion 3.5 Medium", "sd35", "sd3", "<|endoftext|>", None,
           "stable-diffusion-v3.5-medium", "", NETWORKS, "!"),
    Family("sd35-large", "Stable Diffusion 3.5 Large", "sd35", "sd3", "<|endoftext|>", None,
           "stable-diffusion-v3.5-large", "", NETWORKS, "!"),
)  # fmt: skip
