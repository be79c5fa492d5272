"""What every family module declares (`Architecture`, `FileLayout`, `Family`, `Conditioning`), and the part names
and single-file error the floors above share; the registry of the families is `ldm.families`."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
# The parts every model has, as `model.params` and a diffusers folder name them.
NETWORK_PARTS = ("unet", "vae", "text_encoder")
PART_NAMES = (*NETWORK_PARTS, "tokenizer", "scheduler")
# Parts a family may add (a second text encoder): built where a spec gives them or a diffusers folder has them.
OPTIONAL_PARTS = ("text_encoder_2", "tokenizer_2", "text_encoder_3", "tokenizer_3")
# Each part's class where a spec names none.
DEFAULT_CLASSES = {
    "unet": "diffusers.UNet2DConditionModel",
    "vae": "diffusers.AutoencoderKL",
    "text_encoder": "transformers.CLIPTextModel",
    "tokenizer": "transformers.CLIPTokenizer",
    "scheduler": "diffusers.DDPMScheduler",
    "text_encoder_2": "transformers.CLIPTextModelWithProjection",
    "tokenizer_2": "transformers.CLIPTokenizer",
    "text_encoder_3": "transformers.T5EncoderModel",
    "tokenizer_3": "transformers.T5TokenizerFast",
}
# Where every UNet family's single files keep the UNet and the VAE (the CompVis layout).
UNET, VAE = "model.diffusion_model.", "first_stage_model."
PartsLike = Mapping[str, Any]  # `ldm.components.Parts`, which builds on this floor
TextEncoding = Callable[[PartsLike, Sequence[str], torch.device], dict[str, torch.Tensor]]
ImageEncoding = Callable[[PartsLike, tuple[int, int], torch.device], dict[str, torch.Tensor]]


def swapped_halves(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` with its two halves along dim 0 exchanged (`SWAPPED`; its own inverse)."""
    return torch.cat(tensor.chunk(2)[::-1])


def scheduler_prediction(scheduler: Any) -> str:
    """What a built scheduler's model predicts (`prediction_of` its config and class)."""
    return prediction_of({"_class_name": type(scheduler).__name__, **scheduler.config})


def prediction_of(scheduler_config: Mapping[str, Any]) -> str:
    """What a scheduler's model predicts: its `prediction_type`; `flow` (the velocity) for a flow-matching one,
    which has none; else epsilon, the default of those that have one."""
    if "prediction_type" in scheduler_config:
        return scheduler_config["prediction_type"]
    return "flow" if str(scheduler_config.get("_class_name", "")).startswith("FlowMatch") else "epsilon"


class SingleFileError(ValueError):
    """A single file that cannot be read as a model of a family here; the message says why and what to do."""


@dataclass(frozen=True)
class Conditioning:
    """How a family conditions its denoiser: `text` encodes captions with the `text_parts` into the mapping the
    denoiser call takes (`ldm.backbones`: `encoder_hidden_states`, and where a family has them `text_embeds` and
    the like); `image`, where the family has it, makes a batch's per-image conditioning (size ids, say) from the
    batch (the sizes the data records: `original_size`, `crop_top_left`) and the (height, width) trained at. The
    caption part is cached by latent caches and shards; the image part is made per batch. `drop` zeroes the
    share of the `droppable` text encoders given ({part: per-sample bool}) in a caption conditioning, without
    changing it in place (`ldm.systems.text`); `options` are the keyword settings `text` takes."""

    text_parts: tuple[str, ...]
    text: TextEncoding
    image: ImageEncoding | None = None
    options: tuple[str, ...] = ()  # keyword settings `text` takes (`max_sequence_length`, say)
    droppable: tuple[str, ...] = ()  # the text encoders `drop` zeroes one by one
    drop: Callable[[PartsLike, dict[str, torch.Tensor], Mapping[str, torch.Tensor]], dict] | None = None


# (candidate families of a file's layout, state, global_step, where) -> (family, how it was told)
Pick = Callable[[Sequence["Family"], Mapping[str, Any], Any, str], tuple["Family", str]]
# (a denoiser weight's key, the denoiser's config) -> (its key under `UNET` in a single file, its slot), where the
# slot is None (as it is), 0..2 (that third of a fused q/k/v tensor), or `SWAPPED` (its two halves exchanged)
DenoiserNames = Callable[[str, Mapping[str, Any]], tuple[str, int | None]]
SWAPPED = -2


