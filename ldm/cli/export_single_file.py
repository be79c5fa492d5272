"""Export a checkpoint as one original-layout SD file (A1111, ComfyUI, diffusers' `from_single_file`).

python scripts/export_single_file.py --ckpt logs/RUN/checkpoints/last.ckpt --out my-model.safetensors [--half] [--ema]

The file says what it is as other tools read it (`modelspec.*` metadata; for SD 2.x the original YAML
beside it, `my-model.yaml`). When the run started from an original single file (or a folder converted
from one), the tensors of that file no part holds come back: the noise schedule buffers, OpenCLIP's
last layer, its `logit_scale` and `text_projection`; its EMA copy only if the UNet was not trained.
"""

from __future__ import annotations

import argparse
import sys

from ldm.cli import console
from ldm.weights.checkpoint import load_checkpoint
from ldm.weights.read import parts_from_checkpoint, with_base_extras
from ldm.weights.single_file import save_single_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ckpt", required=True, help="a checkpoint written by main.py (file or folder)")
    parser.add_argument("--out", required=True, help="FILE.safetensors (recommended) or FILE.ckpt")
    parser.add_argument("--half", action="store_true", help="write fp16 weights (half the size)")
    parser.add_argument("--ema", action="store_true", help="export the EMA weights instead of the raw ones")
    parser.add_argument("-v", "--verbose", action="store_true", help="show other libraries' messages too")
    args = parser.parse_args(argv)
    console.setup(args.verbose)
    try:
        ckpt = load_checkpoint(args.ckpt)
        parts = with_base_extras(parts_from_checkpoint(ckpt, ema=args.ema), ckpt)
        out = save_single_file(parts, args.out, half=args.half)
    except (FileNotFoundError, ValueError) as err:
        sys.exit(f"export_single_file: {err}")
    print(out)
