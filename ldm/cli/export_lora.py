"""Export a LoRA checkpoint: the adapters for diffusers, or (--merge) a full pipeline with them merged in.

python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-lora [--ema]
    # then: pipe.load_lora_weights("my-lora")
python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-model --merge
"""

from __future__ import annotations

import argparse
import sys

from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.lora_file import save_lora
from ldm.weights.pipeline_folder import write_pipeline
from ldm.weights.read import parts_from_checkpoint


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a checkpoint of a run with model.params.lora")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--merge", action="store_true", help="write a diffusers pipeline with the LoRA merged in")
    parser.add_argument("--ema", action="store_true", help="export the EMA of the adapters")
    args = parser.parse_args(argv)
    try:
        ckpt = load_checkpoint(args.ckpt)
        if not ckpt["ldm"].get("lora"):
            raise ValueError(f"{args.ckpt}: not a LoRA checkpoint; export it with scripts/export_diffusers.py")
        parts = parts_from_checkpoint(ckpt, ema=args.ema, merge=args.merge)
        out = write_pipeline(parts, args.out) if args.merge else save_lora(parts, args.out)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_lora: {err}")
    print(out)
