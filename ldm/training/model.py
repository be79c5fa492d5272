"""Build the `LatentDiffusion` system from the keys of a config's `model.params`.

This is what `target: ldm.models.diffusion.ddpm.LatentDiffusion` (the path CompVis and Colossal-AI
configs carry) names: a factory whose signature is the YAML surface, checked key by key before
anything is built. It reads the weights in whatever format they are (`ldm.weights`), applies the
memory options and LoRA (`ldm.components`), and hands the system its parts ready to train.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import torch

from ldm.components import Parts
from ldm.components.build import PartSpec
from ldm.components.describe import config_dict
from ldm.components.lora import LoraSpec, add_lora
from ldm.components.memory import DTYPES, prepare_for_training, set_attention
from ldm.config import ConfigError, ExistingPath, TargetSpec, import_target, instantiate, supplied
from ldm.families import NETWORK_PARTS, OPTIONAL_PARTS, FamilyName
from ldm.systems.latent_diffusion import LatentDiffusion as System
from ldm.systems.latent_diffusion import Optimization
from ldm.systems.objective import Objective, check_flow_settings
from ldm.systems.text import TextSettings
from ldm.weights.read import load_pretrained, scheduler_class

log = logging.getLogger(__name__)
DEFAULT_OPTIMIZER = {"target": "torch.optim.AdamW", "params": {"weight_decay": 1e-2}}


class NoiseSchedule(TypedDict, total=False):
    """`model.params.noise_schedule`: the training noise schedule, replacing the one the weights came with."""

    beta_start: float
    beta_end: float
    num_train_timesteps: int
    beta_schedule: Literal["linear", "scaled_linear", "squaredcos_cap_v2"]
    rescale_betas_zero_snr: bool  # zero terminal SNR (Lin et al. 2024): v-prediction only
    timestep_spacing: Literal["leading", "trailing", "linspace"]  # of sampling; trailing with zero terminal SNR


class EDMSettings(TypedDict, total=False):
    """`model.params.edm`: EDM's training noise levels (ln sigma ~ N(p_mean, p_std^2)) and data deviation."""

    p_mean: float
    p_std: float
    sigma_data: float


class FlowSettings(TypedDict, total=False):
    """`model.params.flow`: flow matching's noise levels (how drawn, and shifted) and loss weighting."""

    sampling: Literal["logit_normal", "mode", "uniform"]
    logit_mean: float
    logit_std: float
    mode_scale: float
    shift: float | Literal["resolution"] | None
    weighting: Literal["none", "sigma_sqrt", "cosmap"]


class Declared(TypedDict):
    """A part's architecture as a config declares it (e.g. a CompVis `unet_config`), checked against the weights."""

    key: str  # where it was declared
    config: dict


