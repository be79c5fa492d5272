"""The shard format of precomputed training data: MDS shards (mosaicml-streaming's format) plus a manifest.

`scripts/precompute.py` writes a folder of them from any configured dataset, once, with the model's own VAE
and text encoder; `ldm.data.shards` trains from one or several such folders without running either.

A folder holds `index.json` and its shards (MDS, readable by `streaming.StreamingDataset`; written in
`chunk-NNNNN/` subfolders, each an MDS folder of its own, see `ldm.data.precompute`), `ldm_shards.json`
(the manifest: the source, sample count, conditioning and latent shapes, scaling factor and the encoders'
configs, what precomputing cost), `unconditional.safetensors` (the empty caption's conditioning, served when a
caption is dropped for classifier-free guidance) and `bad_samples.tsv` when input files could not be decoded.

Each sample has the columns of `columns()`: the VAE posterior's mean and standard deviation (both times the
VAE's scaling factor, so a latent is `mean + std * noise`), each conditioning tensor under `cond_<name>`, the
caption, the image's size before resizing and where it was cropped (top, left), the source's name and the
input example's key (its file, or its index in the dataset). Tensors are float16.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

MANIFEST = "ldm_shards.json"
UNCONDITIONAL = "unconditional.safetensors"
FORMAT_VERSION = 1
COND_PREFIX = "cond_"


def columns(cond_names: list[str]) -> dict[str, str]:
    """The MDS columns of a sample (name -> MDS encoding); tensor shapes are stored per sample."""
    return {
        "latent_mean": "ndarray:float16",
        "latent_std": "ndarray:float16",
        **{f"{COND_PREFIX}{name}": "ndarray:float16" for name in cond_names},
        "caption": "str",
        "original_size": "ndarray:int32",
        "crop_top_left": "ndarray:int32",
        "source": "str",
        "key": "str",
    }


def to_row(
    mean: torch.Tensor,
    std: torch.Tensor,
    cond: dict[str, torch.Tensor],
    caption: str,
    original_size: tuple[int, int],
    crop_top_left: tuple[int, int],
    source: str,
    key: str,
) -> dict[str, Any]:
    """One encoded example as an MDS sample."""

    def half(tensor: torch.Tensor) -> np.ndarray:
        return tensor.detach().to("cpu", torch.float16).numpy()

    return {
        "latent_mean": half(mean),
        "latent_std": half(std),
        **{f"{COND_PREFIX}{name}": half(value) for name, value in cond.items()},
        "caption": caption,
        "original_size": np.asarray(original_size, np.int32),
        "crop_top_left": np.asarray(crop_top_left, np.int32),
        "source": source,
        "key": key,
    }


def to_example(sample: dict[str, Any], unconditional: dict[str, torch.Tensor] | None) -> dict[str, Any]:
    """An MDS sample as a training example (float32 tensors); `unconditional` replaces the caption's
    conditioning when the caption is dropped, and the caption is then empty."""
    cond = {
        name[len(COND_PREFIX) :]: torch.from_numpy(np.asarray(value, np.float32))
        for name, value in sample.items()
        if name.startswith(COND_PREFIX)
    }
    if unconditional is not None:
        cond = {name: unconditional[name] for name in cond}
    return {
        "latents": torch.from_numpy(np.asarray(sample["latent_mean"], np.float32)),
        "latent_std": torch.from_numpy(np.asarray(sample["latent_std"], np.float32)),
        "cond": cond,
        "caption": "" if unconditional is not None else sample["caption"],
        "original_size": torch.from_numpy(np.asarray(sample["original_size"], np.int64)),
        "crop_top_left": torch.from_numpy(np.asarray(sample["crop_top_left"], np.int64)),
        "source": sample["source"],
        "key": sample["key"],
    }


def read_manifest(folder: Path, where: str) -> dict[str, Any]:
    """The manifest of a shard folder; `where` (a config key path) is named in the error if it is not one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"{where}: {folder} has no {MANIFEST}; is it a folder written by scripts/precompute.py "
            "(and did the precompute finish)?"
        )
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT_VERSION:
        raise ValueError(f"{where}: {path} is format {manifest.get('format')!r}; this ldm reads {FORMAT_VERSION}")
    return manifest


def read_unconditional(folder: Path) -> dict[str, torch.Tensor]:
    """The empty caption's conditioning, as precomputed with the shards (float32)."""
    return {name: tensor.float() for name, tensor in load_file(str(Path(folder) / UNCONDITIONAL)).items()}
