"""The yardstick: a plain diffusers-style text-to-image training loop, the way the diffusers example
scripts train (PyTorch + diffusers, fp32, torch AdamW, the VAE and text encoder run every step).

No Lightning, no caching, no mixed precision, no special attention: every benchmark measures our
training path against this loop on the same networks, data and batch, in the same process tree.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset


@dataclass
class PlainParts:
    """The networks the loop trains or runs: diffusers / transformers objects."""

    unet: torch.nn.Module
    vae: torch.nn.Module
    text_encoder: torch.nn.Module
    tokenizer: Any
    scheduler: Any


@dataclass
class PlainRun:
    """What one run of the loop measured: the loss and the wall time after each optimizer step."""

    losses: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # since the loop started (data loading included)
    images: int = 0


def load_plain_parts(pretrained: str) -> PlainParts:
    """The five components of a diffusers Stable Diffusion folder, loaded as the example scripts do."""
    from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTokenizer

    return PlainParts(
        unet=UNet2DConditionModel.from_pretrained(pretrained, subfolder="unet"),
        vae=AutoencoderKL.from_pretrained(pretrained, subfolder="vae"),
        text_encoder=CLIPTextModel.from_pretrained(pretrained, subfolder="text_encoder"),
        tokenizer=CLIPTokenizer.from_pretrained(pretrained, subfolder="tokenizer"),
        scheduler=DDPMScheduler.from_pretrained(pretrained, subfolder="scheduler"),
    )


def _collate(examples: list[dict], tokenizer: Any, caption_dropout: float, rng: random.Random) -> dict:
    captions = ["" if rng.random() < caption_dropout else e["caption"] for e in examples]
    ids = tokenizer(
        captions, padding="max_length", max_length=tokenizer.model_max_length, truncation=True, return_tensors="pt"
    ).input_ids
    return {"pixel_values": torch.stack([e["pixel_values"] for e in examples]), "input_ids": ids}


def plain_train(
    parts: PlainParts,
    dataset: Dataset,
    batch_size: int,
    steps: int,
    learning_rate: float = 1e-4,
    trainable: Sequence[str] = ("unet",),
    seed: int = 0,
    num_workers: int = 0,
    caption_dropout: float = 0.0,
    max_grad_norm: float | None = 1.0,
    lr_warmup_steps: int = 0,
    device: str = "cpu",
    autocast: torch.dtype | None = None,
    on_step: Callable[[int, PlainRun], bool | None] | None = None,
) -> PlainRun:
    """Train `trainable` parts for `steps` optimizer steps on `dataset` (`{pixel_values, caption}` examples).

    On a GPU the field's usual recipe is fp32 weights under `autocast` (bf16 / fp16), as `accelerate
    --mixed_precision` does; the default is plain fp32.

    `on_step(step, run)` is called after each step (outside the timing it records); returning True
    stops the loop. Returns the per-step losses and cumulative wall times.
    """
    from diffusers.optimization import get_scheduler

    torch.manual_seed(seed)
    rng = random.Random(seed)
    modules = {"unet": parts.unet, "vae": parts.vae, "text_encoder": parts.text_encoder}
    for name, module in modules.items():
        module.requires_grad_(name in trainable)
        module.train(name in trainable)
        module.to(device)
    params = [p for name in trainable for p in modules[name].parameters()]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=1e-2)
    schedule = get_scheduler("constant_with_warmup", optimizer, num_warmup_steps=lr_warmup_steps)
    loader = DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=lambda examples: _collate(examples, parts.tokenizer, caption_dropout, rng),
    )
    scheduler, vae = parts.scheduler, parts.vae
    run, step, paused, start = PlainRun(), 0, 0.0, time.perf_counter()
    while step < steps:
        for batch in loader:
            pixels, ids = batch["pixel_values"].to(device), batch["input_ids"].to(device)
            with torch.autocast(torch.device(device).type, dtype=autocast or torch.float32, enabled=bool(autocast)):
                with torch.no_grad():
                    latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                with torch.set_grad_enabled("text_encoder" in trainable):
                    cond = parts.text_encoder(ids, return_dict=False)[0]
                noise = torch.randn_like(latents)
                t = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
                noisy = scheduler.add_noise(latents, noise, t)
                if scheduler.config.prediction_type == "v_prediction":
                    target = scheduler.get_velocity(latents, noise, t)
                else:
                    target = noise
                prediction = parts.unet(noisy, t, cond, return_dict=False)[0]
                loss = F.mse_loss(prediction.float(), target.float())
            loss.backward()
            if max_grad_norm:
                torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            run.losses.append(float(loss))  # a device sync, so the time below is the step's
            run.seconds.append(time.perf_counter() - start - paused)
            run.images += latents.shape[0]
            if on_step is not None:
                outside = time.perf_counter()
                stop = on_step(step, run)
                paused += time.perf_counter() - outside
                if stop:
                    return run
            if step >= steps:
                break
    return run
