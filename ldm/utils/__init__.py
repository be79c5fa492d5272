"""Small helpers every floor may use."""

from __future__ import annotations

import torch


def stacked_pairs(value: object) -> torch.Tensor:
    """A batch's pairs (an image's (height, width), a crop's (top, left)) as one (batch, 2) integer tensor, in
    whichever form the default collate left them: a tensor, or [firsts, seconds] from per-example tuples."""
    if isinstance(value, (list, tuple)):
        value = torch.stack([torch.as_tensor(v) for v in value], dim=-1)
    return torch.as_tensor(value).reshape(-1, 2).long()
