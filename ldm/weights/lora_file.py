"""LoRA files for other tools: kohya's format (ComfyUI, AUTOMATIC1111, sd-scripts) and diffusers'; and a
LoRA file merged into a full model.

kohya's file is one `.safetensors` with `lora_unet_...` / `lora_te_...` keys (`ldm.components.lora_keys`)
and the metadata sd-scripts writes (`ss_network_dim`, `ss_base_model_version`, ...; values as strings).
diffusers' is `pytorch_lora_weights.safetensors` in a folder, for `pipe.load_lora_weights(folder)`.
"""

from __future__ import annotations

import inspect
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping
from math import prod
from pathlib import Path
from typing import Literal

import torch

from ldm.components import Parts
from ldm.components.lora import add_lora, lora_layers, merged
from ldm.components.lora_keys import kohya_state_dict, lora_modules, read_adapters
from ldm.families import ARCHITECTURES, LAYOUTS, architecture_of, family_of
from ldm.utils.atomic import atomic_path
from ldm.weights.checkpoint import load_pickle
from ldm.weights.formats import Format, detect
from ldm.weights.keymaps import UNET, VAE
from ldm.weights.pipeline_folder import write_pipeline
from ldm.weights.read import read_parts
from ldm.weights.single_file import modelspec

LORA_FILE = "pytorch_lora_weights.safetensors"
LoraFormat = Literal["kohya", "diffusers"]


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

    _check_lora_files(parts)
    state = kohya_state_dict(parts)
    if not state:
        raise ValueError(_NO_ADAPTERS)
    path = kohya_path(out)
    metadata = {**kohya_metadata(parts, path.stem), **(about or {})}
    with atomic_path(path) as partial:
        save_file(state, str(partial), metadata=metadata)
    return path


