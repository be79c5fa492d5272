"""The original Stable Diffusion key layout (CompVis / Stability), generated from each part's config.

Each map goes diffusers name -> original name; readers invert it, so the two directions cannot
drift apart. OpenCLIP (SD 2.x, SDXL's second text encoder) fuses q/k/v into one tensor: such keys map to
(name, slot); its `text_projection` is the transpose of the diffusers weight (slot `TRANSPOSED`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ldm.components import Parts
from ldm.weights.text_model import without_prefix

UNET, VAE = "model.diffusion_model.", "first_stage_model."
CLIP, OPEN_CLIP = "cond_stage_model.transformer.text_model.", "cond_stage_model.model."
SDXL_CLIP, SDXL_OPEN_CLIP = "conditioner.embedders.0.transformer.text_model.", "conditioner.embedders.1.model."
# Each text layout's text encoders: (part, prefix of its keys in the original file, CLIP or OpenCLIP names).
TEXT_LAYOUTS = {
    "clip": (("text_encoder", CLIP, "clip"),),
    "open_clip": (("text_encoder", OPEN_CLIP, "open_clip"),),
    "sdxl": (("text_encoder", SDXL_CLIP, "clip"), ("text_encoder_2", SDXL_OPEN_CLIP, "open_clip")),
}
TRANSPOSED = -1  # the slot of a weight the original file holds transposed
EMA = "model_ema."  # the UNet's EMA copy, one flat name per weight, beside the raw weights in full checkpoints


class SingleFileError(ValueError):
    """A single file that cannot be read as a Stable Diffusion checkpoint; the message says why and what to do."""


_UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0",  # SDXL's pooled text and size ids
    "add_embedding.linear_2": "label_emb.0.2",
}
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_ATTENTION = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPEN_CLIP_TOP = {
    "embeddings.token_embedding.weight": "token_embedding.weight",
    "embeddings.position_embedding.weight": "positional_embedding",
    "final_layer_norm.weight": "ln_final.weight",
    "final_layer_norm.bias": "ln_final.bias",
}
_OPEN_CLIP_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}
_QKV = ("q_proj", "k_proj", "v_proj")


def _rename(rest: str, table: dict[str, str]) -> str:
    for old, new in table.items():
        if rest.startswith(old + "."):
            return new + rest[len(old) :]
    raise KeyError(rest)


def _unet_name(key: str, config: dict) -> str:
    layers = config["layers_per_block"]
    if not isinstance(layers, int):
        raise SingleFileError(
            f"unet layers_per_block {layers!r}: only one count for every block has an original layout"
        )
    if any(key.startswith(top + ".") for top in _UNET_TOP):
        return _rename(key, _UNET_TOP)
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key):
        kind, j, rest = m[1], int(m[2]), m[3]
        return f"middle_block.{2 * j}.{_rename(rest, _UNET_RESNET)}" if kind == "resnets" else f"middle_block.1.{rest}"
    m = re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|attentions|downsamplers|upsamplers)\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(key)
    side, i, kind, j, rest = m[1], int(m[2]), m[3], int(m[4]), m[5]
    if side == "down":
        if kind == "downsamplers":
            return f"input_blocks.{(i + 1) * (layers + 1)}.0.op.{rest.removeprefix('conv.')}"
        block = f"input_blocks.{i * (layers + 1) + j + 1}"
    else:  # up blocks have one more layer each; an upsampler follows its block's last resnet (and attention)
        if kind == "upsamplers":
            has_attention = "CrossAttn" in config["up_block_types"][i]
            return f"output_blocks.{i * (layers + 1) + layers}.{2 if has_attention else 1}.{rest}"
        block = f"output_blocks.{i * (layers + 1) + j}"
    return f"{block}.0.{_rename(rest, _UNET_RESNET)}" if kind == "resnets" else f"{block}.1.{rest}"


def _vae_name(key: str, config: dict) -> str:
    blocks = len(config["block_out_channels"])
    side, _, rest = key.partition(".")
    if side not in ("encoder", "decoder"):
        return key  # quant_conv, post_quant_conv
    if rest.startswith("conv_norm_out."):
        return f"{side}.norm_out.{rest.removeprefix('conv_norm_out.')}"
    if m := re.fullmatch(r"mid_block\.resnets\.(\d+)\.(.+)", rest):
        return f"{side}.mid.block_{int(m[1]) + 1}.{m[2]}"
    if m := re.fullmatch(r"mid_block\.attentions\.0\.(.+)", rest):
        return f"{side}.mid.attn_1.{_rename(m[1], _VAE_ATTENTION)}"
    if m := re.fullmatch(r"(down|up)_blocks\.(\d+)\.(resnets|downsamplers|upsamplers)\.(\d+)\.(.+)", rest):
        level = int(m[2]) if m[1] == "down" else blocks - 1 - int(m[2])  # the original decoder counts upwards
        stage = "down" if m[1] == "down" else "up"
        if m[3] == "resnets":
            inner = m[5].replace("conv_shortcut.", "nin_shortcut.")
            return f"{side}.{stage}.{level}.block.{m[4]}.{inner}"
        return f"{side}.{stage}.{level}.{'downsample' if stage == 'down' else 'upsample'}.{m[5]}"
    if rest.split(".")[0] in ("conv_in", "conv_out"):
        return key
    raise KeyError(key)


def _open_clip_name(key: str) -> tuple[str, int | None]:
    if key in _OPEN_CLIP_TOP:
        return _OPEN_CLIP_TOP[key], None
    if key == "text_projection.weight":  # OpenCLIP projects with x @ P; a Linear's weight is P transposed
        return "text_projection", TRANSPOSED
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(key)
    layer, rest = f"transformer.resblocks.{m[1]}", m[2]
    if qkv := re.fullmatch(r"self_attn\.([qkv]_proj)\.(weight|bias)", rest):
        return f"{layer}.attn.in_proj_{qkv[2]}", _QKV.index(qkv[1])
    return f"{layer}.{_rename(rest, _OPEN_CLIP_LAYER)}", None


def original_names(parts: Parts, text_layout: str) -> dict[str, tuple[str, int | None]]:
    """Our state-dict key (`unet.…`, `vae.…`, `text_encoder.…`, `text_encoder_2.…`) -> (original key, q/k/v
    slot, `TRANSPOSED` or None)."""
    names: dict[str, tuple[str, int | None]] = {}
    for part, prefix, rename in (("unet", UNET, _unet_name), ("vae", VAE, _vae_name)):
        module = getattr(parts, part)
        config = dict(module.config)
        for key in module.state_dict():
            try:
                names[f"{part}.{key}"] = (prefix + rename(key, config), None)
            except KeyError:
                raise SingleFileError(f"{part} weight {key!r} has no place in the original layout") from None
    for part, prefix, kind in TEXT_LAYOUTS[text_layout]:
        if part not in parts:
            raise SingleFileError(f"the {text_layout} layout has a {part}, which these parts lack")
        for key in parts[part].state_dict():
            plain = without_prefix(key)
            try:
                name, slot = (plain, None) if kind == "clip" else _open_clip_name(plain)
            except KeyError:
                raise SingleFileError(f"{part} weight {key!r} has no place in the OpenCLIP layout") from None
            names[f"{part}.{key}"] = (prefix + name, slot)
    return names


def ema_name(original: str) -> str:
    """Where an original file keeps the EMA copy of UNet weight `original`: `model_ema.` and its path without dots."""
    return EMA + "".join(original[len("model.") :].split("."))


def text_layout_of(keys: Iterable[str]) -> str:
    """The text encoder layout of an original state dict's keys: "sdxl", "open_clip" (SD 2.x) or "clip"."""
    keys = list(keys)
    if any(k.startswith(SDXL_OPEN_CLIP) for k in keys):
        return "sdxl"
    return "open_clip" if any(k.startswith(OPEN_CLIP) for k in keys) else "clip"


def is_vae_attention_weight(original: str) -> bool:
    return original.startswith(VAE) and re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", original) is not None
