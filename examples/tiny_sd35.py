"""Tiny Stable-Diffusion-3.5-shaped pipelines with random weights: `python -m examples.tiny_sd OUT --family sd35-medium`
(or `sd35-large`).

Every part is the class SD3.5 has, at a tiny width: an `SD3Transformer2DModel` with RMS QK-norm (and, shaped like
Medium, a second self-attention in its first block: MMDiT-X), a 16-channel VAE with a scaling and a shift factor,
CLIP-L and CLIP-G as `CLIPTextModelWithProjection` (widths 16 and 24, padded to T5's 48), a `T5EncoderModel`, and
SD3's `FlowMatchEulerDiscreteScheduler` (shift 3.0). The CLIP tokenizers are the real ones (`ldm.components.
tokenizers`). No T5 vocabulary ships in a package, so the T5 tokenizer is a real `T5TokenizerFast` whose Unigram
model (the kind T5's SentencePiece model is) is trained here, offline, on words made from CLIP's BPE merges, with
T5's special tokens and their ids (`<pad>` 0, `</s>` 1, `<unk>` 2).
"""

from __future__ import annotations

import gzip
from pathlib import Path

from examples.tiny_sd import TINY_VAE

T5_VOCAB = 1000  # the tiny T5 tokenizer's vocabulary
TINY_MMDIT = dict(
    sample_size=8,
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=2,
    joint_attention_dim=48,
    caption_projection_dim=16,
    pooled_projection_dim=16 + 24,
    pos_embed_max_size=16,
    qk_norm="rms_norm",
)
TINY_SD3_VAE = dict(
    TINY_VAE,
    latent_channels=16,
    scaling_factor=1.5305,
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
)
TINY_CLIP_L = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=77,
    projection_dim=16,
    hidden_act="quick_gelu",
)
TINY_CLIP_G = dict(TINY_CLIP_L, hidden_size=24, intermediate_size=48, projection_dim=24, hidden_act="gelu")
TINY_T5 = dict(d_model=48, d_kv=8, d_ff=64, num_layers=2, num_heads=2, feed_forward_proj="gated-gelu")
MMDIT_X = {"sd35-medium": (0,), "sd35-large": ()}  # the blocks with a second self-attention


def write_t5_tokenizer(out_dir: str | Path, vocab_size: int = T5_VOCAB, model_max_length: int = 512) -> Path:
    """Write a `T5TokenizerFast` folder, its Unigram model trained offline (see the module's docstring)."""
    from tokenizers import SentencePieceUnigramTokenizer
    from transformers import T5TokenizerFast

    from ldm.components.tokenizers import clip_bpe_path

    with gzip.open(clip_bpe_path(), "rt", encoding="utf-8") as merges:
        lines = merges.read().split("\n")[1:20001]
    words = ["".join(line.split()).replace("</w>", " ") for line in lines if line]
    corpus = [" ".join(words[i : i + 50]) for i in range(0, len(words), 50)]
    unigram = SentencePieceUnigramTokenizer()
    specials = ["<pad>", "</s>", "<unk>"]
    unigram.train_from_iterator(corpus, vocab_size, special_tokens=specials, unk_token="<unk>", show_progress=False)
    tokenizer = T5TokenizerFast(
        tokenizer_object=unigram._tokenizer,
        pad_token="<pad>",
        eos_token="</s>",
        unk_token="<unk>",
        extra_ids=0,
        model_max_length=model_max_length,
    )
    tokenizer.save_pretrained(out_dir)
    return Path(out_dir)


def write_sd35_tokenizers(out_dir: Path, t5: bool = True) -> dict:
    """Write an SD3.5 folder's tokenizers (the real CLIP ones, written offline; T5's trained offline, where `t5`)
    and return them by part name, `tokenizer_3` None without T5."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    from ldm.components.tokenizers import write_clip_tokenizer

    write_clip_tokenizer(out_dir / "tokenizer")
    write_clip_tokenizer(out_dir / "tokenizer_2", pad_token="!")
    tokenizer_3 = T5TokenizerFast.from_pretrained(write_t5_tokenizer(out_dir / "tokenizer_3")) if t5 else None
    return {
        "tokenizer": CLIPTokenizer.from_pretrained(out_dir / "tokenizer"),
        "tokenizer_2": CLIPTokenizer.from_pretrained(out_dir / "tokenizer_2"),
        "tokenizer_3": tokenizer_3,
    }


def write_tiny_sd35(out_dir: str | Path, family: str = "sd35-medium", seed: int = 0, t5: bool = True) -> Path:
    """Write a tiny SD3.5-shaped diffusers pipeline folder (16 px images, 16x8x8 latents) with random weights;
    without T5 (`text_encoder_3` and `tokenizer_3` null) where `t5` is False."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    out_dir = Path(out_dir)
    tokenizers = write_sd35_tokenizers(out_dir, t5)
    t5_encoder = None
    if t5:
        vocab = len(tokenizers["tokenizer_3"])
        t5_encoder = T5EncoderModel(T5Config(**TINY_T5, vocab_size=vocab, pad_token_id=0, eos_token_id=1))
    clip_l = CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP_L))
    with torch.no_grad():  # SD3's CLIP-L projects by the identity: its single files hold no projection
        clip_l.text_projection.weight.copy_(torch.eye(TINY_CLIP_L["hidden_size"]))
    pipe = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel(**TINY_MMDIT, dual_attention_layers=MMDIT_X[family]),
        vae=AutoencoderKL(**TINY_SD3_VAE),
        text_encoder=clip_l,
        text_encoder_2=CLIPTextModelWithProjection(CLIPTextConfig(**TINY_CLIP_G)),
        text_encoder_3=t5_encoder,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        **tokenizers,
    )
    pipe.save_pretrained(out_dir, safe_serialization=True)
    return out_dir
