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

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ldm.components import Parts
from ldm.components.unet_layout import original_unet_name
from ldm.families import ARCHITECTURES, architecture_of
from ldm.families.base import SWAPPED, swapped_halves

KOHYA_LEVELS = {"unet": "", "text_encoder": "text_model.", "text_encoder_2": "text_model.", "text_encoder_3": ""}
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
PART_TITLES = {
    "unet": "denoiser",
    "text_encoder": "text encoder",
    "text_encoder_2": "second text encoder",
    "text_encoder_3": "third text encoder",
}
QKV = 3  # the projections a fused adapter stacks (q, k, v)


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


def fused_naming(parts: Parts) -> Callable[[str], tuple[str, int | None]] | None:
    """Where the family's kohya files name its denoiser's modules by original paths that fuse some of them
    (`Architecture.kohya_denoiser`): module path -> (original module path, slot); else None."""
    naming = architecture_of(parts).kohya_denoiser
    if naming is None:
        return None
    config = dict(parts["unet"].config)
    return lambda path: naming(path, config)


def kohya_state_dict(parts: Parts) -> dict[str, torch.Tensor]:
    """The parts' adapters in kohya's format: down = A, up = B (unscaled), alpha as a 0-dim tensor.

    Where the original model fuses modules (q, k and v in one `qkv`), their adapters become one, exactly: the
    downs stacked, the ups block-diagonal, the rank their sum and alpha scaled to keep alpha / rank."""
    state: dict[str, torch.Tensor] = {}
    prefixes, original_unet = kohya_naming(parts)
    fused, pieces = fused_naming(parts), {}
    for part, module in parts.networks.items():
        for path, layer in lora_modules(module).items():
            if part not in prefixes:
                raise ValueError(f"the {part} has LoRA adapters; kohya files hold the denoiser's and text encoders'")
            for adapter in layer.lora_A:
                down = layer.lora_A[adapter].weight.detach().float().clone().contiguous()
                up = layer.lora_B[adapter].weight.detach().float().clone().contiguous()
                scale = float(layer.scaling[adapter])
                if part == "unet" and fused is not None:
                    original, slot = fused(path)
                    pieces.setdefault(prefixes[part] + original.replace(".", "_"), {})[slot] = (down, up, scale)
                    continue
                name = kohya_name(part, path, prefixes, original_unet)
                state |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                          f"{name}.alpha": torch.tensor(scale * down.shape[0])}  # fmt: skip
    for name, by_slot in pieces.items():
        down, up, alpha = _fused(by_slot)
        state |= {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up, f"{name}.alpha": alpha}
    return state


def _fused(by_slot: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One adapter (down, up, alpha) of a module the original fuses, from its pieces' {slot: (down, up, scale)}: a
    piece of slot None is the module itself; `SWAPPED`'s up has its halves exchanged; slots 0..2 stack."""
    if None in by_slot or SWAPPED in by_slot:
        (slot, (down, up, scale)), *_ = by_slot.items()
        up = swapped_halves(up).contiguous() if slot == SWAPPED else up
        return down, up, torch.tensor(scale * down.shape[0])
    slots = sorted(by_slot)
    scale, rows = by_slot[slots[0]][2], by_slot[slots[0]][1].shape[0]
    down = torch.cat([by_slot[s][0] for s in slots])
    up = torch.zeros(QKV * rows, down.shape[0])
    column = 0
    for s in slots:
        piece_down, piece_up, piece_scale = by_slot[s]
        rank = piece_down.shape[0]
        up[s * rows : (s + 1) * rows, column : column + rank] = piece_up * (piece_scale / scale)
        column += rank
    return down.contiguous(), up, torch.tensor(scale * down.shape[0])


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
    folders = architecture_of(parts).folders  # diffusers' files name a part as its pipeline folder does
    spelled = {part: part if kohya else folders.get(part, part) for part in prefixes if part in parts}
    names = {
        spelling: _module_names(spelling, parts[part], kohya, prefixes, original_unet, part)
        for part, spelling in spelled.items()
    }
    fused = _fused_names(parts, prefixes) if kohya else {}
    if fused:  # a fused name stands for the modules it splits into (below)
        names["unet"] = names.get("unet", {}) | {name: name for name in fused}
    found: dict[tuple[str, str], dict] = {}
    for key, tensor in state.items():
        if kohya:
            part, name, role = _kohya_key(key, names, prefixes, f"{where}: {path}")
        else:
            part, name, role = _diffusers_key(key, names, f"{where}: {path}")
        found.setdefault((part, name), {})[role] = tensor
    ours = {spelling: part for part, spelling in spelled.items()}
    adapters: dict[str, dict[str, Adapter]] = {}
    for (part, name), roles in found.items():
        for role in ("down", "up"):
            if role not in roles:
                raise ValueError(f"{where}: {path}: {name} has no {role} weight; the file is incomplete")
        alpha = float(roles["alpha"]) if "alpha" in roles else float(roles["down"].shape[0])  # none: scale 1
        if name in fused:
            for module, slot in fused[name]:
                if (piece := _piece(roles["down"], roles["up"], alpha, slot)) is not None:
                    adapters.setdefault("unet", {})[module] = Adapter(*piece, name)
            continue
        adapters.setdefault(ours[part], {})[names[part][name]] = Adapter(roles["down"], roles["up"], alpha, name)
    return adapters


def _fused_names(parts: Parts, prefixes: dict[str, str]) -> dict[str, list[tuple[str, int | None]]]:
    """{kohya name: [(module path, slot), ...]} of a denoiser whose kohya names fuse modules (`fused_naming`)."""
    naming, table = fused_naming(parts), {}
    if naming is None:
        return {}
    for path, layer in parts["unet"].named_modules():
        if isinstance(getattr(layer, "weight", None), torch.Tensor):
            try:
                original, slot = naming(path)
            except KeyError:
                continue  # a container, or a module the original has no name for
            table.setdefault(prefixes["unet"] + original.replace(".", "_"), []).append((path, slot))
    return table


def _piece(
    down: torch.Tensor, up: torch.Tensor, alpha: float, slot: int | None
) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """The adapter (down, up, alpha) of the module in `slot` of a fused one, exactly: its rows of up (of q, k, v)
    and the ranks they use (a block-diagonal up, as ldm and sd-scripts' split q/k/v write, splits back into each
    projection's own); None where it has none."""
    if slot is None:
        return down, up, alpha
    if slot == SWAPPED:
        return down, swapped_halves(up), alpha
    rows = up.shape[0] // QKV
    piece = up[slot * rows : (slot + 1) * rows]
    used = piece.abs().sum(dim=0) != 0
    if not used.any():
        return None
    return down[used].contiguous(), piece[:, used].contiguous(), alpha / down.shape[0] * int(used.sum())


def _module_names(
    spelling: str,
    module: torch.nn.Module,
    kohya: bool,
    prefixes: dict[str, str],
    original_unet: dict | None,
    part: str,
) -> dict[str, str]:
    """{a file's name for a module: its path in `module`}: kohya names, or diffusers' `spelling.path` (the part as
    diffusers' files name it) in both text encoder layouts."""
    if kohya:
        return kohya_names(part, module, prefixes, original_unet)
    level, names = KOHYA_LEVELS[part], {}
    for path, _ in module.named_modules():
        for written in {path, path.removeprefix(level), level + path.removeprefix(level)} if path else ():
            names[f"{spelling}.{written}"] = path
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
        title = PART_TITLES.get(part, part)
        raise ValueError(f"{where}: key {key!r} matches no module of the {title}; is it for another model?")
    return part, name, DIFFUSERS_SUFFIXES[suffix]
