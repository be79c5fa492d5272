"""Read parts from any weights format: a diffusers folder, one of our checkpoints, an original single file.

The format is detected by `ldm.weights.formats.detect`; a file is one of our checkpoints when its
content says so (whatever its name), else an original Stable Diffusion single file. Parts read from a
single file, or from a diffusers folder that carries its extras, keep them (`ldm.weights.extras`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ldm.components import Parts
from ldm.components.build import build_parts
from ldm.components.describe import parts_from_description
from ldm.components.lora import add_lora, is_lora_key, merged
from ldm.config import ConfigError
from ldm.families import OPTIONAL_PARTS, PART_NAMES, detect_family
from ldm.weights.checkpoint import load_checkpoint, load_pickle
from ldm.weights.extras import attach, read_extras
from ldm.weights.formats import CHECKPOINT_FOLDERS, CHECKPOINTS, PICKLE_SUFFIXES, Format, detect, is_our_checkpoint
from ldm.weights.single_file import extras_from_file, load_single_file, read_single_file, split_pickle
from ldm.weights.text_model import as_module_names

log = logging.getLogger(__name__)


def read_parts(
    src: str | Path,
    ema: bool = False,
    family: str | None = None,
    trust_pickle: bool = False,
    where: str = "--src",
    dtypes: Mapping[str, torch.dtype] | None = None,
    keep_extras: bool = True,
    part_files: Mapping[str, str | Path] | None = None,
) -> Parts:
    """Parts from a diffusers folder, one of our checkpoints, or an original single file: float32, or each network
    read straight into its dtype in `dtypes` (by part name) from a diffusers folder or a single file.

    What was read (for a single file: the family and how it was told) is logged, after `where`. The tensors of a
    single file that no part holds are kept with the parts unless `keep_extras` is False; a single file's text
    encoders may come from `part_files` (`load_single_file`)."""
    src = Path(src)
    kind = detect(src)
    if kind is Format.DIFFUSERS:
        if ema or family:
            raise ValueError(f"{src}: a diffusers folder holds one set of weights; drop --ema / --family")
        try:
            parts = build_parts(pretrained=str(src), key=where, dtypes=dtypes)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        return attach(parts, read_extras(src) if keep_extras else None)
    if kind in CHECKPOINT_FOLDERS:
        log.info("%s: %s: %s", where, src, kind.value)
        return parts_from_checkpoint(load_checkpoint(src), ema)
    if kind is not Format.FILE:
        raise FileNotFoundError(f"no such file or folder: {src}" if kind is Format.MISSING else f"{src}: {kind.value}")
    loaded = ()
    if src.suffix in PICKLE_SUFFIXES:
        obj = load_pickle(src, trust_pickle)
        if is_our_checkpoint(obj):
            if family:
                raise ValueError(f"{src}: an ldm checkpoint knows its model; the family setting is for single files")
            log.info("%s: %s: an ldm checkpoint (step %s)", where, src, obj.get("global_step"))
            return parts_from_checkpoint(obj, ema)
        loaded = split_pickle(obj, src)
    parts, line = load_single_file(src, ema, family, loaded=loaded, dtypes=dtypes, keep_extras=keep_extras,
                                   part_files=part_files)  # fmt: skip
    log.info("%s: %s", where, line)
    return parts


def load_pretrained(
    pretrained: str | None = None,
    key: str = "model.params",
    pretrained_ema: bool = False,
    pretrained_family: str | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
    keep_extras: bool = True,
    part_weights: Mapping[str, str | Path] | None = None,
    **specs: Any,
) -> Parts:
    """Every part, as a config describes it: a module passes through, a spec is built, and a missing one
    comes from `pretrained`, in any format `read_parts` reads; `pretrained_ema` and `pretrained_family`
    apply to single files and our checkpoints. Networks are read or built in their dtype in `dtypes`.
    `part_weights` are files of one part's weights each (`{key}.part_weights`), loaded over the part; a single
    file's text encoders are read with it, straight into their dtypes (its files may lack them)."""
    part_weights = dict(part_weights or {})
    single = pretrained is not None and detect(pretrained) is Format.FILE
    taken = {name: path for name, path in part_weights.items() if single and name.startswith("text_encoder")}
    parts = _load_pretrained(pretrained, key, pretrained_ema, pretrained_family, dtypes, keep_extras, taken, specs)
    for name, path in part_weights.items():
        if name not in taken:
            if name not in parts.networks:
                raise ConfigError(f"{key}.part_weights.{name}: these weights have no {name}")
            load_part_weights(parts[name], Path(path).expanduser(), f"{key}.part_weights.{name}")
    return parts


def _load_pretrained(
    pretrained: str | None,
    key: str,
    pretrained_ema: bool,
    pretrained_family: str | None,
    dtypes: Mapping[str, torch.dtype] | None,
    keep_extras: bool,
    part_files: Mapping[str, str | Path],
    specs: dict,
) -> Parts:
    if pretrained is None or detect(pretrained) not in CHECKPOINTS:
        if pretrained_ema or pretrained_family:
            option = "pretrained_ema" if pretrained_ema else "pretrained_family"
            raise ConfigError(
                f"{key}.{option}: applies to a single-file {key}.pretrained (.safetensors / .ckpt), not a folder"
            )
        return build_parts(pretrained, key, dtypes=dtypes, **specs)
    try:
        parts = read_parts(
            Path(pretrained).expanduser(),
            pretrained_ema,
            pretrained_family,
            where=f"{key}.pretrained",
            dtypes=dtypes,
            keep_extras=keep_extras,
            part_files=part_files,
        )
    except ValueError as err:
        raise ConfigError(f"{key}.pretrained: {err}") from None
    return build_parts(pretrained, key, base=parts, dtypes=dtypes, **specs)


