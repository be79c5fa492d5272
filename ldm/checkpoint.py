"""Our checkpoints: weights, the resolved config and each part's own config travel together.

A checkpoint is written to `NAME.partial`, synced, summed into `NAME.sha256` (the format of
`sha256sum`, one line per file, so `sha256sum -c NAME.sha256` checks it by hand) and only then
renamed to `NAME`: a crash or a full disk at any moment leaves either the old checkpoint or the
new one, never a half-written file under a checkpoint's name.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from ldm.config import import_target
from ldm.models.parts import Parts, module_from_config
from ldm.tokenizers import write_slow_tokenizer_files

MODULE_PARTS = ("unet", "vae", "text_encoder")
# A checkpoint written by ldm.strategies.ColossalAIStrategy is a folder with these entries.
COLOSSAL_FILES = {
    "model": "model",
    "optimizer": "optimizer",
    "master": "master.safetensors",
    "trainer": "trainer.pt",
}
CHECKSUM_SUFFIX = ".sha256"
PARTIAL_SUFFIX = ".partial"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or what is on disk is not what was written."""


class StreamingCheckpointIO(TorchCheckpointIO):
    """Write checkpoint files straight to disk and sync them (Lightning's default first builds the
    whole file in memory, doubling the host memory a save needs).

    With `collect_failures` set, a failed write is kept in `failure` instead of raised, so that the
    saving rank does not leave the others waiting at the barrier that follows every save."""

    def __init__(self) -> None:
        self.collect_failures, self.failure = False, None

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
        except (OSError, RuntimeError) as err:
            remove_path(path)
            if not self.collect_failures:
                raise
            self.failure = err