def latent_diffusion(
    pretrained: ExistingPath | None = None,
    pretrained_ema: bool = False,
    pretrained_family: FamilyName | None = None,
    unet: PartSpec | torch.nn.Module | None = None,
    vae: PartSpec | torch.nn.Module | None = None,
    text_encoder: PartSpec | torch.nn.Module | None = None,
    tokenizer: PartSpec | Any = None,
    scheduler: PartSpec | Any = None,
    text_encoder_2: PartSpec | torch.nn.Module | None = None,
    tokenizer_2: PartSpec | Any = None,
    text_encoder_3: PartSpec | torch.nn.Module | None = None,
    tokenizer_3: PartSpec | Any = None,
    trainable: Sequence[Literal["unet", "text_encoder", "text_encoder_2"]] = ("unet",),
    prediction_type: Literal["epsilon", "v_prediction"] | None = None,
    learning_rate: float = 1e-4,
    optimizer: supplied("params", "lr") | None = None,
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant",
    lr_warmup_steps: int = 0,
    lr_min: float = 0.0,
    snr_gamma: float | None = None,
    sample_latents: bool = True,
    attention: Literal["sdpa", "xformers", "math"] = "sdpa",
    gradient_checkpointing: bool = False,
    channels_last: bool = False,
    frozen_dtype: Literal["float32", "float16", "bfloat16"] | None = None,
    trainable_dtype: Literal["float32", "bfloat16"] | None = None,
    lora: LoraSpec | None = None,
    nonfinite_loss: Literal["skip", "stop"] = "skip",
    noise_schedule: NoiseSchedule | None = None,
    scaling_factor: float | None = None,
    lr_lambda: TargetSpec | None = None,
    part_weights: dict[Literal["unet", "vae", "text_encoder", "text_encoder_2", "text_encoder_3"], ExistingPath]
    | None = None,
    architecture: dict[Literal["unet", "vae"], Declared] | None = None,
    objective: Literal["ddpm", "edm", "flow"] | None = None,
    edm: EDMSettings | None = None,
    flow: FlowSettings | None = None,
    mask_ratio: float = 0.0,
    unconditional: Literal["empty_caption", "zeros"] = "empty_caption",
    expert_lr_multiplier: float = 1.0,
    noise_offset: float = 0.0,
    frozen_device: Literal["cpu"] | None = None,
    max_sequence_length: int | None = None,
    text_dropout: dict[str, float] | None = None,
) -> System:
    """A `LatentDiffusion` system whose parts are built when Lightning configures the model.

    Parts: `pretrained` (a diffusers folder, an original single file or one of our checkpoints) gives
    every part not given on its own (`unet`, `vae`, ... as `{pretrained, subfolder}` or `{config}`, or
    a module; a family's `text_encoder_2`, `tokenizer_2`, `text_encoder_3`, `tokenizer_3` where its weights have
    them). The prediction type follows the weights; `prediction_type` may set it only for parts built from a
    config. `unet` (the denoiser, whatever its architecture: a folder's `transformer`, say) may name any
    denoiser class (`target`) that takes the call `denoiser(noisy, t, cond)` (see `ldm.backbones`).

    `part_weights` loads a file of one part's weights (diffusers names, `.bin` / `.safetensors`) into the
    part built from its config (a single file's text encoders: read with it, where its files may lack them);
    `architecture` lists configs the weights read must agree with; `lr_lambda`
    is an LR factor per step (e.g. `ldm.training.lr_schedules.LambdaLinear`) instead of `lr_schedule`; a linear or
    cosine `lr_schedule` ends at `lr_min` (default 0).

    `objective: flow` trains by flow matching (`flow`: sampling, logit_mean, logit_std, mode_scale, shift, weighting;
    see `ldm.systems.objective`) with a `FlowMatch*` scheduler; with no `objective`, the scheduler decides.
    `objective: edm` trains with EDM (`edm`: p_mean, p_std, sigma_data), `mask_ratio` of the patches dropped after
    a MicroDiT's patch mixer; `unconditional: zeros` makes a dropped caption's conditioning zeros (MicroDiT's
    classifier-free guidance); `expert_lr_multiplier` scales the LR of mixture-of-experts parameters.

    `noise_offset` (DDPM) trains with offset noise (0.05 to 0.1 is usual); `noise_schedule:
    {rescale_betas_zero_snr: true, timestep_spacing: trailing}` trains and samples with zero terminal SNR
    (v-prediction models such as NoobAI-XL v-pred; what the weights' scheduler says may not be contradicted).

    `frozen_device: cpu` keeps the frozen networks (VAE, text encoders) in CPU memory, off the GPU: for runs that
    cache latents and captions (`data.params.cache_latents` / `cache_text`, or shards), whose steps never run them.
    `max_sequence_length` is the T5 token count of families with T5 (diffusers' name; the pipeline's by default);
    `text_dropout` ({text encoder: probability}) zeroes one encoder's share of a sample's conditioning on its own
    (`ldm.systems.text`)."""
    if learning_rate <= 0:
        raise ConfigError(f"model.params.learning_rate: got {learning_rate}; must be positive")
    if lr_min and (lr_schedule == "constant" or not 0 < lr_min < learning_rate):
        raise ConfigError(
            f"model.params.lr_min: got {lr_min} with lr_schedule: {lr_schedule}; it is where a linear or cosine "
            f"schedule ends, between 0 and learning_rate ({learning_rate})"
        )
    if lr_lambda is not None and (lr_schedule != "constant" or lr_warmup_steps):
        raise ConfigError(
            "model.params.lr_lambda: a schedule of its own; it cannot be combined with "
            f"model.params.lr_schedule: {lr_schedule} / lr_warmup_steps: {lr_warmup_steps}; remove one"
        )
    factor = instantiate(lr_lambda, "model.params.lr_lambda") if lr_lambda is not None else None
    optimization = Optimization(
        learning_rate,
        dict(optimizer or DEFAULT_OPTIMIZER),
        lr_schedule,
        lr_warmup_steps,
        factor,
        expert_lr_multiplier,
        lr_min,
    )
    if objective is None:  # as the weights train: flow matching with a flow-matching scheduler, else DDPM
        objective, snr_gamma = _weights_objective(pretrained, scheduler, snr_gamma)
    settings = dict(edm or {})
    training_objective = _objective(objective, settings, mask_ratio, unconditional, snr_gamma, expert_lr_multiplier)
    if flow and objective != "flow":
        raise ConfigError(
            "model.params.flow: applies to objective: flow; set model.params.objective: flow, or remove it"
        )
    if objective == "flow":
        check_flow_settings(dict(flow or {}))
        for k, v in dict(flow or {}).items():
            setattr(training_objective, k, v)
    if noise_offset < 0 or noise_offset and objective != "ddpm":
        raise ConfigError(f"model.params.noise_offset: got {noise_offset}; a DDPM setting, 0 or more (0.05 to 0.1)")
    training_objective.noise_offset = noise_offset
    lora = dict(lora) if lora is not None else None
    trainable = tuple(dict.fromkeys(trainable))
    if trainable_dtype == "bfloat16":
        _check_bf16_training(optimization.optimizer["target"], lora)
    specs = {"unet": unet, "vae": vae, "text_encoder": text_encoder, "tokenizer": tokenizer, "scheduler": scheduler,
             "text_encoder_2": text_encoder_2, "tokenizer_2": tokenizer_2, "text_encoder_3": text_encoder_3,
             "tokenizer_3": tokenizer_3}  # fmt: skip
    memory = {
        "attention": attention,
        "gradient_checkpointing": gradient_checkpointing,
        "channels_last": channels_last,
        "frozen_dtype": frozen_dtype,
        "trainable_dtype": trainable_dtype,
    }
    build = PartsForTraining(
        pretrained, pretrained_ema, pretrained_family, specs, prediction_type, trainable, memory, lora,
        dict(part_weights or {}), dict(architecture or {}), noise_schedule, scaling_factor,
    )  # fmt: skip
    if max_sequence_length is not None and max_sequence_length < 1:
        raise ConfigError(f"model.params.max_sequence_length: got {max_sequence_length}; a count of tokens, 1 or more")
    options = {"max_sequence_length": max_sequence_length} if max_sequence_length is not None else {}
    text = TextSettings(options, {k: float(v) for k, v in (text_dropout or {}).items()})
    system = System(build, trainable, "unet", None, snr_gamma, sample_latents, optimization, lora, nonfinite_loss,
                    training_objective, frozen_device, text)  # fmt: skip
    if all(isinstance(specs[name], torch.nn.Module) for name in NETWORK_PARTS):
        system.configure_model()  # networks passed in: nothing to load
    return system


