"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the UNet and
text encoder, through peft; merged back into plain weights, or exported as a diffusers LoRA file.

A LoRA layer adds `(alpha / rank) * B @ A` to a frozen weight. Checkpoints hold only A and B (and
their EMA); the frozen base is read again from `model.params.pretrained`. Writing LoRA files for other
tools is `ldm.weights.lora_file`.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from ldm.components import Parts
from ldm.components.build import module_from_config
from ldm.config import ConfigError

DEFAULT_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0"],  # the attention projections of every transformer block
    "text_encoder": ["q_proj", "k_proj", "v_proj", "out_proj"],
}
TARGETS_KEY = {"unet": "target_modules", "text_encoder": "text_encoder_target_modules"}  # in LoraSpec
DEFAULT_RANK = 4


class LoraSpec(TypedDict, total=False):
    """`model.params.lora`: adapters on each part in `model.params.trainable` (the UNet by default)."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    text_encoder_target_modules: list[str]


def lora_config(spec: dict, part: str):
    from peft import LoraConfig

    rank = int(spec.get("rank", DEFAULT_RANK))
    targets = spec.get(TARGETS_KEY[part])
    return LoraConfig(
        r=rank,
        lora_alpha=float(spec.get("alpha", rank)),
        lora_dropout=float(spec.get("dropout", 0.0)),
        target_modules=list(targets or DEFAULT_TARGETS[part]),
        init_lora_weights="gaussian",
    )


def add_lora(parts: Parts, trainable: tuple[str, ...], spec: dict, key: str = "model.params.lora") -> None:
    """Freeze `trainable` parts and give each LoRA adapters, the only weights that train (kept in fp32).

    peft's own injection, for every part alike: transformers 5's `add_adapter` needs a newer peft
    than the stacks we support."""
    from peft import inject_adapter_in_model

    unknown = set(spec) - set(LoraSpec.__annotations__)
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}: unknown key; valid: {', '.join(LoraSpec.__annotations__)}")
    if int(spec.get("rank", DEFAULT_RANK)) < 1:
        raise ConfigError(f"{key}.rank: got {spec['rank']}; a LoRA rank is a positive integer")
    for name in trainable:
        module = getattr(parts, name)
        module.requires_grad_(False)
        try:
            inject_adapter_in_model(lora_config(spec, name), module)
        except ValueError as err:
            raise ConfigError(f"{key}.{TARGETS_KEY[name]}: {' '.join(str(err).split())[:300]}") from None
        for param in module.parameters():
            if param.requires_grad:
                param.data = param.data.float()


def is_lora_key(key: str) -> bool:
    return ".lora_" in key


def merged(module: torch.nn.Module) -> torch.nn.Module:
    """A plain copy of `module` (no peft layers) whose weights have its LoRA adapters added in."""
    from accelerate import init_empty_weights
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer) and not layer.merged:
            layer.merge()
    state = {k.replace(".base_layer.", "."): v for k, v in module.state_dict().items() if not is_lora_key(k)}
    config = module.config.to_dict() if hasattr(module.config, "to_dict") else dict(module.config)
    with init_empty_weights():
        plain = module_from_config(type(module), config)
    plain.load_state_dict(state, assign=True)
    return plain.eval()


def lora_layers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of `module` in diffusers' LoRA format, with `alpha / rank` folded into B.

    Folding makes the file correct for every diffusers version: without stored alphas, diffusers
    loads a LoRA with alpha = rank, i.e. scale 1."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.tuners.tuners_utils import BaseTunerLayer

    state = {}
    for name, layer in module.named_modules():
        if isinstance(layer, BaseTunerLayer):
            for adapter, scale in layer.scaling.items():
                state[f"{name}.lora_A.weight"] = layer.lora_A[adapter].weight.detach().float().clone()
                state[f"{name}.lora_B.weight"] = layer.lora_B[adapter].weight.detach().float() * scale
    return convert_state_dict_to_diffusers(state)
