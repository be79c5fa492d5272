"""Describe parts as plain data (class paths, configs, tokenizer files) and rebuild them from it.

A description is what travels with the weights: in our checkpoints and single files, so that
sampling and export never need the training config again.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from pathlib import Path
from typing import Any

from diffusers import SchedulerMixin
from transformers import PreTrainedTokenizerBase

from ldm.components import Parts
from ldm.components.build import module_from_config
from ldm.components.tokenizers import tokenizer_files, write_clip_tokenizer, write_slow_tokenizer_files
from ldm.config import import_target
from ldm.families import ARCHITECTURES, DEFAULT_CLASSES, Family


def describe_parts(parts: Parts) -> dict:
    """Each part's class and config (and the tokenizer's files), enough to rebuild it without weights."""
    described = {}
    for name, part in parts.items():
        if isinstance(part, PreTrainedTokenizerBase):
            described[name] = {"class": class_path(part), "files": tokenizer_files(part.save_pretrained)}
        else:
            described[name] = {"class": class_path(part), "config": _plain(config_dict(part))}
    return described


def config_dict(part: Any) -> dict:
    """A part's config as a dict: a transformers `PretrainedConfig`'s `to_dict()`, a diffusers `FrozenDict` copied."""
    return part.config.to_dict() if hasattr(part.config, "to_dict") else dict(part.config)


def class_path(obj: Any) -> str:
    """The shortest import path of `obj`'s class: `diffusers.UNet2DConditionModel` where the package
    exports it at its top, else its module's full path. A part sharded by FSDP2 is described by its own class
    (`fully_shard` swaps in a subclass `FSDP<Name>` of `(FSDPModule, <Name>)`)."""
    cls = type(obj)
    if cls.__name__.startswith("FSDP") and len(cls.__bases__) == 2 and cls.__bases__[0].__name__ == "FSDPModule":
        cls = cls.__bases__[1]
    top = cls.__module__.split(".")[0]
    if getattr(importlib.import_module(top), cls.__name__, None) is cls:
        return f"{top}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


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


def parts_from_description(described: dict) -> Parts:
    """Parts rebuilt from `describe_parts` output: networks on the meta device (load weights with
    `load_state_dict(..., assign=True)`), tokenizers and scheduler ready."""
    from accelerate import init_empty_weights

    built = Parts()
    for name, entry in described.items():
        cls = import_target(entry["class"])
        if "files" in entry:  # a tokenizer
            with tempfile.TemporaryDirectory() as tmp:
                for filename, text in entry["files"].items():
                    (Path(tmp) / filename).write_text(text)
                write_slow_tokenizer_files(tmp)  # a checkpoint saved under transformers 5 has tokenizer.json only
                built[name] = cls.from_pretrained(tmp)
        elif issubclass(cls, SchedulerMixin):
            built[name] = cls.from_config(entry["config"])
        else:
            with init_empty_weights():
                built[name] = module_from_config(cls, entry["config"])
    return built


def family_description(family: Family) -> dict:
    """A family's parts in `describe_parts` form, from the configs shipped in `configs/models/<family>/`."""
    described = {}
    for name in family.networks:
        config = json.loads((family.network_folder / name / "config.json").read_text())
        described[name] = {"class": _class_of(family, name), "config": config}
    scheduler = json.loads((family.folder / "scheduler" / "scheduler_config.json").read_text())
    described["scheduler"] = {"class": f"diffusers.{scheduler['_class_name']}", "config": scheduler}
    for name, pad in (("tokenizer", family.pad_token), ("tokenizer_2", family.pad_token_2)):
        if pad is not None:
            files = tokenizer_files(lambda folder, pad=pad: write_clip_tokenizer(folder, pad_token=pad))
            described[name] = {"class": _class_of(family, name), "files": files}
    return described


def _class_of(family: Family, part: str) -> str:
    return ARCHITECTURES[family.architecture].part_classes.get(part, DEFAULT_CLASSES[part])
