"""The parts of a CompVis config (`unet_config`, `first_stage_config`, `cond_stage_config`) as our part specs.

Architectures are read with diffusers' own converters (`create_unet_diffusers_config_from_ldm`,
`create_vae_diffusers_config_from_ldm`). A part's weights come from the config's `model.params.ckpt`
(then the declared architecture is checked against them), from a diffusers file of that part
(`from_pretrained`), or, for the text encoder, from a local folder (`version`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ldm.config import ConfigError, Problems
from ldm.families import COMPVIS_TEXT_ENCODERS as TEXT_ENCODERS

UNETS = ("ldm.modules.diffusionmodules.openaimodel.UNetModel",)
VAES = ("ldm.models.autoencoder.AutoencoderKL",)
UNET_IGNORED = {
    "image_size": "unused by Stable Diffusion's UNet",
    "use_fp16": "precision is lightning.trainer.precision",
    "use_bf16": "precision is lightning.trainer.precision",
    "use_spatial_transformer": "always a spatial transformer",
    "legacy": "heads follow num_heads / num_head_channels",
    "use_checkpoint": "read as model.params.gradient_checkpointing",
}
UNET_KEYS = {
    *UNET_IGNORED,
    *("in_channels", "out_channels", "model_channels", "attention_resolutions", "num_res_blocks"),
    *("channel_mult", "num_heads", "num_head_channels", "transformer_depth", "context_dim"),
    *("use_linear_in_transformer", "from_pretrained", "dropout"),
}
VAE_KEYS = {"embed_dim", "monitor", "ddconfig", "lossconfig", "from_pretrained", "image_key"}


def node_params(node: Any, key: str) -> tuple[Any, dict, str]:
    """A CompVis sub-config's target, params, and the key path of its params, in either form the Colossal-AI
    example has shipped: `{target, params: {...}}`, or the settings held directly (`{warm_up_steps: ..., ...}`)."""
    if node is None:
        return None, {}, f"{key}.params"
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key}: must be a mapping of target and params (or of the settings themselves)")
    direct = [k for k in node if k not in ("target", "params")]
    if direct and node.get("params") is not None:
        raise ConfigError(
            f"{key}: holds settings both under params and directly ({direct[0]}); write them one way, "
            f"e.g. {key}.{direct[0]} or {key}.params.{direct[0]}"
        )
    if direct:
        return node.get("target"), {k: node[k] for k in direct}, key
    return node.get("target"), dict(node.get("params") or {}), f"{key}.params"


def translate_parts(params: dict, ours: dict, from_weights: bool, ignored: list[str]) -> None:
    """The UNet, VAE and text encoder of `unet_config`, `first_stage_config` and `cond_stage_config`."""
    from diffusers.loaders.single_file_utils import (
        create_unet_diffusers_config_from_ldm,
        create_vae_diffusers_config_from_ldm,
    )

    key = "model.params"
    problems = Problems()
    (unet, unet_key), (vae, vae_key) = _node(params, "unet_config", UNETS), _node(params, "first_stage_config", VAES)
    with problems.check():
        _check_keys(unet, UNET_KEYS, unet_key)
    with problems.check():
        _check_keys(vae, VAE_KEYS, vae_key)
    problems.raise_any()
    for k, reason in UNET_IGNORED.items():
        if k in unet:
            ignored.append(f"{unet_key}.{k} ({reason})")
    for k in ("monitor", "lossconfig", "image_key"):
        if k in vae:
            ignored.append(f"{vae_key}.{k} (the VAE is not trained here)")
    if unet.get("use_checkpoint"):
        ours.setdefault("gradient_checkpointing", True)
    ddconfig = dict(vae.get("ddconfig") or {})
    if vae and "embed_dim" in vae and vae["embed_dim"] != ddconfig.get("z_channels", vae["embed_dim"]):
        raise ConfigError(f"{vae_key}.embed_dim: differs from ddconfig.z_channels")
    original = {"model": {"params": {**params, "unet_config": {"params": unet}}}}
    original["model"]["params"]["first_stage_config"] = {"params": {"ddconfig": ddconfig or {"ch_mult": [1, 2, 4, 4]}}}
    declared = {}
    with problems.check():
        if unet:
            config = _converted(create_unet_diffusers_config_from_ldm, original, unet)
            declared["unet"] = (f"{key}.unet_config", unet_key, config)
    with problems.check():
        if ddconfig:
            config = _converted(create_vae_diffusers_config_from_ldm, original, ddconfig)
            declared["vae"] = (f"{key}.first_stage_config", vae_key, config)
    problems.raise_any()
    for name, (where, params_key, config) in declared.items():
        source = unet if name == "unet" else vae
        if source.get("from_pretrained"):
            if from_weights:
                raise ConfigError(f"{params_key}.from_pretrained and {key}.ckpt both give the {name}'s weights")
            ours.setdefault(name, {"config": config})
            ours.setdefault("part_weights", {})[name] = source["from_pretrained"]
        elif from_weights:
            shapes = {k: v for k, v in config.items() if k not in ("sample_size", "scaling_factor")}
            ours.setdefault("architecture", {})[name] = {"key": where, "config": shapes}
        else:
            ours.setdefault(name, {"config": config})
    _text_encoder(params.get("cond_stage_config"), ours, from_weights, ignored)


def _node(params: dict, name: str, targets: tuple[str, ...]) -> tuple[dict, str]:
    """A part's params and their key path; a target, if given, must be the CompVis class this part translates."""
    target, part, where = node_params(params.get(name), f"model.params.{name}")
    if target is not None and target not in targets:
        raise ConfigError(f"model.params.{name}.target: {target} has no equivalent here; valid: {', '.join(targets)}")
    return part, where