def _weights_objective(pretrained: str | None, scheduler: Any, snr_gamma: float | None) -> tuple[str, float | None]:
    """The objective a config that names none trains with, and its `snr_gamma`: `flow` where the scheduler (the
    config's, else the weights') is a flow-matching one, where Min-SNR, a DDPM weighting a preset may set, is
    left out, said in the log; else `ddpm`."""
    target = scheduler.get("target") if isinstance(scheduler, dict) else None
    name = str(target).rpartition(".")[2] if target else scheduler_class(pretrained)
    if not str(name).startswith("FlowMatch"):
        return "ddpm", snr_gamma
    if snr_gamma is not None:
        log.info("model.params.snr_gamma: %s left out: these weights train by flow matching (their %s), which "
                 "weights its loss its own way", snr_gamma, name)  # fmt: skip
    return "flow", None


def _objective(
    kind: str, edm: dict, mask_ratio: float, unconditional: str, snr_gamma: float | None, expert_lr_multiplier: float
) -> Objective:
    """The training objective of `model.params`, its settings checked against each other."""
    if kind != "edm" and (edm or mask_ratio):
        given = "model.params.edm" if edm else "model.params.mask_ratio"
        raise ConfigError(f"{given}: applies to objective: edm; set model.params.objective: edm, or remove it")
    if kind != "ddpm" and snr_gamma is not None:
        raise ConfigError(f"model.params.snr_gamma: Min-SNR weights DDPM's loss; {kind} weights its own, remove it")
    if expert_lr_multiplier <= 0:
        raise ConfigError(f"model.params.expert_lr_multiplier: got {expert_lr_multiplier}; must be positive")
    if not 0 <= mask_ratio < 1:
        raise ConfigError(f"model.params.mask_ratio: got {mask_ratio}; must be in [0, 1) (MicroDiT trains at 0.75)")
    if edm.get("sigma_data", 1.0) <= 0 or edm.get("p_std", 1.0) <= 0:
        raise ConfigError(f"model.params.edm: sigma_data and p_std must be positive; got {edm}")
    return Objective(kind, **edm, mask_ratio=mask_ratio, zero_unconditional=unconditional == "zeros")


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
    part_weights: dict
    architecture: dict
    noise_schedule: dict | None
    scaling_factor: float | None

    def __call__(self) -> Parts:
        memory = self.memory
        with torch.device("cpu"):  # the strategy places them
            parts = load_pretrained(
                self.pretrained,
                pretrained_ema=self.pretrained_ema,
                pretrained_family=self.pretrained_family,
                dtypes=self.dtypes(),
                keep_extras=False,  # an export reads them again from model.params.pretrained
                part_weights=self.part_weights,
                **self.specs,
            )
        for name in self.trainable:
            if name not in parts.networks:
                raise ConfigError(
                    f"model.params.trainable: {name!r}, but these weights have no {name}; they have "
                    f"{', '.join(parts.networks)}"
                )
        for name, declared in self.architecture.items():
            _check_architecture(parts[name], declared, name, self.pretrained)
        _resolve_prediction_type(parts.scheduler, self.prediction_type, self.pretrained, self.specs["scheduler"])
        _apply_schedule(parts, self.noise_schedule, self.scaling_factor, self.pretrained)
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

    def dtypes(self) -> dict[str, torch.dtype]:
        """The dtype each network lives in during the run, so that it is read straight into it: the frozen ones in
        `frozen_dtype` (every network's own weights with LoRA), the trained ones in `trainable_dtype`; float32 else."""
        frozen, trained = (DTYPES.get(self.memory[k] or "float32") for k in ("frozen_dtype", "trainable_dtype"))
        adapters = self.lora is not None
        names = (*NETWORK_PARTS, *OPTIONAL_PARTS)
        return {name: trained if name in self.trainable and not adapters else frozen for name in names}


