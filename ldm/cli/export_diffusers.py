"""Export a checkpoint as a diffusers pipeline folder: `python scripts/export_diffusers.py --ckpt CKPT --out DIR`."""

from __future__ import annotations

import argparse
import sys

from ldm.cli import console
from ldm.export import export_pipeline
from ldm.sampling import SAMPLER_NAMES


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="a checkpoint written by main.py (e.g. RUN/checkpoints/last.ckpt)"
    )
    parser.add_argument(
        "--out", required=True, help="output folder; loads with StableDiffusionPipeline.from_pretrained"
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    parser.add_argument("--sampler", choices=SAMPLER_NAMES, default="ddim", help="scheduler written to the folder")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    try:
        out = export_pipeline(args.ckpt, args.out, ema=args.ema, sampler=args.sampler)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_diffusers: {err}")
    print(out)
