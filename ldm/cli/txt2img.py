"""Generate images from a checkpoint or an exported pipeline folder.

python scripts/txt2img.py --model RUN/checkpoints/last.ckpt --prompt "a photo of a cat" --outdir out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from ldm.cli import console
from ldm.export import load_pipeline
from ldm.sampling import SAMPLER_NAMES, image_grid, sample


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", required=True, help="a main.py checkpoint, an original SD .safetensors/.ckpt, or a diffusers folder"
    )
    parser.add_argument("--prompt", action="append", required=True, help="prompt; repeat for several")
    parser.add_argument("--outdir", default="outputs/txt2img")
    parser.add_argument("--sampler", choices=SAMPLER_NAMES, default="ddim")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance-scale", type=float, default=7.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="images per prompt")
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--ema", action="store_true", help="use a checkpoint's EMA weights")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    try:
        pipe = load_pipeline(args.model, args.sampler, ema=args.ema).to(args.device)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"txt2img: {err}")
    images = sample(pipe, args.prompt, args.n, args.steps, args.guidance_scale, args.seed, args.height, args.width)
    outdir = Path(args.outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    for i, image in enumerate(images):
        image.save(outdir / f"{i // args.n:03d}_{i % args.n:02d}.png")
    image_grid(images, rows=len(args.prompt), labels=args.prompt).save(outdir / "grid.png")
    print(f"{len(images)} images in {outdir}")
