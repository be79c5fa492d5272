"""Our checkpoints on disk: a file, a ColossalAIStrategy folder, or a folder of FSDP shards; read without running
code from them.

A checkpoint holds the weights (`state_dict`, and `ema_state_dict` with EMA), Lightning's training
state and an `ldm` entry: the resolved config and each part's description, so that it rebuilds
without the training config (`ldm.weights.read.parts_from_checkpoint`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ldm.weights.formats import COLOSSAL_FILES, SHARDED_FILES, Format, detect


def load_checkpoint(path: str | Path) -> dict:
    """Load one of our checkpoints (a file, a ColossalAIStrategy folder, a folder of FSDP shards) without executing
    code from it.

    A folder is consolidated: its weight shards become one `state_dict` (for Colossal-AI, the fp32 master
    weights, if saved, replacing the half-precision working copies)."""
    path = Path(path)
    kind = detect(path)
    if kind is Format.COLOSSAL:
        return _load_folder(path)
    if kind is Format.SHARDED:
        return _load_shards(path)
    if kind is Format.MISSING:
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if kind is not Format.FILE:
        raise ValueError(
            f"{path}: a folder, but not an ldm checkpoint folder (expected {COLOSSAL_FILES['trainer']} and "
            f"{COLOSSAL_FILES['model']}/*.safetensors, as ColossalAIStrategy writes them)"
        )
    ckpt = load_pickle(path)
    if not isinstance(ckpt, dict) or "ldm" not in ckpt or "state_dict" not in ckpt:
        raise ValueError(f"{path}: not an ldm checkpoint (no 'ldm' and 'state_dict' entries); was it made by main.py?")
    return ckpt


def load_pickle(path: str | Path, trust: bool = False) -> Any:
    """`torch.load` that never runs code from the file (`weights_only`), unless `trust` is given.

    A file that needs more than tensors and plain containers is refused with a message that says
    how to convert it, once, into a safetensors file."""
    path = Path(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust)
    except Exception as err:
        detail = " ".join(str(err).split())
        if trust or "weights_only" not in detail:
            raise ValueError(f"{path}: not a readable checkpoint ({detail[:300]})") from None
        raise ValueError(
            f"{path}: refused: loading it would unpickle {unpickled_object(err)}, which can run code. If you trust "
            "where it came from, convert it once to safetensors and use that file: "
            f"python scripts/convert.py --src {path} --dst {path.with_suffix('.safetensors')} --trust-pickle"
        ) from None


def unpickled_object(err: BaseException) -> str:
    """What a refused weights-only load would have had to unpickle, from torch's error message."""
    found = re.search(r"GLOBAL ([\w.]+)", " ".join(str(err).split()))
    return found[1] if found else "arbitrary objects"


def _load_shards(path: Path) -> dict:
    """A folder `torch.distributed.checkpoint` wrote (FSDPStrategy, `state_dict: sharded`) as one checkpoint: the
    weights gathered from every process's shard in this one process (no process group), the optimizer states
    left on disk."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(str(path))
    prefix = "state_dict."
    weights = {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in reader.read_metadata().state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }
    if not weights:
        raise ValueError(f"{path}: a folder of shards without weights (no state_dict.* entries in its index)")
    load(weights, storage_reader=reader)  # gathers in this process alone when no process group is up
    ckpt = load_pickle(path / SHARDED_FILES["trainer"])
    if not isinstance(ckpt, dict) or "ldm" not in ckpt:
        raise ValueError(f"{path}: not an ldm checkpoint (no 'ldm' entry); was it made by main.py?")
    ckpt["state_dict"] = {key.removeprefix(prefix): value for key, value in weights.items()}
    return ckpt


def _load_folder(path: Path) -> dict:
    from safetensors.torch import load_file

    shards = sorted((path / COLOSSAL_FILES["model"]).glob("*.safetensors"))
    if not shards:
        raise ValueError(f"{path}: an ldm checkpoint folder without weights ({COLOSSAL_FILES['model']}/*.safetensors)")
    ckpt = load_pickle(path / COLOSSAL_FILES["trainer"])
    state = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    if (path / COLOSSAL_FILES["master"]).is_file():
        state.update(load_file(str(path / COLOSSAL_FILES["master"])))
    ckpt["state_dict"] = state
    if "ldm" not in ckpt:
        raise ValueError(f"{path}: not an ldm checkpoint (no 'ldm' entry); was it made by main.py?")
    return ckpt
