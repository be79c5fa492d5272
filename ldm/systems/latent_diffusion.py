"""`LatentDiffusion`: the training system for latent text-to-image diffusion (Rombach et al. 2022).

The system receives its parts built for it (`ldm.training.model` builds them from a config) and
knows them by role: the denoiser (behind the call of `ldm.backbones`), the VAE, the text encoder
and tokenizer, the noise schedule. The math is `ldm.diffusion`; side concerns are callbacks.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import lightning.pytorch as pl
import torch

from ldm import diffusion
from ldm.backbones import as_denoiser
from ldm.components import Parts, vae_downscale
from ldm.components.describe import describe_parts
from ldm.components.lora import is_lora_key
from ldm.config import ConfigError, import_target
from ldm.families import CONDITIONINGS, conditioning_for
from ldm.systems.objective import Objective, flow_loss, is_flow_scheduler
from ldm.systems.optimization import Optimization, WarmupDecay
from ldm.systems.text import TextSettings, drop_encoders

log = logging.getLogger(__name__)

# Skipping more non-finite losses than this in a row means the weights or data are broken: stop.
MAX_SKIPS_IN_A_ROW = 10


class LatentDiffusion(pl.LightningModule):
    """Train a denoiser (and optionally the text encoder) on VAE latents, conditioned on captions.

    `parts` are the built parts, or a function that builds them: Lightning calls `configure_model`
    inside `fit`, so weights then load once the Trainer and its strategy exist. Each network becomes
    a submodule under its part name (`unet.…`, `vae.…` in the state dict); `denoiser` names the part
    that denoises, `conditioning` how captions become its conditioning (`ldm.families.CONDITIONINGS`;
    by default the one the parts have).
    `text` sets the caption encoding's options and each text encoder's dropout (`ldm.systems.text`).
    `trainable` parts train; the others stay frozen, in eval mode. `lora` is the adapter spec the
    parts were given, if any: checkpoints then hold the adapters only. `frozen_device: cpu` keeps the frozen
    networks in CPU memory when the system moves to its device: with latents and captions cached they never
    run in a training step, and encoding on the CPU is slow but works; sampling brings them over for a while.
    """

    def __init__(
        self,
        parts: Parts | Callable[[], Parts],
        trainable: Sequence[str] = ("unet",),
        denoiser: str = "unet",
        conditioning: str | None = None,
        snr_gamma: float | None = None,
        sample_latents: bool = True,
        optimization: Optimization | None = None,
        lora: dict | None = None,
        nonfinite_loss: str = "skip",
        objective: Objective | None = None,
        frozen_device: str | None = None,
        text: TextSettings | None = None,
    ) -> None:
        super().__init__()
        if frozen_device not in (None, "cpu"):
            raise ConfigError(f"model.params.frozen_device: got {frozen_device!r}; valid: cpu, or null")
        self.frozen_device = frozen_device
        self._source: Parts | Callable[[], Parts] | None = parts
        self.trainable, self.denoiser_name = tuple(dict.fromkeys(trainable)), denoiser
        if conditioning is not None and conditioning not in CONDITIONINGS:
            raise ConfigError(f"model.params.conditioning: got {conditioning!r}; valid: {', '.join(CONDITIONINGS)}")
        self.conditioning = conditioning
        self.snr_gamma, self.sample_latents = snr_gamma, sample_latents
        self.optimization = optimization or Optimization()
        self.objective, self.text = objective or Objective(), text or TextSettings()
        self.lora = dict(lora) if lora is not None else None
        self.strict_loading = self.lora is None  # a LoRA checkpoint holds the adapters only
        self.run_config: dict | None = None  # the resolved config, set by ldm.training.run and saved in checkpoints
        self.seed = 0  # the run's seed (ldm.training.run sets it): with the step, it keys per-sample draws
        self.nonfinite_loss, self.skipped_steps, self._skips_in_a_row = nonfinite_loss, 0, 0
        self.stop_reason: str | None = None  # set when the guard stops the run; the checkpoint callback reports it
        self._others: dict[str, Any] = {}  # parts without weights: tokenizer, scheduler
        self._names: tuple[str, ...] = ()
        if not callable(parts):
            self.configure_model()

    def configure_model(self) -> None:
        """Build the parts (once) and take them in."""
        if self._names:
            return
        parts = self._source() if callable(self._source) else self._source
        self._source = None  # the parts live in the system now
        for name, part in parts.items():
            if isinstance(part, torch.nn.Module):
                setattr(self, name, part)
            else:
                self._others[name] = part
        self._names = tuple(parts)
        self.conditioning = self.conditioning or conditioning_for(parts)
        self.text.check(CONDITIONINGS[self.conditioning], self.conditioning)
        self.train(self.training)  # parts arrive in the mode they were read or built in: trained ones follow the system
        scheduler = self._others["scheduler"]
        self.prediction_type = scheduler.config.get("prediction_type", "epsilon")
        if self.objective.kind == "edm":
            self._check_edm(scheduler)
            return
        if (self.objective.kind == "flow") != is_flow_scheduler(scheduler):
            fix = "objective: flow" if is_flow_scheduler(scheduler) else "a FlowMatchEulerDiscreteScheduler"
            raise ConfigError(f"model.params.objective: {self.objective.kind} cannot train with the scheduler "
                              f"{type(scheduler).__name__}; use {fix}")  # fmt: skip
        if self.objective.kind == "flow":
            return
        # Not a buffer: ZeRO / Gemini cast every floating buffer to fp16, and the schedule must stay float32.
        self.alphas_cumprod = torch.as_tensor(scheduler.alphas_cumprod, dtype=torch.float32)

    def _check_edm(self, scheduler: Any) -> None:
        """EDM training samples with an EDM scheduler of the same sigma_data; masking needs a denoiser that masks."""
        sigma_data = scheduler.config.get("sigma_data")
        if sigma_data is None or abs(sigma_data - self.objective.sigma_data) > 1e-9:
            raise ConfigError(
                f"model.params.scheduler: objective edm trains with sigma_data {self.objective.sigma_data}, but the "
                f"scheduler {type(scheduler).__name__} has {sigma_data}; use {{target: diffusers.EDMEulerScheduler, "
                f"config: {{sigma_data: {self.objective.sigma_data}}}}} so samples are drawn as it trained"
            )
        module = getattr(self, self.denoiser_name)
        if self.objective.mask_ratio and not hasattr(module, "num_patches"):
            raise ConfigError(
                f"model.params.mask_ratio: {self.objective.mask_ratio}, but the {self.denoiser_name} "
                f"({type(module).__name__}) does not mask patches; set mask_ratio: 0, or use a MicroDiT"
            )

    @property
    def parts(self) -> Parts:
        self.configure_model()
        return Parts(
            (name, self._others[name] if name in self._others else getattr(self, name)) for name in self._names
        )

    @property
    def latent_scale(self) -> float:
        return float(self.vae.config.scaling_factor)

    @property
    def latent_shift(self) -> float:
        """The VAE's `shift_factor`, taken off before scaling; 0 for VAEs without one."""
        return float(self.vae.config.get("shift_factor") or 0.0)

    def train(self, mode: bool = True) -> LatentDiffusion:
        """Switch to train mode, keeping frozen parts in eval mode."""
        super().train(mode)
        for name in self._names:
            if name not in self.trainable and name not in self._others:
                getattr(self, name).eval()
        return self

    def _held(self) -> list[str]:
        """The frozen networks `frozen_device` keeps where they are when the system moves."""
        if self.frozen_device is None:
            return []
        return [name for name in self._names if name not in self.trainable and name in self._modules]

    def _apply(self, fn: Callable, recurse: bool = True) -> LatentDiffusion:
        """Move or cast the system (`to`, `cuda`, `half`, ...), but not the networks `frozen_device` holds."""
        held, order = self._held(), list(self._modules)
        kept = {name: self._modules.pop(name) for name in held}
        try:
            return super()._apply(fn, recurse)
        finally:
            self._modules.update(kept)
            self._modules = {name: self._modules[name] for name in order}

    @contextlib.contextmanager
    def networks_on(self, device: torch.device | str, names: Sequence[str]) -> Iterator[None]:
        """Have the networks among `names` on `device` for a while (encoding caches, sampling), then where they
        were; other names (tokenizers) are passed over."""
        self.configure_model()
        was = {name: next(getattr(self, name).parameters()).device for name in names if name in self._modules}
        for name in was:
            getattr(self, name).to(device)
        try:
            yield
        finally:
            for name, device in was.items():
                getattr(self, name).to(device)

    def frozen_parts_on_device(self) -> contextlib.AbstractContextManager:
        """Bring the networks `frozen_device` holds on the CPU to the system's device for a while (sampling)."""
        return self.networks_on(self.device, self._held())

    @torch.no_grad()
    def encode_posterior(self, pixel_values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Images in [-1, 1] to the VAE posterior's mean (less the VAE's shift factor, if any) and standard
        deviation, both times the VAE's scaling factor. Training draws a latent from them every step; the
        deviation is None when `sample_latents` is off, and training then uses the mean."""
        self.configure_model()  # a latent cache encodes in the data's setup, before Lightning builds the model
        posterior = self.vae.encode(pixel_values.to(self.vae.device, self.vae.dtype)).latent_dist
        std = posterior.std.to(self.device) * self.latent_scale if self.sample_latents else None
        return (posterior.mean.to(self.device) - self.latent_shift) * self.latent_scale, std

    @property
    def text_parts(self) -> tuple[str, ...]:
        """The parts that encode captions (`ldm.families.CONDITIONINGS`)."""
        self.configure_model()
        return CONDITIONINGS[self.conditioning].text_parts

    def encode_text(self, captions: Sequence[str]) -> dict[str, torch.Tensor]:
        """Captions to the denoiser's conditioning mapping, by the system's `conditioning`
        (`ldm.families.CONDITIONINGS`); with gradients when a text part trains."""
        trains = any(name in self.trainable for name in self.text_parts)
        parts = self.parts
        encoder = next(part for name in self.text_parts if isinstance(part := parts[name], torch.nn.Module))
        device = next(encoder.parameters()).device
        with torch.set_grad_enabled(trains and self.training):
            cond = CONDITIONINGS[self.conditioning].text(parts, captions, device, **self.text.options)
        return {k: v.to(self.device) for k, v in cond.items()}

    def encode_image_sizes(self, batch: dict, latents: torch.Tensor) -> dict[str, torch.Tensor]:
        """The batch's per-image conditioning, for families that have it (size and crop ids), at the
        image size its `latents` decode to; none for the others."""
        image = CONDITIONINGS[self.conditioning].image
        if image is None:
            return {}
        factor = vae_downscale(self.vae.config)
        return image(batch, (latents.shape[-2] * factor, latents.shape[-1] * factor), latents.device)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        loss = self.loss(batch)
        if not self._loss_is_finite(loss):
            return None  # Lightning skips backward and the optimizer step
        if self._trainer is not None:
            self.log("train/loss", loss, prog_bar=True, batch_size=len(batch["caption"]))
        return loss

    def loss(self, batch: dict) -> torch.Tensor:
        """The diffusion loss of one batch: latents (encoded now, or cached), conditioning, the objective."""
        if "latents" in batch:  # encoded once (cache_latents): the posterior's mean, and its deviation if kept
            mean, std = batch["latents"], batch.get("latent_std") if self.sample_latents else None
        else:
            mean, std = self.encode_posterior(batch["pixel_values"])
        module = getattr(self, self.denoiser_name)
        dtype = next(module.parameters()).dtype
        draws = self.draws(batch)
        latents = diffusion.sample_posterior(mean, std, draws).to(dtype)
        cond = batch["cond"] if "cond" in batch else self.encode_text(batch["caption"])
        if self.objective.zero_unconditional:  # the caption's conditioning; an image's own (sizes) stays
            kept = torch.tensor([bool(c) for c in batch["caption"]], device=latents.device)
            cond = {k: v * kept.reshape(-1, *([1] * (v.ndim - 1))).to(v.dtype) for k, v in cond.items()}
        if self.text.dropout:  # each text encoder dropped on its own (Esser et al. 2024)
            cond = drop_encoders(self.text, CONDITIONINGS[self.conditioning], self.parts, cond, draws)
        cond = {k: v.to(dtype) for k, v in {**cond, **self.encode_image_sizes(batch, latents)}.items()}
        if self.objective.kind == "edm":
            return self._edm_loss(module, latents, cond, draws)
        if self.objective.kind == "flow":
            return flow_loss(self.objective, self._others["scheduler"], module, latents, cond, draws)
        if self.alphas_cumprod.device != latents.device:
            self.alphas_cumprod = self.alphas_cumprod.to(latents.device)
        return diffusion.ddpm_loss(as_denoiser(module), latents, cond, self.alphas_cumprod, self.prediction_type,
                                   self.snr_gamma, draws, self.objective.noise_offset)  # fmt: skip

    def draws(self, batch: dict) -> diffusion.Draws:
        """Where this step's random numbers come from. A batch with `sample_id`s (shards and `ldm.data.DataModule`
        give them): each sample's from a generator keyed by (seed, step, id), so the same global batch trains the
        same at any number of processes, and after a resume on another number. Otherwise (a user's own
        LightningDataModule) the global generator, which a resume restores."""
        ids = batch.get("sample_id")
        if ids is None:
            return diffusion.GLOBAL_DRAWS
        return diffusion.Draws(diffusion.sample_keys(self.seed, self.global_step, ids.tolist()))

    def _edm_loss(
        self, module: torch.nn.Module, latents: torch.Tensor, cond: dict, draws: diffusion.Draws
    ) -> torch.Tensor:
        """EDM's loss, over the patches kept this step when training masked (drawn as the noise is)."""
        objective, keep, patch_size = self.objective, None, 1
        if objective.mask_ratio and self.training:
            patches = module.num_patches(*latents.shape[-2:])
            keep = diffusion.random_keep(latents.shape[0], patches, objective.mask_ratio, device=latents.device,
                                         draws=draws)  # fmt: skip
            patch_size = module.config.patch_size
        return diffusion.edm_loss(as_denoiser(module), latents, cond, objective.p_mean, objective.p_std,
                                  objective.sigma_data, keep, patch_size, draws)  # fmt: skip

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

    def trained_parameters(self) -> list[torch.nn.Parameter]:
        return [p for name in self.trainable for p in getattr(self, name).parameters() if p.requires_grad]

    def parameter_groups(self) -> list[torch.nn.Parameter] | list[dict]:
        """The trained parameters for the optimizer: two groups when `expert_lr_multiplier` is not 1, those of
        mixture-of-experts modules (`lr_group = "experts"`) at that multiple of the LR and all others; else the
        plain list, as every optimizer (Colossal-AI's included) takes it."""
        multiplier = self.optimization.expert_lr_multiplier
        experts = {
            id(p)
            for name in self.trainable
            for module in getattr(self, name).modules()
            if getattr(module, "lr_group", None) == "experts"
            for p in module.parameters()
        }
        params = self.trained_parameters()
        if multiplier == 1 or not experts:
            return params
        rest = [p for p in params if id(p) not in experts]
        moe = [p for p in params if id(p) in experts]
        return [{"params": rest}, {"params": moe, "lr": self.optimization.learning_rate * multiplier}]

    def configure_optimizers(self) -> dict:
        from diffusers.optimization import get_scheduler

        opt = self.optimization
        spec = opt.optimizer
        optimizer_cls = import_target(spec["target"], "model.params.optimizer.target")
        try:
            optimizer = optimizer_cls(self.parameter_groups(), lr=opt.learning_rate, **(spec.get("params") or {}))
        except ValueError as err:  # e.g. betas out of range
            raise ConfigError(f"model.params.optimizer.params: {spec['target']} rejects them: {err}") from None
        if opt.lr_lambda is not None:
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, opt.lr_lambda)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        total = self.trainer.estimated_stepping_batches if opt.lr_schedule != "constant" else None
        if opt.lr_min and total is not None:
            decay = WarmupDecay(opt.lr_warmup_steps, int(total), opt.lr_min / opt.learning_rate, opt.lr_schedule)
            schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, decay)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
        name = "constant_with_warmup" if opt.lr_schedule == "constant" else opt.lr_schedule
        schedule = get_scheduler(
            name, optimizer, num_warmup_steps=opt.lr_warmup_steps, num_training_steps=int(total or 0)
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def on_train_start(self) -> None:
        """An optimizer that places its own state (`init_state`: LowMemoryAdamW with `offload`) puts it where it
        lives before the first step: Lightning moves every optimizer's state to the device when it restores a run."""
        for optimizer in self.trainer.optimizers:
            if hasattr(optimizer, "init_state"):
                optimizer.init_state()

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Store the resolved config, every part's own config and the run's seed: a self-contained checkpoint."""
        checkpoint["ldm"] = {"config": self.run_config, "parts": describe_parts(self.parts), "seed": self.seed}
        if self.lora is not None:
            checkpoint["ldm"]["lora"] = {"spec": self.lora, "trainable": list(self.trainable)}
            checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if is_lora_key(k)}
