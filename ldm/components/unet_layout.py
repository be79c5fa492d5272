"""A diffusers UNet's weights by their names in the original (CompVis / Stability) layout, from its config.

The single files of every UNet family name the UNet this way (`input_blocks.4.1.transformer_blocks.0.attn1.to_q`
for diffusers' `down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`), and so do the kohya LoRA files of
families whose `Architecture.kohya_original_unet` says so (`ldm.families`).
"""

from __future__ import annotations

import re

UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
    "add_embedding.linear_1": "label_emb.0.0",  # the added conditioning (pooled text, size ids)
    "add_embedding.linear_2": "label_emb.0.2",
}
UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}


def rename(rest: str, table: dict[str, str]) -> str:
    """`rest` with its leading module path renamed by `table` (old path -> new); KeyError where none matches."""
    for old, new in table.items():
        if rest.startswith(old + "."):
            return new + rest[len(old) :]
    raise KeyError(rest)


def original_unet_name(key: str, config: dict) -> str:
    """The original name of a diffusers UNet weight (or module path) `key`; KeyError where it has none."""
    layers = config["layers_per_block"]
    if not isinstance(layers, int):
        raise ValueError(f"unet layers_per_block {layers!r}: only one count for every block has an original layout")
    if any(key.startswith(top + ".") for top in UNET_TOP):
        return rename(key, UNET_TOP)
    if m := re.fullmatch(r"mid_block\.(resnets|attentions)\.(\d+)\.(.+)", key):
        kind, j, rest = m[1], int(m[2]), m[3]
        return f"middle_block.{2 * j}.{rename(rest, UNET_RESNET)}" if kind == "resnets" else f"middle_block.1.{rest}"
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
    return f"{block}.0.{rename(rest, UNET_RESNET)}" if kind == "resnets" else f"{block}.1.{rest}"