def remove_path(path: Path) -> None:
    """Delete a file, a link or a folder, if there."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish_checkpoint(partial: Path, final: Path) -> None:
    """Sum and sync a finished `partial` checkpoint (a file or a folder), write `final`'s checksum file,
    then rename `partial` to `final`. Every step is atomic; the checksum file comes first, so a
    checkpoint under its final name always has one."""
    lines = []
    for file in _files(partial):
        _fsync(file)
        name = final.name if file == partial else f"{final.name}/{file.relative_to(partial).as_posix()}"
        lines.append(f"{_sha256(file)}  {name}\n")
    sums = final.with_name(final.name + CHECKSUM_SUFFIX)
    temporary = sums.with_name(sums.name + PARTIAL_SUFFIX)
    with open(temporary, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, sums)
    if final.exists() or final.is_symlink():  # the same step saved again, after a resume from an earlier one
        old = final.with_name(final.name + ".old")
        remove_path(old)
        final.rename(old)
        remove_path(old)
    os.replace(partial, final)
    _fsync(final.parent)


def verify_checkpoint(path: Path) -> str | None:
    """Why the checkpoint at `path` (a file, folder or link to one) is not intact, or None if it is.

    A checkpoint written before checksums existed (no `.sha256` beside it) cannot be checked and
    passes; loading it will tell."""
    path = Path(path)
    target = path.resolve()
    if not target.exists():
        return "missing" + (f" (the link points to {target.name})" if path.is_symlink() else "")
    sums = target.with_name(target.name + CHECKSUM_SUFFIX)
    if not sums.is_file():
        return None
    lines = [line.split("  ", 1) for line in sums.read_text().splitlines() if line.strip()]
    if not lines or any(len(line) != 2 for line in lines):
        return f"its checksum file {sums.name} is unreadable"
    for digest, name in lines:
        file = target.parent / target.name / name.partition("/")[2] if "/" in name else target
        if not file.is_file():
            return f"{file.relative_to(target.parent)} is missing"
        if _sha256(file) != digest:
            return (
                f"{file.relative_to(target.parent)} does not match its checksum in {sums.name} "
                f"(truncated or corrupted; {file.stat().st_size} bytes on disk)"
            )
    return None


def describe_parts(parts: Parts) -> dict:
    """Each part's class and config (and the tokenizer's files), enough to rebuild it without weights."""
    described = {}
    for name in MODULE_PARTS:
        module = getattr(parts, name)
        config = module.config.to_dict() if hasattr(module.config, "to_dict") else dict(module.config)
        described[name] = {"class": _class_path(module), "config": _plain(config)}
    described["scheduler"] = {"class": _class_path(parts.scheduler), "config": _plain(dict(parts.scheduler.config))}
    with tempfile.TemporaryDirectory() as tmp:
        parts.tokenizer.save_pretrained(tmp)
        files = {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}
    described["tokenizer"] = {"class": _class_path(parts.tokenizer), "files": files}
    return described


def _class_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__.split('.')[0]}.{cls.__name__}"


def _plain(value: Any) -> Any:
    """Config values as plain Python types, so the checkpoint loads with `weights_only=True`."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def load_checkpoint(path: str | Path) -> dict:
    """Load one of our checkpoints (a file, or a ColossalAIStrategy folder) without executing code from it.

    A folder is consolidated: its weight shards become one `state_dict`, the fp32 master weights
    (if saved) replacing the half-precision working copies."""
    path = Path(path)
    if path.is_dir():
        return _load_folder(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
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


def _load_folder(path: Path) -> dict:
    from safetensors.torch import load_file

    trainer_state = path / COLOSSAL_FILES["trainer"]
    shards = sorted((path / COLOSSAL_FILES["model"]).glob("*.safetensors"))
    if not trainer_state.is_file() or not shards:
        raise ValueError(
            f"{path}: a folder, but not an ldm checkpoint folder (expected {COLOSSAL_FILES['trainer']} and "
            f"{COLOSSAL_FILES['model']}/*.safetensors, as ColossalAIStrategy writes them)"
        )
    ckpt = load_pickle(trainer_state)
    state = {}
    for shard in shards:
        state.update(load_file(str(shard)))
    if (path / COLOSSAL_FILES["master"]).is_file():
        state.update(load_file(str(path / COLOSSAL_FILES["master"])))
    ckpt["state_dict"] = state
    if "ldm" not in ckpt:
        raise ValueError(f"{path}: not an ldm checkpoint (no 'ldm' entry); was it made by main.py?")
    return ckpt


def _same_layout(state: dict, module: torch.nn.Module, prefix: str = "text_model.") -> dict:
    """Keys as `module` names them: transformers >= 5.6 dropped CLIPTextModel's `text_model.` level, so a
    checkpoint trained under one transformers version names the text encoder's weights differently
    from the other."""
    own = list(module.state_dict())
    if own and all(k.startswith(prefix) for k in own) and not any(k.startswith(prefix) for k in state):
        return {prefix + k: v for k, v in state.items()}
    if own and not any(k.startswith(prefix) for k in own):
        return {k.removeprefix(prefix): v for k, v in state.items()}
    return state


def parts_from_description(described: dict) -> Parts:
    """Parts rebuilt from `describe_parts` output: networks on the meta device (load weights with
    `load_state_dict(..., assign=True)`), tokenizer and scheduler ready."""
    from accelerate import init_empty_weights

    built = {}
    for name in MODULE_PARTS:
        with init_empty_weights():
            built[name] = module_from_config(import_target(described[name]["class"]), described[name]["config"])
    built["scheduler"] = import_target(described["scheduler"]["class"]).from_config(described["scheduler"]["config"])
    with tempfile.TemporaryDirectory() as tmp:
        for filename, text in described["tokenizer"]["files"].items():
            (Path(tmp) / filename).write_text(text)
        write_slow_tokenizer_files(tmp)  # a checkpoint saved under transformers 5 has tokenizer.json only
        built["tokenizer"] = import_target(described["tokenizer"]["class"]).from_pretrained(tmp)
    return Parts(**built)


def parts_from_checkpoint(ckpt: dict, ema: bool = False, merge: bool = True) -> Parts:
    """Rebuild the parts saved in a checkpoint, with its trained weights (or its EMA weights).

    A LoRA checkpoint holds the adapters only: its base weights are read again from the run's
    `model.params.pretrained`, and the adapters are merged into them unless `merge` is False."""
    state = dict(ckpt["state_dict"])
    if ema:
        if not ckpt.get("ema_state_dict"):
            raise ValueError("this checkpoint has no EMA weights; train with the EMA callback or drop --ema")
        state.update(ckpt["ema_state_dict"])
    if ckpt["ldm"].get("lora"):
        return _parts_with_lora(ckpt, state, merge)
    parts = parts_from_description(ckpt["ldm"]["parts"])
    for name in MODULE_PARTS:
        module = getattr(parts, name)
        prefix = f"{name}."
        part_state = _same_layout({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, module)
        module.load_state_dict(part_state, assign=True)
        setattr(parts, name, module.float().eval())  # parts trained or frozen in half precision come back as fp32
    return parts


def _parts_with_lora(ckpt: dict, state: dict, merge: bool) -> Parts:
    from ldm.config import ConfigError
    from ldm.lora import add_lora, merged
    from ldm.models.parts import PART_NAMES, build_parts

    params = (ckpt["ldm"].get("config") or {}).get("model", {}).get("params", {})
    base = {k: v for k, v in params.items() if k in ("pretrained", "pretrained_ema", "pretrained_family", *PART_NAMES)}
    try:
        parts = build_parts(**base)
    except ConfigError as err:
        raise ValueError(f"a LoRA checkpoint needs its base weights, as trained: {err}") from None
    lora = ckpt["ldm"]["lora"]
    add_lora(parts, tuple(lora["trainable"]), lora["spec"])
    for name in lora["trainable"]:
        module = getattr(parts, name)
        prefix = f"{name}."
        adapters = _same_layout({k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}, module)
        missing = [k for k in module.load_state_dict(adapters, strict=False).missing_keys if ".lora_" in k]
        if missing:
            raise ValueError(f"LoRA checkpoint: no weights for {name}.{missing[0]} (and {len(missing) - 1} more)")
        module.float().eval()
        if merge:
            setattr(parts, name, merged(module))
    return parts
