"""Build the parts of a latent diffusion model from a local diffusers folder or from a config.

Single files and our checkpoints are read by `ldm.weights`, which builds on this.

Parts are library classes: diffusers `AutoencoderKL`, `UNet2DConditionModel` and noise schedulers,
transformers `CLIPTextModel` and `CLIPTokenizer`. Nothing here reaches a model hub.
"""

from __future__ import annotations

import inspect
import json
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict

import torch

from ldm.components import Parts
from ldm.components.tokenizers import write_clip_tokenizer
from ldm.config import ConfigError, ExistingPath, import_target
from ldm.families import (
    DEFAULT_CLASSES,
    OPTIONAL_PARTS,
    PART_NAMES,
    SUPPORTED,
    Architecture,
    architecture_of_pipeline,
    refused_pipeline,
)


class PartSpec(TypedDict, total=False):
    """How to get one part: from a local folder (`pretrained`, `subfolder`) or a `config` dict.

    `target` names the class when it is not the part's default. A tokenizer's `config` is
    `{vocab: clip, model_max_length: N, pad_token: T}`: the real CLIP tokenizer, written offline (OpenCLIP's pads
    with "!").
    """

    target: str
    pretrained: ExistingPath
    subfolder: str
    config: dict


def build_parts(
    pretrained: str | None = None,
    key: str = "model.params",
    base: Parts | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    **specs: Any,
) -> Parts:
    """Build every part: a module (or tokenizer, scheduler) passes through, a spec is built, a missing
    one is taken from `base` (parts already read) or else is the part's subfolder of the diffusers
    folder `pretrained`; an optional part (`OPTIONAL_PARTS`) only where it is given or the folder has it.
    A network built here is loaded (or made) in its dtype in `dtypes`, by part name; float32 where not given."""
    built = Parts(base or {})
    listed = folder_parts(pretrained, f"{key}.pretrained") if base is None else set()
    for name in (*PART_NAMES, *OPTIONAL_PARTS):
        if specs.get(name) is None and (base is not None or name in OPTIONAL_PARTS and name not in listed):
            continue
        spec = part_spec(name, specs.get(name), pretrained, key)
        dtype = (dtypes or {}).get(name, torch.float32)
        built[name] = build_part(name, spec, f"{key}.{name}", dtype) if isinstance(spec, dict) else spec
    return built


def folder_parts(pretrained: str | None, key: str = "model.params.pretrained") -> set[str]:
    """The parts a diffusers folder's `model_index.json` lists (with a class, not null); none without one. A
    pipeline of a model ldm does not train (`ldm.families.refused_pipeline`) is refused by name, naming `key`."""
    index = Path(pretrained).expanduser() / "model_index.json" if pretrained is not None else None
    if index is None or not index.is_file():
        return set()
    listed = json.loads(index.read_text())
    other = refused_pipeline(listed.get("_class_name"))
    if other is not None:
        raise ConfigError(f"{key}: {pretrained} is {other} ({listed['_class_name']}); {SUPPORTED}")
    architecture = architecture_of_pipeline(listed.get("_class_name"))
    parts = {folder: part for part, folder in (architecture.folders if architecture else {}).items()}
    return {parts.get(k, k) for k, entry in listed.items() if isinstance(entry, list) and entry[-1] is not None}


def folder_architecture(pretrained: str | None) -> Architecture | None:
    """The family architecture of the diffusers folder `pretrained`, by its pipeline class; None for another."""
    index = Path(pretrained).expanduser() / "model_index.json" if pretrained is not None else None
    if index is None or not index.is_file():
        return None
    return architecture_of_pipeline(json.loads(index.read_text()).get("_class_name"))


