"""The model families ldm trains, one module each; the generic code asks this registry and never names a family.

A module of this package holds all ldm knows of one architecture (`Architecture`) and its released models
(`Family`): the networks and their configs (`configs/models/<name>/`), how captions and image sizes become the
denoiser's conditioning, how its single files name their weights and how such a file is recognised, its kohya
LoRA names, its diffusers pipeline and the inputs it refuses. ComfyUI's `comfy/supported_models.py`, one class
per model, is the same idea.

This is the lowest floor that knows a model: it imports no other part of ldm but `ldm.utils`, and the part names
(`NETWORK_PARTS`, `DEFAULT_CLASSES`) and the single-file error are defined here for the floors above.

Families are told apart three ways: `family_of` (parts whose configs are a released family's), `architecture_of`
(any parts of an architecture's shape: a tiny SDXL-shaped model is SDXL's) and `detect_family` (a single file's
keys and metadata).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

from ldm.families import sd, sd35, sdxl  # the registry: one module per family
from ldm.families.base import (
    CONFIGS,
    DEFAULT_CLASSES,
    NETWORK_PARTS,
    OPTIONAL_PARTS,
    PART_NAMES,
    UNET,
    VAE,
    Architecture,
    Conditioning,
    Family,
    FileLayout,
    PartsLike,
    SingleFileError,
    prediction_of,
    scheduler_prediction,
)

__all__ = [
    "ARCHITECTURES",
    "CONDITIONINGS",
    "COMPVIS_TEXT_ENCODERS",
    "FAMILIES",
    "LAYOUTS",
    "SUPPORTED",
    "FamilyName",
    "architecture_of",
    "architecture_of_pipeline",
    "conditioning_for",
    "detect_family",
    "family_of",
    "layout_of_keys",
    "prediction_of",
    "scheduler_prediction",
    "refused_pipeline",
    "refuse_other_models",
    "CONFIGS",
    "DEFAULT_CLASSES",
    "NETWORK_PARTS",
    "OPTIONAL_PARTS",
    "PART_NAMES",
    "UNET",
    "VAE",
    "Architecture",
    "Conditioning",
    "Family",
    "FileLayout",
    "PartsLike",
    "SingleFileError",
]

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (sd.ARCHITECTURE, sdxl.ARCHITECTURE, sd35.ARCHITECTURE)}
FAMILIES: dict[str, Family] = {f.name: f for f in (*sd.FAMILIES, *sdxl.FAMILIES, *sd35.FAMILIES)}
FamilyName = Literal[tuple(FAMILIES)]  # for signatures: config checks then list exactly the families above
# Most specific first: a file is of the first layout whose `detect_key` it holds.
LAYOUTS: dict[str, FileLayout] = {
    layout.name: layout for a in reversed(ARCHITECTURES.values()) for layout in reversed(a.layouts)
}
CONDITIONINGS: dict[str, Conditioning] = {a.conditioning_name: a.conditioning for a in ARCHITECTURES.values()}
# The CompVis text encoder classes (`cond_stage_config.target`): (the family whose encoder it is, layer used).
COMPVIS_TEXT_ENCODERS: dict[str, tuple[Family, str]] = {
    cls: (FAMILIES[name], layer)
    for a in ARCHITECTURES.values()
    for cls, (name, layer) in a.compvis_text_encoders.items()
}
_TITLES = [a.title for a in ARCHITECTURES.values()]
SUPPORTED = f"ldm trains {', '.join(_TITLES[:-1])} and {_TITLES[-1]} text-to-image models"
# Models ldm does not read yet, by a key prefix of their single files (with or without UNET) and pipeline class.
NOT_YET = {"double_blocks.": "Flux"}
NOT_YET_PIPELINES = {"FluxPipeline": "Flux"}


def _most_fitting(
    parts: Mapping[str, object], needed: Callable[[Architecture], tuple[str, ...]]
) -> Architecture | None:
    """Of the architectures whose `needed` parts `parts` all have (those whose pipeline takes their denoiser, if
    any do), the one that needs the most."""
    fitting = [a for a in ARCHITECTURES.values() if all(p in parts for p in needed(a))]
    denoiser = type(parts.get("unet")).__name__
    fitting = [a for a in fitting if denoiser in a.denoiser_classes] or fitting
    return max(fitting, key=lambda a: len(needed(a))) if fitting else None


def architecture_of(parts: Mapping[str, object]) -> Architecture:
    """The architecture of `parts` (networks, with or without tokenizers): of those whose text encoders they all
    have (and whose pipeline takes their denoiser, if any), the one with the most."""
    architecture = _most_fitting(parts, lambda a: a.text_encoders)
    if architecture is None:
        raise ValueError(f"no family has the text encoders of parts {', '.join(parts)}")
    return architecture


def conditioning_for(parts: Mapping[str, object]) -> str:
    """The name of the conditioning of `parts` (`CONDITIONINGS`): of those whose text parts (tokenizers and
    encoders) they all have (and whose pipeline takes their denoiser, if any), the one that reads the most."""
    architecture = _most_fitting(parts, lambda a: a.conditioning.text_parts)
    if architecture is None:
        raise ValueError(f"no conditioning fits parts {', '.join(parts)}: each needs a tokenizer and text encoder")
    return architecture.conditioning_name


def family_of(parts: Any) -> Family | None:
    """The released family whose architecture and prediction type `parts` have, or None (a custom model)."""
    for family in FAMILIES.values():
        unet = json.loads((family.network_folder / "unet" / "config.json").read_text())
        text = json.loads((family.network_folder / "text_encoder" / "config.json").read_text())
        same_unet = all(_same(parts.unet.config.get(k), v) for k, v in unet.items() if not k.startswith("_"))
        same_text = all(
            getattr(parts.text_encoder.config, k) == text[k]
            for k in ("hidden_size", "num_hidden_layers", "intermediate_size")
        )
        prediction = scheduler_prediction(parts.scheduler)
        text_parts = {p for p in parts if p.startswith("text_encoder")}
        same_parts = text_parts == {p for p in family.networks if p.startswith("text_encoder")}
        if same_unet and same_text and same_parts and prediction == family.prediction_type:
            return family
    return None


def _same(a: Any, b: Any) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def layout_of_keys(keys: Iterable[str]) -> str:
    """The file layout of an original state dict's keys: the first (most specific) whose text encoder prefix
    they have; the first architecture's first layout where none is there."""
    keys = list(keys)
    for layout in LAYOUTS.values():
        if layout.detect_key in keys or any(k.startswith(layout.signature) for k in keys):
            return layout.name
    return next(iter(ARCHITECTURES.values())).layouts[0].name