def load_part_weights(module: torch.nn.Module, path: Path, key: str) -> None:
    """Load a file of one part's weights, in diffusers / transformers names, strictly into `module`."""
    try:
        state, _, _ = read_single_file(path)  # .safetensors, or a pickle read without running code from it
    except (FileNotFoundError, ValueError) as err:
        raise ConfigError(f"{key}: {err}") from None
    state = as_module_names(state, module)
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        problem = f"no {missing[0]}" if missing else f"an unknown {unexpected[0]}"
        raise ConfigError(
            f"{key}: {path} does not fit the part's config: {len(missing)} weights missing, {len(unexpected)} "
            f"unknown (first: {problem}); is it the weights of this part, in diffusers names?"
        )
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ConfigError(
                f"{key}: {path} does not fit the part's config: {name} is {list(tensor.shape)} in the file but "
                f"{list(own[name].shape)} by the config; make the config describe these weights"
            )
    module.load_state_dict(state)


def scheduler_class(pretrained: str | Path | None) -> str | None:
    """The class name of the scheduler the weights at `pretrained` come with, read without loading a network: a
    diffusers folder's, or a `.safetensors` single file's (its ldm metadata, else its family's); None where that
    cannot be told so (a `.ckpt`, one of our checkpoints, an unreadable file: reading it says why)."""
    if pretrained is None:
        return None
    path = Path(pretrained).expanduser()
    kind = detect(path)
    if kind is Format.DIFFUSERS:
        config = path / "scheduler" / "scheduler_config.json"
        return json.loads(config.read_text()).get("_class_name") if config.is_file() else None
    if kind is not Format.FILE or path.suffix != ".safetensors":
        return None
    try:
        state, metadata, _ = read_single_file(path)
        if metadata.get("parts", {}).get("scheduler"):
            return str(metadata["parts"]["scheduler"]["class"]).rpartition(".")[2]
        family, _ = detect_family(state, metadata, where=str(path))
    except ValueError:
        return None
    if family is None:
        return None
    return json.loads((family.folder / "scheduler" / "scheduler_config.json").read_text()).get("_class_name")


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
    for name, module in parts.networks.items():
        module.load_state_dict(as_module_names(_part_state(state, name), module), assign=True)
        parts[name] = module.float().eval()  # parts trained or frozen in half precision come back as fp32
    return parts


def with_base_extras(parts: Parts, ckpt: dict) -> Parts:
    """`parts` rebuilt from `ckpt`, with the extras of the model its run started from (`model.params.pretrained`:
    an original single file, or a diffusers folder that carries them), for a single file exported from a fine-tune.

    The base's EMA copy comes back only if the UNet was not trained. Where the base cannot be read again (moved,
    or now another model), the export goes on without extras, which no reader needs, and the log says why."""
    params = (ckpt["ldm"].get("config") or {}).get("model", {}).get("params", {})
    if not params.get("pretrained"):
        return parts
    base = Path(str(params["pretrained"])).expanduser()
    kind = detect(base)
    try:
        if kind is Format.DIFFUSERS:
            extras = read_extras(base)
        elif kind is Format.FILE:
            extras = extras_from_file(base, parts, bool(params.get("pretrained_ema")))
            if extras is None:
                log.info("%s: not an original single file of this architecture; exporting without its extras", base)
        else:
            log.info("%s (model.params.pretrained): %s; exporting without its extras", base, kind.value)
            return parts
    except ValueError as err:
        log.info("model.params.pretrained: %s; exporting without its extras", err)
        return parts
    return attach(parts, extras)


def _part_state(state: dict, name: str) -> dict:
    prefix = f"{name}."
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _parts_with_lora(ckpt: dict, state: dict, merge: bool) -> Parts:
    params = (ckpt["ldm"].get("config") or {}).get("model", {}).get("params", {})
    base = {
        k: v
        for k, v in params.items()
        if k in ("pretrained", "pretrained_ema", "pretrained_family", "part_weights", *PART_NAMES, *OPTIONAL_PARTS)
    }
    try:
        parts = load_pretrained(**base)
    except ConfigError as err:
        raise ValueError(f"a LoRA checkpoint needs its base weights, as trained: {err}") from None
    lora = ckpt["ldm"]["lora"]
    add_lora(parts, tuple(lora["trainable"]), lora["spec"])
    for name in lora["trainable"]:
        module = parts[name]
        adapters = as_module_names({k: v for k, v in _part_state(state, name).items() if is_lora_key(k)}, module)
        missing = [k for k in module.load_state_dict(adapters, strict=False).missing_keys if is_lora_key(k)]
        if missing:
            raise ValueError(f"LoRA checkpoint: no weights for {name}.{missing[0]} (and {len(missing) - 1} more)")
        module.float().eval()
        if merge:
            parts[name] = merged(module)
    return parts
