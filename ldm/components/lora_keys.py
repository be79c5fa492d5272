"""LoRA file keys, kohya's and diffusers', mapped to the modules of our parts; files read into adapters.

kohya's format (sd-scripts; what ComfyUI and AUTOMATIC1111 read) names a module `lora_unet_<path>` or
`lora_te_<path>`: its module path in the diffusers UNet / transformers CLIP text encoder with `.` as
`_`, the text encoder's always under `text_model.` (transformers 5 names it without that level). A family
may name its text encoders otherwise (`lora_te1_`, `lora_te2_`) and its UNet's modules by their original paths
(`lora_unet_input_blocks_4_1_...`, `ldm.components.unet_layout`): its `Architecture` says (`ldm.families`). Each
module has `<name>.lora_down.weight` (A: rank x in), `<name>.lora_up.weight` (B: out x rank) and
`<name>.alpha` (a 0-dim tensor): the adapted weight is W + up @ down * alpha / rank. Conv layers keep
their shapes (down: rank x in x kh x kw, up: out x rank x 1 x 1), as peft's are.

diffusers' format (our `pytorch_lora_weights.safetensors`) names `unet.<path>.lora.down.weight` and
`.lora.up.weight` (`text_encoder.<path>.lora_linear_layer.down.weight`, ...), alpha / rank folded into up.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ldm.components import Parts
from ldm.components.unet_layout import original_unet_name
from ldm.families import ARCHITECTURES, architecture_of

KOHYA_LEVELS = {"unet": "", "text_encoder": "text_model.", "text_encoder_2": "text_model."}  # kohya paths have it
KOHYA_SUFFIXES = {"lora_down.weight": "down", "lora_up.weight": "up", "alpha": "alpha"}
DIFFUSERS_SUFFIXES = {
    "lora.down.weight": "down",
    "lora.up.weight": "up",
    "lora_linear_layer.down.weight": "down",  # the text encoder's
    "lora_linear_layer.up.weight": "up",
    "lora_A.weight": "down",
    "lora_B.weight": "up",
    "alpha": "alpha",
}
PART_TITLES = {"unet": "UNet", "text_encoder": "text encoder", "text_encoder_2": "second text encoder"}


@dataclass
class Adapter:
    """One module's LoRA from a file: W + up @ down * alpha / rank."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float
    key: str  # the file's name for the module, for errors

    @property
    def rank(self) -> int:
        return self.down.shape[0]


def kohya_naming(parts: Parts) -> tuple[dict[str, str], dict | None]:
    """How kohya names the modules of `parts`: the name prefix of each adaptable part, and the UNet's config
    where the family names its UNet's modules by their original paths (else None)."""
    architecture = architecture_of(parts)
    original_unet = dict(parts["unet"].config) if architecture.kohya_original_unet else None
    return dict(architecture.kohya_prefixes), original_unet


def kohya_name(part: str, path: str, prefixes: dict[str, str] | None = None, original_unet: dict | None = None) -> str:
    """kohya's name for the module at `path` in `part` (`lora_unet_...`, `lora_te_text_model_...`) under the
    family's `prefixes` (by default the first family's); the UNet's by its original path where `original_unet`,
    the UNet's config, is given."""
    prefixes = prefixes or next(iter(ARCHITECTURES.values())).kohya_prefixes
    level = KOHYA_LEVELS[part]
    if part == "unet" and original_unet is not None:
        path = original_unet_name(path + ".weight", original_unet).removesuffix(".weight")
    return prefixes[part] + (level + path.removeprefix(level)).replace(".", "_")


def kohya_names(
    part: str, module: torch.nn.Module, prefixes: dict[str, str] | None = None, original_unet: dict | None = None
) -> dict[str, str]:
    """Every submodule of `part` (with weights, for a UNet named by original paths) by its kohya name:
    {kohya name: module path}."""
    if original_unet is None or part != "unet":
        return {kohya_name(part, path, prefixes, original_unet): path for path, _ in module.named_modules() if path}
    return {
        kohya_name(part, path, prefixes, original_unet): path
        for path, layer in module.named_modules()
        if path and isinstance(getattr(layer, "weight", None), torch.Tensor) and _has_original_name(path, original_unet)
    }


def _has_original_name(path: str, config: dict) -> bool:
    try:
        original_unet_name(path + ".weight", config)
    except KeyError:
        return False
    return True


def lora_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The peft LoRA layers of `module` by their module path (the path of the layer they adapt)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return {path: layer for path, layer in module.named_modules() if isinstance(layer, BaseTunerLayer)}


