"""Write parts as a diffusers pipeline folder that loads the same under transformers 4.51 and 5.

Parts read from an original single file carry the tensors no part holds (`ldm.weights.extras`); the
folder keeps them in `single_file_extras.safetensors` at its root, which diffusers never reads, so a
single file written from the folder gives them back.
"""

from __future__ import annotations

import json
from pathlib import Path

from ldm.components import Parts
from ldm.components.build import folder_parts
from ldm.components.tokenizers import write_both_tokenizer_forms
from ldm.families import OPTIONAL_PARTS
from ldm.sampling import build_pipeline
from ldm.utils.atomic import atomic_path, honour_umask
from ldm.weights import text_model
from ldm.weights.extras import writable, write_extras


def write_pipeline(parts: Parts, out_dir: str | Path, sampler: str = "ddim", half: bool = False) -> Path:
    """Write parts as a diffusers pipeline folder (`ldm.sampling.build_pipeline`'s) that loads under transformers
    4.51 and 5, with the extras the parts carry (`ldm.weights.extras`) at its root."""
    extras = writable(parts, half)  # before `half`: is the UNet still the one the EMA copy averages?
    pipe = build_pipeline(parts, sampler)
    if half:
        for module in parts.networks.values():
            module.half()
    out_dir = Path(out_dir)
    pipe.save_pretrained(out_dir, safe_serialization=True)
    make_portable(out_dir)
    write_extras(out_dir, parts, extras)
    return out_dir


def make_portable(folder: str | Path) -> Path:
    """Make a diffusers SD folder load the same under transformers 4.51 and 5, and for other users.

    transformers >= 5.6 writes the CLIP text encoder's weights without their `text_model.` prefix
    and the tokenizer as `tokenizer.json` only; transformers 4.51 then leaves the text encoder
    silently random and cannot build the tokenizer. Both versions read the older weight layout, so
    this restores the prefix (`ldm.weights.text_model`); and it writes both tokenizer forms, each
    made from the other. `save_pretrained` leaves weights files 0600: every file and folder gets the
    mode the umask gives (`ldm.utils.atomic.honour_umask`).
    """
    from safetensors.torch import load_file, save_file

    folder = Path(folder)
    for name in folder_parts(folder) & {"text_encoder", *OPTIONAL_PARTS}:
        if name.startswith("tokenizer"):
            if _is_clip_tokenizer(folder / name):
                write_both_tokenizer_forms(folder / name)
            continue
        if not (folder / name / "config.json").is_file():
            continue
        config = json.loads((folder / name / "config.json").read_text())
        for weights in sorted((folder / name).glob("*.safetensors")):
            state = load_file(str(weights))
            if text_model.takes_prefix(config) and not all(k.startswith(text_model.PREFIX) for k in state):
                with atomic_path(weights) as partial:
                    save_file(text_model.with_prefix(state), str(partial), metadata={"format": "pt"})
    write_both_tokenizer_forms(folder / "tokenizer")
    honour_umask(folder)
    return folder


def _is_clip_tokenizer(folder: Path) -> bool:
    """Whether the tokenizer folder holds a CLIP tokenizer (the kind whose two forms `make_portable` writes)."""
    config = folder / "tokenizer_config.json"
    return not config.is_file() or "CLIP" in json.loads(config.read_text()).get("tokenizer_class", "CLIP")