def _check_architecture(module: torch.nn.Module, declared: dict, name: str, pretrained: str | None) -> None:
    """The weights' config must agree with the architecture a config declared for them."""
    config = config_dict(module)
    for k, want in declared["config"].items():
        have = config.get(k)
        if have is not None and want is not None and _plain(have) != _plain(want):
            raise ConfigError(
                f"{declared['key']}: declares {k} = {want!r}, but the {name} of {pretrained} has {have!r}; "
                "fix the config, or use weights of that architecture"
            )


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, (list, tuple)) else value


def _apply_schedule(parts: Parts, schedule: dict | None, scaling_factor: float | None, pretrained: str | None) -> None:
    """Set the training noise schedule and the latent scaling factor; a scaling factor may not contradict
    the one the pretrained VAE was trained with, nor the schedule drop the weights' zero terminal SNR."""
    if schedule:
        had = bool(parts.scheduler.config.get("rescale_betas_zero_snr", False))
        if pretrained is not None and had and schedule.get("rescale_betas_zero_snr") is False:
            raise ConfigError(
                "model.params.noise_schedule.rescale_betas_zero_snr: false contradicts the pretrained weights, "
                "trained with zero terminal SNR (their scheduler config says so); remove the key"
            )
        config = {**parts.scheduler.config, **schedule}
        # diffusers' from_config drops values it lists as defaults it filled in: these are set now
        config["_use_default_values"] = [k for k in config.get("_use_default_values", []) if k not in schedule]
        parts.scheduler = type(parts.scheduler).from_config(config)
    _check_zero_snr(parts.scheduler, bool((schedule or {}).get("rescale_betas_zero_snr")))
    if scaling_factor is not None:
        current = float(parts.vae.config.get("scaling_factor", 1.0))
        if pretrained is not None and abs(current - scaling_factor) > 1e-9 * max(1.0, abs(current)):
            raise ConfigError(
                f"model.params.scaling_factor: {scaling_factor} contradicts the pretrained VAE's scaling factor "
                f"{current} (the UNet was trained on latents scaled by it); remove the key"
            )
        parts.vae.register_to_config(scaling_factor=scaling_factor)


def _check_zero_snr(scheduler: Any, requested: bool) -> None:
    """Zero terminal SNR (Lin et al. 2024), `requested` or the scheduler's, needs a scheduler that rescales the
    betas and a v-prediction model: at the last step no signal is left, so no noise can be told from it."""
    if not (requested or scheduler.config.get("rescale_betas_zero_snr")):
        return
    key = "model.params.noise_schedule.rescale_betas_zero_snr"
    if float(scheduler.alphas_cumprod[-1]) > 1e-6:
        raise ConfigError(
            f"{key}: {type(scheduler).__name__} does not rescale its betas; give model.params.scheduler a "
            "DDPMScheduler, DDIMScheduler or EulerDiscreteScheduler"
        )
    prediction = scheduler.config.get("prediction_type", "epsilon")
    if prediction != "v_prediction":
        raise ConfigError(f"{key}: zero terminal SNR needs v-prediction, but the model predicts {prediction}")


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
