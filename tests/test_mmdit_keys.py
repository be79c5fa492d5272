"""The SD3 / SD3.5 single-file key map (`ldm.families.mmdit_keys`), checked against diffusers' own reader of such
files, `convert_sd3_transformer_checkpoint_to_diffusers`: what our map writes, it reads back bit for bit."""

import inspect
import json
import re

import pytest
import torch
from diffusers import SD3Transformer2DModel
from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

from ldm.families import CONFIGS, UNET
from ldm.families.mmdit_keys import QKV_SLOTS, SWAPPED, mmdit_module_name, mmdit_name

pytestmark = pytest.mark.skipif(
    "dual_attention_layers" not in inspect.signature(SD3Transformer2DModel.__init__).parameters,
    reason="this diffusers predates SD3.5's layers (MMDiT-X, QK-norm): the Colossal-AI stack's 0.29 does",
)
TINY = {"sample_size": 8, "patch_size": 2, "in_channels": 4, "out_channels": 4, "attention_head_dim": 8}
TINY |= {"num_attention_heads": 2, "joint_attention_dim": 12, "caption_projection_dim": 16}
TINY |= {"pooled_projection_dim": 8, "pos_embed_max_size": 8, "num_layers": 3}
SHAPES = {
    "sd35-medium": {"dual_attention_layers": (0, 1), "qk_norm": "rms_norm"},
    "sd35-large": {"dual_attention_layers": (), "qk_norm": "rms_norm"},
    "sd3-medium": {"dual_attention_layers": (), "qk_norm": None},  # SD3 (3.0) Medium: neither
}
ORIGINAL_KEYS = {"sd35-medium": 665, "sd35-large": 923}  # the real files' MMDiT tensors


def _places(keys, config: dict) -> dict[str, dict[int | None, str]]:
    """Original key -> {slot: diffusers key}, checking that the map is one-to-one and each fused tensor whole."""
    places: dict[str, dict[int | None, str]] = {}
    for key in keys:
        name, slot = mmdit_name(key, config)
        assert slot not in places.setdefault(name, {}), f"{key} and {places[name][slot]} both go to {name}"
        places[name][slot] = key
    for name, slots in places.items():
        assert len(slots) == 1 or sorted(slots) == list(QKV_SLOTS), (name, slots)
    return places


def _original(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """The single file's MMDiT tensors for diffusers' `state`, as our map places them."""
    original = {}
    for name, slots in _places(state, config).items():
        if slots.keys() == {SWAPPED}:
            scale, shift = state[slots[SWAPPED]].chunk(2, dim=0)
            tensor = torch.cat([shift, scale])
        elif slots.keys() == {None}:
            tensor = state[slots[None]]
        else:
            shapes = {state[slots[s]].shape for s in QKV_SLOTS}
            assert len(shapes) == 1, f"{name}'s q, k and v differ in shape: {shapes}"
            tensor = torch.cat([state[slots[s]] for s in QKV_SLOTS])
        original[UNET + name] = tensor
    return original


def _converted(original: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """diffusers' reading of `original`, checking that it used every tensor (it pops what it reads)."""
    left = dict(original)
    converted = convert_sd3_transformer_checkpoint_to_diffusers(left)
    assert not left, f"diffusers left {sorted(left)} unread"
    return converted


@pytest.mark.parametrize("shape", SHAPES)
def test_diffusers_reads_back_what_the_map_writes(shape):
    torch.manual_seed(0)
    model = SD3Transformer2DModel(**TINY, **SHAPES[shape])
    for tensor in model.state_dict().values():
        tensor.copy_(torch.randn_like(tensor))  # norms start at ones, zero-init layers at zeros: make all distinct
    state = model.state_dict()
    converted = _converted(_original(state, dict(model.config)))
    assert converted.keys() == state.keys()
    assert all(torch.equal(converted[k], state[k]) for k in state)


@pytest.mark.parametrize("family", ORIGINAL_KEYS)
def test_every_real_size_weight_has_one_place(family):
    config = json.loads((CONFIGS / family / "unet" / "config.json").read_text())
    with torch.device("meta"):
        model = SD3Transformer2DModel.from_config(config)
    state = model.state_dict()
    original = _original(state, dict(model.config))
    assert len(original) == ORIGINAL_KEYS[family]
    converted = _converted(original)  # on meta tensors: shapes only
    assert {k: v.shape for k, v in converted.items()} == {k: v.shape for k, v in state.items()}


def test_modules_map_as_their_weights():
    """A LoRA target's module path maps where its weights do, slot included."""
    model = SD3Transformer2DModel(**TINY, **SHAPES["sd35-medium"])
    config = dict(model.config)
    assert mmdit_module_name("transformer_blocks.0.attn.to_q", config) == ("joint_blocks.0.x_block.attn.qkv", 0)
    assert mmdit_module_name("transformer_blocks.2.norm1_context.linear", config)[1] == SWAPPED
    assert mmdit_module_name("transformer_blocks.1.norm1_context.linear", config)[1] is None
    for path, module in model.named_modules():
        for parameter, _ in module.named_parameters(recurse=False):
            name, slot = mmdit_module_name(path, config)
            assert mmdit_name(f"{path}.{parameter}", config) == (f"{name}.{parameter}", slot)


@pytest.mark.parametrize(
    "key",
    [
        "transformer_blocks.0.attn.nope.weight",
        "transformer_blocks.3.attn.to_q.weight",  # past the last layer
        "transformer_blocks.2.attn2.to_q.weight",  # not a dual-attention layer
        "transformer_blocks.2.attn.to_add_out.weight",  # the last block's caption stream ends at its q, k, v
        "transformer_blocks.2.ff_context.net.2.bias",
        "transformer_blocks.0.attn.to_q.scale",
        "transformer_blocks.0.attn",
        "pos_embed",
        "x_embedder.proj.weight",  # already original
    ],
)
def test_a_key_without_a_place_is_named(key):
    config = {**TINY, **SHAPES["sd35-medium"]}
    with pytest.raises(KeyError, match=re.escape(repr(key))):
        mmdit_name(key, config)


def test_qk_norms_need_qk_norm():
    config = {**TINY, **SHAPES["sd3-medium"]}
    with pytest.raises(KeyError, match="norm_added_q"):
        mmdit_name("transformer_blocks.0.attn.norm_added_q.weight", config)
    with pytest.raises(KeyError, match=re.escape("'transformer_blocks.0.attn'")):
        mmdit_module_name("transformer_blocks.0.attn", config)
