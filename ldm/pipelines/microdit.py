"""`MicroDiTPipeline`: text-to-image sampling from a MicroDiT (Sehwag et al. 2024) with an EDM scheduler.

A diffusers `DiffusionPipeline` (VAE, text encoder, tokenizer, scheduler and the transformer), so it saves and
loads as a folder: `MicroDiTPipeline.from_pretrained(DIR)`, or `DiffusionPipeline.from_pretrained(DIR)` once
`ldm.pipelines.microdit` is imported. The scheduler is diffusers' `EDMEulerScheduler` (or
`EDMDPMSolverMultistepScheduler`) with the `sigma_data` the model trained with: it preconditions the inputs
(c_in, c_noise) and the outputs (c_skip, c_out) as `ldm.diffusion.edm_scalings`. Classifier-free guidance takes
an all-zero caption embedding as the unconditional branch, as MicroDiT trains with dropped captions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import diffusers
import torch
from diffusers import DiffusionPipeline, ImagePipelineOutput
from diffusers.image_processor import VaeImageProcessor

# Imported here so that loading a folder finds its transformer's class: diffusers 0.42 loads a component of a
# library it does not know only from a module already imported (it will not import one a folder names).
from ldm.backbones.microdit import MicroDiT
from ldm.components import vae_downscale


class MicroDiTPipeline(DiffusionPipeline):
    """Sample images for prompts from a MicroDiT denoiser in a VAE's latent space."""

    model_cpu_offload_seq = "text_encoder->transformer->vae"

    def __init__(self, transformer: MicroDiT, vae: Any, text_encoder: Any, tokenizer: Any, scheduler: Any) -> None:
        super().__init__()
        self.register_modules(
            transformer=transformer, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler
        )
        self.vae_scale_factor = vae_downscale(vae.config)
        self.image_processor = VaeImageProcessor(vae_scale_factor=self.vae_scale_factor)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> torch.Tensor:
        """The text encoder's last hidden states of the prompts, padded to the tokenizer's length (as trained)."""
        tokens = self.tokenizer(
            prompts, padding="max_length", max_length=self.tokenizer.model_max_length, truncation=True,
            return_tensors="pt",
        ).input_ids.to(self._execution_device)  # fmt: skip
        return self.text_encoder(tokens)[0]

    @torch.no_grad()
    def __call__(
        self,
        prompt: str | list[str],
        num_inference_steps: int = 30,
        guidance_scale: float = 5.0,
        height: int | None = None,
        width: int | None = None,
        num_images_per_prompt: int = 1,
        generator: torch.Generator | None = None,
        output_type: str = "pil",
        callback_on_step_end: Callable[..., dict] | None = None,
    ) -> ImagePipelineOutput:
        """Images for `prompt`: `num_inference_steps` of the scheduler, classifier-free guidance at
        `guidance_scale` (1: none) against an all-zero caption embedding; `height` / `width` in pixels."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        device, transformer = self._execution_device, self.transformer
        size = transformer.config.sample_size * self.vae_scale_factor
        height, width = height or size, width or size
        cond = self.encode_prompt(prompts).repeat_interleave(num_images_per_prompt, dim=0)
        guided = guidance_scale > 1
        if guided:
            cond = torch.cat([torch.zeros_like(cond), cond])
        shape = (len(cond) // (2 if guided else 1), transformer.config.in_channels,
                 height // self.vae_scale_factor, width // self.vae_scale_factor)  # fmt: skip
        dtype = next(transformer.parameters()).dtype
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(device)
        self.scheduler.set_timesteps(num_inference_steps, device=device)
        latents = latents * self.scheduler.init_noise_sigma
        for i, t in enumerate(self.progress_bar(self.scheduler.timesteps)):
            both = torch.cat([latents] * 2) if guided else latents
            model_input = self.scheduler.scale_model_input(both, t).to(dtype)
            noise_level = t.reshape(1).expand(len(both)).to(device)
            out = transformer(model_input, noise_level, {"encoder_hidden_states": cond.to(dtype)}).float()
            if guided:
                unconditional, conditional = out.chunk(2)
                out = unconditional + guidance_scale * (conditional - unconditional)
            latents = self.scheduler.step(out, t, latents).prev_sample
            if callback_on_step_end is not None:
                callback_on_step_end(self, i, t, {"latents": latents})
        scale = self.vae.config.scaling_factor
        images = self.vae.decode((latents / scale).to(self.vae.dtype)).sample
        images = self.image_processor.postprocess(images.float(), output_type=output_type)
        self.maybe_free_model_hooks()
        return ImagePipelineOutput(images=images)


# `DiffusionPipeline.from_pretrained(DIR)` looks a folder's pipeline class up by name in the diffusers namespace
# only (diffusers 0.29 and 0.42): naming ours there lets a MicroDiT folder load through it once ldm is imported.
if not hasattr(diffusers, MicroDiTPipeline.__name__):
    setattr(diffusers, MicroDiTPipeline.__name__, MicroDiTPipeline)
