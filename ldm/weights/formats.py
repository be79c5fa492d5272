"""Which format a path holds, decided in one place: a diffusers folder, a Colossal-AI checkpoint folder, a
sharded FSDP checkpoint folder, or a file (one of our checkpoints or an original single file, told apart by
content)."""

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
# One written by FSDPStrategy with `state_dict: sharded`: torch.distributed.checkpoint's shards and index, and
# Lightning's file of everything else (the `ldm` entry, the loops' state).
SHARDED_FILES = {"index": ".metadata", "trainer": "meta.pt"}
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")


class Format(Enum):
    DIFFUSERS = "a diffusers folder"
    COLOSSAL = "an ldm checkpoint folder (ColossalAIStrategy)"
    SHARDED = "an ldm checkpoint folder of shards (FSDPStrategy, state_dict: sharded)"
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
        if all((path / name).is_file() for name in SHARDED_FILES.values()):
            return Format.SHARDED
        if (path / "model_index.json").is_file():
            return Format.DIFFUSERS
        return Format.OTHER_FOLDER
    return Format.MISSING


CHECKPOINTS = (Format.FILE, Format.COLOSSAL, Format.SHARDED)  # what may hold one of our checkpoints
CHECKPOINT_FOLDERS = (Format.COLOSSAL, Format.SHARDED)


def is_our_checkpoint(obj: object) -> bool:
    """Whether a loaded file is one of our checkpoints: an `ldm` entry describing parts, and a state dict
    keyed by those parts' names (our pickled single files carry the same entry, but original key names)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("ldm"), dict) and isinstance(obj.get("state_dict"), dict)):
        return False
    parts = obj["ldm"].get("parts") or {}
    return any(key.split(".", 1)[0] in parts for key in obj["state_dict"])
