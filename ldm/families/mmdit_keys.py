"""Where each weight of diffusers' `SD3Transformer2DModel` lies in a Stable Diffusion 3 / 3.5 single file.

Such a file (`sd3.5_medium.safetensors`, as ComfyUI and sd-scripts read it) holds the MMDiT under
`model.diffusion_model.` with the names of Stability's `mmditx.py`: `joint_blocks.N.x_block` (image stream) and
`joint_blocks.N.context_block` (caption stream) where diffusers has `transformer_blocks.N`. The map goes diffusers
name -> original name, generated from the transformer's config; a reader inverts it, so the two directions cannot
drift apart. Two kinds of weight are not copied as they are:

- the original fuses each attention's q, k and v projections into one `qkv` tensor, stacked along dim 0 in that
  order: a diffusers projection maps to (the fused name, its slot in `QKV_SLOTS`);
- the final layer's modulation, and the last block's caption-stream one (its context block is `pre_only`), give
  (shift, scale) in the original and (scale, shift) in diffusers' `AdaLayerNormContinuous`: such a weight maps to
  (name, `SWAPPED`), the original tensor being diffusers' with its two halves along dim 0 exchanged.

Checked against diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`, which reads such a file, and
ComfyUI's `comfy/utils.py` `mmdit_to_diffusers`; `tests/test_mmdit_keys.py` feeds the former what this map writes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ldm.families.base import SWAPPED

QKV_SLOTS = (0, 1, 2)  # a slot n in 0..2: the tensor is the n-th third (dim 0) of the fused original q/k/v tensor

_POS_EMBED = ("pos_embed.pos_embed", "pos_embed")  # a buffer, not a module's parameter
_TOP: dict[str, tuple[str, int | None]] = {
    "pos_embed.proj": ("x_embedder.proj", None),
    "time_text_embed.timestep_embedder.linear_1": ("t_embedder.mlp.0", None),
    "time_text_embed.timestep_embedder.linear_2": ("t_embedder.mlp.2", None),
    "time_text_embed.text_embedder.linear_1": ("y_embedder.mlp.0", None),
    "time_text_embed.text_embedder.linear_2": ("y_embedder.mlp.2", None),
    "context_embedder": ("context_embedder", None),
    "proj_out": ("final_layer.linear", None),
    "norm_out.linear": ("final_layer.adaLN_modulation.1", SWAPPED),
}
_FUSED = {  # diffusers' q, k and v projections -> the original fused one, in a joint block
    ("attn.to_q", "attn.to_k", "attn.to_v"): "x_block.attn.qkv",
    ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"): "context_block.attn.qkv",
    ("attn2.to_q", "attn2.to_k", "attn2.to_v"): "x_block.attn2.qkv",
}
_QK_NORMS = {  # present where the config's qk_norm is set
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
}
_CONTEXT_OUT = {  # absent from the last block, whose caption stream ends after its attention's q, k and v
    "attn.to_add_out": "context_block.attn.proj",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
_BLOCK: dict[str, tuple[str, int | None]] = {
    **{name: (fused, slot) for names, fused in _FUSED.items() for slot, name in zip(QKV_SLOTS, names)},
    **{name: (original, None) for name, original in {**_QK_NORMS, **_CONTEXT_OUT}.items()},
    "attn.to_out.0": ("x_block.attn.proj", None),
    "attn2.to_out.0": ("x_block.attn2.proj", None),
    "norm1.linear": ("x_block.adaLN_modulation.1", None),
    "norm1_context.linear": ("context_block.adaLN_modulation.1", None),
    "ff.net.0.proj": ("x_block.mlp.fc1", None),
    "ff.net.2": ("x_block.mlp.fc2", None),
}
_PARAMETERS = ("weight", "bias")


def _layers(config: Mapping[str, Any]) -> int:
    if "num_layers" not in config:
        raise ValueError(
            f"the transformer config has no num_layers (keys: {', '.join(config)}): pass the config of "
            "an SD3Transformer2DModel"
        )
    return int(config["num_layers"])


def mmdit_module_name(path: str, config: Mapping[str, Any]) -> tuple[str, int | None]:
    """diffusers `SD3Transformer2DModel` module path (a Linear or norm with weights; a LoRA target) -> (original
    module path without `model.diffusion_model.`, slot: one of `QKV_SLOTS`, `SWAPPED` or None), for a transformer
    of `config`. Raises KeyError(path) for a path such a transformer lacks or the original has no module for."""
    if path in _TOP:
        return _TOP[path]
    m = re.fullmatch(r"transformer_blocks\.(\d+)\.(.+)", path)
    if not m or m[2] not in _BLOCK:
        raise KeyError(path)
    layer, rest = int(m[1]), m[2]
    last = _layers(config) - 1
    if (
        layer > last
        or (rest.startswith("attn2.") and layer not in set(config.get("dual_attention_layers") or ()))
        or (rest in _QK_NORMS and not config.get("qk_norm"))
        or (rest in _CONTEXT_OUT and layer == last)
    ):
        raise KeyError(path)
    name, slot = _BLOCK[rest]
    if rest == "norm1_context.linear" and layer == last:
        slot = SWAPPED
    return f"joint_blocks.{layer}.{name}", slot


def mmdit_name(key: str, config: Mapping[str, Any]) -> tuple[str, int | None]:
    """diffusers `SD3Transformer2DModel` state-dict key -> (original key WITHOUT the `model.diffusion_model.`
    prefix, slot: one of `QKV_SLOTS`, `SWAPPED` or None), for a transformer of `config` (its `config` as a dict).
    Raises KeyError(key) for a key such a transformer lacks or the original has no place for."""
    if key == _POS_EMBED[0]:
        return _POS_EMBED[1], None
    module, _, parameter = key.rpartition(".")
    if parameter not in _PARAMETERS:
        raise KeyError(key)
    try:
        name, slot = mmdit_module_name(module, config)
    except KeyError:
        raise KeyError(key) from None
    return f"{name}.{parameter}", slot
