"""Export a checkpoint as a diffusers pipeline folder: `python scripts/export_diffusers.py --ckpt CKPT --out DIR`."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ldm.pipeline import SAMPLERS, export_pipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--ckpt", required=True, help="a checkpoint written by main.py (e.g. RUN/checkpoints/last.ckpt)"
    )
    parser.add_argument(
        "--out", required=True, help="output folder; loads with StableDiffusionPipeline.from_pretrained"
    )
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    parser.add_argument("--sampler", choices=list(SAMPLERS), default="ddim", help="scheduler written to the folder")
    args = parser.parse_args()
    try:
        out = export_pipeline(args.ckpt, args.out, ema=args.ema, sampler=args.sampler)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_diffusers: {err}")
    print(out)


if __name__ == "__main__":
    main()
