"""Build the parts of a latent diffusion model from a local diffusers folder or from a config.

Parts are library classes: diffusers `AutoencoderKL`, `UNet2DConditionModel` and noise schedulers,
transformers `CLIPTextModel` and `CLIPTokenizer`. Nothing here reaches a model hub.
"""

from __future__ import annotations

import inspect
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import torch

from ldm.config import ConfigError, ExistingPath, import_target

PART_NAMES = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")

DEFAULT_CLASSES = {
    "unet": "diffusers.UNet2DConditionModel",
    "vae": "diffusers.AutoencoderKL",
    "text_encoder": "transformers.CLIPTextModel",
    "tokenizer": "transformers.CLIPTokenizer",
    "scheduler": "diffusers.DDPMScheduler",
}


class PartSpec(TypedDict, total=False):
    """How to get one part: from a local folder (`pretrained`, `subfolder`) or a `config` dict.

    `target` names the class when it is not the part's default. A tokenizer's `config` is
    `{vocab: clip, model_max_length: N}`: the real SD 1.x CLIP tokenizer, written offline.
    """

    target: str
    pretrained: ExistingPath
    subfolder: str
    config: dict


@dataclass
class Parts:
    """The five parts of a latent text-to-image diffusion model."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    scheduler: Any


def build_parts(
    pretrained: str | None = None,
    key: str = "model.params",
    pretrained_ema: bool = False,
    pretrained_family: str | None = None,
    **specs: Any,
) -> Parts:
    """Build every part: a module passes through, a spec is built, a missing one comes from `pretrained`.

    `pretrained` is a diffusers folder, an original single file (`.safetensors` / `.ckpt`) or one of
    our checkpoints; for those two, `pretrained_ema` picks their EMA weights, and `pretrained_family`
    says which SD 2.x a single file is where its weights cannot tell."""
    loaded = {}
    if pretrained is not None and _is_one_checkpoint(Path(pretrained).expanduser()):
        from ldm.export import read_parts

        try:
            parts = read_parts(
                Path(pretrained).expanduser(), pretrained_ema, pretrained_family, where=f"{key}.pretrained"
            )
        except ValueError as err:
            raise ConfigError(f"{key}.pretrained: {err}") from None
        loaded = {name: getattr(parts, name) for name in PART_NAMES}
    elif pretrained_ema or pretrained_family:
        option = "pretrained_ema" if pretrained_ema else "pretrained_family"
        raise ConfigError(
            f"{key}.{option}: applies to a single-file {key}.pretrained (.safetensors / .ckpt), not a folder"
        )
    built = {}
    for name in PART_NAMES:
        spec = specs.get(name)
        if spec is None and name in loaded:
            built[name] = loaded[name]
            continue
        spec = part_spec(name, spec, pretrained, key)
        built[name] = spec if not isinstance(spec, dict) else build_part(name, spec, f"{key}.{name}")
    return Parts(**built)


def _is_one_checkpoint(path: Path) -> bool:
    """A single file (original SD or ours), or a ColossalAIStrategy checkpoint folder: not a diffusers folder."""
    from ldm.checkpoint import COLOSSAL_FILES

    return path.is_file() or path.is_dir() and (path / COLOSSAL_FILES["trainer"]).is_file()


def part_spec(name: str, spec: Any, pretrained: str | None, key: str = "model.params") -> Any:
    """The spec of one part: as given, or by default the `name` subfolder of `pretrained`."""
    if spec is not None:
        return spec
    if pretrained is None:
        raise ConfigError(f"{key}.{name}: missing; give `{key}.pretrained: PATH` or `{key}.{name}.config`")
    return {"pretrained": pretrained, "subfolder": name}


def part_folder(spec: dict) -> Path:
    """The folder a `{pretrained, subfolder}` spec points at."""
    folder = Path(spec["pretrained"]).expanduser()
    return folder / spec["subfolder"] if spec.get("subfolder") else folder


def module_from_config(cls: type, config: dict) -> torch.nn.Module:
    """A network with fresh weights from its config: a transformers model through its `config_class`."""
    if hasattr(cls, "config_class") and not hasattr(cls, "from_config"):
        return cls(cls.config_class(**{k: v for k, v in config.items() if not k.startswith("_")}))
    return cls.from_config(config)


def build_part(name: str, spec: dict, key: str) -> Any:
    """Build one part from a `PartSpec`; errors name `key` and the path that was read."""
    cls = import_target(spec.get("target", DEFAULT_CLASSES[name]), f"{key}.target")
    if ("pretrained" in spec) == ("config" in spec):
        raise ConfigError(f"{key}: give exactly one of `pretrained` (a local folder) or `config`")
    if "config" in spec:
        return _from_config(name, cls, dict(spec["config"]), key)
    source = part_folder(spec)
    if not source.is_dir():
        raise ConfigError(f"{key}: no folder {source} (from {key}.pretrained); expected a diffusers-format folder")
    try:
        if name == "scheduler":
            return cls.from_config(cls.load_config(source))
        return cls.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{key}: cannot load {cls.__name__} from {source}: {' '.join(str(err).split())}") from None


def _from_config(name: str, cls: type, config: dict, key: str) -> Any:
    if name == "tokenizer":
        return _tokenizer_from_config(cls, config, key)
    is_transformers_model = hasattr(cls, "config_class") and not hasattr(cls, "from_config")
    _check_keys(config, inspect.signature((cls.config_class if is_transformers_model else cls).__init__), key)
    return module_from_config(cls, config)


def _check_keys(config: dict, sig: inspect.Signature, key: str) -> None:
    if any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) and len(sig.parameters) <= 3:
        return
    valid = [n for n in sig.parameters if n not in ("self", "kwargs")]
    for k in config:
        if k not in valid and not k.startswith("_"):
            raise ConfigError(f"{key}.config.{k}: unknown key; valid: {', '.join(valid)}")


def _tokenizer_from_config(cls: type, config: dict, key: str) -> Any:
    from ldm.tokenizers import write_clip_tokenizer

    vocab = config.get("vocab", "clip")
    if vocab != "clip":
        raise ConfigError(f"{key}.config.vocab: got {vocab!r}; valid: 'clip'")
    unknown = set(config) - {"vocab", "model_max_length"}
    if unknown:
        raise ConfigError(f"{key}.config.{sorted(unknown)[0]}: unknown key; valid: vocab, model_max_length")
    with tempfile.TemporaryDirectory() as tmp:
        write_clip_tokenizer(tmp, model_max_length=int(config.get("model_max_length", 77)))
        return cls.from_pretrained(tmp, local_files_only=True)


ATTENTION = ("sdpa", "xformers", "math")
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def set_attention(parts: Parts, attention: str, key: str = "model.params.attention") -> None:
    """Choose the attention kernel of the UNet, VAE and text encoder.

    `sdpa`: PyTorch's `scaled_dot_product_attention` (flash / memory-efficient kernels on CUDA);
    `xformers`: xformers' memory-efficient attention (CUDA only); `math`: plain softmax(QK^T)V.
    """
    from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

    if attention == "xformers":
        try:
            parts.unet.enable_xformers_memory_efficient_attention()
            parts.vae.enable_xformers_memory_efficient_attention()
        except (ImportError, ModuleNotFoundError, NotImplementedError, ValueError, RuntimeError) as err:
            raise ConfigError(
                f"{key}: xformers is not usable here ({' '.join(str(err).split())[:200]}); "
                "use sdpa (the same kernels through PyTorch) or install ldm[xformers] on CUDA"
            ) from None
        return
    if attention not in ATTENTION:
        raise ConfigError(f"{key}: got {attention!r}; valid: {', '.join(ATTENTION)}")
    processor = AttnProcessor2_0 if attention == "sdpa" else AttnProcessor
    parts.unet.set_attn_processor(processor())
    parts.vae.set_attn_processor(processor())
    if hasattr(parts.text_encoder, "set_attn_implementation"):
        parts.text_encoder.set_attn_implementation("sdpa" if attention == "sdpa" else "eager")


def prepare_for_training(
    parts: Parts,
    trainable: tuple[str, ...],
    gradient_checkpointing: bool,
    channels_last: bool,
    frozen_dtype: str | None,
    adapters: bool = False,
) -> None:
    """Freeze what does not train, and apply the memory options to the networks.

    With `adapters` (LoRA), every network's own weights are frozen; adapters added later train."""
    for name in ("unet", "vae", "text_encoder"):
        module = getattr(parts, name)
        trains_own_weights = name in trainable and not adapters
        module.requires_grad_(trains_own_weights)
        if not trains_own_weights and frozen_dtype is not None:
            module.to(DTYPES[frozen_dtype])
    if gradient_checkpointing:
        parts.unet.enable_gradient_checkpointing()
        if "text_encoder" in trainable:
            parts.text_encoder.gradient_checkpointing_enable()
    if channels_last:
        parts.unet.to(memory_format=torch.channels_last)
        parts.vae.to(memory_format=torch.channels_last)
