"""Weights across formats: our checkpoints, diffusers folders and original single files, any direction.

The format follows the path: a folder with `model_index.json` is a diffusers pipeline; a file or
folder holding our `ldm` entry is one of our checkpoints (recognised by content, whatever its
name); any other `.safetensors` / `.ckpt` is an original Stable Diffusion single file.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ldm.checkpoint import load_checkpoint, load_pickle, parts_from_checkpoint
from ldm.config import ConfigError
from ldm.models.parts import Parts, build_parts
from ldm.pipeline import write_pipeline
from ldm.single_file import PICKLE_SUFFIXES, load_single_file, save_single_file, split_pickle

log = logging.getLogger(__name__)


def read_parts(
    src: str | Path,
    ema: bool = False,
    family: str | None = None,
    trust_pickle: bool = False,
    where: str = "--src",
) -> Parts:
    """Float32 parts from a diffusers folder, one of our checkpoints, or an original single file.

    What was read (for a single file: the family and how it was told) is logged, after `where`."""
    src = Path(src)
    if src.is_dir():
        if (src / "model_index.json").is_file():
            if ema or family:
                raise ValueError(f"{src}: a diffusers folder holds one set of weights; drop --ema / --family")
            try:
                return build_parts(pretrained=str(src), key=where)
            except ConfigError as err:
                raise ValueError(str(err)) from None
        log.info("%s: %s: an ldm checkpoint folder", where, src)
        return parts_from_checkpoint(load_checkpoint(src), ema)
    if not src.is_file():
        raise FileNotFoundError(f"no such file or folder: {src}")
    loaded = ()
    if src.suffix in PICKLE_SUFFIXES:
        obj = load_pickle(src, trust_pickle)
        if _is_our_checkpoint(obj):
            if family:
                raise ValueError(f"{src}: an ldm checkpoint knows its model; the family setting is for single files")
            log.info("%s: %s: an ldm checkpoint (step %s)", where, src, obj.get("global_step"))
            return parts_from_checkpoint(obj, ema)
        loaded = split_pickle(obj, src)
    parts, line = load_single_file(src, ema, family, loaded=loaded)
    log.info("%s: %s", where, line)
    return parts


def _is_our_checkpoint(obj: object) -> bool:
    return (
        isinstance(obj, dict)
        and isinstance(obj.get("ldm"), dict)
        and isinstance(obj.get("state_dict"), dict)
        and any(k.startswith("unet.") for k in obj["state_dict"])
    )


def convert(
    src: str | Path,
    dst: str | Path,
    half: bool = False,
    ema: bool = False,
    family: str | None = None,
    trust_pickle: bool = False,
) -> Path:
    """Write `src`'s weights to `dst`: a `.safetensors` / `.ckpt` path is a single file, anything else a folder."""
    dst = Path(dst)
    if dst.suffix not in (".safetensors", *PICKLE_SUFFIXES) and dst.suffix:
        raise ValueError(f"--dst {dst}: a folder (no suffix) for diffusers, or a .safetensors / .ckpt single file")
    if dst.exists() and (dst.is_file() or any(dst.iterdir())):
        raise FileExistsError(f"--dst {dst}: exists; choose a new path (nothing is overwritten)")
    parts = read_parts(src, ema, family, trust_pickle)
    if dst.suffix:
        return save_single_file(parts, dst, half)
    return write_pipeline(parts, dst, half=half)
