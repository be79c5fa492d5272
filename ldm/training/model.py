"""Build the `LatentDiffusion` system from the keys of a config's `model.params`.

This is what `target: ldm.models.diffusion.ddpm.LatentDiffusion` (the path CompVis and Colossal-AI
configs carry) names: a factory whose signature is the YAML surface, checked key by key before
anything is built. It reads the weights in whatever format they are (`ldm.weights`), applies the
memory options and LoRA (`ldm.components`), and hands the system its parts ready to train.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ldm.components import Parts
from ldm.components.build import NETWORK_PARTS, PartSpec
from ldm.components.families import FamilyName
from ldm.components.lora import LoraSpec, add_lora
from ldm.components.memory import DTYPES, prepare_for_training, set_attention
from ldm.config import ConfigError, ExistingPath, import_target, supplied
from ldm.systems.latent_diffusion import LatentDiffusion as System
from ldm.systems.latent_diffusion import Optimization
from ldm.weights.read import load_pretrained

DEFAULT_OPTIMIZER = {"target": "torch.optim.AdamW", "params": {"weight_decay": 1e-2}}


def latent_diffusion(
    pretrained: ExistingPath | None = None,
    pretrained_ema: bool = False,
    pretrained_family: FamilyName | None = None,
    unet: PartSpec | torch.nn.Module | None = None,
    vae: PartSpec | torch.nn.Module | None = None,
    text_encoder: PartSpec | torch.nn.Module | None = None,
    tokenizer: PartSpec | Any = None,
    scheduler: PartSpec | Any = None,
    trainable: Sequence[Literal["unet", "text_encoder"]] = ("unet",),
    prediction_type: Literal["epsilon", "v_prediction"] | None = None,
    learning_rate: float = 1e-4,
    optimizer: supplied("params", "lr") | None = None,
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant",
    lr_warmup_steps: int = 0,
    snr_gamma: float | None = None,
    sample_latents: bool = True,
    attention: Literal["sdpa", "xformers", "math"] = "sdpa",
    gradient_checkpointing: bool = False,
    channels_last: bool = False,
    frozen_dtype: Literal["float32", "float16", "bfloat16"] | None = None,
    trainable_dtype: Literal["float32", "bfloat16"] | None = None,
    lora: LoraSpec | None = None,
    nonfinite_loss: Literal["skip", "stop"] = "skip",
) -> System:
    """A `LatentDiffusion` system whose parts are built when Lightning configures the model.

    Parts: `pretrained` (a diffusers folder, an original single file or one of our checkpoints) gives
    every part not given on its own (`unet`, `vae`, ... as `{pretrained, subfolder}` or `{config}`, or
    a module). The prediction type follows the weights; `prediction_type` may set it only for parts
    built from a config. `unet` may name any denoiser class (`target`) that takes the call
    `denoiser(noisy, t, cond)` (see `ldm.backbones`)."""
    if learning_rate <= 0:
        raise ConfigError(f"model.params.learning_rate: got {learning_rate}; must be positive")
    optimization = Optimization(learning_rate, dict(optimizer or DEFAULT_OPTIMIZER), lr_schedule, lr_warmup_steps)
    lora = dict(lora) if lora is not None else None
    trainable = tuple(dict.fromkeys(trainable))
    if trainable_dtype == "bfloat16":
        _check_bf16_training(optimization.optimizer["target"], lora)
    specs = {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler}
    memory = {
        "attention": attention,
        "gradient_checkpointing": gradient_checkpointing,
        "channels_last": channels_last,
        "frozen_dtype": frozen_dtype,
        "trainable_dtype": trainable_dtype,
    }
    build = PartsForTraining(
        pretrained, pretrained_ema, pretrained_family, specs, prediction_type, trainable, memory, lora
    )
    system = System(build, trainable, "unet", "clip", snr_gamma, sample_latents, optimization, lora, nonfinite_loss)
    if all(isinstance(specs[name], torch.nn.Module) for name in NETWORK_PARTS):
        system.configure_model()  # networks passed in: nothing to load
    return system


@dataclass
class PartsForTraining:
    """Build the parts of a config, ready to train: read, prediction type settled, memory options and LoRA
    applied. A plain object (not a closure), so a system holding it still pickles, e.g. for `ddp_spawn`."""

    pretrained: str | None
    pretrained_ema: bool
    pretrained_family: str | None
    specs: dict
    prediction_type: str | None
    trainable: tuple[str, ...]
    memory: dict
    lora: dict | None

    def __call__(self) -> Parts:
        memory = self.memory
        with torch.device("cpu"):  # the strategy places them
            parts = load_pretrained(
                self.pretrained,
                pretrained_ema=self.pretrained_ema,
                pretrained_family=self.pretrained_family,
                **self.specs,
            )
        _resolve_prediction_type(parts.scheduler, self.prediction_type, self.pretrained, self.specs["scheduler"])
        if memory["trainable_dtype"] is not None:
            for name in self.trainable:
                parts[name].to(DTYPES[memory["trainable_dtype"]])
        set_attention(parts, memory["attention"])
        prepare_for_training(
            parts,
            self.trainable,
            memory["gradient_checkpointing"],
            memory["channels_last"],
            memory["frozen_dtype"],
            adapters=self.lora is not None,
        )
        if self.lora is not None:
            add_lora(parts, self.trainable, self.lora)
        return parts


def _check_bf16_training(optimizer_target: str, lora: dict | None) -> None:
    """bf16 weights lose every update smaller than their precision (1/256 of their size) unless the
    optimizer compensates: refuse optimizers that do not say they do, and LoRA (its adapters are small)."""
    key = "model.params.trainable_dtype"
    if lora is not None:
        raise ConfigError(f"{key}: bfloat16 applies to full fine-tuning; LoRA adapters are small, remove it")
    optimizer_cls = import_target(optimizer_target, "model.params.optimizer.target")
    if not getattr(optimizer_cls, "low_precision_weights", False):
        raise ConfigError(
            f"{key}: bfloat16 weights under {optimizer_target} would lose every update smaller than about 1/256 of a "
            "weight; set model.params.optimizer.target: ldm.training.optim.LowMemoryAdamW, or trainable_dtype: float32"
        )


def _resolve_prediction_type(scheduler: Any, requested: str | None, pretrained: str | None, spec: Any) -> None:
    """Keep the scheduler's prediction type; a config value may set it only where it does not contradict it."""
    configured = scheduler.config.get("prediction_type", "epsilon")
    from_weights = pretrained is not None and spec is None or isinstance(spec, dict) and "pretrained" in spec
    if requested is None or requested == configured:
        return
    if from_weights:
        raise ConfigError(
            f"model.params.prediction_type: {requested!r} contradicts the pretrained weights' prediction type "
            f"{configured!r} (from their scheduler config or model family); remove the key (it follows the weights)"
        )
    scheduler.register_to_config(prediction_type=requested)
