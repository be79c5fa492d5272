"""The one quirk of transformers' CLIP text encoder layout, handled in one place.

transformers >= 5.6 names `CLIPTextModel`'s weights without their `text_model.` level (and saves
them so); earlier versions, the original SD files and transformers 4.51's loader expect it.
transformers 4.51 loading the new layout leaves the text encoder silently random.
"""

from __future__ import annotations

import torch

PREFIX = "text_model."


def without_prefix(key: str) -> str:
    """A text encoder key as the newer layout names it."""
    return key.removeprefix(PREFIX)


def with_prefix(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIP text encoder state dict in the older layout, which every transformers version reads."""
    return {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in state.items()}


def as_module_names(state: dict[str, torch.Tensor], module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state`'s keys as `module` names them, whichever transformers version wrote `state`."""
    own = list(module.state_dict())
    if own and all(k.startswith(PREFIX) for k in own) and not any(k.startswith(PREFIX) for k in state):
        return with_prefix(state)
    if own and not any(k.startswith(PREFIX) for k in own):
        return {without_prefix(k): v for k, v in state.items()}
    return state


def takes_prefix(config: dict) -> bool:
    """Whether a saved text encoder (its `config.json`) is a `CLIPTextModel`, whose file lacks the level under
    transformers >= 5.6 (`CLIPTextModelWithProjection` keeps it)."""
    return "CLIPTextModel" in config.get("architectures", [])