def kohya_state_dict(parts: Parts) -> dict[str, torch.Tensor]:
    """The parts' adapters in kohya's format: down = A, up = B (unscaled), alpha as a 0-dim tensor."""
    state = {}
    prefixes, original_unet = kohya_naming(parts)
    for part, module in parts.networks.items():
        for path, layer in lora_modules(module).items():
            if part not in prefixes:
                raise ValueError(f"the {part} has LoRA adapters; kohya files hold the UNet's and text encoders' only")
            name = kohya_name(part, path, prefixes, original_unet)
            for adapter in layer.lora_A:
                down = layer.lora_A[adapter].weight.detach().float()
                state[f"{name}.lora_down.weight"] = down.clone().contiguous()
                state[f"{name}.lora_up.weight"] = layer.lora_B[adapter].weight.detach().float().clone().contiguous()
                state[f"{name}.alpha"] = torch.tensor(float(layer.scaling[adapter]) * down.shape[0])
    return state


def read_adapters(path: str | Path, parts: Parts, where: str) -> dict[str, dict[str, Adapter]]:
    """A LoRA file (kohya's or diffusers' format) as {part: {module path: Adapter}} for `parts`.

    Every key must name a module of the parts: a key that matches none is an error naming it."""
    from safetensors.torch import load_file

    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{where}: no such file: {path}")
    if path.suffix != ".safetensors":
        raise ValueError(f"{where}: {path}: a LoRA file is a .safetensors file (kohya's or diffusers' format)")
    state = load_file(str(path))
    if not state:
        raise ValueError(f"{where}: {path}: holds no tensors")
    prefixes, original_unet = kohya_naming(parts)
    every = tuple(prefix for a in ARCHITECTURES.values() for prefix in a.kohya_prefixes.values())
    kohya = any(k.startswith(every) for k in state)
    names = {
        part: _module_names(part, parts[part], kohya, prefixes, original_unet) for part in prefixes if part in parts
    }
    found: dict[tuple[str, str], dict] = {}
    for key, tensor in state.items():
        if kohya:
            part, name, role = _kohya_key(key, names, prefixes, f"{where}: {path}")
        else:
            part, name, role = _diffusers_key(key, names, f"{where}: {path}")
        found.setdefault((part, name), {})[role] = tensor
    adapters: dict[str, dict[str, Adapter]] = {}
    for (part, name), roles in found.items():
        for role in ("down", "up"):
            if role not in roles:
                raise ValueError(f"{where}: {path}: {name} has no {role} weight; the file is incomplete")
        alpha = float(roles["alpha"]) if "alpha" in roles else float(roles["down"].shape[0])  # none: scale 1
        adapters.setdefault(part, {})[names[part][name]] = Adapter(roles["down"], roles["up"], alpha, name)
    return adapters


def _module_names(
    part: str, module: torch.nn.Module, kohya: bool, prefixes: dict[str, str], original_unet: dict | None
) -> dict[str, str]:
    """{a file's name for a module: its path in `module`}: kohya names, or diffusers' `part.path` in both
    text encoder layouts."""
    if kohya:
        return kohya_names(part, module, prefixes, original_unet)
    level, names = KOHYA_LEVELS[part], {}
    for path, _ in module.named_modules():
        for spelling in {path, path.removeprefix(level), level + path.removeprefix(level)} if path else ():
            names[f"{part}.{spelling}"] = path
    return names


def _kohya_key(
    key: str, names: dict[str, dict[str, str]], prefixes: dict[str, str], where: str
) -> tuple[str, str, str]:
    name, _, suffix = key.partition(".")
    if suffix not in KOHYA_SUFFIXES:
        raise ValueError(
            f"{where}: key {key!r} is not a LoRA weight (expected NAME.lora_down.weight, .lora_up.weight or "
            ".alpha); LoCon / LoHa / DoRA files are not supported"
        )
    part = next((p for p, prefix in prefixes.items() if name.startswith(prefix)), None)
    if part is None or part not in names:
        other = " / ".join(
            f"{a.title} files' {' / '.join(p for p in a.kohya_prefixes.values() if p not in prefixes.values())}"
            for a in ARCHITECTURES.values()
            if set(a.kohya_prefixes.values()) - set(prefixes.values())
        )
        raise ValueError(
            f"{where}: key {key!r} names no part of this model: its kohya names start with "
            f"{' or '.join(prefixes.values())} ({other} are for another model)"
        )
    if name not in names[part]:
        raise ValueError(
            f"{where}: key {key!r} matches no module of the {PART_TITLES[part]}: the file is for another "
            "model, or names its modules another way (kohya names are module paths, . as _)"
        )
    return part, name, KOHYA_SUFFIXES[suffix]


def _diffusers_key(key: str, names: dict[str, dict[str, str]], where: str) -> tuple[str, str, str]:
    part = key.partition(".")[0]
    suffix = next((s for s in DIFFUSERS_SUFFIXES if key.endswith("." + s)), None)
    if part not in names or suffix is None:
        raise ValueError(
            f"{where}: key {key!r} is in neither kohya's (lora_unet_... / lora_te_...) nor diffusers' "
            "(unet.<module>.lora.down.weight, text_encoder.<module>...) LoRA format"
        )
    name = key.removesuffix("." + suffix)
    if name not in names[part]:
        raise ValueError(f"{where}: key {key!r} matches no module of the {PART_TITLES[part]}; is it for another model?")
    return part, name, DIFFUSERS_SUFFIXES[suffix]
