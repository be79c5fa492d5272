"""Captions (and, for some families, each image's size and crop) to the denoiser's conditioning.

A system's conditioning is named (`LatentDiffusion(conditioning=...)`) or follows its parts
(`conditioning_for`): SD 1.x / 2.x use `clip`. Each returns the mapping the denoiser call takes
(`ldm.backbones`): `encoder_hidden_states`, and where a family has them, `text_embeds` (pooled) and the
like. The caption part is cached by latent caches and shards; the image part (SDXL's `time_ids`) is made
per batch from the sizes the data records (`original_size`, `crop_top_left`) and the size trained at.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from ldm.utils import stacked_pairs

TextEncoding = Callable[[Mapping[str, object], Sequence[str], torch.device], dict[str, torch.Tensor]]
ImageEncoding = Callable[[Mapping[str, object], tuple[int, int], torch.device], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Conditioning:
    """How a family conditions its denoiser: `text` encodes captions with the `text_parts`; `image`, where the
    family has it, makes a batch's per-image conditioning from the batch and the (height, width) trained at."""

    text_parts: tuple[str, ...]
    text: TextEncoding
    image: ImageEncoding | None = None


def clip_last_hidden_state(parts: Mapping[str, object], captions: Sequence[str], device: torch.device) -> dict:
    """SD 1.x / 2.x: the text encoder's last hidden states of the captions, padded to the tokenizer's length."""
    tokenizer = parts["tokenizer"]
    padded = {"padding": "max_length", "max_length": tokenizer.model_max_length, "truncation": True}
    ids = tokenizer(list(captions), return_tensors="pt", **padded).input_ids.to(device)
    return {"encoder_hidden_states": parts["text_encoder"](ids)[0]}


def sdxl_text(parts: Mapping[str, object], captions: Sequence[str], device: torch.device) -> dict:
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


CONDITIONINGS: dict[str, Conditioning] = {
    "clip": Conditioning(("tokenizer", "text_encoder"), clip_last_hidden_state),
    "sdxl": Conditioning(("tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2"), sdxl_text, sdxl_time_ids),
}


def conditioning_for(parts: Mapping[str, object]) -> str:
    """The conditioning of `parts`: the one that reads the most of their text parts, all of which they have."""
    fitting = [name for name, c in CONDITIONINGS.items() if all(p in parts for p in c.text_parts)]
    if not fitting:
        raise ValueError(f"no conditioning fits parts {', '.join(parts)}: each needs a tokenizer and text encoder")
    return max(fitting, key=lambda name: len(CONDITIONINGS[name].text_parts))
