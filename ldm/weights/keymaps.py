"""The original key layout of single files (CompVis / Stability), generated from each part's config.

Each map goes diffusers name -> original name; readers invert it, so the two directions cannot drift apart.
The denoiser is under `UNET` (a UNet by its original names, else as its family's `FileLayout` names it), the VAE
under `VAE`; where each text encoder is, and whether it has OpenAI CLIP's names, OpenCLIP's or transformers', the
`FileLayout` says (`ldm.families`). OpenCLIP fuses q/k/v into one tensor:
such keys map to (name, slot); its `text_projection` is the transpose of the diffusers weight (slot
`TRANSPOSED`).
"""

from __future__ import annotations

import re
from typing import Any

from ldm.components import Parts
from ldm.components.unet_layout import original_unet_name, rename
from ldm.families import UNET, VAE, SingleFileError
from ldm.weights.text_model import without_prefix

TRANSPOSED = -1  # the slot of a weight the original file holds transposed
EMA = "model_ema."  # the UNet's EMA copy, one flat name per weight, beside the raw weights in full checkpoints


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
        return f"{side}.mid.attn_1.{rename(m[1], _VAE_ATTENTION)}"
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
    return f"{layer}.{rename(rest, _OPEN_CLIP_LAYER)}", None


def original_names(parts: Parts, layout: Any) -> dict[str, tuple[str, int | None]]:
    """Our state-dict key (`unet.…`, `vae.…`, `text_encoder.…`, `text_encoder_2.…`) -> (original key, q/k/v
    slot, `TRANSPOSED` or None), for a file of `layout` (an `ldm.families.FileLayout`)."""
    names: dict[str, tuple[str, int | None]] = {}
    denoiser = layout.denoiser or (lambda key, config: (original_unet_name(key, config), None))
    for part, prefix, to_original in (("unet", UNET, denoiser), ("vae", VAE, lambda k, c: (_vae_name(k, c), None))):
        module = getattr(parts, part)
        config = dict(module.config)
        for key in module.state_dict():
            try:
                name, slot = to_original(key, config)
                names[f"{part}.{key}"] = (prefix + name, slot)
            except KeyError:
                raise SingleFileError(f"{part} weight {key!r} has no place in the original layout") from None
            except ValueError as err:
                raise SingleFileError(str(err)) from None
    for part, prefix, kind in layout.text:
        if part not in parts:
            raise SingleFileError(f"the {layout.name} layout has a {part}, which these parts lack")
        for key in parts[part].state_dict():
            if f"{part}.{key}" in layout.implied:
                continue
            plain = without_prefix(key)
            try:
                if kind == "open_clip":
                    name, slot = _open_clip_name(plain)
                else:  # transformers' names: CLIP's without its `text_model.` level, or as they are
                    name, slot = (plain if kind == "clip" else tied_name(key)), None
            except KeyError:
                raise SingleFileError(f"{part} weight {key!r} has no place in the OpenCLIP layout") from None
            names[f"{part}.{key}"] = (prefix + name, slot)
    return names


def tied_name(key: str) -> str:
    """A T5 encoder's token embedding is one tensor under two names (`shared`, `encoder.embed_tokens`): files hold
    it once, as `shared.weight`."""
    return "shared.weight" if key == "encoder.embed_tokens.weight" else key


def ema_name(original: str) -> str:
    """Where an original file keeps the EMA copy of UNet weight `original`: `model_ema.` and its path without dots."""
    return EMA + "".join(original[len("model.") :].split("."))


def is_vae_attention_weight(original: str) -> bool:
    return original.startswith(VAE) and re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", original) is not None
