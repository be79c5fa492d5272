"""Original Stable Diffusion single files (the CompVis / Stability key layout), to and from our parts.

A1111, ComfyUI and the original `ldm` code read one `.safetensors` / `.ckpt` holding the UNet under
`model.diffusion_model.`, the VAE under `first_stage_model.` and the text encoder under
`cond_stage_model.` (OpenAI CLIP for SD 1.x; OpenCLIP for SD 2.x, with fused q/k/v). Each part's key
map is generated from that part's own config, diffusers name -> original name; loading inverts it,
so the two directions cannot drift apart.

The model family decides the architecture configs (`configs/models/<family>/`), the tokenizer and
the prediction type: a file is never paired with a prediction type guessed in a config.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ldm.checkpoint import describe_parts, load_pickle, parts_from_description
from ldm.models.parts import Parts

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "models"
UNET, VAE = "model.diffusion_model.", "first_stage_model."
CLIP, OPEN_CLIP = "cond_stage_model.transformer.text_model.", "cond_stage_model.model."
EMA = "model_ema."
METADATA_KEY = "ldm"  # safetensors metadata / pickle entry: JSON with family, layout and part configs
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
# The global step of Stability's 512-base-ema.ckpt; diffusers keys SD 2 base off the same number.
SD2_BASE_GLOBAL_STEP = 875000


@dataclass(frozen=True)
class Family:
    """A released model family: its architecture configs, tokenizer and prediction type."""

    name: str
    title: str
    text_layout: str  # "clip" (OpenAI CLIP, SD 1.x) or "open_clip" (OpenCLIP ViT-H, SD 2.x)
    pad_token: str
    original_config: str  # the original inference YAML, in configs/models/original/

    @property
    def folder(self) -> Path:
        return CONFIGS / self.name

    @property
    def prediction_type(self) -> str:
        return json.loads((self.folder / "scheduler" / "scheduler_config.json").read_text())["prediction_type"]


FAMILIES = {
    f.name: f
    for f in (
        Family("sd15", "Stable Diffusion 1.x", "clip", "<|endoftext|>", "v1-inference.yaml"),
        Family("sd2-base", "Stable Diffusion 2.x 512-base", "open_clip", "!", "v2-inference.yaml"),
        Family("sd2-768-v", "Stable Diffusion 2.x 768-v", "open_clip", "!", "v2-inference-v.yaml"),
    )
}


class SingleFileError(ValueError):
    """A single file that cannot be read as a Stable Diffusion checkpoint; the message says why and what to do."""


# ---------------------------------------------------------------------------------------------- key maps

_UNET_TOP = {
    "time_embedding.linear_1": "time_embed.0",
    "time_embedding.linear_2": "time_embed.2",
    "conv_in": "input_blocks.0.0",
    "conv_norm_out": "out.0",
    "conv_out": "out.2",
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
    m = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", key)
    if not m:
        raise KeyError(key)
    layer, rest = f"transformer.resblocks.{m[1]}", m[2]
    if qkv := re.fullmatch(r"self_attn\.([qkv]_proj)\.(weight|bias)", rest):
        return f"{layer}.attn.in_proj_{qkv[2]}", _QKV.index(qkv[1])
    return f"{layer}.{_rename(rest, _OPEN_CLIP_LAYER)}", None


def original_names(parts: Parts, text_layout: str) -> dict[str, tuple[str, int | None]]:
    """Our state-dict key (`unet.…`, `vae.…`, `text_encoder.…`) -> (original key, q/k/v slot or None)."""
    names: dict[str, tuple[str, int | None]] = {}
    for part, prefix, rename in (("unet", UNET, _unet_name), ("vae", VAE, _vae_name)):
        module = getattr(parts, part)
        config = dict(module.config)
        for key in module.state_dict():
            try:
                names[f"{part}.{key}"] = (prefix + rename(key, config), None)
            except KeyError:
                raise SingleFileError(f"{part} weight {key!r} has no place in the original layout") from None
    for key in parts.text_encoder.state_dict():
        plain = key.removeprefix("text_model.")
        try:
            name, slot = (CLIP + plain, None) if text_layout == "clip" else _open_clip_name(plain)
        except KeyError:
            raise SingleFileError(f"text_encoder weight {key!r} has no place in the OpenCLIP layout") from None
        names[f"text_encoder.{key}"] = (name if text_layout == "clip" else OPEN_CLIP + name, slot)
    return names


def _is_vae_attention_weight(original: str) -> bool:
    return original.startswith(VAE) and re.search(r"\.mid\.attn_1\.(q|k|v|proj_out)\.weight$", original) is not None


# ---------------------------------------------------------------------------------------------- writing


def family_of(parts: Parts) -> Family | None:
    """The released family whose architecture and prediction type `parts` have, or None (a custom model)."""
    for family in FAMILIES.values():
        unet = json.loads((family.folder / "unet" / "config.json").read_text())
        text = json.loads((family.folder / "text_encoder" / "config.json").read_text())
        same_unet = all(_same(parts.unet.config.get(k), v) for k, v in unet.items() if not k.startswith("_"))
        same_text = all(
            getattr(parts.text_encoder.config, k) == text[k]
            for k in ("hidden_size", "num_hidden_layers", "intermediate_size")
        )
        prediction = parts.scheduler.config.get("prediction_type", "epsilon")
        if same_unet and same_text and prediction == family.prediction_type:
            return family
    return None


def _same(a: Any, b: Any) -> bool:
    return list(a) == list(b) if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) else a == b


def to_original(parts: Parts, text_layout: str, half: bool = False) -> dict[str, torch.Tensor]:
    """The parts' weights as one original-layout state dict (fp16 with `half`, else as they are)."""
    state = {
        f"{part}.{k}": v
        for part in ("unet", "vae", "text_encoder")
        for k, v in getattr(parts, part).state_dict().items()
    }
    out: dict[str, torch.Tensor] = {}
    fused: dict[str, list] = {}
    for ours, (original, slot) in original_names(parts, text_layout).items():
        tensor = state[ours].detach()
        if _is_vae_attention_weight(original) and tensor.dim() == 2:
            tensor = tensor[:, :, None, None]
        if slot is None:
            out[original] = tensor
        else:
            fused.setdefault(original, [None] * 3)[slot] = tensor
    out.update({k: torch.cat(chunks) for k, chunks in fused.items()})
    if text_layout == "open_clip":
        # OpenCLIP's output projection, unused by SD 2.x (it conditions on hidden states) and so absent
        # from CLIPTextModel; readers size the encoder from it, so it is written as the identity.
        width = parts.text_encoder.config.hidden_size
        out[OPEN_CLIP + "text_projection"] = torch.eye(width, dtype=out[OPEN_CLIP + "ln_final.weight"].dtype)
    dtype = torch.float16 if half else None
    return {k: v.to(dtype=dtype or v.dtype).contiguous() for k, v in out.items()}