@dataclass(frozen=True)
class FileLayout:
    """How a single file of one architecture names its weights; its name is stored in the files we write.

    `text` is each text encoder's (part, prefix of its keys, names): "clip" (transformers' CLIP names, without
    the `text_model.` level), "open_clip" (OpenCLIP's) or "hf" (transformers' state-dict keys as they are). The
    denoiser and VAE are under `UNET` and `VAE` in every layout (`ldm.weights.keymaps`); `denoiser` names the
    denoiser's weights there where they are not a UNet's original names. A file has this layout when it holds
    `detect_key`. `markers` are empty tensors by which a file says a scheduler setting (key: (setting, value));
    `placeholders` makes the tensors written for want of the real ones (`placeholder_keys`), which an extra
    read from the parts' source file replaces. `implied` are our weights (`part.key`) the layout has no place
    for, with the value they then have (from their shape); `optional` the text encoders its files may lack, which
    then come from files of their own. `pick` chooses among the families of this layout."""

    name: str
    text: tuple[tuple[str, str, str], ...]
    detect_key: str
    pick: Pick
    markers: Mapping[str, tuple[str, Any]] = field(default_factory=dict)
    placeholder_keys: tuple[str, ...] = ()
    placeholders: Callable[[PartsLike, Mapping[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    denoiser: DenoiserNames | None = None
    implied: Mapping[str, Callable[[torch.Size], torch.Tensor]] = field(default_factory=dict)
    optional: tuple[str, ...] = ()

    @property
    def signature(self) -> str:
        """The key prefix only this layout's files have: its last text encoder's."""
        return self.text[-1][1]


@dataclass(frozen=True)
class Architecture:
    """One architecture: the parts it has, how it conditions, how its files and LoRA name things, its pipeline.

    `conditioning_name` is what `model.params.conditioning` calls its conditioning. `refuse_file` names a model
    of this shape that ldm does not train (an inpainting variant, say) from a single file's keys, else None;
    `refused_pipelines` does so for diffusers folders, by pipeline class. `pipeline` builds the diffusers
    pipeline of parts (with the sampling scheduler given), `pipeline_class` names it, `pipeline_options` are what
    `from_pretrained` then needs. `kohya_prefixes` are the kohya LoRA name prefixes by part; with
    `kohya_original_unet` the UNet's modules are named by their original paths (`ldm.components.unet_layout`);
    `kohya_denoiser` names a transformer's so, some fused into one (q, k and v: one adapter in kohya's files).
    `denoiser_classes` are the classes its pipeline denoises with; `part_classes` the classes of its parts where
    they are not `DEFAULT_CLASSES`', and `folders` the subfolders of its diffusers folders that are not named as
    our parts are (the denoiser, our part `unet`, may be a folder's `transformer`)."""

    name: str
    title: str
    conditioning_name: str
    conditioning: Conditioning
    layouts: tuple[FileLayout, ...]
    kohya_prefixes: Mapping[str, str]
    pipeline_class: str
    pipeline: Callable[[PartsLike, Any], Any]
    pipeline_options: Mapping[str, Any] = field(default_factory=dict)
    kohya_original_unet: bool = False
    kohya_denoiser: DenoiserNames | None = None  # module path -> (original module path, slot): fused in kohya's files
    denoiser_classes: tuple[str, ...] = ("UNet2DConditionModel",)
    lora_files: bool = True  # whether ldm writes its LoRA files (kohya's and diffusers' formats)
    part_classes: Mapping[str, str] = field(default_factory=dict)
    folders: Mapping[str, str] = field(default_factory=dict)
    refuse_file: Callable[[Mapping[str, Any]], str | None] = lambda state: None
    refused_pipelines: Mapping[str, str] = field(default_factory=dict)
    compvis_text_encoders: Mapping[str, tuple[str, str]] = field(default_factory=dict)  # class: (family, layer)

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return tuple(p for p in self.conditioning.text_parts if not p.startswith("tokenizer"))


@dataclass(frozen=True)
class Family:
    """A released model family: its architecture configs, tokenizers, prediction type and how files name it."""

    name: str
    title: str
    architecture: str  # its `Architecture`'s name
    text_layout: str | None  # the `FileLayout` of its single files (None: ldm reads and writes none yet)
    pad_token: str
    original_config: str | None  # the original inference YAML, in configs/models/original/ (None: files need none)
    modelspec: str  # the Stability AI model spec's architecture id (github.com/Stability-AI/ModelSpec)
    kohya_base: str  # sd-scripts' `ss_base_model_version`
    networks: tuple[str, ...] = NETWORK_PARTS  # the parts with weights, each a folder of configs/models/<name>/
    pad_token_2: str | None = None  # the second tokenizer's, for a family with two text encoders
    networks_from: str | None = None  # the family whose network configs this one shares (its scheduler differs)
    kohya_v2: bool = False  # sd-scripts' `ss_v2`

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
        return prediction_of(json.loads((self.folder / "scheduler" / "scheduler_config.json").read_text()))
