"""Tiny Stable-Diffusion-shaped models with random weights, for tests and for trying the fine-tune path.

    python -m examples.tiny_sd OUT [--family sdxl] [--prediction-type v_prediction] [--seed N]

writes a diffusers pipeline folder (16 px images, 4x8x8 latents) with the real SD 1.x CLIP
tokenizer, built offline from open_clip_torch's BPE file; `--family sdxl` an SDXL-shaped one (two text
encoders, the second with a projection, and the UNet's size and crop conditioning); `--family sd35-medium`
or `sd35-large` an SD3.5-shaped one (`examples.tiny_sd35`: an MMDiT, three text encoders, flow matching).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffusers import (
    AutoencoderKL,
    EulerDiscreteScheduler,
    PNDMScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from ldm.components.tokenizers import VOCAB_SIZE, write_clip_tokenizer
from ldm.weights.pipeline_folder import make_portable

TINY_UNET = dict(
    sample_size=8,
    in_channels=4,
    out_channels=4,
    block_out_channels=(16, 32),
    layers_per_block=1,
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=32,
    attention_head_dim=2,
    norm_num_groups=8,
)
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    block_out_channels=(8, 16),
    down_block_types=("DownEncoderBlock2D",) * 2,
    up_block_types=("UpDecoderBlock2D",) * 2,
    layers_per_block=1,
    norm_num_groups=4,
    sample_size=16,
)
# The block layout of SD 1.x / 2.x (two layers per block, attention in all but the lowest level) at a
# tiny width: every kind of key the original single-file layout has, at a few kB. 64 px images.
SD_LAYOUT_UNET = dict(
    TINY_UNET,
    block_out_channels=(8, 8, 16, 16),
    layers_per_block=2,
    down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
    up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
    norm_num_groups=4,
)
SD_LAYOUT_VAE = dict(
    TINY_VAE,
    block_out_channels=(8, 8, 16, 16),
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2,
    sample_size=64,
)
TINY_TEXT_ENCODER = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    bos_token_id=49406,
    eos_token_id=49407,
    pad_token_id=49407,
)
# SDXL's layout at a tiny width: no attention at the first level, more transformer layers lower down, linear
# projections, both text encoders' states side by side (32 + 48), and the pooled text (32) beside six size and
# crop ids (6 x 8) in the added embedding. The encoders' widths differ, as SDXL's do: readers of single files
# tell the two apart by them.
TINY_SDXL_UNET = dict(
    TINY_UNET,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    transformer_layers_per_block=(1, 2),
    attention_head_dim=(2, 4),
    cross_attention_dim=32 + 48,
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    projection_class_embeddings_input_dim=32 + 6 * 8,
)
TINY_TEXT_ENCODER_2 = dict(
    TINY_TEXT_ENCODER, hidden_size=48, intermediate_size=96, hidden_act="gelu", projection_dim=32
)
# The noise schedule of SD 1.x / 2.x.
SD_SCHEDULE = dict(
    num_train_timesteps=1000,
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    skip_prk_steps=True,
    steps_offset=1,
    set_alpha_to_one=False,
)


def write_tiny_sd(
    out_dir: str | Path,
    prediction_type: str = "epsilon",
    seed: int = 0,
    unet: dict = TINY_UNET,
    vae: dict = TINY_VAE,
    text_encoder: dict = TINY_TEXT_ENCODER,
) -> Path:
    """Write a tiny SD-shaped diffusers pipeline folder (16 px images, 4x8x8 latents) with random weights."""
    import torch

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    write_clip_tokenizer(out_dir / "tokenizer")
    pipe = StableDiffusionPipeline(
        vae=AutoencoderKL(**vae),
        text_encoder=CLIPTextModel(CLIPTextConfig(**text_encoder)),
        tokenizer=CLIPTokenizer.from_pretrained(out_dir / "tokenizer"),
        unet=UNet2DConditionModel(**unet),
        scheduler=PNDMScheduler(**SD_SCHEDULE, prediction_type=prediction_type),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return make_portable(out_dir)


def write_tiny_sdxl(out_dir: str | Path, prediction_type: str = "epsilon", seed: int = 0) -> Path:
    """Write a tiny SDXL-shaped diffusers pipeline folder (16 px images, 4x8x8 latents) with random weights: the
    SD 1.x tokenizer and one padding with "!" as SDXL's second, and SDXL's Euler scheduler config."""
    import torch

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    write_clip_tokenizer(out_dir / "tokenizer")
    write_clip_tokenizer(out_dir / "tokenizer_2", pad_token="!")
    pipe = StableDiffusionXLPipeline(
        vae=AutoencoderKL(**TINY_VAE, scaling_factor=0.13025),
        text_encoder=CLIPTextModel(CLIPTextConfig(**TINY_TEXT_ENCODER)),
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**TINY_TEXT_ENCODER_2)),
        tokenizer=CLIPTokenizer.from_pretrained(out_dir / "tokenizer"),
        tokenizer_2=CLIPTokenizer.from_pretrained(out_dir / "tokenizer_2"),
        unet=UNet2DConditionModel(**TINY_SDXL_UNET),
        scheduler=EulerDiscreteScheduler(
            **{k: SD_SCHEDULE[k] for k in ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")},
            steps_offset=1,
            timestep_spacing="leading",
            prediction_type=prediction_type,
        ),
        add_watermarker=False,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return make_portable(out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="output folder (a diffusers pipeline)")
    parser.add_argument(
        "--family", choices=["sd", "sdxl", "sd35-medium", "sd35-large"], default="sd", help="SD 1.x-shaped (default)"
    )
    parser.add_argument("--prediction-type", choices=["epsilon", "v_prediction"], default="epsilon")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.family.startswith("sd35"):
        from examples.tiny_sd35 import write_tiny_sd35

        print(write_tiny_sd35(args.out, args.family, args.seed))
        return
    write = write_tiny_sdxl if args.family == "sdxl" else write_tiny_sd
    print(write(args.out, args.prediction_type, args.seed))


if __name__ == "__main__":
    main()