def part_spec(name: str, spec: Any, pretrained: str | None, key: str = "model.params") -> Any:
    """The spec of one part: as given, or by default its subfolder of `pretrained` (the part's name, or the one
    its family's folders give it), read as the class the family gives it where not the default."""
    if spec is not None:
        return spec
    if pretrained is None:
        raise ConfigError(f"{key}.{name}: missing; give `{key}.pretrained: PATH` or `{key}.{name}.config`")
    architecture = folder_architecture(pretrained)
    if architecture is None:
        return {"pretrained": pretrained, "subfolder": name}
    target = {"target": architecture.part_classes[name]} if name in architecture.part_classes else {}
    return {"pretrained": pretrained, "subfolder": architecture.folders.get(name, name), **target}


def part_folder(spec: dict) -> Path:
    """The folder a `{pretrained, subfolder}` spec points at."""
    folder = Path(spec["pretrained"]).expanduser()
    return folder / spec["subfolder"] if spec.get("subfolder") else folder


def _is_transformers_model(cls: type) -> bool:
    return hasattr(cls, "config_class") and not hasattr(cls, "from_config")


def module_from_config(cls: type, config: dict) -> torch.nn.Module:
    """A network with fresh weights from its config: a transformers model through its `config_class`."""
    if _is_transformers_model(cls):
        return cls(cls.config_class(**{k: v for k, v in config.items() if not k.startswith("_")}))
    return cls.from_config(config)


def build_part(name: str, spec: dict, key: str, dtype: torch.dtype = torch.float32) -> Any:
    """Build one part from a `PartSpec`, a network in `dtype`; errors name `key` and the path that was read."""
    cls = import_target(spec.get("target", DEFAULT_CLASSES[name]), f"{key}.target")
    if ("pretrained" in spec) == ("config" in spec):
        raise ConfigError(f"{key}: give exactly one of `pretrained` (a local folder) or `config`")
    if "config" in spec:
        part = _from_config(name, cls, dict(spec["config"]), key)
        return part.to(dtype) if isinstance(part, torch.nn.Module) else part
    source = part_folder(spec)
    if not source.is_dir():
        raise ConfigError(f"{key}: no folder {source} (from {key}.pretrained); expected a diffusers-format folder")
    try:
        if name == "scheduler":
            return cls.from_config(cls.load_config(source))
        if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):  # a tokenizer
            return cls.from_pretrained(source, local_files_only=True)
        # Read straight into its dtype. transformers 5 calls the argument `dtype` and still takes `torch_dtype`, the
        # name 4.x and diffusers know; without it, transformers 5 would load the dtype the folder's config says.
        return cls.from_pretrained(source, local_files_only=True, torch_dtype=dtype)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: cannot load {cls.__name__} from {source}: {' '.join(str(err).split())}") from None


def _from_config(name: str, cls: type, config: dict, key: str) -> Any:
    if name.startswith("tokenizer"):
        return _tokenizer_from_config(cls, config, key)
    _check_keys(config, inspect.signature((cls.config_class if _is_transformers_model(cls) else cls).__init__), key)
    return module_from_config(cls, config)


def _check_keys(config: dict, sig: inspect.Signature, key: str) -> None:
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and len(sig.parameters) <= 3:
        return
    valid = [n for n in sig.parameters if n not in ("self", "kwargs")]
    for k in config:
        if k not in valid and not k.startswith("_"):
            raise ConfigError(f"{key}.config.{k}: unknown key; valid: {', '.join(valid)}")


def _tokenizer_from_config(cls: type, config: dict, key: str) -> Any:
    vocab = config.get("vocab", "clip")
    if vocab != "clip":
        raise ConfigError(f"{key}.config.vocab: got {vocab!r}; valid: 'clip'")
    unknown = set(config) - {"vocab", "model_max_length", "pad_token"}
    if unknown:
        raise ConfigError(f"{key}.config.{sorted(unknown)[0]}: unknown key; valid: vocab, model_max_length, pad_token")
    with tempfile.TemporaryDirectory() as tmp:
        extra = {"pad_token": str(config["pad_token"])} if "pad_token" in config else {}
        write_clip_tokenizer(tmp, model_max_length=int(config.get("model_max_length", 77)), **extra)
        return cls.from_pretrained(tmp, local_files_only=True)
