"""LoRA adapters (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models") on the UNet and
text encoder, through peft; merged back into plain weights, or exported as a diffusers LoRA file.

A LoRA layer adds `(alpha / rank) * B @ A` to a frozen weight. Checkpoints hold only A and B (and
their EMA); the frozen base is read again from `model.params.pretrained`. Adapters may start from a
LoRA file (`init_from`, kohya's or diffusers' format: `ldm.components.lora_keys`); writing LoRA files
for other tools is `ldm.weights.lora_file`.
"""

from __future__ import annotations

from typing import TypedDict

import torch

from ldm.components import Parts
from ldm.components.build import module_from_config
from ldm.components.describe import config_dict
from ldm.components.lora_keys import PART_TITLES, Adapter, lora_modules, read_adapters
from ldm.config import ConfigError, ExistingPath

DEFAULT_TARGETS = {
    "unet": ["to_q", "to_k", "to_v", "to_out.0"],  # the attention projections of every transformer block
    "text_encoder": ["q_proj", "k_proj", "v_proj", "out_proj"],
    "text_encoder_2": ["q_proj", "k_proj", "v_proj", "out_proj"],  # a family's second
}
TARGETS_KEY = {  # in LoraSpec; a family's two text encoders share theirs
    "unet": "target_modules",
    "text_encoder": "text_encoder_target_modules",
    "text_encoder_2": "text_encoder_target_modules",
}
DEFAULT_RANK = 4


class LoraSpec(TypedDict, total=False):
    """`model.params.lora`: adapters on each part in `model.params.trainable` (the UNet by default).

    `init_from` starts them from a LoRA file (kohya's or diffusers' format), whose rank, alpha and
    modules are used where these keys are not set: a set `rank` must be the file's; a set `alpha`
    rescales the file's up weights, so the adapted model is the file's either way; set target modules
    must include every module the file adapts. A trainable part the file has no adapters for gets
    fresh ones."""

    rank: int
    alpha: float
    dropout: float
    target_modules: list[str]
    text_encoder_target_modules: list[str]
    init_from: ExistingPath


def lora_config(spec: dict, part: str):
    """peft's `LoraConfig` for `part` from a `LoraSpec`."""
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


def add_lora(
    parts: Parts, trainable: tuple[str, ...], spec: dict, key: str = "model.params.lora", where: str | None = None
) -> None:
    """Freeze `trainable` parts and give each LoRA adapters, the only weights that train (kept in fp32),
    started from the file `spec["init_from"]` if set (errors about it name `where`, by default `key.init_from`).

    peft's own injection, for every part alike: transformers 5's `add_adapter` needs a newer peft
    than the stacks we support."""
    from peft import inject_adapter_in_model

    unknown = set(spec) - set(LoraSpec.__annotations__)
    if unknown:
        raise ConfigError(f"{key}.{sorted(unknown)[0]}: unknown key; valid: {', '.join(LoraSpec.__annotations__)}")
    if int(spec.get("rank", DEFAULT_RANK)) < 1:
        raise ConfigError(f"{key}.rank: got {spec['rank']}; a LoRA rank is a positive integer")
    where = where or f"{key}.init_from"
    loaded = {}
    if spec.get("init_from"):
        try:
            loaded = read_adapters(spec["init_from"], parts, where)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(str(err)) from None
        spec = _with_file_defaults(spec, loaded, trainable, key, where)
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
        if name in loaded:
            _load_adapters(module, name, loaded[name], float(spec["alpha"]), key, where)


def _with_file_defaults(spec: dict, loaded: dict, trainable: tuple[str, ...], key: str, where: str) -> dict:
    """`spec` with the rank, alpha and (per part, where not set) target modules of the adapters read from a file."""
    file = spec["init_from"]
    for part, adapters in loaded.items():
        if part not in trainable:
            example = next(iter(adapters.values())).key
            trainable_key = f"{key.rpartition('.')[0]}.trainable" if "." in key else "trainable"
            raise ConfigError(
                f"{where}: {file} has adapters for the {PART_TITLES[part]} ({example}, ...); add {part} to "
                f"{trainable_key} to train them"
            )
    adapters = [adapter for part in loaded.values() for adapter in part.values()]
    by_rank: dict[int, Adapter] = {}
    for adapter in adapters:
        by_rank.setdefault(adapter.rank, adapter)
    if len(by_rank) > 1:
        examples = ", ".join(f"{a.key} (rank {r})" for r, a in sorted(by_rank.items()))
        raise ConfigError(
            f"{where}: {file} holds adapters of several ranks: {examples}; one rank per file is supported"
        )
    (rank,) = by_rank
    if "rank" in spec and int(spec["rank"]) != rank:
        raise ConfigError(
            f"{key}.rank: {spec['rank']}, but {where} {file} holds rank-{rank} adapters ({by_rank[rank].key}); "
            f"set {key}.rank: {rank}, or remove it to take the file's"
        )
    alphas = {adapter.alpha for adapter in adapters}
    resolved = {**spec, "rank": rank, "alpha": spec.get("alpha", alphas.pop() if len(alphas) == 1 else rank)}
    for part, modules in loaded.items():
        if not spec.get(TARGETS_KEY[part]):
            resolved[TARGETS_KEY[part]] = sorted(modules)
    return resolved


def _load_adapters(
    module: torch.nn.Module, part: str, adapters: dict[str, Adapter], alpha: float, key: str, where: str
) -> None:
    """Copy a file's adapters into the peft layers of `module`: A = down, B = up * file alpha / `alpha`."""
    layers = lora_modules(module)
    for path, adapter in adapters.items():
        layer = layers.get(path)
        if layer is None:
            raise ConfigError(
                f"{where}: {adapter.key} adapts {part} module {path}, which {key}.{TARGETS_KEY[part]} does not "
                f"target; add it there, or remove {key}.{TARGETS_KEY[part]} to take the file's modules"
            )
        for name in layer.lora_A:
            pairs = ((layer.lora_A[name].weight, adapter.down, "down"), (layer.lora_B[name].weight, adapter.up, "up"))
            for weight, tensor, role in pairs:
                if tensor.squeeze().shape != weight.squeeze().shape:
                    raise ConfigError(
                        f"{where}: {adapter.key}: the {role} weight is {tuple(tensor.shape)}, but {part} module "
                        f"{path} takes {tuple(weight.shape)}; the file is for another model"
                    )
                scale = adapter.alpha / alpha if role == "up" else 1.0
                with torch.no_grad():
                    weight.copy_((tensor.float() * scale).reshape(weight.shape))


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
    config = config_dict(module)
    with init_empty_weights():
        plain = module_from_config(type(module), config)
    plain.load_state_dict(state, assign=True)
    return plain.eval()


def lora_layers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters of `module` in diffusers' LoRA format (peft's names where diffusers' older ones would not name
    every adapter), with `alpha / rank` folded into B.

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
    converted = convert_state_dict_to_diffusers(state)
    # diffusers' names exist for attention projections only; a file mixing both formats is read by one only
    return state if any(".lora_A." in key for key in converted) else converted