def _check_keys(params: dict, valid: set[str], key: str) -> None:
    problems = Problems()
    for k in params:
        if k not in valid:
            with problems.check():
                raise ConfigError(f"{key}.{k}: not a setting that translates here; valid: {', '.join(sorted(valid))}")
    problems.raise_any()


def _converted(convert: Any, original: dict, params: dict) -> dict:
    try:
        config = convert(original, {})
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as err:
        raise ConfigError(f"cannot read the architecture: {type(err).__name__} {err}") from None
    if "image_size" in params and convert.__name__.startswith("create_unet"):
        config["sample_size"] = params["image_size"]
    return {k: v for k, v in config.items() if v is not None or k == "cross_attention_dim"}


def _text_encoder(node: Any, ours: dict, from_weights: bool, ignored: list[str]) -> None:
    key = "model.params.cond_stage_config"
    if node is None:
        return
    if not isinstance(node, Mapping):
        raise ConfigError(f"{key}: got {node!r}; a text-to-image model needs a text encoder (target and params)")
    target, params, where = node_params(node, key)
    target = target or (
        "ldm.modules.encoders.modules.FrozenOpenCLIPEmbedder"
        if "layer" in params or "arch" in params
        else "ldm.modules.encoders.modules.FrozenCLIPEmbedder"
    )
    if target not in TEXT_ENCODERS:
        raise ConfigError(f"{key}.target: {target} has no equivalent here; valid: {', '.join(TEXT_ENCODERS)}")
    family, used = TEXT_ENCODERS[target]
    layer = params.pop("layer", "last")
    if layer != used:
        raise ConfigError(
            f"{where}.layer: {layer!r}; Stable Diffusion's text encoders here condition on "
            f"the {used} layer of {target.split('.')[-1]}"
        )
    max_length = int(params.pop("max_length", 77))
    weights, version = params.pop("from_pretrained", None), params.pop("version", None)
    for k in list(params):
        if k in ("freeze", "device", "use_fp16", "arch"):
            ignored.append(f"{where}.{k} (the text encoder follows model.params.trainable and the precision)")
            params.pop(k)
    if params:
        raise ConfigError(f"{where}.{sorted(params)[0]}: not a setting that translates here")
    tokenizer = {"config": {"vocab": "clip", "model_max_length": max_length, "pad_token": family.pad_token}}
    config = json.loads((family.network_folder / "text_encoder" / "config.json").read_text())
    if weights is not None:
        if from_weights:
            raise ConfigError(f"{where}.from_pretrained and model.params.ckpt both give the text encoder")
        ours.setdefault("text_encoder", {"config": config})
        ours.setdefault("part_weights", {})["text_encoder"] = weights
        ours.setdefault("tokenizer", tokenizer)
    elif version is not None and Path(str(version)).expanduser().is_dir() and not from_weights:
        folder = Path(str(version)).expanduser()
        root = folder / "text_encoder" if (folder / "text_encoder").is_dir() else folder
        ours.setdefault("text_encoder", {"pretrained": str(root)})
        tokenizers = [
            p
            for p in (folder / "tokenizer", folder)
            if (p / "vocab.json").is_file() or (p / "tokenizer.json").is_file()
        ]
        ours.setdefault("tokenizer", {"pretrained": str(tokenizers[0])} if tokenizers else tokenizer)
    elif not from_weights:
        raise ConfigError(
            f"{where}: the text encoder's weights come from local files only; set {where}.version to a "
            f"local folder of a CLIP text model (or a diffusers folder), {where}.from_pretrained to a weights "
            "file, or model.params.ckpt to a Stable Diffusion single file"
            + (f" ({version!r} is not a local folder)" if version else "")
        )
