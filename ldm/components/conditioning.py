"""Captions to the denoiser's conditioning: which text parts encode them, and into what `cond` mapping.

The system is given one by name (`LatentDiffusion(conditioning=...)`); SD 1.x / 2.x use `clip`. Each
returns the mapping the denoiser call takes (`ldm.backbones`): `encoder_hidden_states`, and where a
family has them, `text_embeds` (pooled) and the like. A family with two text encoders (SDXL) adds an
entry here that reads `text_encoder_2` / `tokenizer_2` too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

Conditioning = Callable[[Mapping[str, Any], Sequence[str], torch.device], dict[str, torch.Tensor]]


def clip_last_hidden_state(parts: Mapping[str, Any], captions: Sequence[str], device: torch.device) -> dict:
    """SD 1.x / 2.x: the text encoder's last hidden states of the captions, padded to the tokenizer's length."""
    tokenizer = parts["tokenizer"]
    padded = {"padding": "max_length", "max_length": tokenizer.model_max_length, "truncation": True}
    ids = tokenizer(list(captions), return_tensors="pt", **padded).input_ids.to(device)
    return {"encoder_hidden_states": parts["text_encoder"](ids)[0]}


CONDITIONINGS: dict[str, Conditioning] = {"clip": clip_last_hidden_state}
TEXT_PARTS = {"clip": ("tokenizer", "text_encoder")}  # the parts each conditioning reads
