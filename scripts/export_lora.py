"""Export a LoRA checkpoint: the adapters for diffusers, or (--merge) a full pipeline with them merged in.

python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-lora [--ema]
    # then: pipe.load_lora_weights("my-lora")
python scripts/export_lora.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-model --merge
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ldm.checkpoint import load_checkpoint, parts_from_checkpoint  # noqa: E402
from ldm.lora import save_lora  # noqa: E402
from ldm.pipeline import write_pipeline  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a checkpoint of a run with model.params.lora")
    parser.add_argument("--out", required=True, help="output folder")
    parser.add_argument("--merge", action="store_true", help="write a diffusers pipeline with the LoRA merged in")
    parser.add_argument("--ema", action="store_true", help="export the EMA of the adapters")
    args = parser.parse_args()
    try:
        ckpt = load_checkpoint(args.ckpt)
        if not ckpt["ldm"].get("lora"):
            raise ValueError(f"{args.ckpt}: not a LoRA checkpoint; export it with scripts/export_diffusers.py")
        parts = parts_from_checkpoint(ckpt, ema=args.ema, merge=args.merge)
        out = write_pipeline(parts, args.out) if args.merge else save_lora(parts, args.out)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_lora: {err}")
    print(out)


if __name__ == "__main__":
    main()
