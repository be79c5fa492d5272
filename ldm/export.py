"""Weights out: diffusers pipelines, single files and conversions, from any format `ldm.weights` reads."""

from __future__ import annotations

import json
from pathlib import Path

import diffusers

from ldm.families import ARCHITECTURES
from ldm.pipelines.microdit import MicroDiTPipeline
from ldm.sampling import build_pipeline, inference_scheduler
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.formats import PICKLE_SUFFIXES, Format, detect
from ldm.weights.pipeline_folder import write_pipeline
from ldm.weights.read import parts_from_checkpoint, read_parts
from ldm.weights.single_file import save_single_file


def load_pipeline(path: str | Path, sampler: str = "ddim", ema: bool = False) -> diffusers.DiffusionPipeline:
    """A pipeline from one of our checkpoints, an original single file, or a diffusers folder."""
    path = Path(path)
    if detect(path) is Format.DIFFUSERS:
        if ema:
            raise ValueError("--ema applies to checkpoints; an exported folder holds one set of weights")
        kind = json.loads((path / "model_index.json").read_text()).get("_class_name")
        if kind == MicroDiTPipeline.__name__:
            pipe = MicroDiTPipeline.from_pretrained(path, local_files_only=True)
        else:  # the family's pipeline; the first family's where the folder names none of them
            first = next(iter(ARCHITECTURES.values()))
            family = next((a for a in ARCHITECTURES.values() if a.pipeline_class == kind), first)
            cls = getattr(diffusers, family.pipeline_class)
            pipe = cls.from_pretrained(path, local_files_only=True, **family.pipeline_options)
        pipe.scheduler = inference_scheduler(pipe.scheduler, sampler)
        return pipe
    return build_pipeline(read_parts(path, ema=ema), sampler)


def export_pipeline(ckpt_path: str | Path, out_dir: str | Path, ema: bool = False, sampler: str = "ddim") -> Path:
    """Write a checkpoint as a diffusers folder (safetensors weights, tokenizer, scheduler)."""
    ckpt = load_checkpoint(ckpt_path)
    out_dir = write_pipeline(parts_from_checkpoint(ckpt, ema=ema), out_dir, sampler)
    if ckpt["ldm"].get("config"):
        (out_dir / "ldm_config.json").write_text(json.dumps(ckpt["ldm"]["config"], indent=2))
    return out_dir


def convert(
    src: str | Path,
    dst: str | Path,
    half: bool = False,
    ema: bool = False,
    family: str | None = None,
    trust_pickle: bool = False,
    part_files: dict[str, str] | None = None,
) -> Path:
    """Write `src`'s weights to `dst`: a `.safetensors` / `.ckpt` path is a single file, anything else a folder.
    A single file's text encoders may come from `part_files` (`ldm.weights.single_file.load_single_file`)."""
    dst = Path(dst)
    if dst.suffix not in (".safetensors", *PICKLE_SUFFIXES) and dst.suffix:
        raise ValueError(f"--dst {dst}: a folder (no suffix) for diffusers, or a .safetensors / .ckpt single file")
    if dst.exists() and (dst.is_file() or any(dst.iterdir())):
        raise FileExistsError(f"--dst {dst}: exists; choose a new path (nothing is overwritten)")
    parts = read_parts(src, ema, family, trust_pickle, part_files=part_files)
    if dst.suffix:
        return save_single_file(parts, dst, half)
    return write_pipeline(parts, dst, half=half)
