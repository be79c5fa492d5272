"""LoRA files for other tools: kohya's format (ComfyUI, AUTOMATIC1111, sd-scripts) and diffusers'; and a
LoRA file merged into a full model.

kohya's file is one `.safetensors` with `lora_unet_...` / `lora_te_...` keys (`ldm.components.lora_keys`)
and the metadata sd-scripts writes (`ss_network_dim`, `ss_base_model_version`, ...; values as strings).
diffusers' is `pytorch_lora_weights.safetensors` in a folder, for `pipe.load_lora_weights(folder)`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import torch

from ldm.components import Parts
from ldm.components.families import family_of
from ldm.components.lora import add_lora, lora_layers, merged
from ldm.components.lora_keys import kohya_state_dict, lora_modules, read_adapters
from ldm.utils.atomic import atomic_path
from ldm.weights.pipeline_folder import write_pipeline
from ldm.weights.read import read_parts
from ldm.weights.single_file import modelspec

LORA_FILE = "pytorch_lora_weights.safetensors"
LoraFormat = Literal["kohya", "diffusers"]
# Our families as sd-scripts names them in ss_base_model_version (model_util.get_model_version_str_for_sd1_sd2).
KOHYA_BASES = {"sd15": "sd_v1", "sd2-base": "sd_v2", "sd2-768-v": "sd_v2_v"}


def save_lora(
    parts: Parts, out: str | Path, file_format: LoraFormat = "kohya", about: Mapping[str, str] | None = None
) -> Path:
    """Write the parts' adapters as a LoRA file; return its path.

    kohya: `out` if it ends in `.safetensors`, else `out/<out's name>.safetensors`, with `about` added to
    its metadata. diffusers: `out/pytorch_lora_weights.safetensors`. Either is written atomically: an
    existing file is replaced only by a complete one."""
    if file_format == "kohya":
        return save_kohya_lora(parts, out, about)
    if file_format != "diffusers":
        raise ValueError(f"--format: got {file_format!r}; valid: kohya, diffusers")
    return save_diffusers_lora(parts, out)


def kohya_path(out: str | Path) -> Path:
    """Where the kohya LoRA file for `--out OUT` goes: OUT if it ends in .safetensors, else OUT/<name>.safetensors,
    named after the folder."""
    out = Path(out)
    return out if out.suffix == ".safetensors" else out / f"{out.resolve().name}.safetensors"


def save_kohya_lora(parts: Parts, out: str | Path, about: Mapping[str, str] | None = None) -> Path:
    """Write the parts' adapters as one kohya-format `.safetensors` file (see `kohya_path`)."""
    from safetensors.torch import save_file

    state = kohya_state_dict(parts)
    if not state:
        raise ValueError(_NO_ADAPTERS)
    path = kohya_path(out)
    metadata = {**kohya_metadata(parts, state, path.stem), **(about or {})}
    with atomic_path(path) as partial:
        save_file(state, str(partial), metadata=metadata)
    return path


def kohya_metadata(parts: Parts, state: Mapping[str, torch.Tensor], name: str) -> dict[str, str]:
    """The safetensors metadata sd-scripts writes with a LoRA, for the file `name`, and the SAI model spec
    where the parts are a released family."""
    first = next(k for k in state if k.endswith(".lora_down.weight")).removesuffix(".lora_down.weight")
    family = family_of(parts)
    metadata = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(state[f"{first}.lora_down.weight"].shape[0]),
        "ss_network_alpha": str(round(float(state[f"{first}.alpha"]), 6)),  # as sd-scripts: "8.0"
        "ss_v2": str(bool(family) and family.text_layout == "open_clip"),
        "ss_base_model_version": KOHYA_BASES.get(family.name, "") if family else "",
        "ss_output_name": name,
        "ss_training_comment": "exported by ldm (scripts/export_lora.py)",
    }
    spec = modelspec(parts, family, name)  # the family's, as its single file says it; a LoRA of it:
    if spec:
        spec |= {
            "modelspec.sai_model_spec": "1.0.1",
            "modelspec.architecture": spec["modelspec.architecture"] + "/lora",
            "modelspec.implementation": "diffusers",
        }
    return metadata | spec


def checkpoint_about(ckpt: dict) -> dict[str, str]:
    """What a LoRA file's metadata says of the run it comes from, as sd-scripts names it: steps, base model."""
    params = ((ckpt.get("ldm") or {}).get("config") or {}).get("model", {}).get("params", {})
    about = {"ss_steps": str(ckpt.get("global_step", 0))}
    if params.get("pretrained"):
        about["ss_sd_model_name"] = Path(str(params["pretrained"])).name
    return about


def save_diffusers_lora(parts: Parts, out_dir: str | Path) -> Path:
    """Write the parts' adapters as `out_dir/pytorch_lora_weights.safetensors`, for `pipe.load_lora_weights`."""
    from diffusers import StableDiffusionPipeline

    layers = {f"{name}_lora_layers": lora_layers(m) for name, m in parts.networks.items() if lora_modules(m)}
    if not layers:
        raise ValueError(_NO_ADAPTERS)
    out_dir = Path(out_dir)
    if out_dir.suffix == ".safetensors":
        raise ValueError(f"--out {out_dir}: diffusers' LoRA format is a folder; name one, or use --format kohya")
    with atomic_path(out_dir / LORA_FILE) as partial:
        StableDiffusionPipeline.save_lora_weights(
            partial.parent, **layers, weight_name=partial.name, safe_serialization=True
        )
    return out_dir / LORA_FILE


def merge_lora_file(lora: str | Path, pretrained: str | Path, out_dir: str | Path, half: bool = False) -> Path:
    """Merge a LoRA file (kohya's or diffusers' format) into the model `pretrained` (a diffusers folder,
    an original single file or one of our checkpoints) and write a diffusers pipeline folder."""
    parts = read_parts(pretrained, where="--pretrained")
    covered = tuple(read_adapters(lora, parts, "--lora"))
    add_lora(parts, covered, {"init_from": str(lora)}, key="--lora", where="--lora")
    for name in covered:
        parts[name] = merged(parts[name])
    return write_pipeline(parts, out_dir, half=half)


_NO_ADAPTERS = "no LoRA adapters to export: this checkpoint was not trained with model.params.lora"