def save_single_file(parts: Parts, path: str | Path, half: bool = False, text_layout: str | None = None) -> Path:
    """Write `parts` as an original Stable Diffusion single file: `.safetensors` (default) or `.ckpt`.

    The file carries our part configs as metadata, so it reads back exactly, architecture and all.
    """
    family = family_of(parts)
    layout = text_layout or (family.text_layout if family else "clip")
    state = to_original(parts, layout, half)
    meta = {
        "family": family.name if family else "custom",
        "text_layout": layout,
        "prediction_type": parts.scheduler.config.get("prediction_type", "epsilon"),
        "parts": describe_parts(parts),
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    if path.suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(state, str(partial), metadata={"format": "pt", METADATA_KEY: json.dumps(meta)})
    elif path.suffix in PICKLE_SUFFIXES:
        torch.save({"state_dict": state, METADATA_KEY: meta}, partial)
    else:
        raise SingleFileError(f"{path}: a single file ends in .safetensors (recommended) or .ckpt")
    partial.replace(path)
    return path


# ---------------------------------------------------------------------------------------------- reading


def read_single_file(path: str | Path, trust_pickle: bool = False) -> tuple[dict[str, torch.Tensor], dict, Any]:
    """(state dict, our metadata or {}, global_step or None) of a single file, without running code from it."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file, safe_open

        try:
            with safe_open(str(path), "pt") as handle:
                metadata = handle.metadata() or {}
            state = load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise SingleFileError(f"{path}: not a readable safetensors file ({err})") from None
        return state, json.loads(metadata.get(METADATA_KEY, "{}")), None
    if path.suffix not in PICKLE_SUFFIXES:
        raise SingleFileError(f"{path}: expected a .safetensors or .ckpt file")
    try:
        return split_pickle(load_pickle(path, trust_pickle), path)
    except ValueError as err:
        raise SingleFileError(str(err)) from None


def split_pickle(obj: Any, path: Path) -> tuple[dict[str, torch.Tensor], dict, Any]:
    """(state dict, our metadata or {}, global_step or None) of a loaded pickle checkpoint."""
    if not isinstance(obj, dict):
        raise SingleFileError(f"{path}: holds a {type(obj).__name__}, not a state dict")
    state = obj.get("state_dict", obj)
    return state, obj.get(METADATA_KEY) or {}, obj.get("global_step")


def detect_family(
    state: dict, metadata: dict, global_step: Any = None, declared: str | None = None, where: str = "the file"
) -> tuple[Family | None, str]:
    """The family of an original-layout state dict, and how it was told; `declared` settles SD 2 base vs 768-v."""
    if declared is not None and declared not in FAMILIES:
        raise SingleFileError(f"family {declared!r} is not one of {', '.join(FAMILIES)}")
    if metadata.get("family"):
        family = FAMILIES.get(metadata["family"])
        if declared and family and declared != family.name:
            raise SingleFileError(f"{where} says it is {family.name}, not {declared}; drop the family setting")
        return family, "from the file's ldm metadata"
    if any(k.startswith("conditioner.embedders.") for k in state):
        raise SingleFileError(f"{where}: an SDXL checkpoint; only SD 1.x and 2.x are supported")
    conv_in = state.get(UNET + "input_blocks.0.0.weight")
    if conv_in is None:
        raise SingleFileError(f"{where}: not a Stable Diffusion checkpoint (no {UNET}* weights)")
    if conv_in.shape[1] != 4:
        raise SingleFileError(
            f"{where}: a UNet with {conv_in.shape[1]} input channels (inpainting or depth); "
            "only text-to-image models (4 channels) are supported"
        )
    if CLIP + "embeddings.token_embedding.weight" in state:
        layout = "clip"
    elif OPEN_CLIP + "token_embedding.weight" in state:
        layout = "open_clip"
    else:
        raise SingleFileError(f"{where}: no text encoder weights under {CLIP} or {OPEN_CLIP}")
    candidates = [f for f in FAMILIES.values() if f.text_layout == layout]
    if declared:
        if FAMILIES[declared].text_layout != layout:
            found = " or ".join(f.name for f in candidates)
            raise SingleFileError(f"{where} holds a {layout} text encoder, so it is {found}, not {declared}")
        return FAMILIES[declared], "as declared"
    if len(candidates) == 1:
        return candidates[0], f"from its {layout} text encoder"
    if global_step == SD2_BASE_GLOBAL_STEP:
        return FAMILIES["sd2-base"], f"from its OpenCLIP text encoder and global_step {global_step}"
    raise SingleFileError(
        f"{where}: Stable Diffusion 2.x weights, but the weights cannot tell 512-base (epsilon) from 768-v "
        "(v-prediction); say which: model.params.pretrained_family: sd2-base or sd2-768-v (convert.py: --family)"
    )


def load_single_file(
    path: str | Path, ema: bool = False, family: str | None = None, trust_pickle: bool = False, loaded: tuple = ()
) -> tuple[Parts, str]:
    """Parts (float32) from an original single file, and a line saying which family was detected and how.

    `loaded` is the file's `(state, metadata, global_step)` where the caller has read it already."""
    path = Path(path)
    state, metadata, global_step = loaded or read_single_file(path, trust_pickle)
    detected, how = detect_family(state, metadata, global_step, family, where=str(path))
    parts = parts_from_description(metadata["parts"] if metadata.get("parts") else family_description(detected))
    if ema:
        state = _with_ema(state, path)
    _load_original(parts, state, metadata.get("text_layout") or detected.text_layout, path)
    title = detected.title if detected else "a custom architecture"
    prediction = parts.scheduler.config.get("prediction_type", "epsilon")
    return parts, f"{path}: {title} ({prediction}), {how}"


def family_description(family: Family) -> dict:
    """A family's parts in `describe_parts` form, from the configs shipped in `configs/models/<family>/`."""
    from ldm.models.parts import DEFAULT_CLASSES
    from ldm.tokenizers import write_clip_tokenizer

    described = {}
    for name in ("unet", "vae", "text_encoder"):
        config = json.loads((family.folder / name / "config.json").read_text())
        described[name] = {"class": DEFAULT_CLASSES[name], "config": config}
    scheduler = json.loads((family.folder / "scheduler" / "scheduler_config.json").read_text())
    described["scheduler"] = {"class": f"diffusers.{scheduler['_class_name']}", "config": scheduler}
    with tempfile.TemporaryDirectory() as tmp:
        write_clip_tokenizer(tmp, pad_token=family.pad_token)
        files = {p.name: p.read_text() for p in Path(tmp).iterdir() if p.is_file()}
    described["tokenizer"] = {"class": DEFAULT_CLASSES["tokenizer"], "files": files}
    return described


def _with_ema(state: dict, path: Path) -> dict:
    """Replace the UNet weights by the EMA weights stored beside them (`model_ema.<key without dots>`)."""
    ema = {}
    for key in state:
        if key.startswith(UNET):
            flat = EMA + "".join(key[len("model.") :].split("."))
            if flat not in state:
                raise SingleFileError(
                    f"{path}: has no EMA weights ({flat} missing); its UNet weights may be the EMA ones already "
                    "(as in *-emaonly files): drop the EMA setting"
                )
            ema[key] = state[flat]
    return {**state, **ema}


def _load_original(parts: Parts, state: dict, layout: str, path: Path) -> None:
    """Load an original-layout state dict into `parts` (built on the meta device), as float32."""
    by_part: dict[str, dict] = {"unet": {}, "vae": {}, "text_encoder": {}}
    shapes = {part: {k: v.shape for k, v in getattr(parts, part).state_dict().items()} for part in by_part}
    for ours, (original, slot) in original_names(parts, layout).items():
        if original not in state:
            raise SingleFileError(f"{path}: missing weight {original} (for {ours}); is it a complete checkpoint?")
        tensor = state[original]
        if slot is not None:
            tensor = tensor.chunk(3)[slot].clone()  # its own storage: savers refuse tensors that share one
        part, _, key = ours.partition(".")
        expected = shapes[part][key]
        if _is_vae_attention_weight(original) and tensor.dim() == 4:
            tensor = tensor[:, :, 0, 0]
        if tensor.shape != expected:
            raise SingleFileError(
                f"{path}: {original} has shape {tuple(tensor.shape)}, but the detected architecture expects "
                f"{tuple(expected)}; the file is not the family it looks like"
            )
        by_part[part][key] = tensor.to(torch.float32)
    for part, part_state in by_part.items():
        module = getattr(parts, part)
        module.load_state_dict(part_state, assign=True)
        module.eval()
