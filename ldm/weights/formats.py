"""Which format a path holds, decided in one place: a diffusers folder, a Colossal-AI checkpoint folder,
or a file (one of our checkpoints or an original single file, told apart by content)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

# A checkpoint written by ColossalAIStrategy is a folder with these entries.
COLOSSAL_FILES = {
    "model": "model",
    "optimizer": "optimizer",
    "master": "master.safetensors",
    "trainer": "trainer.pt",
}
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


class Format(Enum):
    DIFFUSERS = "a diffusers folder"
    COLOSSAL = "an ldm checkpoint folder (ColossalAIStrategy)"
    FILE = "a file (an ldm checkpoint or an original single file)"
    OTHER_FOLDER = "a folder that is neither a diffusers pipeline nor an ldm checkpoint"
    MISSING = "nothing (no such file or folder)"


def detect(path: str | Path) -> Format:
    """The format at `path`, from what is on disk (never from its name)."""
    path = Path(path).expanduser()
    if path.is_file():
        return Format.FILE
    if path.is_dir():
        if (path / COLOSSAL_FILES["trainer"]).is_file():
            return Format.COLOSSAL
        if (path / "model_index.json").is_file():
            return Format.DIFFUSERS
        return Format.OTHER_FOLDER
    return Format.MISSING


def is_our_checkpoint(obj: object) -> bool:
    """Whether a loaded file is one of our checkpoints: an `ldm` entry describing parts, and a state dict
    keyed by those parts' names (our pickled single files carry the same entry, but original key names)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("ldm"), dict) and isinstance(obj.get("state_dict"), dict)):
        return False
    parts = obj["ldm"].get("parts") or {}
    return any(key.split(".", 1)[0] in parts for key in obj["state_dict"])