def kohya_metadata(parts: Parts, name: str) -> dict[str, str]:
    """The safetensors metadata sd-scripts writes with a LoRA, for the file `name`, and the SAI model spec
    where the parts are a released family."""
    # the adapters' own rank and alpha: a file may hold fused ones of a larger rank (`kohya_state_dict`)
    layer = next(layer for module in parts.networks.values() for layer in lora_modules(module).values())
    adapter = next(iter(layer.lora_A))
    rank = layer.lora_A[adapter].weight.shape[0]
    family = family_of(parts)
    metadata = {
        "ss_network_module": "networks.lora",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(round(float(layer.scaling[adapter]) * rank, 6)),  # as sd-scripts: "8.0"
        "ss_v2": str(bool(family) and family.kohya_v2),
        "ss_base_model_version": family.kohya_base if family else "",
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
    about = {"ss_steps": str(ckpt.get("global_step", 0))}
    if base := checkpoint_base(ckpt):
        about["ss_sd_model_name"] = Path(base).name
    return about


def checkpoint_base(ckpt: dict) -> str | None:
    """The model a run started from (its `model.params.pretrained`), or None."""
    params = ((ckpt.get("ldm") or {}).get("config") or {}).get("model", {}).get("params", {})
    return str(params["pretrained"]) if params.get("pretrained") else None


def save_diffusers_lora(parts: Parts, out_dir: str | Path) -> Path:
    """Write the parts' adapters as `out_dir/pytorch_lora_weights.safetensors`, for `pipe.load_lora_weights`."""
    import diffusers

    _check_lora_files(parts)
    architecture = architecture_of(parts)
    folders = architecture.folders  # the pipeline's name for each part (its denoiser may be a `transformer`)
    layers = {f"{folders.get(n, n)}_lora_layers": lora_layers(m) for n, m in parts.networks.items() if lora_modules(m)}
    pipeline = getattr(diffusers, architecture.pipeline_class)
    if not layers:
        raise ValueError(_NO_ADAPTERS)
    takes = inspect.signature(pipeline.save_lora_weights).parameters
    if unknown := [name.removesuffix("_lora_layers") for name in layers if name not in takes]:
        raise ValueError(
            f"diffusers' {architecture.title} LoRA files hold no {', '.join(unknown)} adapters "
            "(its loader has none); export kohya's format (--format kohya), which does"
        )
    out_dir = Path(out_dir)
    if out_dir.suffix == ".safetensors":
        raise ValueError(f"--out {out_dir}: diffusers' LoRA format is a folder; name one, or use --format kohya")
    with atomic_path(out_dir / LORA_FILE) as partial:
        pipeline.save_lora_weights(partial.parent, **layers, weight_name=partial.name, safe_serialization=True)
    return out_dir / LORA_FILE


def merge_lora_file(lora: str | Path, pretrained: str | Path, out_dir: str | Path, half: bool = False) -> Path:
    """Merge a LoRA file (kohya's or diffusers' format) into the model `pretrained` (a diffusers folder,
    an original single file or one of our checkpoints) and write a diffusers pipeline folder in the base's
    dtypes, or in fp16 with `half` (`write_merged`)."""
    parts = read_parts(pretrained, where="--pretrained")
    covered = tuple(read_adapters(lora, parts, "--lora"))
    add_lora(parts, covered, {"init_from": str(lora)}, key="--lora", where="--lora")
    for name in covered:
        parts[name] = merged(parts[name])
    return write_merged(parts, pretrained, out_dir, half)


def write_merged(parts: Parts, base: str | Path | None, out_dir: str | Path, half: bool = False) -> Path:
    """Write `parts`, LoRA adapters merged in (in fp32), as a diffusers pipeline folder: each network in the
    dtype its weights have in `base`, the model merged into (`stored_dtypes`; fp32 where it does not say),
    or all in fp16 with `half`. A merge into an fp16 base so stays fp16, not twice its size."""
    if not half:
        dtypes = stored_dtypes(base) if base is not None else {}
        for name, module in parts.networks.items():
            # torch's own `to`: diffusers' warns of fp32-only modules even where a model has none
            torch.nn.Module.to(module, dtypes.get(name, torch.float32))
    return write_pipeline(parts, out_dir, half=half)


def _part_prefixes() -> dict[str, tuple[str, ...]]:
    """Where each network's weights are in our checkpoints, then in original single files (each file layout's)."""
    prefixes = {"unet": ("unet.", UNET), "vae": ("vae.", VAE)}
    for layout in LAYOUTS.values():
        for part, prefix, _ in layout.text:
            prefixes[part] = (*prefixes.get(part, (f"{part}.",)), prefix)
    return prefixes


_PART_PREFIXES = _part_prefixes()
_SAFETENSORS_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def stored_dtypes(path: str | Path) -> dict[str, torch.dtype]:
    """The dtype of each network's weights as stored at `path` (a diffusers folder, an original single file
    or one of our checkpoints): the floating dtype that holds most of its numbers. Of safetensors files only
    the headers are read; a network `path` holds no weights of is left out."""
    path = Path(path).expanduser()
    kind = detect(path)
    counts: dict[str, Counter] = defaultdict(Counter)
    if kind is Format.DIFFUSERS:
        for part in _PART_PREFIXES:  # the files from_pretrained reads: no variants (`*.fp16.safetensors`)
            named = {part, *(a.folders[part] for a in ARCHITECTURES.values() if part in a.folders)}
            for file in sorted(f for folder in named for f in (path / folder).glob("*")):
                if file.suffix in (".safetensors", ".bin") and len(file.suffixes) == 1:
                    for _, dtype, numel in _floating_tensors(file):
                        counts[part][dtype] += numel
    elif kind is Format.FILE:
        for key, dtype, numel in _floating_tensors(path):
            part = next((p for p, prefixes in _PART_PREFIXES.items() if key.startswith(prefixes)), None)
            if part:
                counts[part][dtype] += numel
    return {part: numbers.most_common(1)[0][0] for part, numbers in counts.items()}


def _floating_tensors(file: Path) -> Iterator[tuple[str, torch.dtype, int]]:
    """(name, dtype, number of elements) of each floating tensor of a safetensors or pickle weights file."""
    if file.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():
                piece = handle.get_slice(key)
                if piece.get_dtype() in _SAFETENSORS_DTYPES:
                    yield key, _SAFETENSORS_DTYPES[piece.get_dtype()], prod(piece.get_shape())
        return
    obj = load_pickle(file)
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            yield key, value.dtype, value.numel()


_NO_ADAPTERS = "no LoRA adapters to export: this checkpoint was not trained with model.params.lora"


def _check_lora_files(parts: Parts) -> None:
    """Refuse, by name, to write LoRA files of a family whose file names ldm does not map yet."""
    architecture = architecture_of(parts)
    if not architecture.lora_files:
        raise ValueError(
            f"ldm writes no {architecture.title} LoRA files yet; scripts/export_diffusers.py writes the model "
            "with the adapters merged"
        )
