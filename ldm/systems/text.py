"""What a run sets of how captions become the denoiser's conditioning, beyond the family's own way
(`ldm.families.Conditioning`): the settings its caption encoding takes (T5's token count, diffusers'
`max_sequence_length`), and each text encoder's own dropout.

A text encoder dropped for a sample gives zeros in its share of that sample's conditioning, as Esser et al. 2024
(sec. 5.3.2) train with three encoders, each dropped independently, which lets the model sample without the
largest. Whole captions are dropped by the data (`data.params.caption_dropout`); the two combine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ldm import diffusion
from ldm.config import ConfigError
from ldm.families import Conditioning, PartsLike


@dataclass
class TextSettings:
    """`options`: keyword settings of the conditioning's caption encoding (`model.params.<name>`); `dropout`: per
    text encoder (part name), the probability that a sample trains with its share of the conditioning zeroed
    (`model.params.text_dropout`)."""

    options: dict[str, Any] = field(default_factory=dict)
    dropout: dict[str, float] = field(default_factory=dict)

    def check(self, conditioning: Conditioning, name: str) -> None:
        """Refuse, naming the key, what the conditioning `name` does not take."""
        for option in self.options:
            if option not in conditioning.options:
                takes = f"; it takes {', '.join(conditioning.options)}" if conditioning.options else ""
                raise ConfigError(f"model.params.{option}: the {name} conditioning takes no {option}{takes}")
        for part, probability in self.dropout.items():
            if part not in conditioning.droppable:
                droppable = ", ".join(conditioning.droppable) or "none"
                raise ConfigError(
                    f"model.params.text_dropout.{part}: the {name} conditioning drops these text encoders one by "
                    f"one: {droppable} (data.params.caption_dropout drops whole captions)"
                )
            if not 0.0 <= float(probability) <= 1.0:
                raise ConfigError(f"model.params.text_dropout.{part}: got {probability}; a probability is in [0, 1]")


def drop_encoders(
    settings: TextSettings,
    conditioning: Conditioning,
    parts: PartsLike,
    cond: dict[str, torch.Tensor],
    draws: diffusion.Draws,
) -> dict[str, torch.Tensor]:
    """`cond` with each text encoder of `settings.dropout` zeroed for the samples it is dropped for: one uniform
    number per sample and encoder, from the step's draws (keyed per sample where the batch has ids)."""
    first = next(iter(cond.values()))
    names = list(settings.dropout)
    numbers = draws.uniform(first.shape[0], (len(names),), first.device)
    dropped = {name: numbers[:, i] < float(settings.dropout[name]) for i, name in enumerate(names)}
    return conditioning.drop(parts, cond, dropped)
