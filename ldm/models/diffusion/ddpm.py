"""`LatentDiffusion`: the training system for latent text-to-image diffusion (Rombach et al. 2022).

The networks are library classes passed in (or described by config and built by
`ldm.models.parts`); the math is in `ldm.diffusion`; side concerns are callbacks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch

from ldm import diffusion
from ldm.config import ConfigError, ExistingPath, import_target, supplied
from ldm.lora import LoraSpec, add_lora, is_lora_key
from ldm.models.parts import DTYPES, Parts, PartSpec, build_parts, prepare_for_training, set_attention

log = logging.getLogger(__name__)

# Skipping more non-finite losses than this in a row means the weights or data are broken: stop.
MAX_SKIPS_IN_A_ROW = 10


class LatentDiffusion(pl.LightningModule):
    """Train a UNet (and optionally the text encoder) to denoise VAE latents given caption embeddings."""

    def __init__(
        self,
        pretrained: ExistingPath | None = None,
        pretrained_ema: bool = False,
        pretrained_family: Literal["sd15", "sd2-base", "sd2-768-v"] | None = None,
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
    ) -> None:
        super().__init__()
        if learning_rate <= 0:
            raise ConfigError(f"model.params.learning_rate: got {learning_rate}; must be positive")
        self._specs = {"unet": unet, "vae": vae, "text_encoder": text_encoder}
        self._specs.update(tokenizer=tokenizer, scheduler=scheduler)
        self.pretrained, self.requested_prediction_type = pretrained, prediction_type
        self.pretrained_options = {"pretrained_ema": pretrained_ema, "pretrained_family": pretrained_family}
        self.trainable = tuple(dict.fromkeys(trainable))
        self.memory_options = {
            "attention": attention,
            "gradient_checkpointing": gradient_checkpointing,
            "channels_last": channels_last,
            "frozen_dtype": frozen_dtype,
            "trainable_dtype": trainable_dtype,
        }
        self.learning_rate, self.lr_schedule, self.lr_warmup_steps = learning_rate, lr_schedule, lr_warmup_steps
        self.optimizer_spec = optimizer or {"target": "torch.optim.AdamW", "params": {"weight_decay": 1e-2}}
        self.snr_gamma, self.sample_latents = snr_gamma, sample_latents
        self.lora = dict(lora) if lora is not None else None
        if trainable_dtype == "bfloat16":
            _check_bf16_training(self.optimizer_spec["target"], self.lora)
        self.strict_loading = self.lora is None  # a LoRA checkpoint holds the adapters only
        self.run_config: dict | None = None  # the resolved config, set by ldm.run and saved in checkpoints
        self.nonfinite_loss, self.skipped_steps, self._skips_in_a_row = nonfinite_loss, 0, 0
        self.stop_reason: str | None = None  # set when the guard stops the run; the checkpoint callback reports it
        self._built = False
        if all(isinstance(self._specs[name], torch.nn.Module) for name in ("unet", "vae", "text_encoder")):
            self.configure_model()  # networks passed in: nothing to load

    def configure_model(self) -> None:
        """Build the parts (once). Lightning calls this inside `fit`, so weights load after the Trainer
        and its strategy exist; they load on the CPU and the strategy places them."""
        if self._built:
            return
        with torch.device("cpu"):
            parts = build_parts(self.pretrained, **self.pretrained_options, **self._specs)
        self.unet, self.vae, self.text_encoder = parts.unet, parts.vae, parts.text_encoder
        self.tokenizer, self.noise_scheduler = parts.tokenizer, parts.scheduler
        self.prediction_type = _resolve_prediction_type(
            parts.scheduler, self.requested_prediction_type, self.pretrained, self._specs["scheduler"]
        )
        options = self.memory_options
        if options["trainable_dtype"] is not None:
            for name in self.trainable:
                getattr(parts, name).to(DTYPES[options["trainable_dtype"]])
        set_attention(parts, options["attention"])
        prepare_for_training(
            parts,
            self.trainable,
            options["gradient_checkpointing"],
            options["channels_last"],
            options["frozen_dtype"],
            adapters=self.lora is not None,
        )
        if self.lora is not None:
            add_lora(parts, self.trainable, self.lora)
        # Not a buffer: ZeRO / Gemini cast every floating buffer to fp16, and the schedule must stay float32.
        self.alphas_cumprod = torch.as_tensor(parts.scheduler.alphas_cumprod, dtype=torch.float32)
        self._built = True

    @property
    def parts(self) -> Parts:
        self.configure_model()
        return Parts(self.unet, self.vae, self.text_encoder, self.tokenizer, self.noise_scheduler)

    @property
    def latent_scale(self) -> float:
        return float(self.vae.config.scaling_factor)

    def train(self, mode: bool = True) -> LatentDiffusion:
        """Switch to train mode, keeping frozen parts in eval mode."""
        super().train(mode)
        for name in ("unet", "vae", "text_encoder"):
            if self._built and name not in self.trainable:
                getattr(self, name).eval()
        return self

    @torch.no_grad()
    def encode_posterior(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images in [-1, 1] to the VAE posterior's mean and standard deviation, both times the VAE's
        scaling factor. Training draws a latent from them every step; the deviation is None when
        `sample_latents` is off, and training then uses the mean."""
        self.configure_model()  # a latent cache encodes in the data's setup, before Lightning builds the model
        posterior = self.vae.encode(pixel_values.to(self.device, self.vae.dtype)).latent_dist
        std = posterior.std * self.latent_scale if self.sample_latents else None
        return posterior.mean * self.latent_scale, std

    def encode_text(self, captions: Sequence[str]) -> torch.Tensor:
        """Captions to the text encoder's last hidden states, padded to the tokenizer's length."""
        ids = self.tokenizer(
            list(captions),
            padding="max_length",
            max_length=self.tokenizer.model_max_length,
            truncation=True,
            return_tensors="pt",
        ).input_ids.to(self.device)
        with torch.set_grad_enabled("text_encoder" in self.trainable and self.training):
            return self.text_encoder(ids)[0]

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        if "latents" in batch:  # encoded once (cache_latents): the posterior's mean, and its deviation if kept
            mean, std = batch["latents"], batch.get("latent_std") if self.sample_latents else None
        else:
            mean, std = self.encode_posterior(batch["pixel_values"])
        latents = diffusion.sample_posterior(mean, std).to(self.unet.dtype)
        cond = batch["text_embeddings"] if "text_embeddings" in batch else self.encode_text(batch["caption"])
        cond = cond.to(self.unet.dtype)
        # Drawn in logical order whatever the latents' memory layout (VAE outputs can be channels-last),
        # so cached and freshly encoded latents get the same noise.
        noise = torch.randn_like(latents, memory_format=torch.contiguous_format)
        if self.alphas_cumprod.device != latents.device:
            self.alphas_cumprod = self.alphas_cumprod.to(latents.device)
        t = torch.randint(0, len(self.alphas_cumprod), (latents.shape[0],), device=latents.device)
        noisy = diffusion.add_noise(latents, noise, t, self.alphas_cumprod)
        prediction = self.unet(noisy, t, encoder_hidden_states=cond).sample
        target = diffusion.training_target(latents, noise, t, self.alphas_cumprod, self.prediction_type)
        weights = None
        if self.snr_gamma is not None:
            weights = diffusion.min_snr_weights(t, self.alphas_cumprod, self.snr_gamma, self.prediction_type)
        loss = diffusion.diffusion_loss(prediction, target, weights)
        if not self._loss_is_finite(loss):
            return None  # Lightning skips backward and the optimizer step
        self.log("train/loss", loss, prog_bar=True, batch_size=latents.shape[0])
        return loss

    def _loss_is_finite(self, loss: torch.Tensor) -> bool:
        """Guard against NaN/inf losses, on every rank at once: skip the step's update, or stop the run
        (`nonfinite_loss`); a run of `MAX_SKIPS_IN_A_ROW` skipped steps stops it too."""
        finite = bool(torch.isfinite(loss))
        if self._trainer is not None:
            finite = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if finite:
            self._skips_in_a_row = 0
            return True
        step, value = self.global_step + 1, float(loss.detach())
        self.skipped_steps += 1
        self._skips_in_a_row += 1
        setting = f"model.params.nonfinite_loss: {self.nonfinite_loss}"
        if self.nonfinite_loss == "stop" or self._skips_in_a_row >= MAX_SKIPS_IN_A_ROW:
            why = setting if self.nonfinite_loss == "stop" else f"{MAX_SKIPS_IN_A_ROW} steps in a row skipped"
            self.stop_reason = f"non-finite loss ({value}) at step {step} ({why})"
            if self._trainer is not None:
                self.trainer.should_stop = True
            log.error("step %d: loss is %s; stopping with the weights from before this step", step, value)
        else:
            log.warning(
                "step %d: loss is %s; skipped this step's update (%s; %d skipped so far)",
                step,
                value,
                setting,
                self.skipped_steps,
            )
        return False

    def configure_optimizers(self) -> dict:
        from diffusers.optimization import get_scheduler

        params = [p for name in self.trainable for p in getattr(self, name).parameters() if p.requires_grad]
        spec = self.optimizer_spec
        optimizer_cls = import_target(spec["target"], "model.params.optimizer.target")
        try:
            optimizer = optimizer_cls(params, lr=self.learning_rate, **(spec.get("params") or {}))
        except ValueError as err:  # e.g. betas out of range
            raise ConfigError(f"model.params.optimizer.params: {spec['target']} rejects them: {err}") from None
        total = self.trainer.estimated_stepping_batches if self.lr_schedule != "constant" else None
        name = "constant_with_warmup" if self.lr_schedule == "constant" else self.lr_schedule
        schedule = get_scheduler(
            name, optimizer, num_warmup_steps=self.lr_warmup_steps, num_training_steps=int(total or 0)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the resolved config and every part's own config, so a checkpoint is self-contained."""
        from ldm.checkpoint import describe_parts

        checkpoint["ldm"] = {"config": self.run_config, "parts": describe_parts(self.parts)}
        if self.lora is not None:
            checkpoint["ldm"]["lora"] = {"spec": self.lora, "trainable": list(self.trainable)}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if is_lora_key(k)}


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
            "weight; set model.params.optimizer.target: ldm.optim.LowMemoryAdamW, or trainable_dtype: float32"
        )


def _resolve_prediction_type(scheduler: Any, requested: str | None, pretrained: str | None, spec: Any) -> str:
    """The scheduler's prediction type; a config value may set it only where it does not contradict it."""
    configured = scheduler.config.get("prediction_type", "epsilon")
    from_weights = pretrained is not None and spec is None or isinstance(spec, dict) and "pretrained" in spec
    if requested is None or requested == configured:
        return configured
    if from_weights:
        raise ConfigError(
            f"model.params.prediction_type: {requested!r} contradicts the pretrained weights' prediction type "
            f"{configured!r} (from their scheduler config or model family); remove the key (it follows the weights)"
        )
    scheduler.register_to_config(prediction_type=requested)
    return requested