def architecture_of_pipeline(class_name: str | None) -> Architecture | None:
    """The architecture whose diffusers pipeline is `class_name` (a folder's `model_index.json` says), or None."""
    return next((a for a in ARCHITECTURES.values() if a.pipeline_class == class_name), None)


def refused_pipeline(class_name: str | None) -> str | None:
    """What a diffusers folder of pipeline `class_name` is, where ldm does not train it; else None."""
    for a in ARCHITECTURES.values():
        if class_name in a.refused_pipelines:
            return a.refused_pipelines[class_name]
    return NOT_YET_PIPELINES.get(class_name)


def refuse_other_models(state: Mapping[str, Any], where: str) -> None:
    """Raise `SingleFileError` naming the model a single file holds where ldm does not train it."""
    other = next((what for pre, what in NOT_YET.items() if any(k.startswith((UNET + pre, pre)) for k in state)), None)
    for architecture in ARCHITECTURES.values():
        other = other or architecture.refuse_file(state)
    if other is not None:
        raise SingleFileError(f"{where}: {other}; {SUPPORTED}")


def detect_family(
    state: Mapping[str, Any],
    metadata: Mapping[str, Any],
    global_step: Any = None,
    declared: str | None = None,
    where: str = "the file",
) -> tuple[Family | None, str]:
    """The family of an original-layout state dict, and how it was told; `declared` settles what the weights
    cannot tell (each layout's `pick` says what that is)."""
    if declared is not None and declared not in FAMILIES:
        raise SingleFileError(f"family {declared!r} is not one of {', '.join(FAMILIES)}")
    if metadata.get("family"):
        family = FAMILIES.get(metadata["family"])
        if declared and family and declared != family.name:
            raise SingleFileError(f"{where} says it is {family.name}, not {declared}; drop the family setting")
        return family, "from the file's ldm metadata"
    refuse_other_models(state, where)
    layout = next((layout for layout in LAYOUTS.values() if layout.detect_key in state), None)
    conv_in = state.get(UNET + "input_blocks.0.0.weight")
    if conv_in is None and (layout is None or layout.denoiser is None):
        raise SingleFileError(f"{where}: not a Stable Diffusion checkpoint (no {UNET}* weights)")
    if conv_in is not None and conv_in.shape[1] != 4:
        raise SingleFileError(
            f"{where}: a UNet with {conv_in.shape[1]} input channels (inpainting or depth); "
            "only text-to-image models (4 channels) are supported"
        )
    if layout is None:
        prefixes = " or ".join(dict.fromkeys(t[1] for lay in LAYOUTS.values() for t in lay.text[:1]))
        raise SingleFileError(f"{where}: no text encoder weights under {prefixes}")
    candidates = [f for f in FAMILIES.values() if f.text_layout == layout.name]
    if declared:
        if FAMILIES[declared].text_layout != layout.name:
            found = " or ".join(f.name for f in candidates)
            raise SingleFileError(f"{where} holds a {layout.name} text encoder, so it is {found}, not {declared}")
        return FAMILIES[declared], "as declared"
    return layout.pick(candidates, state, global_step, where)
