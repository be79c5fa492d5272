"""The model families ldm knows, in one table: architecture configs, tokenizer, prediction type.

A family's architecture ships in `configs/models/<name>/` (configs only, no weights); the original
inference YAML other tools read is in `configs/models/original/`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ldm.components import Parts
from ldm.components.build import DEFAULT_CLASSES, NETWORK_PARTS
from ldm.components.tokenizers import tokenizer_files, write_clip_tokenizer

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"


@dataclass(frozen=True)
class Family:
    """A released model family: its architecture configs, tokenizer and prediction type."""

    name: str
    title: str
    text_layout: str  # "clip" (OpenAI CLIP, SD 1.x), "open_clip" (OpenCLIP ViT-H, SD 2.x), "sdxl" (both)
    pad_token: str
    original_config: str | None  # the original inference YAML, in configs/models/original/ (None: files need none)
    networks: tuple[str, ...] = NETWORK_PARTS  # the parts with weights, each a folder of configs/models/<name>/
    pad_token_2: str | None = None  # the second tokenizer's, for a family with two text encoders
    networks_from: str | None = None  # the family whose network configs this one shares (its scheduler differs)

    @property
    def folder(self) -> Path:
        """The family's scheduler config is in `folder/scheduler/`."""
        return CONFIGS / self.name

    @property
    def network_folder(self) -> Path:
        """Each network's config is in `network_folder/<part>/config.json`."""
        return CONFIGS / (self.networks_from or self.name)

    @property
    def prediction_type(self) -> str:
        return json.loads((self.folder / "scheduler" / "scheduler_config.json").read_text())["prediction_type"]


SDXL_NETWORKS = (*NETWORK_PARTS, "text_encoder_2")
FAMILIES = {
    f.name: f
    for f in (
        Family("sd15", "Stable Diffusion 1.x", "clip", "<|endoftext|>", "v1-inference.yaml"),
        Family("sd2-base", "Stable Diffusion 2.x 512-base", "open_clip", "!", "v2-inference.yaml"),
        Family("sd2-768-v", "Stable Diffusion 2.x 768-v", "open_clip", "!", "v2-inference-v.yaml"),
        Family("sdxl", "Stable Diffusion XL 1.0 base", "sdxl", "<|endoftext|>", None, SDXL_NETWORKS, "!"),
        Family(
            "sdxl-v",
            "SDXL, v-prediction with zero terminal SNR (NoobAI-XL v-pred and the like)",
            "sdxl",
            "<|endoftext|>",
            None,
            SDXL_NETWORKS,
            "!",
            networks_from="sdxl",
        ),  # fmt: skip
    )
}
FamilyName = Literal[tuple(FAMILIES)]  # for signatures: config checks then list exactly the families above


def family_of(parts: Parts) -> Family | None:
    """The released family whose architecture and prediction type `parts` have, or None (a custom model)."""
    for family in FAMILIES.values():
        unet = json.loads((family.network_folder / "unet" / "config.json").read_text())
        text = json.loads((family.network_folder / "text_encoder" / "config.json").read_text())
        same_unet = all(_same(parts.unet.config.get(k), v) for k, v in unet.items() if not k.startswith("_"))
        same_text = all(
            getattr(parts.text_encoder.config, k) == text[k]
            for k in ("hidden_size", "num_hidden_layers", "intermediate_size")
        )
        prediction = parts.scheduler.config.get("prediction_type", "epsilon")
        same_parts = ("text_encoder_2" in parts) == ("text_encoder_2" in family.networks)
        if same_unet and same_text and same_parts and prediction == family.prediction_type:
            return family
    return None


def _same(a: Any, b: Any) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def family_description(family: Family) -> dict:
    """A family's parts in `describe_parts` form, from the configs shipped in `configs/models/<family>/`."""
    described = {}
    for name in family.networks:
        config = json.loads((family.network_folder / name / "config.json").read_text())
        described[name] = {"class": DEFAULT_CLASSES[name], "config": config}
    scheduler = json.loads((family.folder / "scheduler" / "scheduler_config.json").read_text())
    described["scheduler"] = {"class": f"diffusers.{scheduler['_class_name']}", "config": scheduler}
    for name, pad in (("tokenizer", family.pad_token), ("tokenizer_2", family.pad_token_2)):
        if pad is not None:
            files = tokenizer_files(lambda folder, pad=pad: write_clip_tokenizer(folder, pad_token=pad))
            described[name] = {"class": DEFAULT_CLASSES[name], "files": files}
    return described
