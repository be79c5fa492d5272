"""Read our checkpoints: weights, the resolved config and each part's own config travel together."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import torch

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
        found = re.search(r"GLOBAL ([\w.]+)", detail)
        raise ValueError(
            f"{path}: refused: loading it would unpickle {found[1] if found else 'arbitrary objects'}, which can "
            "run code. If you trust where it came from, convert it once to safetensors and use that file: "
            f"python scripts/convert.py --src {path} --dst {path.with_suffix('.safetensors')} --trust-pickle"
        ) from None


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
